"""The loader on CPUs without AVX-512, emulated by qemu-user: an AMD EPYC Rome (AVX2, the CPU of
the crash report), a Sandy Bridge (AVX, no AVX2/FMA) and a Nehalem (no AVX at all).

Control: the AVX-512-only ``cmeel-openblas`` build dies with SIGILL on each of them when
loaded directly (on the Nehalem already while being loaded). Through ``load_optimized_blas()``
the same process refuses it by its build target without running any of it, names the flags
the CPU lacks, and computes right (on Debian's OpenBLAS when it is installed).

qemu-user runs a child process natively, on the real CPU, and shows the real ``/proc/cpuinfo``.
So the probe's child is started through the same emulator (``sys.executable`` points at a
wrapper), and ``KVPOLICY_CPUINFO`` hands the loader the flags the emulated CPU's CPUID reports
(``scripts/cpuinfo_from_cpuid.c``, run under the emulator): the whole loader runs as on such a
machine. ``scripts/test_on_emulated_cpu.sh`` runs whole test files that way.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_blas import CHILD, WANT

from kvpolicy_core.runtime import blas, blas_check

QEMU = shutil.which("qemu-x86_64")
CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        platform.machine() != "x86_64" or QEMU is None or CC is None,
        reason="needs x86-64, a C compiler and qemu-user (scripts/setup.sh installs qemu)",
    ),
]
#: qemu CPU model -> the core a DYNAMIC_ARCH OpenBLAS picks on it.
CPUS = {"EPYC-Rome": "Zen", "SandyBridge": "Sandybridge", "Nehalem": "Nehalem"}

CPUINFO_C = Path(__file__).resolve().parents[1] / "scripts" / "cpuinfo_from_cpuid.c"


@pytest.fixture(scope="module")
def cpuinfo_tool(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpuinfo")
    subprocess.run([CC, "-O1", "-o", str(d / "cpuinfo"), str(CPUINFO_C)], check=True)
    return str(d / "cpuinfo")


def emulated_cpuinfo(tool, cpu, tmp_path):
    """A ``/proc/cpuinfo`` for the emulated ``cpu``, from its own CPUID."""
    proc = subprocess.run([QEMU, "-cpu", cpu, tool, f"{cpu} (qemu)"], capture_output=True, text=True, check=True)
    (tmp_path / "cpuinfo").write_text(proc.stdout)
    return tmp_path / "cpuinfo"


def emulated(code, cpu, tmp_path, **env):
    """Run ``code`` in a python on the emulated ``cpu``; every python it starts runs there too."""
    wrapper = tmp_path / "python-on-emulated-cpu"
    wrapper.write_text(f'#!/bin/sh\nexec {QEMU} -cpu {cpu} {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    full = {**os.environ, **env}
    for k in ("KVPOLICY_BLAS", "OPENBLAS_CORETYPE"):
        if k not in env:
            full.pop(k, None)
    # qemu runs AVX2 kernels at ~0.01 GFLOP/s: a 128-cubed probe sgemm takes ~0.4 s there, a 512-cubed one ~30 s.
    prelude = (
        f"import sys; sys.executable = {str(wrapper)!r}\n"
        "from kvpolicy_core.runtime import blas_check; blas_check.PROBE_N = 128\n"
    )
    return subprocess.run(
        [QEMU, "-cpu", cpu, sys.executable, "-c", prelude + code], capture_output=True, text=True, env=full, timeout=600
    )


@pytest.fixture(scope="module")
def cmeel():
    paths = [p for s, p in blas.candidates() if s == "cmeel-openblas"]
    if not paths:
        pytest.skip("cmeel-openblas is not installed (a kvpolicy-core dependency on Linux)")
    return paths[0]


def test_the_cpuid_reader_agrees_with_proc_cpuinfo_on_this_cpu(cpuinfo_tool, tmp_path):
    """The emulated CPUs' flags below come from this program: natively it must say what Linux says."""
    out = subprocess.run([cpuinfo_tool], capture_output=True, text=True, check=True).stdout
    (tmp_path / "cpuinfo").write_text(out)
    mine = blas_check.cpu_flags(str(tmp_path / "cpuinfo"))
    assert "sse2" in mine and mine <= blas_check.cpu_flags("/proc/cpuinfo")


@pytest.mark.parametrize("cpu", list(CPUS))
def test_the_avx512_build_really_dies_on_the_emulated_cpu(tmp_path, cmeel, cpu):
    code = (
        f"import ctypes; ctypes.CDLL({cmeel!r}, mode=ctypes.RTLD_GLOBAL)\n"
        "import mlx.core as mx\na = mx.ones((256, 256)); mx.eval(a @ a); print('survived')"
    )
    proc = emulated(code, cpu, tmp_path)
    assert proc.returncode in (-4, 132) and "survived" not in proc.stdout, (proc.returncode, proc.stderr[-500:])


def run_emulated_loader(cpu, tool, tmp_path, **env):
    cpuinfo = emulated_cpuinfo(tool, cpu, tmp_path)
    proc = emulated(CHILD, cpu, tmp_path, KVPOLICY_CPUINFO=str(cpuinfo), KVPOLICY_CACHE=str(tmp_path / "cache"), **env)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-1500:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["product"] == WANT
    return out, blas_check.cpu_flags(str(cpuinfo))


@pytest.mark.parametrize("cpu", list(CPUS))
def test_the_loader_refuses_the_avx512_build_unrun_on_the_emulated_cpu(tmp_path, cmeel, cpuinfo_tool, cpu):
    out, flags = run_emulated_loader(cpu, cpuinfo_tool, tmp_path, KVPOLICY_BLAS=cmeel)
    assert "avx512f" not in flags and out["info"]["path"] != cmeel
    assert cmeel not in out["probed"]  # judged by its build target: not even the probe's child ran it
    assert any(cmeel in w and "SKYLAKEX" in w and "avx512f" in w for w in out["warnings"]), out["warnings"]
    if any(s == "system OpenBLAS" for s, _ in blas.candidates()):  # DYNAMIC_ARCH: this CPU's core, nothing forced
        assert out["info"]["source"] == "system OpenBLAS", out["info"]
        assert out["info"]["corename"] == CPUS[cpu] and out["info"].get("coretype_forced") is None


def test_a_forced_core_beyond_the_emulated_cpu_refuses_the_library(tmp_path, cpuinfo_tool):
    """``OPENBLAS_CORETYPE=SkylakeX`` on an AVX2 CPU: OpenBLAS obeys it and dies; the loader refuses it first."""
    system = [p for s, p in blas.candidates() if s == "system OpenBLAS"]
    if not system:
        pytest.skip("no system OpenBLAS (scripts/setup.sh installs libopenblas0-pthread as root)")
    out, _ = run_emulated_loader(
        "EPYC-Rome", cpuinfo_tool, tmp_path, KVPOLICY_BLAS=system[0], OPENBLAS_CORETYPE="SkylakeX"
    )
    assert out["info"]["path"] != system[0] and system[0] not in out["probed"]
    assert any(system[0] in w and "OPENBLAS_CORETYPE=SkylakeX" in w and "avx512f" in w for w in out["warnings"])
