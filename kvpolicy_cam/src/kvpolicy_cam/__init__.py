"""kvpolicy-cam: CaM (Cache Merging) as a kvpolicy method: H2O's loser, merged instead of dropped."""

from .config import CamConfig

__all__ = ["CamConfig"]
__version__ = "0.3.0"
