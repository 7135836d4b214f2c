"""The README's ``generate`` example shows eviction: its budget is below the tokens the run holds (the prompt's and
the generated ones), so the cache it prints is bounded, not the full cache."""

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_generate_example_evicts():
    line = next(ln for ln in README.read_text().splitlines() if ln.startswith("kvpolicy generate "))
    argv = shlex.split(line.partition("#")[0])
    budget = int(re.search(r"budget=(\d+)", argv[argv.index("--method") + 1]).group(1))
    max_tokens = int(argv[argv.index("--max-tokens") + 1])
    prompt_words = len(argv[2].split())  # at least one token per word
    assert budget < prompt_words + max_tokens, f"{line}: budget {budget} never fills, nothing is evicted"
