"""The BLAS loader never loads a library that would crash this CPU, and picks a fast one when it can.

Decision logic runs on fake CPU flag sets and fake builds; build targets are read from
libraries compiled here (and the installed ones); the loader itself runs in child processes
(in this one mlx is already imported), on the real CPU and on pretended AVX2-only and AVX-512
CPUs (``KVPOLICY_CPUINFO``). Nothing here assumes which of these the real CPU is.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest

from kvpolicy_core.runtime import blas, blas_check, blas_elf

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


SINGLE = blas_elf.StaticBuild(openblas=True, target="SKYLAKEX")
DYNAMIC = blas_elf.StaticBuild(openblas=True, dynamic=True, cores=frozenset({"PRESCOTT", "HASWELL", "SKYLAKEX"}))


def test_a_build_read_from_its_file_is_judged_against_the_cpu_before_it_runs():
    ok, why = blas_check.judge_build(SINGLE, AVX2)
    assert not ok and why.startswith("built for SKYLAKEX only") and "avx512f" in why
    assert blas_check.judge_build(SINGLE, AVX512)[0]
    for flags in (AVX512, AVX2, SSE, frozenset()):
        assert blas_check.judge_build(DYNAMIC, flags)[0]
        assert blas_check.judge_build(blas_elf.StaticBuild(openblas=False), flags)[0]  # MKL & co: the probe decides
    unread = blas_elf.StaticBuild(openblas=True, note="openblas_get_corename() is not a plain string return")
    assert not blas_check.judge_build(unread, AVX512)[0]
    assert "unknown target" in blas_check.judge_build(blas_elf.StaticBuild(openblas=True, target="FUTURE"), AVX512)[1]


@pytest.mark.parametrize(
    "coretype, flags, ok",
    [
        ("SkylakeX", AVX2, False),  # OpenBLAS would run AVX-512 kernels on an AVX2 CPU
        ("skylakex", AVX512, True),  # names are case-insensitive, as in OpenBLAS
        ("Haswell", AVX2, True),
        ("Haswell", SSE, False),
        ("Katmai", SSE, True),  # a core kvpolicy does not know: OpenBLAS's own business
    ],
)
def test_a_user_forced_coretype_must_fit_the_cpu(coretype, flags, ok):
    verdict, why = blas_check.judge_build(DYNAMIC, flags, coretype)
    assert verdict is ok
    if not ok:
        assert f"OPENBLAS_CORETYPE={coretype}" in why and "lacks" in why


def test_coretype_is_forced_only_to_a_core_the_library_carries():
    assert blas_check.best_coretype("Prescott", AVX512, frozenset({"PRESCOTT", "HASWELL"})) == "Haswell"
    assert blas_check.best_coretype("Prescott", AVX512, frozenset({"PRESCOTT"})) is None
    assert blas_check.best_coretype("Prescott", AVX512, DYNAMIC.cores) == "SkylakeX"


@pytest.mark.parametrize(
    "picked, flags, want",
    [
        ("Prescott", AVX512, "SkylakeX"),  # library older than the CPU: force the best core the flags allow
        ("Prescott", AVX2, "Haswell"),
        ("Prescott", frozenset({"avx"}), "Sandybridge"),
        ("Prescott", SSE, None),  # nothing better is safe
        ("Haswell", AVX2, None),  # the library already picked well
        ("SkylakeX", AVX512, None),
        ("Zen", AVX2, None),
    ],
)
def test_coretype_is_forced_only_upwards_and_only_within_the_flags(picked, flags, want):
    assert blas_check.best_coretype(picked, flags) == want


def test_cpu_flags_and_model_read_from_a_cpuinfo_file(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(
        "vendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC 7B12\n"
        "flags\t\t: fpu sse4_2 avx avx2 fma\n\nprocessor : 1\nflags : avx512f\n"
    )
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


# ------------------------------------------------------------------ libraries compiled here, read from their files
# A BLAS whose sgemm dies with SIGILL (ud2: what an AVX-512 kernel does on an AVX2 CPU) and whose file says nothing
# of its build (no OpenBLAS symbols): only the probe can catch it, on any CPU.
CRASH_C = r"""
void cblas_sgemm(void) { __builtin_trap(); }
"""
# A single-target SKYLAKEX OpenBLAS that dies as soon as it is loaded (as the real wheel does on a CPU without AVX).
SKYLAKEX_C = r"""
__attribute__((constructor)) static void init(void) { __builtin_trap(); }
const char *openblas_get_config(void) { return "OpenBLAS 0.3.31 NO_AFFINITY SKYLAKEX MAX_THREADS=4"; }
const char *openblas_get_corename(void) { return "SKYLAKEX"; }
void cblas_sgemm(void) { __builtin_trap(); }
"""
# A DYNAMIC_ARCH OpenBLAS carrying three cores (ATHLON's table is a zero-filled placeholder, as in Debian's).
DYNAMIC_C = r"""
char gotoblas_PRESCOTT[8] = {1}, gotoblas_HASWELL[8] = {1}, gotoblas_SKYLAKEX[8] = {1}, gotoblas_ATHLON[8];
void gotoblas_dynamic_init(void) {}
const char *openblas_get_config(void) { return "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Prescott MAX_THREADS=64"; }
const char *openblas_get_corename(void) { return "Prescott"; }
void cblas_sgemm(void) { __builtin_trap(); }
"""
AVX2_CPUINFO = (
    "vendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC 7B12\n"
    "flags\t\t: fpu sse sse2 pni ssse3 sse4_1 sse4_2 avx avx2 fma\n"
)
AVX512_CPUINFO = (
    "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 207\nmodel name\t: Intel Xeon\n"
    "flags\t\t: fpu sse sse2 pni ssse3 sse4_1 sse4_2 avx avx2 fma avx512f avx512cd avx512bw avx512dq "
    "avx512vl\n"
)


def compile_lib(tmp_path_factory, source, name, opt="-O2"):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the test library (the pure decision tests above still run)")
    d = tmp_path_factory.mktemp(name)
    (d / f"{name}.c").write_text(source)
    subprocess.run([cc, "-shared", "-fPIC", opt, "-o", str(d / f"lib{name}.so"), str(d / f"{name}.c")], check=True)
    return str(d / f"lib{name}.so")


@pytest.fixture(scope="module")
def sigill_lib(tmp_path_factory):
    return compile_lib(tmp_path_factory, CRASH_C, "crash")


@pytest.fixture(scope="module", params=["-O0", "-O2"])
def skylakex_lib(tmp_path_factory, request):
    return compile_lib(tmp_path_factory, SKYLAKEX_C, "skylakex", request.param)


@pytest.fixture(scope="module")
def dynamic_lib(tmp_path_factory):
    return compile_lib(tmp_path_factory, DYNAMIC_C, "dynamic")


def read_build_in_a_child(path):
    """``blas_elf.read_build(path)`` in a child process: a library that ran while being read would kill it."""
    code = (
        "import sys, json; from kvpolicy_core.runtime.blas_elf import read_build\n"
        "b = read_build(sys.argv[1]); print(json.dumps({**b.__dict__, 'cores': sorted(b.cores)}))"
    )
    proc = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"reading the file ran the library ({proc.returncode}): {proc.stderr[-1000:]}"
    return json.loads(proc.stdout)


def test_a_single_target_build_is_read_from_the_file_without_running_it(skylakex_lib):
    build = read_build_in_a_child(skylakex_lib)
    assert build["openblas"] and not build["dynamic"] and build["target"] == "SKYLAKEX"


def test_a_dynamic_arch_build_and_its_cores_are_read_from_the_file(dynamic_lib, sigill_lib):
    build = read_build_in_a_child(dynamic_lib)
    assert build["openblas"] and build["dynamic"] and build["cores"] == ["HASWELL", "PRESCOTT", "SKYLAKEX"]
    assert read_build_in_a_child(sigill_lib)["openblas"] is False


def test_files_that_are_not_libraries_are_not_openblas(tmp_path):
    for name, data in (("empty.so", b""), ("text.so", b"not an ELF file"), ("truncated.so", b"\x7fELF\x02\x01\x01")):
        (tmp_path / name).write_bytes(data)
        assert blas_elf.read_build(str(tmp_path / name)) == blas_elf.StaticBuild(openblas=False)


def test_an_openblas_whose_symbol_table_cannot_be_read_is_refused_unrun(skylakex_lib, tmp_path):
    data = bytearray(open(skylakex_lib, "rb").read())
    data[0x28:0x30] = bytes(8)  # e_shoff: no section headers (as after sstrip)
    data[0x3C:0x3E] = bytes(2)  # e_shnum
    (tmp_path / "libheadless.so").write_bytes(bytes(data))
    build = blas_elf.read_build(str(tmp_path / "libheadless.so"))
    assert build.openblas and build.target is None and "cannot be read" in build.note
    ok, why = blas_check.judge_build(build, AVX512)
    assert not ok and "cannot be read" in why


def test_the_file_read_agrees_with_what_each_installed_openblas_says_of_itself(tmp_path):
    """Every installed candidate: the build read from its bytes is the one ``openblas_get_config()`` reports,
    asked in a child process only where that build fits this CPU."""
    flags = blas_check.cpu_flags()
    for _, path in blas.candidates():
        build = blas_elf.read_build(path)
        if build.openblas and blas_check.judge_build(build, flags)[0]:
            verdict = blas_check.probe(path)
            assert verdict["ok"], verdict
            dynamic, target = blas_check.build_target(verdict["config"])
            assert dynamic == build.dynamic and (dynamic or target == build.target), (verdict["config"], build)
        if "cmeel.prefix" in path:
            assert build == blas_elf.StaticBuild(openblas=True, target="SKYLAKEX")
        if "openblas-pthread" in path:
            assert build.openblas and build.dynamic and {"HASWELL", "SANDYBRIDGE"} <= build.cores


# Loads the BLAS, records which libraries the probe's child was started for, then multiplies with MLX.
CHILD = r"""
import json, sys, warnings
from kvpolicy_core.runtime import blas_check
probed, probe = [], blas_check.probe
blas_check.probe = lambda path, *a, **k: probed.append(path) or probe(path, *a, **k)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from kvpolicy_core.runtime.blas import blas_info, load_optimized_blas
    load_optimized_blas()
import mlx.core as mx
a = mx.arange(12, dtype=mx.float32).reshape(3, 4)
product = (a @ a.T).tolist()
print(json.dumps({"info": blas_info(), "warnings": [str(w.message) for w in caught], "product": product,
                  "probed": probed}))
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
    assert sigill_lib in out["probed"] and sigill_lib not in again["probed"]


def test_a_cached_verdict_holds_only_on_the_cpu_it_was_reached_on(tmp_path, sigill_lib, monkeypatch):
    """A verdict cached on an AVX-512 machine is not trusted on an AVX2 one: there the library is probed again."""
    for name, text in (("avx512", AVX512_CPUINFO), ("avx2", AVX2_CPUINFO)):
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("KVPOLICY_CPUINFO", str(tmp_path / "avx512"))
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    key = blas._key(sigill_lib, env, blas_check.cpu_flags())
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "blas-verdicts.json").write_text(json.dumps({key: {"ok": False, "reason": "cached here"}}))
    same = run_child(tmp_path, KVPOLICY_BLAS=sigill_lib, KVPOLICY_CPUINFO=str(tmp_path / "avx512"))
    assert sigill_lib not in same["probed"] and any("cached here" in w for w in same["warnings"])
    other = run_child(tmp_path, KVPOLICY_BLAS=sigill_lib, KVPOLICY_CPUINFO=str(tmp_path / "avx2"))
    assert sigill_lib in other["probed"] and any(sigill_lib in w and "died with" in w for w in other["warnings"])


def test_a_cached_pass_never_overrides_the_build_target(tmp_path, skylakex_lib, monkeypatch):
    """Even a cache that says the SKYLAKEX build passed here does not get it loaded on an AVX2 CPU."""
    (tmp_path / "avx2").write_text(AVX2_CPUINFO)
    monkeypatch.setenv("KVPOLICY_CPUINFO", str(tmp_path / "avx2"))
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    key = blas._key(skylakex_lib, env, blas_check.cpu_flags())
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "blas-verdicts.json").write_text(json.dumps({key: {"ok": True, "config": None}}))
    out = run_child(tmp_path, KVPOLICY_BLAS=skylakex_lib, KVPOLICY_CPUINFO=str(tmp_path / "avx2"))
    assert out["info"]["path"] != skylakex_lib and any(skylakex_lib in w and "avx512f" in w for w in out["warnings"])


def test_a_skylakex_build_is_refused_on_an_avx2_cpu_without_being_probed(tmp_path, skylakex_lib):
    """On an AVX2-only CPU the AVX-512 build is refused by its target, naming the missing flags: nothing of it
    runs, not even in the probe's child (on such a CPU that child would die with SIGILL, hiding why)."""
    (tmp_path / "avx2").write_text(AVX2_CPUINFO)
    out = run_child(tmp_path, KVPOLICY_BLAS=skylakex_lib, KVPOLICY_CPUINFO=str(tmp_path / "avx2"))
    assert out["info"]["path"] != skylakex_lib and skylakex_lib not in out["probed"]
    warned = [w for w in out["warnings"] if skylakex_lib in w]
    assert len(warned) == 1 and "built for SKYLAKEX only" in warned[0] and "avx512f" in warned[0], warned


def test_a_forced_core_the_cpu_cannot_run_refuses_a_dynamic_arch_build_without_probing(tmp_path, dynamic_lib):
    """OpenBLAS obeys ``OPENBLAS_CORETYPE`` without checking the CPU: SkylakeX kernels on an AVX2 CPU would die."""
    (tmp_path / "avx2").write_text(AVX2_CPUINFO)
    out = run_child(
        tmp_path, KVPOLICY_BLAS=dynamic_lib, KVPOLICY_CPUINFO=str(tmp_path / "avx2"), OPENBLAS_CORETYPE="SkylakeX"
    )
    assert out["info"]["path"] != dynamic_lib and dynamic_lib not in out["probed"]
    assert any(dynamic_lib in w and "OPENBLAS_CORETYPE=SkylakeX" in w and "avx512f" in w for w in out["warnings"])


def test_avx512_only_build_is_refused_on_a_pretended_avx2_cpu(tmp_path):
    cmeel = [p for s, p in blas.candidates() if s == "cmeel-openblas"]
    if not cmeel:
        pytest.skip("cmeel-openblas is not installed")  # it is a dependency on Linux: always there in CI
    fake = tmp_path / "cpuinfo"
    fake.write_text(AVX2_CPUINFO)
    out = run_child(tmp_path, KVPOLICY_BLAS=cmeel[0], KVPOLICY_CPUINFO=str(fake))
    assert out["info"]["path"] != cmeel[0] and cmeel[0] not in out["probed"]
    assert any(cmeel[0] in w and "SKYLAKEX" in w and "avx512f" in w for w in out["warnings"])
    if system_or_mkl_available():  # the DYNAMIC_ARCH library is taken instead, at most with AVX2 kernels
        assert out["info"]["source"] in ("system OpenBLAS", "mkl")
        assert out["info"].get("coretype_forced") in (None, "Haswell", "Sandybridge")


def candidates_fitting_this_cpu():
    """The installed candidates whose build (read from the file) this CPU can run."""
    flags = blas_check.cpu_flags()
    return [(s, p) for s, p in blas.candidates() if blas_check.judge_build(blas_elf.read_build(p), flags)[0]]


def test_loader_on_this_machine_ends_with_a_working_non_reference_blas(tmp_path):
    """Whenever a candidate this CPU can run is installed, the loader ends with one loaded, and MLX is right."""
    fits = candidates_fitting_this_cpu()
    out = run_child(tmp_path)
    assert not fits or out["info"]["path"] is not None, out["info"]
    if out["info"]["path"]:
        assert out["info"]["source"] in {s for s, _ in fits}


def test_no_candidate_left_warns_with_the_fix(tmp_path, sigill_lib):
    script = CHILD.replace(
        "load_optimized_blas()",
        textwrap.dedent(
            """\
        import kvpolicy_core.runtime.blas as b
        b.candidates = lambda: iter([("test", %r)])
        load_optimized_blas()"""
            % sigill_lib
        ).replace("\n", "\n    "),
    )
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
    proc = subprocess.run(
        [sys.executable, "-m", "kvpolicy_core.apps.cli", "doctor", "--json", "--no-measure"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) >= {"cpu", "isa", "mlx", "blas"}
    if candidates_fitting_this_cpu():
        assert report["blas"]["path"] and report["blas"]["source"]
        assert report["blas"]["config"] is not None or report["blas"]["source"] == "mkl"
