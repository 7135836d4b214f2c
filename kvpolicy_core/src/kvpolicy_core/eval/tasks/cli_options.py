"""What the tasks' command-line runs share (no mlx imported): option checks, the progress log, the JSON file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional


def number_list(text: str, name: str, cast=int, positive: bool = False) -> List:
    """``--name``'s comma-separated numbers; ``positive``: at least one, each above 0."""
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name}: expected comma-separated numbers (got {text!r})") from None
    if positive and (not values or any(v <= 0 for v in values)):
        raise ValueError(f"--{name}: expected positive numbers (got {text!r})")
    return values


def check_seeds_and_steps(seeds: int, prefill_steps: Iterable[Optional[int]]) -> None:
    """``--seeds`` at least 1; every ``--prefill-step`` given at least 1 (None: the whole prompt)."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1 (got {seeds})")
    for s in prefill_steps:
        if s is not None and s < 1:
            raise ValueError(f"--prefill-step must be >= 1 (got {s})")


def progress_log(quiet: bool, line: Callable[[Dict[str, Any]], str]) -> Callable[[Dict[str, Any]], None]:
    """A row logger printing ``line(row)`` to stderr as each row is done (nothing when ``quiet``)."""

    def log(row: Dict[str, Any]) -> None:
        if not quiet:
            print(line(row), file=sys.stderr, flush=True)

    return log


def write_json(payload: Dict[str, Any], dest: str) -> None:
    """``payload`` as indented JSON: to stdout for ``-``, else to the file ``dest`` (its folder made)."""
    text = json.dumps(payload, indent=1)
    if dest == "-":
        print(text)
    else:
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        Path(dest).write_text(text)
        print(f"wrote {dest}", file=sys.stderr)
