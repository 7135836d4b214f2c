"""Shared helpers of the benchmark programs: BLAS first, versions, result files, timing."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

from kvpolicy_core.blas import load_optimized_blas

BLAS = load_optimized_blas(quiet=True)

import mlx.core as mx  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def versions() -> dict:
    import mlx_lm

    import kvpolicy_core

    return {
        "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "kvpolicy_core": kvpolicy_core.__version__,
        "python": platform.python_version(), "machine": platform.machine(), "blas": BLAS,
    }


def write_json(name: str, payload: dict, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"command": " ".join(["python"] + sys.argv), "versions": versions(), **payload}
    path.write_text(json.dumps(payload, indent=1, default=float))
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
