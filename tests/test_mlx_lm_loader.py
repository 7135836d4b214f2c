"""``import kvpolicy_core`` is enough for mlx-lm's own loader (docs/cache.md, docs/serving.md).

Process A (this test process) runs every shipped method on a tiny Gemma 3 (sliding-window and global layers)
written to disk, saves the caches with mlx-lm's ``save_prompt_cache`` and continues them (the same next tokens
as a run never saved). Process B is a new
Python process whose only kvpolicy import is ``import kvpolicy_core`` (plus the BLAS loader, so that its matmuls
are this process's): it loads the model and the file with mlx-lm's ``load_prompt_cache`` and continues; its
logits must be exactly A's. Without the registration B's load raises ``KeyError: 'PolicyCache'``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import resume_driver as driver
from mlx_lm.models.cache import save_prompt_cache

from kvpolicy_core import KVCacheBuilder, PolicyCache
from kvpolicy_core.testing.tiny_models import write_model_dir

#: process B: nothing of kvpolicy but the package import (and the BLAS loader, before mlx, as conftest.py)
PROCESS_B = r"""
import json, sys
import kvpolicy_core
import kvpolicy_core.runtime.blas
kvpolicy_core.runtime.blas.load_optimized_blas(quiet=True)
assert not any(m.startswith(("mlx", "kvpolicy_core.cache")) for m in sys.modules), "the import imported mlx"
from pathlib import Path
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import load_prompt_cache
from mlx_lm.utils import load_model

d = Path(sys.argv[1])
spec = json.loads((d / "spec.json").read_text())
model = load_model(d / "model")[0]
toks = mx.array(spec["tokens"])
out, classes = {}, {}
for i in range(spec["methods"]):
    caches = load_prompt_cache(str(d / f"{i}.safetensors"))
    classes[str(i)] = sorted({type(c).__name__ for c in caches})
    start = spec["start"]
    logits = [model(toks[:, t : t + 1], cache=caches) for t in range(start, start + spec["steps"])]
    out[str(i)] = np.array(mx.concatenate(logits, axis=1))
np.savez(d / "b.npz", **out)
print(json.dumps(classes))
"""


def _prompt(model, caches, toks):
    t = 0
    for S in driver.PROMPT + (1,) * driver.DECODE:
        model(toks[:, t : t + S], cache=caches)
        t += S


@pytest.mark.slow
def test_a_new_process_that_only_imports_the_package_loads_mlx_lm_prompt_caches_bit_for_bit(tmp_path):
    write_model_dir(tmp_path / "model", "gemma3_text", layers=4, heads=4, kv_heads=2)
    model = driver.load_model(tmp_path)
    toks = driver.tokens()
    start = sum(driver.PROMPT) + driver.DECODE
    want = {}
    for i, method in enumerate(driver.METHODS):
        caches = KVCacheBuilder.for_model(model, method)
        _prompt(model, caches, toks)
        assert any(c.n > c.budget for c in caches if isinstance(c, PolicyCache)), "a pending eviction is saved"
        save_prompt_cache(str(tmp_path / f"{i}.safetensors"), caches)
        want[i] = np.array(driver.continuation(model, caches))
        # a run never saved: saving settles the pending eviction (slot order, so float sums differ in the last
        # bits), hence A's own continuation after the save is the bit-for-bit reference; the tokens are the same
        unsaved = KVCacheBuilder.for_model(model, method)
        _prompt(model, unsaved, toks)
        never_saved = driver.continuation(model, unsaved)
        assert np.array_equal(never_saved.argmax(-1), want[i].argmax(-1)), method
        np.testing.assert_allclose(never_saved, want[i], rtol=1e-4, atol=1e-4, err_msg=method)
    spec = {"tokens": np.array(toks).tolist(), "start": start, "steps": driver.CONTINUE, "methods": len(want)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-c", PROCESS_B, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    classes = json.loads(proc.stdout.strip().splitlines()[-1])
    got = np.load(tmp_path / "b.npz")
    for i, method in enumerate(driver.METHODS):
        assert "PolicyCache" in classes[str(i)], (method, classes[str(i)])
        assert np.array_equal(got[str(i)], want[i]), (method, float(np.abs(got[str(i)] - want[i]).max()))
        assert np.array_equal(got[str(i)].argmax(-1), want[i].argmax(-1)), method  # the same next tokens


@pytest.mark.slow
def test_the_package_import_registers_both_classes_whichever_is_imported_first():
    """In new processes: the package before mlx-lm, mlx-lm before the package, and a cache module alone."""
    check = (
        "import sys, mlx_lm.models.cache as m; "
        "assert m.PolicyCache is sys.modules['kvpolicy_core.cache.policy_cache'].PolicyCache; "
        "assert m.BatchPolicyCache is sys.modules['kvpolicy_core.cache.batch'].BatchPolicyCache"
    )
    for first in (
        "import kvpolicy_core; import mlx_lm",
        "import mlx_lm; import kvpolicy_core",
        "import kvpolicy_core.cache.batch",
        "import kvpolicy_core.cache.slots; from mlx_lm import load",
    ):
        proc = subprocess.run([sys.executable, "-c", f"{first}; {check}"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, (first, proc.stderr[-2000:])


@pytest.mark.slow
def test_importing_the_package_imports_no_mlx():
    code = "import sys, kvpolicy_core; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_mlx_lm_modules_keep_their_source():
    """The module imported through the registration hook is mlx-lm's, source and all (tracebacks, inspect)."""
    import inspect

    import mlx_lm.models.cache as m

    assert "def load_prompt_cache" in inspect.getsource(m)
    assert Path(m.__file__).name == "cache.py"
