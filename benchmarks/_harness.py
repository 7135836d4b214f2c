"""The BLAS-free part of the benchmark harness (arguments, result names, timing, interleaving, JSON).

Scripts import these names from ``_common`` (which loads the BLAS and mlx first); only a script that must
not load the BLAS in its own process (blas_speedup.py) imports this module directly. This module imports
nothing of the harness: ``_common`` imports it, never the other way round. It imports mlx only when
:func:`versions` runs (when results are written), loading the BLAS just before as ``_common`` does.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

RESULTS = Path(__file__).resolve().parent / "results"


# -- arguments and result names --------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Fills ``--out`` after parsing: the given folder, else a new temporary folder for ``--smoke`` (printed on
    stderr; a smoke run checks that the program runs, its files are not results), else the program's default."""

    def __init__(self, *a, default_out=None, **kw):
        super().__init__(*a, **kw)
        self.default_out = default_out

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        if getattr(ns, "out", "") is None:
            if getattr(ns, "smoke", False) and self.default_out is not None:
                ns.out = tempfile.mkdtemp(prefix=f"{Path(self.prog).stem}-smoke-")
                print(f"smoke run: results written to {ns.out}", file=sys.stderr)
            else:
                ns.out = None if self.default_out is None else str(self.default_out)
        return ns, rest


def parser(
    doc: Optional[str] = None,
    *,
    rounds: Optional[int] = None,
    seed: Optional[int] = None,
    tag: bool = True,
    out=RESULTS,
    smoke_help: str = "tiny sizes (checks the program runs)",
    rounds_help: str = "interleaved rounds (medians reported)",
) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` (description: the first line of ``doc``) with the common arguments:
    ``--smoke``, ``--out`` (result folder, default ``out``: benchmarks/results; with ``--smoke`` a new temporary
    folder, so that no smoke file lands among the results), ``--tag`` (a suffix of the result names, when
    ``tag``), ``--rounds`` (when given a default) and ``--seed`` (when given a default). ``out=None`` leaves
    ``--out`` unset when not given (the program chooses)."""
    description = doc.strip().splitlines()[0] if doc and doc.strip() else None
    p = _Parser(description=description, default_out=out)
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    where = "" if out is None else " (default benchmarks/results; --smoke: a new temporary folder)"
    p.add_argument("--out", default=None, help="folder of the result files" + where)
    if tag:
        p.add_argument("--tag", default="", help="suffix of the result file names")
    if rounds is not None:
        p.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    if seed is not None:
        p.add_argument("--seed", type=int, default=seed, help="random seed of the inputs / model weights")
    return p


def result_name(base: str, args=None, *, tag: str = "", smoke: bool = False) -> str:
    """``base[_tag][_smoke]``: the stem of a benchmark's result files (tag and smoke from ``args`` if given)."""
    if args is not None:
        tag, smoke = getattr(args, "tag", "") or "", bool(getattr(args, "smoke", False))
    return base + (f"_{tag}" if tag else "") + ("_smoke" if smoke else "")


# -- timing ----------------------------------------------------------------------------------------------------


class Stopwatch:
    """Wall (``perf_counter``) and CPU (``process_time``) seconds since construction or :meth:`restart`."""

    def __init__(self):
        self.restart()

    def restart(self) -> Stopwatch:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    @property
    def wall(self) -> float:
        return time.perf_counter() - self.wall0

    @property
    def cpu(self) -> float:
        return time.process_time() - self.cpu0


def with_budget(spec: str, budget: int) -> str:
    """A method's config string at ``budget`` (``full`` has none): ``h2o`` -> ``h2o:budget=256``,
    ``cam:merge=drop`` -> ``cam:merge=drop,budget=256``, ``rotating`` -> ``rotating:budget=256``."""
    if spec == "full":
        return "full"
    return f"{spec}{',' if ':' in spec else ':'}budget={budget}"


def timed_step(fn: Callable[[], object]):
    """``(wall seconds, cpu seconds, fn())`` of one call."""
    sw = Stopwatch()
    out = fn()
    return sw.wall, sw.cpu, out


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeat`` runs (after one warm-up)."""
    fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    samples.sort()
    return samples[len(samples) // 2]


def interleave(kinds: Mapping[str, Callable[[], object]], rounds: int, on_round=None) -> Dict[str, List[object]]:
    """Call every kind once per round, in order (A, B, C, A, B, C, ...), so a load change on a shared
    machine hits every kind alike. Returns kind -> what each call returned, one entry per round
    (a number of seconds, or any record the kind's function makes). ``on_round(r, {kind: value})``
    is called after each round (progress printing)."""
    got: Dict[str, List[object]] = {k: [] for k in kinds}
    for r in range(rounds):
        this = {}
        for name, fn in kinds.items():
            this[name] = fn()
            got[name].append(this[name])
        if on_round is not None:
            on_round(r, this)
    return got


def median(xs) -> float:
    return statistics.median(list(xs))


def summarize(samples: Mapping[str, List[float]], baseline: Optional[str] = None) -> Dict[str, dict]:
    """kind -> ``{"median", "rounds"}`` (and ``"ratio"`` to the baseline kind's median when ``baseline``)."""
    meds = {k: median(v) for k, v in samples.items()}
    out = {}
    for k, v in samples.items():
        row = {"median": meds[k], "rounds": list(v)}
        if baseline is not None:
            row["ratio"] = meds[k] / meds[baseline] if meds[baseline] else float("nan")
        out[k] = row
    return out


# -- results ---------------------------------------------------------------------------------------------------


def write_json(name: str, payload: dict, out_dir=RESULTS) -> Path:
    """Write ``<out_dir>/<name>.json`` (atomically) with ``command`` and ``versions`` added; returns the path."""
    out_dir = Path(out_dir if out_dir is not None else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    from kvpolicy_core.eval.tasks.cli_options import atomic_write_text  # no mlx, no BLAS

    payload = {"command": " ".join(["python"] + sys.argv), "versions": versions(), **payload}
    text = json.dumps(payload, indent=1, default=float)  # before the file is touched: a bad payload changes nothing
    # atomic (a temporary file in the folder, fsynced, renamed): a reader never sees half a file and a failed
    # write (a full disk) leaves the previous results whole and no temporary file behind
    atomic_write_text(path, text, "--out")
    return path


def versions() -> dict:
    """The versions a result was measured with (mlx, mlx-lm, kvpolicy, Python, the machine) and the BLAS.

    Imports mlx here, at the first call (a script that imported ``_common`` has it already): the BLAS is loaded
    first (a no-op once loaded or once mlx is imported), as importing ``_common`` would have done."""
    from kvpolicy_core.runtime.blas import blas_info, load_optimized_blas

    load_optimized_blas(quiet=True)
    import mlx.core as mx
    import mlx_lm

    import kvpolicy_core

    return {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "kvpolicy_core": kvpolicy_core.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "blas": {k: blas_info().get(k) for k in ("path", "source", "config", "coretype_forced", "threads")},
    }


def plot_time_memory(runs, path: Path, title: str) -> None:
    """Two panels over decode steps: ms per step and MLX active memory, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        steps = [p["step"] for p in r["points"]]
        ax[0].plot(steps, [p["ms_per_step"] for p in r["points"]], label=r["spec"])
        ax[1].plot(steps, [p["active_mb"] for p in r["points"]], label=r["spec"])
    ax[0].set(xlabel="decode step", ylabel="ms / step", title=f"{title}: step time")
    ax[1].set(xlabel="decode step", ylabel="MLX active memory (MB)", title=f"{title}: memory")
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
