"""The BLAS loader never loads a library that would crash this CPU, and picks a fast one when it can.

Decision logic runs on fake CPU flag sets and fake build strings; the loader itself runs in
child processes (in this one mlx is already imported), on the real CPU and on a pretended
AVX2-only CPU (``KVPOLICY_CPUINFO``), with a library compiled here that dies with SIGILL.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest

from kvpolicy_core import blas, blas_check

AVX512 = frozenset("sse4_2 ssse3 pni avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl".split())
AVX2 = frozenset("sse4_2 ssse3 pni avx avx2 fma".split())
SSE = frozenset("sse4_2 ssse3 pni".split())
CMEEL = "OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4"
DEBIAN = "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64"


def test_avx512_build_is_rejected_on_an_avx2_cpu_and_accepted_with_avx512():
    ok, why = blas_check.judge(CMEEL, AVX2)
    assert not ok and "SKYLAKEX" in why and "avx512f" in why
    assert blas_check.judge(CMEEL, AVX512)[0]


def test_dynamic_arch_is_accepted_on_any_cpu():
    for flags in (AVX512, AVX2, SSE, frozenset()):
        assert blas_check.judge(DEBIAN, flags)[0]


def test_unknown_single_target_is_rejected_and_non_openblas_defers_to_the_probe():
    ok, why = blas_check.judge("OpenBLAS 0.4 NO_AFFINITY FUTURECHIP", AVX512)
    assert not ok and "unknown target" in why
    assert blas_check.judge(None, SSE)[0]


def test_build_target_parsing():
    assert blas_check.build_target(CMEEL) == (False, "SKYLAKEX")
    assert blas_check.build_target(DEBIAN) == (True, "PRESCOTT")
    assert blas_check.build_target("OpenBLAS 0.3.26 HASWELL MAX_THREADS=8") == (False, "HASWELL")


@pytest.mark.parametrize("picked, flags, want", [
    ("Prescott", AVX512, "SkylakeX"),   # library older than the CPU: force the best core the flags allow
    ("Prescott", AVX2, "Haswell"),
    ("Prescott", frozenset({"avx"}), "Sandybridge"),
    ("Prescott", SSE, None),            # nothing better is safe
    ("Haswell", AVX2, None),            # the library already picked well
    ("SkylakeX", AVX512, None),
    ("Zen", AVX2, None),
])
def test_coretype_is_forced_only_upwards_and_only_within_the_flags(picked, flags, want):
    assert blas_check.best_coretype(picked, flags) == want


def test_cpu_flags_and_model_read_from_a_cpuinfo_file(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("vendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC 7B12\n"
                 "flags\t\t: fpu sse4_2 avx avx2 fma\n\nprocessor : 1\nflags : avx512f\n")
    assert blas_check.cpu_flags(str(f)) == frozenset({"fpu", "sse4_2", "avx", "avx2", "fma"})
    assert blas_check.cpu_model(str(f)) == "AuthenticAMD 23 49 AMD EPYC 7B12"
    assert blas_check.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_a_probe_that_dies_is_reported_not_propagated(monkeypatch):
    monkeypatch.setattr(blas_check, "_PROBE_SRC", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    verdict = blas_check.probe("/does/not/matter.so")
    assert verdict["ok"] is False and "SIGILL" in verdict["reason"]


def test_a_wrong_result_or_load_failure_rejects(monkeypatch, tmp_path):
    assert "failed to load" in blas_check.probe(str(tmp_path / "nope.so"))["reason"]
    monkeypatch.setattr(blas_check, "_PROBE_SRC", "import sys; sys.exit(3)")
    assert blas_check.probe("x.so")["reason"] == "probe sgemm gave a wrong result"


# ------------------------------------------------------------------ the loader, in child processes
SIGILL_C = r"""
const char *openblas_get_config(void) { return "OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4"; }
const char *openblas_get_corename(void) { return "SKYLAKEX"; }
void cblas_sgemm(void) { __builtin_trap(); }  /* ud2 on x86-64: what an AVX-512 kernel does on an AVX2 CPU */
"""

CHILD = r"""
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from kvpolicy_core.blas import blas_info, load_optimized_blas
    load_optimized_blas()
import mlx.core as mx
a = mx.arange(12, dtype=mx.float32).reshape(3, 4)
product = (a @ a.T).tolist()
print(json.dumps({"info": blas_info(), "warnings": [str(w.message) for w in caught], "product": product}))
"""
WANT = [[14.0, 38.0, 62.0], [38.0, 126.0, 214.0], [62.0, 214.0, 366.0]]


def run_child(tmp_path, **env):
    full = {**os.environ, "KVPOLICY_CACHE": str(tmp_path / "cache"), **env}
    for k in ("KVPOLICY_BLAS", "KVPOLICY_CPUINFO", "OPENBLAS_CORETYPE"):
        if k not in env:
            full.pop(k, None)
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=full, timeout=300)
    assert proc.returncode == 0, f"the process died ({proc.returncode}): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["product"] == WANT
    return out


@pytest.fixture(scope="module")
def sigill_lib(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the crashing library (the pure probe test above still runs)")
    d = tmp_path_factory.mktemp("sigill")
    (d / "crash.c").write_text(SIGILL_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", str(d / "libcrash.so"), str(d / "crash.c")], check=True)
    return str(d / "libcrash.so")


def system_or_mkl_available():
    return any(src in ("system OpenBLAS", "mkl") for src, _ in blas.candidates())


def test_a_library_that_dies_with_sigill_is_never_loaded(tmp_path, sigill_lib):
    out = run_child(tmp_path, KVPOLICY_BLAS=sigill_lib)  # the process survives and computes right
    assert out["info"]["path"] != sigill_lib
    warned = [w for w in out["warnings"] if sigill_lib in w]
    assert len(warned) == 1 and "died with" in warned[0]
    if platform.machine() in ("x86_64", "AMD64"):
        assert "SIGILL" in warned[0]
    # The verdict is cached: the second process does not probe again, and still refuses it.
    cache = json.loads((tmp_path / "cache" / "blas-verdicts.json").read_text())
    assert any(not v["ok"] and "died with" in v["reason"] for v in cache.values())
    again = run_child(tmp_path, KVPOLICY_BLAS=sigill_lib)
    assert again["info"]["path"] != sigill_lib and any(sigill_lib in w for w in again["warnings"])


def test_avx512_only_build_is_refused_on_a_pretended_avx2_cpu(tmp_path):
    cmeel = [p for s, p in blas.candidates() if s == "cmeel-openblas"]
    if not cmeel:
        pytest.skip("cmeel-openblas is not installed")  # it is a dependency on Linux: always there in CI
    fake = tmp_path / "cpuinfo"
    fake.write_text("vendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC\n"
                    "flags\t\t: fpu sse sse2 pni ssse3 sse4_1 sse4_2 avx avx2 fma\n")
    out = run_child(tmp_path, KVPOLICY_BLAS=cmeel[0], KVPOLICY_CPUINFO=str(fake))
    assert out["info"]["path"] != cmeel[0]
    assert any(cmeel[0] in w and "SKYLAKEX" in w and "avx512f" in w for w in out["warnings"])
    if system_or_mkl_available():  # the DYNAMIC_ARCH library is taken instead, at most with AVX2 kernels
        assert out["info"]["source"] in ("system OpenBLAS", "mkl")
        assert out["info"].get("coretype_forced") in (None, "Haswell", "Sandybridge")


def test_loader_on_this_machine_ends_with_a_working_non_reference_blas(tmp_path):
    """Whenever a candidate is installed and passes, the loader ends with one loaded, and MLX is right."""
    cands = list(blas.candidates())
    out = run_child(tmp_path)
    assert not cands or out["info"]["path"] is not None, out["info"]
    if out["info"]["path"]:
        assert out["info"]["source"] in {s for s, _ in cands}


def test_no_candidate_left_warns_with_the_fix(tmp_path, sigill_lib):
    script = CHILD.replace("load_optimized_blas()", textwrap.dedent("""\
        import kvpolicy_core.blas as b
        b.candidates = lambda: iter([("test", %r)])
        load_optimized_blas()""" % sigill_lib).replace("\n", "\n    "))
    env = {**os.environ, "KVPOLICY_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["info"]["path"] is None and out["product"] == WANT
    assert any("no optimised BLAS" in w and "libopenblas0-pthread" in w for w in out["warnings"])


def test_a_corrupt_verdict_cache_is_ignored(tmp_path, sigill_lib):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "blas-verdicts.json").write_text("{not json")
    out = run_child(tmp_path, KVPOLICY_BLAS=sigill_lib)
    assert out["info"]["path"] != sigill_lib


def test_cli_doctor_reports_the_blas(tmp_path):
    env = {**os.environ, "KVPOLICY_CACHE": str(tmp_path / "cache")}
    env.pop("KVPOLICY_BLAS", None)
    proc = subprocess.run([sys.executable, "-m", "kvpolicy_core.cli", "doctor", "--json", "--no-measure"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) >= {"cpu", "isa", "mlx", "blas"}
    if list(blas.candidates()):
        assert report["blas"]["path"] and report["blas"]["source"]
        assert report["blas"]["config"] is not None or report["blas"]["source"] == "mkl"
