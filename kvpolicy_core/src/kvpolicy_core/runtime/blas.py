"""Load a fast BLAS for MLX's CPU backend on Linux, before ``mlx.core`` is imported, safely.

The ``mlx[cpu]`` wheel on Linux resolves its BLAS calls against a reference (netlib) BLAS,
whose fp32 matmul is unblocked and single-threaded. A library with the standard ``cblas_sgemm``
names loaded into the global symbol namespace first replaces it with tuned, threaded kernels
(``kvpolicy doctor`` measures the matmul speed on this machine).

A library is loaded only once it is *proven* to run on this CPU (:mod:`.blas_check`): its
build target, read from the file without running any of it (:mod:`.blas_elf`), must fit the
CPU's flags, and then a child process must have run an sgemm with it and got the right
numbers. A candidate that fails is skipped with a one-line warning that names it and why (for
a build target: the flags the CPU lacks); with none left MLX keeps its reference BLAS, and
the warning says how to fix that. Probe verdicts are cached per (library path, size, mtime;
CPU model and flags) in ``$KVPOLICY_CACHE`` (default ``~/.cache/kvpolicy``), so the probe's
child process runs once per library and CPU; the build is read from the file every time (cheap).

Candidates, in order: ``$KVPOLICY_BLAS`` (a path; ``off`` disables all of this); the
system OpenBLAS (Debian/Ubuntu ``libopenblas0-pthread``, a DYNAMIC_ARCH build that
``scripts/setup.sh`` installs when it can); Intel MKL (``pip install mkl``); the
``cmeel-openblas`` wheel (a SKYLAKEX-only build: AVX-512 CPUs only). On a DYNAMIC_ARCH
OpenBLAS older than the CPU (it falls back to a generic core), ``OPENBLAS_CORETYPE`` is set
to the best core the CPU's flags allow, unless the user set it (a user's core the CPU cannot
run refuses the library). Threads: all cores.

This module must not import mlx: call :func:`load_optimized_blas` first thing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from . import blas_check, blas_elf

_loaded: Optional[str] = None
_info: Dict = {}

_FIX = (
    "install a run-time-dispatching BLAS: `apt install libopenblas0-pthread` (Debian/Ubuntu; "
    "scripts/setup.sh does it as root) or `pip install mkl`, or point KVPOLICY_BLAS at one"
)


def _cache_file() -> Path:
    root = (
        os.environ.get("KVPOLICY_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpolicy"
    )
    return Path(root) / "blas-verdicts.json"


def candidates() -> Iterator[Tuple[str, str]]:
    """``(source, path)`` of every library worth trying, best first, existing files only."""
    env = os.environ.get("KVPOLICY_BLAS")
    if env:
        yield "KVPOLICY_BLAS", env
    seen = {os.path.realpath(env)} if env else set()

    def fresh(paths):
        for p in paths:
            real = os.path.realpath(p)
            if os.path.isfile(real) and real not in seen:
                seen.add(real)
                yield p

    system = [
        "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
        "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
        "/usr/lib64/libopenblasp.so.0",
        "/usr/lib64/libopenblas.so.0",
    ]
    found = ctypes.util.find_library("openblas")
    for p in fresh(system + ([f"/usr/lib/x86_64-linux-gnu/{found}", f"/usr/lib/{found}"] if found else [])):
        yield "system OpenBLAS", p
    roots = [sys.prefix, sys.base_prefix]
    for p in fresh(sorted(f for r in roots for f in glob.glob(os.path.join(r, "lib", "libmkl_rt.so*")))):
        yield "mkl", p
    sites = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}
    wheel = sorted(
        f
        for r in sites
        if r and os.path.isdir(r)
        for f in glob.glob(os.path.join(r, "cmeel.prefix", "lib", "libopenblas*.so*"))
    )
    for p in fresh(sorted(wheel, key=lambda f: not f.endswith(".so.0"))[:1]):  # copies of one library
        yield "cmeel-openblas", p


def _key(path: str, env: Dict[str, str], flags) -> str:
    st = os.stat(path)
    raw = json.dumps(
        [
            blas_check.PROBE_VERSION,
            os.path.realpath(path),
            st.st_size,
            st.st_mtime_ns,
            blas_check.cpu_model(),
            sorted(flags),
            env.get("OPENBLAS_CORETYPE"),
            env.get("MKL_THREADING_LAYER"),
        ]
    )
    return hashlib.sha256(raw.encode()).hexdigest()


def _read_verdicts() -> Dict:
    try:
        data = json.loads(_cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_verdict(key: str, verdict: Dict) -> None:
    path = _cache_file()
    data = _read_verdicts()
    data[key] = verdict
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".blas-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:  # an unwritable cache only costs a probe next time
        pass


def _probe_cached(path: str, env: Dict[str, str], flags) -> Dict:
    try:
        key = _key(path, env, flags)
    except OSError as e:
        return {"ok": False, "reason": f"cannot read it ({e.strerror})"}
    verdict = _read_verdicts().get(key)
    if not isinstance(verdict, dict) or "ok" not in verdict:
        verdict = blas_check.probe(path, env)
        _write_verdict(key, verdict)
    return verdict


def _check(source: str, path: str, flags) -> Tuple[Dict, Dict[str, str]]:
    """The verdict on one candidate and the environment to load it with.

    Its build is judged from the file first (:mod:`.blas_elf`): a library the CPU cannot run is
    refused before any of it runs, the probe's child included; only then is it probed.
    """
    env = dict(os.environ)
    if "mkl_rt" in os.path.basename(path):
        env.setdefault("MKL_THREADING_LAYER", "GNU" if ctypes.util.find_library("gomp") else "SEQUENTIAL")
    try:
        build = blas_elf.read_build(path)
    except OSError as e:
        return {"ok": False, "reason": f"cannot read it ({e.strerror})"}, env
    ok, why = blas_check.judge_build(build, flags, env.get("OPENBLAS_CORETYPE"))
    if not ok:
        return {"ok": False, "reason": why}, env
    verdict = _probe_cached(path, env, flags)
    if verdict.get("ok"):
        ok, why = blas_check.judge(verdict.get("config"), flags)
        if not ok:
            return {**verdict, "ok": False, "reason": why}, env
        dynamic, _ = blas_check.build_target(verdict.get("config") or "")
        core = blas_check.best_coretype(verdict.get("corename"), flags, build.cores) if dynamic else None
        if core and "OPENBLAS_CORETYPE" not in os.environ:
            forced_env = {**env, "OPENBLAS_CORETYPE": core}
            forced = _probe_cached(path, forced_env, flags)
            if forced.get("ok"):
                return {**forced, "coretype_forced": core}, forced_env
    return verdict, env


def load_optimized_blas(quiet: bool = False) -> Optional[str]:
    """Load the first proven BLAS with ``RTLD_GLOBAL`` so MLX's CPU matmuls use it; its path.

    Does nothing (returns None) off Linux or when ``KVPOLICY_BLAS=off``. Never loads a
    library that failed its check. Unless ``quiet``, warns once per skipped candidate, when
    none is left (MLX then runs fp32 matmul on the reference BLAS, far slower), and when ``mlx.core`` is already
    imported (too late to take effect). :func:`blas_info` says what happened.
    """
    global _loaded
    if _loaded is not None or _info:
        return _loaded
    if not sys.platform.startswith("linux") or os.environ.get("KVPOLICY_BLAS", "").lower() == "off":
        _info.update(
            path=None,
            reason="disabled (KVPOLICY_BLAS=off)"
            if sys.platform.startswith("linux")
            else "not Linux: MLX uses the platform's BLAS",
        )
        return None
    if "mlx.core" in sys.modules:
        if not quiet:
            warnings.warn(
                "kvpolicy: load_optimized_blas() called after mlx.core was imported; MLX keeps its "
                "reference BLAS. Call it before importing mlx (the kvpolicy CLI does).",
                RuntimeWarning,
                stacklevel=2,
            )
        return None
    flags = blas_check.cpu_flags()
    skipped: List[Dict] = []
    for source, path in candidates():
        verdict, env = _check(source, path, flags)
        if not verdict.get("ok"):
            skipped.append({"source": source, "path": path, "reason": verdict.get("reason")})
            if not quiet:
                warnings.warn(
                    f"kvpolicy: not loading BLAS {path} ({source}): {verdict.get('reason')}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            continue
        for var in ("OPENBLAS_CORETYPE", "MKL_THREADING_LAYER"):
            if var in env and var not in os.environ:
                os.environ[var] = env[var]
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(os.cpu_count() or 1))
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        _loaded = path
        _info.update(
            path=path,
            source=source,
            skipped=skipped,
            threads=_threads(lib, verdict),
            **{k: verdict.get(k) for k in ("config", "corename", "coretype_forced", "probe_gflops")},
        )
        return path
    _info.update(path=None, skipped=skipped, reason="no proven BLAS: MLX's reference BLAS (~30x slower fp32 matmul)")
    if not quiet:
        warnings.warn(
            f"kvpolicy: no optimised BLAS could be loaded; MLX fp32 matmul on this CPU will be ~30x "
            f"slower (~6 instead of ~170 GFLOP/s on 2 cores). Fix: {_FIX}",
            RuntimeWarning,
            stacklevel=2,
        )
    return None


def _threads(lib, verdict: Dict) -> Optional[int]:
    fn = getattr(lib, "openblas_get_num_threads", None)
    return int(fn()) if fn is not None else verdict.get("threads")


def blas_info(measure: bool = False) -> Dict:
    """What :func:`load_optimized_blas` decided: path, source, config, corename, threads,
    skipped candidates with reasons; with ``measure``, MLX's fp32 matmul GFLOP/s (imports mlx)."""
    info = {"path": _loaded, **_info}
    if measure:
        info["mlx_matmul_gflops"] = measure_mlx_gflops()
    return info


def measure_mlx_gflops(n: int = 1024, reps: int = 5) -> float:
    """fp32 ``n x n`` matmul throughput of MLX's CPU backend in this process (GFLOP/s)."""
    import time

    import mlx.core as mx

    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b, a @ b)
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(a @ b)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e9
