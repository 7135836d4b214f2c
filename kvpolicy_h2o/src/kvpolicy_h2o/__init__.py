"""kvpolicy-h2o: H2O (heavy hitters + recent window, drop) as a kvpolicy method."""

from .config import H2OConfig

__all__ = ["H2OConfig"]
__version__ = "0.3.0"
