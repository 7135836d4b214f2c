"""The loader on a CPU without AVX-512, emulated: qemu-user with ``-cpu Haswell`` (AVX2/FMA only).

Control: loading the AVX-512-only ``cmeel-openblas`` build directly dies with SIGILL there,
exactly as on the AMD EPYC that reported it. Then the same process through
``load_optimized_blas()`` survives, refuses that library and computes right.

qemu-user shows the host's ``/proc/cpuinfo`` and does not follow the probe's child process
into emulation, so ``KVPOLICY_CPUINFO`` hands the loader the emulated CPU's flags; the probe
then runs natively and the static check (build target versus flags) is what refuses the build.
"""

import json
import os
import platform
import shutil
import subprocess
import sys

import pytest

from kvpolicy_core import blas

from test_blas import CHILD, WANT

QEMU = shutil.which("qemu-x86_64")
pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or QEMU is None,
                                reason="needs x86-64 and qemu-user (scripts/setup.sh installs it as root)")
HASWELL_CPUINFO = ("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 60\nmodel name\t: Haswell (qemu)\n"
                   "flags\t\t: fpu sse sse2 pni ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c avx2 bmi1 bmi2\n")


def emulated(code, tmp_path, **env):
    full = {**os.environ, "QEMU_CPU": "Haswell", **env}
    full.pop("OPENBLAS_CORETYPE", None)
    return subprocess.run([QEMU, sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=600)


@pytest.fixture(scope="module")
def cmeel():
    paths = [p for s, p in blas.candidates() if s == "cmeel-openblas"]
    if not paths:
        pytest.skip("cmeel-openblas is not installed (a kvpolicy-core dependency on Linux)")
    return paths[0]


def test_the_avx512_build_really_dies_on_the_emulated_cpu(tmp_path, cmeel):
    code = (f"import ctypes; ctypes.CDLL({cmeel!r}, mode=ctypes.RTLD_GLOBAL)\n"
            "import mlx.core as mx\na = mx.ones((256, 256)); mx.eval(a @ a); print('survived')")
    proc = emulated(code, tmp_path)
    assert proc.returncode in (-4, 132) and "survived" not in proc.stdout, (proc.returncode, proc.stderr[-500:])


def test_the_loader_survives_on_the_emulated_cpu(tmp_path, cmeel):
    (tmp_path / "cpuinfo").write_text(HASWELL_CPUINFO)
    proc = emulated(CHILD, tmp_path, KVPOLICY_BLAS=cmeel, KVPOLICY_CPUINFO=str(tmp_path / "cpuinfo"),
                    KVPOLICY_CACHE=str(tmp_path / "cache"))
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-1500:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["product"] == WANT
    assert out["info"]["path"] != cmeel
    assert any(cmeel in w and "avx512f" in w for w in out["warnings"])
    if out["info"]["path"]:  # a DYNAMIC_ARCH library, never forced beyond AVX2
        assert out["info"].get("coretype_forced") in (None, "Haswell", "Sandybridge")
