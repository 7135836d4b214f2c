"""Shared helpers of the benchmark programs: BLAS first, versions, result files, timing."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from kvpolicy_core.blas import blas_info, load_optimized_blas

BLAS = load_optimized_blas(quiet=True)

import mlx.core as mx  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def versions() -> dict:
    import mlx_lm

    import kvpolicy_core

    return {
        "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "kvpolicy_core": kvpolicy_core.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "blas": {k: blas_info().get(k) for k in ("path", "source", "config", "coretype_forced", "threads")},
    }


def write_json(name: str, payload: dict, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"command": " ".join(["python"] + sys.argv), "versions": versions(), **payload}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=float))
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return path


def timed(fn, repeat: int) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs (after one warm-up)."""
    fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    samples.sort()
    return samples[len(samples) // 2]


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
