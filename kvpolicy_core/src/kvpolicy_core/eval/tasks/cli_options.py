"""What the tasks' command-line runs share (no mlx imported): option checks, the progress log, the JSON file.

Every option is checked before the model loads, and each refusal is one line naming the option (the command line
prints ``kvpolicy: error: ...`` and exits 2): numbers bounded by what the machine can do (:data:`MAX_LENGTH`,
:data:`MAX_SEEDS`), output files writable (:func:`check_output`), input files readable (:func:`check_input_file`).
Results are written atomically (:func:`write_json`): a failed write never replaces the previous file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

#: The longest prompt or text a task builds or reads, in tokens (2**20: the haystacks, prompts and the full cache
#: of a 1M-token context already take gigabytes; a longer length would exhaust memory silently, not fail first).
MAX_LENGTH = 1 << 20
#: The most seeds (contexts per task, haystack and length) a run may ask for.
MAX_SEEDS = 1 << 16


def number_list(
    text: str, name: str, cast=int, positive: bool = False, minimum: Optional[float] = None, maximum=None
) -> List:
    """``--name``'s comma-separated numbers, at least one (an empty list would run nothing), each finite;
    ``positive``: each above 0; ``minimum`` / ``maximum``: each within them."""
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name}: expected comma-separated numbers (got {text!r})") from None
    if not values:
        raise ValueError(f"--{name}: no number given; expected comma-separated numbers (got {text!r})")
    if any(not math.isfinite(v) for v in values):
        raise ValueError(f"--{name}: expected finite numbers (got {text!r})")
    if positive and (not values or any(v <= 0 for v in values)):
        raise ValueError(f"--{name}: expected positive numbers (got {text!r})")
    if minimum is not None and any(v < minimum for v in values):
        raise ValueError(f"--{name}: each must be at least {minimum:g} (got {text!r})")
    if maximum is not None and any(v > maximum for v in values):
        raise ValueError(f"--{name}: each must be at most {maximum} (got {text!r})")
    return values


def check_int_option(value: Optional[int], name: str, low: int, high: int) -> None:
    """``--name`` (None: not given) within ``[low, high]``, else a ValueError naming it."""
    if value is not None and not low <= value <= high:
        raise ValueError(f"--{name} must be in [{low}, {high}] (got {value})")


def check_seeds_and_steps(seeds: int, prefill_steps: Iterable[Optional[int]]) -> None:
    """``--seeds`` in [1, MAX_SEEDS]; every ``--prefill-step`` given in [1, MAX_LENGTH] (None: the whole prompt)."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1 (got {seeds})")
    check_int_option(seeds, "seeds", 1, MAX_SEEDS)
    for s in prefill_steps:
        if s is not None and s < 1:
            raise ValueError(f"--prefill-step must be >= 1 (got {s})")
        check_int_option(s, "prefill-step", 1, MAX_LENGTH)


def check_output(dest: Optional[str], option: str) -> None:
    """``dest`` (None or ``-``: nothing to check) can be written: a regular file or none (not a folder, FIFO or
    device, nor a symlink to one), its folder made and writable.

    Checked before a run, so that a run does not end by failing to write its results; ValueError naming ``option``.
    """
    if dest is None or dest == "-":
        return
    from ...runtime.files import check_writable

    check_writable(dest, f"{option} {dest}", ValueError, make_parent=True)


def check_input_file(path: Optional[str], option: str) -> None:
    """``path`` (None: not given) is a readable file, else a ValueError naming ``option``."""
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{option} {path}: no such file")
    if not p.is_file():
        raise ValueError(f"{option} {path}: not a file")
    try:
        with p.open("rb"):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot be read ({exc.strerror or exc})") from None


def progress_log(quiet: bool, line: Callable[[Dict[str, Any]], str]) -> Callable[[Dict[str, Any]], None]:
    """A row logger printing ``line(row)`` to stderr as each row is done (nothing when ``quiet``)."""

    def log(row: Dict[str, Any]) -> None:
        if not quiet:
            print(line(row), file=sys.stderr, flush=True)

    return log


def write_json(payload: Dict[str, Any], dest: str, option: str = "--json") -> None:
    """``payload`` as indented JSON: to stdout for ``-``, else to the file ``dest`` (its folder made), atomically:
    written to a temporary file in the same folder, then renamed over ``dest``, so a failure (a full disk) leaves
    the previous file whole; the failure is a ValueError naming ``option``."""
    text = json.dumps(payload, indent=1)
    if dest == "-":
        print(text)
        return
    atomic_write_text(Path(dest), text, option)
    print(f"wrote {dest}", file=sys.stderr)


def atomic_write_text(path: Path, text: str, option: str = "--json") -> None:
    """``text`` into ``path`` through a temporary file in its folder and :func:`os.replace`: ``path`` is the old
    file or the new one, never a part, and nothing is left behind on failure (a ValueError naming ``option``)."""
    from ...runtime.files import check_output_target

    what = f"{option} {path}"
    check_output_target(path, what)  # a directory, FIFO or device is refused, never replaced
    path = Path(os.path.realpath(path))  # a symlink is written through: its target is replaced, the link stays
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "x") as f:  # a new file with the usual permissions (mkstemp's are 0600)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        check_output_target(path, what)
        os.replace(tmp, path)
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, ValueError):
            raise
        raise ValueError(
            f"{what}: could not be written ({exc.strerror or exc}); the previous file, if any, is unchanged"
        ) from None
