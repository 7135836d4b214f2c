"""What ties caches to a model: building caches for a model (and attaching them
to mlx-lm's generation), and saving/loading a model's caches."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "install": "..attention.hook",
        "AttentionHook": "..attention.hook",
        "KVCacheBuilder": ".builder",
        "attach": ".builder",
        "detach": ".builder",
        "save_caches": ".persistence",
        "load_caches": ".persistence",
    },
)
