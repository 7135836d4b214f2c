"""The per-layer policy cache (mlx-lm's cache contract) and its engine: the slot store, the checked
policy step, compiled decode calls, persistence state, diagnostics and the batched cache."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "PolicyCache": ".policy_cache",
        "BatchPolicyCache": ".batch",
    },
)
