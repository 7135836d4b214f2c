"""Test kits for policy authors: the conformance class (:class:`PolicyConformance`) and tiny
random-weight models of every supported family."""

from .conformance import *  # noqa: F401,F403  (the kit's names: PolicyConformance, tiny_llama, ...)
from .conformance import __all__  # noqa: F401
