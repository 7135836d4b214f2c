"""Load an optimised BLAS for MLX's CPU backend on Linux, before ``mlx.core`` is imported.

The ``mlx[cpu]`` wheel on Linux resolves its BLAS calls against a reference (netlib)
BLAS: fp32 matmul runs at ~6 GFLOP/s on a 2-core x86-64 machine. Loading OpenBLAS into
the global symbol namespace first makes the same matmul ~28x faster. The library comes
from the ``cmeel-openblas`` wheel (a dependency of kvpolicy-core on Linux); a system
OpenBLAS (``libopenblas.so.0``) is used as a fallback. Measure with
``python benchmarks/blas_speedup.py``.

This module must not import mlx: call :func:`load_optimized_blas` first thing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import sysconfig
import warnings
from typing import Optional

_loaded: Optional[str] = None


def _candidates():
    env = os.environ.get("KVPOLICY_BLAS")
    if env:
        yield env
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    for root in roots:
        if root and os.path.isdir(root):
            yield from sorted(glob.glob(os.path.join(root, "cmeel.prefix", "lib", "libopenblas*.so*")))
    found = ctypes.util.find_library("openblas")
    if found:
        yield found
    yield "libopenblas.so.0"


def load_optimized_blas(quiet: bool = False) -> Optional[str]:
    """Load OpenBLAS with ``RTLD_GLOBAL`` so MLX's CPU matmuls use it; returns its path.

    Does nothing (returns None) off Linux or when ``KVPOLICY_BLAS=off``. Unless ``quiet``,
    warns when ``mlx.core`` is already imported (then it is too late to take effect) and
    when no optimised BLAS can be loaded (cmeel-openblas needs ``libgfortran.so.5``:
    Debian/Ubuntu ``apt install libgfortran5``).
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    if not sys.platform.startswith("linux") or os.environ.get("KVPOLICY_BLAS", "").lower() == "off":
        return None
    if "mlx.core" in sys.modules:
        if quiet:
            return None
        warnings.warn(
            "kvpolicy: load_optimized_blas() called after mlx.core was imported; MLX keeps the slow "
            "reference BLAS. Call it before importing mlx (the kvpolicy CLI does).",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    for path in _candidates():
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        _loaded = path
        return path
    if not quiet:
        warnings.warn(
            "kvpolicy: no optimised BLAS could be loaded (pip install cmeel-openblas; it needs "
            "libgfortran.so.5: apt install libgfortran5); MLX fp32 matmul on Linux CPU will be ~28x slower",
            RuntimeWarning,
            stacklevel=2,
        )
    return None


def loaded_blas() -> Optional[str]:
    return _loaded
