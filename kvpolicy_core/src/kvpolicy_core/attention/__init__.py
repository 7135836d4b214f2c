"""Attention: the hook at mlx-lm's one attention call (installed and owned by the caches that need it), and the
arithmetic the cache and the hook share: attention with weights in one pass, the
log-weight bias, sliding-window masks."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "install": ".hook",
        "AttentionHook": ".hook",
        "ATTR": ".hook",
    },
)
