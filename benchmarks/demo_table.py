"""The main job's table (recorded in docs/results/benchmarks.md, "The demo"): perplexity next to retrieval, from the two
JSON files scripts/demo.sh writes.

    python benchmarks/demo_table.py [benchmarks/results/demo.json] [benchmarks/results/demo_needle.json]

Rows are matched by method family (full, rotating, h2o, cam); each column keeps its own budget.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from _harness import RESULTS


def family(label: str) -> str:
    return label.partition(":")[0]


def main(argv):
    ppl_path = Path(argv[0]) if argv else RESULTS / "demo.json"
    needle_path = Path(argv[1]) if len(argv) > 1 else RESULTS / "demo_needle.json"
    ppl = json.loads(ppl_path.read_text())
    needle = json.loads(needle_path.read_text())
    found = {family(s["method"]): s for s in needle["summary"]}
    base = next(r for r in ppl["results"] if r["spec"] == "full")["perplexity"]
    prompt = max(r["prompt_tokens"] for r in needle["rows"])
    print(
        f"perplexity: {ppl['tokens']} tokens, token by token | needle: {prompt}-token prompt, "
        f"depths {', '.join(sorted(next(iter(found.values()))['per_depth'], key=float))}, one-chunk prefill"
    )
    head = f"{'method':24} {'ppl':>8} {'Δppl':>8} {'tok/s':>6}   {'needle method':24} {'found':>6}"
    print(head)
    print("-" * len(head))
    for r in ppl["results"]:
        s = found.get(family(r["spec"]))
        delta = f"{100 * (r['perplexity'] / base - 1):+.1f}%"
        right = f"{s['method'][:24]:24} {s['found']:>3}/{s['trials']:<2}" if s else ""
        print(f"{r['spec'][:24]:24} {r['perplexity']:8.3f} {delta:>8} {r['tokens_per_s']:6.1f}   {right}")


if __name__ == "__main__":
    main(sys.argv[1:])
