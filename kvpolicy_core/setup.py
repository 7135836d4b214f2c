"""Installs ``kvpolicy_core_mlx_lm.pth`` next to the package (site-packages), in a wheel and in an editable
install alike: at interpreter start it runs :mod:`_kvpolicy_core_hook`, which lets mlx-lm's own
``load_prompt_cache`` find kvpolicy's cache classes without an ``import kvpolicy_core``. Everything else is in
pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "kvpolicy_core_mlx_lm.pth"
# one line: site.py runs a .pth line that starts with "import"; a failing import is swallowed, never reported
PTH_TEXT = 'import sys; exec("try:\\n import _kvpolicy_core_hook\\nexcept Exception:\\n pass")\n'


class BuildPy(build_py):
    """The packages, and the .pth file at the wheel's root (installed into site-packages)."""

    def run(self):
        super().run()
        if not self.editable_mode:
            target = Path(self.build_lib, PTH)
            target.write_text(PTH_TEXT)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib, PTH))]


class _WithPth:
    """An editable-wheel strategy that also writes the .pth file into the wheel."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.writestr(PTH, PTH_TEXT)


class EditableWheel(editable_wheel):
    """``pip install -e``: the editable wheel gets the .pth file too."""

    def _select_strategy(self, *args, **kwargs):
        return _WithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel})
