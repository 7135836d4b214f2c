"""Is a BLAS library safe to load on this CPU? Pure decision logic plus a subprocess probe.

Two checks, in this order, both required before :func:`kvpolicy_core.runtime.blas.load_optimized_blas`
puts a library into the process:

1. *Static*, before anything of the library runs: OpenBLAS builds for one target use that
   target's instructions unconditionally (the ``cmeel-openblas`` SKYLAKEX wheel dies with
   SIGILL on an AVX2 CPU at its first sgemm, and on a CPU without AVX while being loaded).
   :func:`judge_build` compares the target, read from the file by :mod:`.blas_elf`, with the
   flags in ``/proc/cpuinfo``; a ``DYNAMIC_ARCH`` build picks its kernels at run time and
   needs none, unless ``OPENBLAS_CORETYPE`` forces a core the CPU cannot run.
2. *Dynamic*, only for a library that passed 1: :func:`probe` loads it in a short-lived child
   process and runs a ``PROBE_N``-cubed (512) ``cblas_sgemm`` on small integers, checking
   sampled entries exactly. A child killed by SIGILL (or any signal), a timeout or a wrong
   result rejects the library, and this process never loaded it. :func:`judge` then checks the
   build string the child reported (``openblas_get_config()``, e.g.
   ``"OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4"``) the same way.

This module must not import mlx or numpy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Dict, FrozenSet, Optional, Tuple

from .blas_elf import StaticBuild

#: Flags each OpenBLAS single-target build needs (x86-64; upper-case target names).
_AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
_AVX2 = frozenset({"avx", "avx2", "fma"})
TARGET_FLAGS: Dict[str, FrozenSet[str]] = {
    "SAPPHIRERAPIDS": _AVX512 | {"avx512_bf16"},
    "COOPERLAKE": _AVX512 | {"avx512_bf16"},
    "SKYLAKEX": _AVX512,
    "HASWELL": _AVX2,
    "ZEN": _AVX2,
    "SANDYBRIDGE": frozenset({"avx"}),
    "NEHALEM": frozenset({"sse4_2", "ssse3"}),
    "PENRYN": frozenset({"ssse3"}),
    "CORE2": frozenset({"ssse3"}),
    "ATOM": frozenset({"ssse3"}),
    "PRESCOTT": frozenset({"pni"}),
    "OPTERON": frozenset(),
    "OPTERON_SSE3": frozenset({"pni"}),
    "BARCELONA": frozenset({"sse4a"}),
    "BULLDOZER": frozenset({"avx", "fma4"}),
    "PILEDRIVER": frozenset({"avx", "fma"}),
    "STEAMROLLER": frozenset({"avx", "fma"}),
    "EXCAVATOR": frozenset({"avx", "avx2", "fma"}),
    "GENERIC": frozenset(),
}

#: Run-time core types of a DYNAMIC_ARCH OpenBLAS, best first, with the flags each needs.
#: An OpenBLAS older than the CPU falls back to a generic core (e.g. 0.3.21 picks
#: "Prescott", without AVX kernels, on an Emerald Rapids Xeon); :func:`best_coretype`
#: names the best one the flags allow, for ``OPENBLAS_CORETYPE``.
CORETYPE_LADDER: Tuple[Tuple[str, FrozenSet[str]], ...] = (
    ("SkylakeX", _AVX512),
    ("Haswell", _AVX2),
    ("Sandybridge", frozenset({"avx"})),
)
_CORE_RANK = {
    "SKYLAKEX": 3,
    "COOPERLAKE": 3,
    "SAPPHIRERAPIDS": 3,
    "HASWELL": 2,
    "ZEN": 2,
    "EXCAVATOR": 2,
    "SANDYBRIDGE": 1,
}

PROBE_VERSION = 1
#: The probe's sgemm is ``PROBE_N`` cubed.
PROBE_N = 512


def _cpuinfo_path() -> str:
    """``/proc/cpuinfo``, or ``$KVPOLICY_CPUINFO`` (a file in its format) to decide as if on another CPU."""
    return os.environ.get("KVPOLICY_CPUINFO") or "/proc/cpuinfo"


def cpu_flags(cpuinfo: Optional[str] = None) -> FrozenSet[str]:
    """The instruction-set flags of the first CPU in ``/proc/cpuinfo`` (empty if unreadable)."""
    cpuinfo = cpuinfo or _cpuinfo_path()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model(cpuinfo: Optional[str] = None) -> str:
    """``vendor family/model name`` of the first CPU, for cache keys and reports."""
    cpuinfo = cpuinfo or _cpuinfo_path()
    fields: Dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return " ".join(fields.get(k, "?") for k in ("vendor_id", "cpu family", "model", "model name"))


def build_target(config: str) -> Tuple[bool, Optional[str]]:
    """``(dynamic_arch, target)`` parsed from ``openblas_get_config()``.

    >>> build_target("OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4")
    (False, 'SKYLAKEX')
    >>> build_target("OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64")
    (True, 'PRESCOTT')
    """
    words = config.split()
    dynamic = "DYNAMIC_ARCH" in words
    target = next((w.upper() for w in words if w.upper() in TARGET_FLAGS), None)
    return dynamic, target


def _judge_target(target: str, flags: FrozenSet[str], what: str) -> Tuple[bool, str]:
    missing = sorted(TARGET_FLAGS[target] - flags)
    if missing:
        return False, f"{what}, which needs {', '.join(missing)}: this CPU lacks {'them' if len(missing) > 1 else 'it'}"
    return True, f"{what}; this CPU has every flag it needs"


def judge(config: Optional[str], flags: FrozenSet[str]) -> Tuple[bool, str]:
    """May a library with this ``openblas_get_config()`` run on a CPU with these flags?

    ``config`` None (not an OpenBLAS, e.g. MKL, which dispatches at run time) defers to the
    probe. A single-target build is accepted only if the CPU has every flag its target needs;
    an unknown single target is rejected (its instructions cannot be checked).
    """
    if config is None:
        return True, "not OpenBLAS: relies on the probe"
    dynamic, target = build_target(config)
    if dynamic:
        return True, "DYNAMIC_ARCH build: kernels chosen at run time"
    if target is None:
        return False, f"single-target build of unknown target ({config!r}): cannot check it against this CPU"
    return _judge_target(target, flags, f"built for {target} only")


def judge_build(build: StaticBuild, flags: FrozenSet[str], coretype: Optional[str] = None) -> Tuple[bool, str]:
    """May a library built as ``build`` (read from its file) run here? Decided before it runs at all.

    Refuses a single-target OpenBLAS whose target needs a flag the CPU lacks, or whose target
    is unknown or could not be read, and a DYNAMIC_ARCH one that ``coretype`` (the user's
    ``OPENBLAS_CORETYPE``; OpenBLAS obeys it without checking the CPU) sends to kernels the
    CPU cannot run. Anything else (not an OpenBLAS: MKL, BLIS, ...) is left to the probe.
    """
    if not build.openblas:
        return True, "not OpenBLAS: relies on the probe"
    if build.dynamic:
        forced = (coretype or "").upper()
        if forced in TARGET_FLAGS:
            ok, why = _judge_target(forced, flags, f"OPENBLAS_CORETYPE={coretype} forces the {forced} core")
            return ok, why if ok else f"{why} (unset OPENBLAS_CORETYPE)"
        return True, "DYNAMIC_ARCH build: kernels chosen at run time"
    if build.target is None:
        return False, f"single-target OpenBLAS whose target cannot be read ({build.note}): cannot check it"
    if build.target not in TARGET_FLAGS:
        return False, f"single-target build of unknown target {build.target}: cannot check it against this CPU"
    return _judge_target(build.target, flags, f"built for {build.target} only")


def best_coretype(corename: Optional[str], flags: FrozenSet[str], cores: FrozenSet[str] = frozenset()) -> Optional[str]:
    """The ``OPENBLAS_CORETYPE`` to force on a DYNAMIC_ARCH build, or None to keep its choice.

    Forces only a core whose every required flag the CPU has, that the library carries (upper-case
    names in ``cores``; empty: not known, any), and only when it ranks above the core OpenBLAS
    picked by itself (which is generic when the CPU is newer than the library).
    """
    picked = _CORE_RANK.get((corename or "").upper(), 0)
    for name, need in CORETYPE_LADDER:
        if need <= flags and (not cores or name.upper() in cores):
            return name if _CORE_RANK[name.upper()] > picked else None
    return None


# The child process: load, report the build, run sgemm, check sampled entries exactly.
_PROBE_SRC = r"""
import ctypes, json, sys, time
path, n = sys.argv[1], int(sys.argv[2])
lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
out = {"config": None, "corename": None, "threads": None}
for name in ("openblas_get_config", "openblas_get_corename"):
    fn = getattr(lib, name, None)
    if fn is not None:
        fn.restype = ctypes.c_char_p
        out[name[len("openblas_get_"):]] = fn().decode(errors="replace")
fn = getattr(lib, "openblas_get_num_threads", None)
if fn is not None:
    out["threads"] = int(fn())
print("BUILD " + json.dumps(out), flush=True)
a = (ctypes.c_float * (n * n))(*[((i // n + i % n) % 5) - 2 for i in range(n * n)])
b = (ctypes.c_float * (n * n))(*[((i // n) * (i % n) % 7) - 3 for i in range(n * n)])
c = (ctypes.c_float * (n * n))()
sgemm = lib.cblas_sgemm
sgemm.restype = None
args = (101, 111, 111, n, n, n, ctypes.c_float(1.0), a, n, b, n, ctypes.c_float(0.0), c, n)
sgemm(*args)
for s in range(64):
    i, j = (s * 97) % n, (s * 389 + 11) % n
    want = sum(a[i * n + k] * b[k * n + j] for k in range(n))
    if c[i * n + j] != want:
        print("WRONG " + json.dumps({"i": i, "j": j, "got": c[i * n + j], "want": want}), flush=True)
        sys.exit(3)
t = time.perf_counter()
sgemm(*args)
out["probe_gflops"] = 2 * n ** 3 / max(time.perf_counter() - t, 1e-9) / 1e9
print("OK " + json.dumps(out), flush=True)
"""


def _signal_name(rc: int) -> str:
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"
    return {"SIGILL": "SIGILL (illegal instruction)", "SIGSEGV": "SIGSEGV (segmentation fault)"}.get(name, name)


def probe(path: str, env: Optional[Dict[str, str]] = None, timeout: float = 60.0) -> Dict:
    """Load ``path`` and run sgemm in a child process; never loads it into this one.

    Returns ``{"ok": bool, "reason": str, "config", "corename", "threads", "probe_gflops"}``.
    """
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("OPENBLAS_NUM_THREADS", str(os.cpu_count() or 1))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE_SRC, path, str(PROBE_N)],
            capture_output=True,
            text=True,
            env=child_env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "reason": f"probe timed out after {timeout:.0f} s"}
    result: Dict = {"ok": False}
    for line in proc.stdout.splitlines():
        tag, _, payload = line.partition(" ")
        if tag in ("BUILD", "OK"):
            result.update(json.loads(payload))
    if proc.returncode == 0 and "probe_gflops" in result:
        result.update(ok=True, reason="sgemm probe passed")
    elif proc.returncode < 0:
        result["reason"] = f"probe died with {_signal_name(proc.returncode)}"
    elif proc.returncode == 3:
        result["reason"] = "probe sgemm gave a wrong result"
    else:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        result["reason"] = f"probe failed to load it (exit {proc.returncode}: {err[:200]})"
    return result
