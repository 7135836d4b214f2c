"""Exceptions raised by kvpolicy. Every message names what was wrong and what is accepted."""

import contextlib
from typing import Iterator


class KVPolicyError(Exception):
    """Base class of every kvpolicy error."""


class ConfigError(KVPolicyError, ValueError):
    """An invalid configuration: the message names the field, the value and what is accepted."""


class UnknownMethodError(ConfigError):
    """A method name that no installed plugin registers."""


class PluginError(KVPolicyError):
    """A plugin failed to load, to register, or raised inside a policy part."""


class ModelError(KVPolicyError, ValueError):
    """A model that kvpolicy cannot attach caches to (no ``layers``, foreign cache types, ...)."""


class InputFileError(KVPolicyError, ValueError):
    """A file the user named that cannot be read as text: missing, a directory, not UTF-8, empty."""


#: What MLX raises, evaluating or tracing: nanobind's translations of C++'s invalid_argument, runtime_error,
#: out_of_range and bad_alloc
MLX_ERRORS = (ValueError, RuntimeError, IndexError, MemoryError)


@contextlib.contextmanager
def blamed(what: str, passes: tuple = ()) -> Iterator[None]:
    """Run a plugin's code (its import, its registration hooks, its parts): anything it raises but ``passes``
    becomes a :class:`PluginError` ``"<what> <type>: <message>"``, chained to it."""
    try:
        yield
    except passes:
        raise
    except (Exception, SystemExit) as exc:  # a plugin's own code may raise anything (sys.exit() too): its bug, named
        raise PluginError(f"{what} {type(exc).__name__}: {exc}") from exc
