"""Run at interpreter start by the ``kvpolicy_core_mlx_lm.pth`` file that kvpolicy-core installs: lets mlx-lm's
own ``load_prompt_cache`` (``mlx_lm.generate --prompt-cache-file``) find kvpolicy's cache classes without an
``import kvpolicy_core``.

It imports nothing but :mod:`sys` at start-up and puts one finder on :data:`sys.meta_path` that finds nothing
itself: when ``mlx_lm.models.cache`` is first imported, it takes the spec the standard path finder gives and, once that
module has run, imports kvpolicy's two cache modules (which register ``PolicyCache`` and ``BatchPolicyCache`` in it:
:func:`kvpolicy_core.cache.batch.register_with_mlx_lm`), then leaves the path. ``import kvpolicy_core`` imports
this module too: it is the package's one import finder, also where the ``.pth`` file did not run. Every error of its
own is swallowed: a broken hook never breaks Python, it only leaves mlx-lm without the classes (importing
``PolicyCache`` registers it).
"""

import sys

_WATCHED = "mlx_lm.models.cache"


def _register(_module) -> None:
    try:
        # each registers its class in the module just run (kvpolicy_core/cache/batch.py)
        from kvpolicy_core.cache import batch, policy_cache  # noqa: F401
    except Exception:  # noqa: BLE001 - any error of a broken kvpolicy install must not break mlx-lm's import
        pass


class _Finder:
    """A :data:`sys.meta_path` finder for :data:`_WATCHED` only; it removes itself at its first use."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != _WATCHED:
            return None
        try:
            sys.meta_path.remove(cls)
        except ValueError:
            pass
        try:
            # the standard path finder itself, not the other meta-path finders (one may be another watcher that
            # asks this one in turn)
            from importlib.machinery import PathFinder

            spec = PathFinder.find_spec(name, path, target)
            if spec is None:
                return None
            loader = spec.loader
            run = getattr(loader, "exec_module", None)
            if run is None:
                return spec

            def exec_module(module, _run=run):
                _run(module)
                _register(module)

            loader.exec_module = exec_module  # this module's own loader instance
            return spec
        except (ImportError, AttributeError, TypeError, ValueError):  # a loader it cannot wrap: the other finders
            return None


def install() -> None:
    """Put the finder on :data:`sys.meta_path` (once; nothing when mlx-lm's module is already imported)."""
    if _WATCHED in sys.modules:  # (the .pth line that imports this module swallows what this raises)
        _register(sys.modules[_WATCHED])
    elif _Finder not in sys.meta_path:
        sys.meta_path.insert(0, _Finder)


install()
