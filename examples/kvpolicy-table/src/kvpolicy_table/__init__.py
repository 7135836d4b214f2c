"""kvpolicy-table: SnapKV, PyramidKV and ChunkKV as kvpolicy methods (one module each, public API only)."""

__version__ = "0.3.0"
