"""mlx-lm's own loader finds kvpolicy's cache classes with no ``import kvpolicy_core``: a new user's first
``mlx_lm.generate --prompt-cache-file FILE`` on a kvpolicy prompt file loads it (it ended in ``KeyError:
'PolicyCache'``). kvpolicy-core installs ``kvpolicy_core_mlx_lm.pth`` (kvpolicy_core/setup.py), whose start-up hook
(:mod:`_kvpolicy_core_hook`) imports nothing heavy and registers the classes when ``mlx_lm.models.cache`` is
imported; a broken hook never breaks Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_llama
from mlx_lm.models.cache import save_prompt_cache

from kvpolicy_core import KVCacheBuilder

ROOT = Path(__file__).resolve().parents[1]

#: mlx-lm's loader only: kvpolicy is never imported by this code
LOAD = """
import sys
from mlx_lm.models.cache import load_prompt_cache
caches = load_prompt_cache(sys.argv[1])
print(sorted({type(c).__name__ for c in caches}), sum(c.offset for c in caches))
"""


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    import mlx.core as mx

    model = tiny_llama()
    caches = KVCacheBuilder.for_model(model, "h2o:budget=8,n_sink=1,recent=1,signal=proxy")
    model(mx.arange(20)[None] % 32, cache=caches)
    path = tmp_path_factory.mktemp("hook") / "prompt.safetensors"
    save_prompt_cache(str(path), caches)
    return path


def _python(code: str, *args, site_dir=None):
    """``code`` in a new interpreter; with ``site_dir``, that directory is processed as a site directory first
    (its .pth files run, as site-packages' do at start-up)."""
    if site_dir is not None:
        code = f"import site; site.addsitedir({str(site_dir)!r})\n" + code
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=os.environ)


def test_the_hook_lets_mlx_lm_load_a_policy_cache_without_importing_kvpolicy(policy_file):
    proc = _python("import _kvpolicy_core_hook\n" + LOAD, policy_file)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("['PolicyCache']"), proc.stdout


def test_the_hook_and_kvpolicy_core_s_own_watcher_together(policy_file):
    """The hook runs at start-up, then ``import kvpolicy_core`` before mlx-lm is imported (a plugin's test suite
    does this): mlx-lm's module imports once and the classes are registered (when the package had a finder of its
    own, the two asked each other in turn: ``KeyError: 'mlx_lm.models.cache'``; now it reuses the hook's)."""
    proc = _python("import _kvpolicy_core_hook, kvpolicy_core\n" + LOAD, policy_file)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("['PolicyCache']"), proc.stdout


def test_the_package_alone_installs_the_one_finder_where_the_pth_did_not_run(policy_file):
    """As under ``python -S`` or an install that skipped the ``.pth``: ``import kvpolicy_core`` puts the hook's
    finder (kvpolicy's only ``sys.meta_path`` entry) on the path, and mlx-lm's loader then finds the classes."""
    code = (
        "import sys\n"
        "hook = sys.modules.pop('_kvpolicy_core_hook', None)\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if f is not getattr(hook, '_Finder', None)]\n"
        "import kvpolicy_core, _kvpolicy_core_hook\n"
        "assert 'mlx_lm' not in sys.modules and _kvpolicy_core_hook._Finder in sys.meta_path\n"
        "assert sum(type(f).__module__.startswith('kvpolicy') for f in sys.meta_path) == 0\n" + LOAD
    )
    proc = _python(code, policy_file)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("['PolicyCache']"), proc.stdout


def test_the_hook_imports_nothing_heavy_at_start_up():
    code = (
        "import sys, _kvpolicy_core_hook\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'kvpolicy_core', 'pydantic')]\n"
        "print(heavy)"
    )
    proc = _python(code)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)


def test_a_broken_hook_does_not_break_the_import_it_watches(policy_file):
    # kvpolicy_core cannot be imported: mlx-lm's module still imports, only the classes are missing
    code = "import sys; sys.modules['kvpolicy_core'] = None\nimport _kvpolicy_core_hook\n" + LOAD
    proc = _python(code, policy_file)
    assert "KeyError: 'PolicyCache'" in proc.stderr and "ImportError" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_the_built_wheel_installs_the_start_up_hook(tmp_path, policy_file):
    """The wheel (built from the sdist, as PyPI gets it) puts the .pth and the hook into site-packages: processed
    as a site directory, they make mlx-lm's own loader work in a process that never imports kvpolicy."""
    uv = [sys.executable, "-m", "uv"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = lambda *cmd: subprocess.run([*map(str, cmd)], capture_output=True, text=True, env=env, check=True)  # noqa: E731
    run(*uv, "build", "-q", "--out-dir", tmp_path / "dist", ROOT / "kvpolicy_core")
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    site_dir = tmp_path / "site"
    run(*uv, "pip", "install", "-q", "--no-deps", "--python", sys.executable, "--target", site_dir, wheel)
    assert (site_dir / "kvpolicy_core_mlx_lm.pth").is_file() and (site_dir / "_kvpolicy_core_hook.py").is_file()
    proc = _python(LOAD, policy_file, site_dir=site_dir)
    assert proc.returncode == 0 and proc.stdout.startswith("['PolicyCache']"), proc.stderr
