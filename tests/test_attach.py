"""attach and detach: detach gives the model its own make_cache back, and one user's detach leaves another
user's observed caches working."""

import mlx.core as mx
from helpers import tiny_llama

from kvpolicy_core import KVCacheBuilder, attach, detach


def test_detach_restores_the_models_own_make_cache():
    from mlx_lm.models.cache import RotatingKVCache

    model = tiny_llama()
    custom = lambda: [RotatingKVCache(max_size=32, keep=4) for _ in model.layers]  # noqa: E731
    model.make_cache = custom
    attach(model, "h2o:budget=16")
    detach(model)
    assert model.make_cache is custom


def test_one_users_detach_does_not_break_another_users_observed_caches():
    model = tiny_llama(seed=6)
    mine = KVCacheBuilder.for_model(model, "h2o:budget=8,signal=observed")
    KVCacheBuilder.for_model(model, "h2o:budget=8")
    detach(model)  # someone else's detach
    tokens = mx.random.randint(0, 97, (1, 20), key=mx.random.key(2))
    model(tokens[:, :12], cache=mine)
    model(tokens[:, 12:13], cache=mine)  # still observed: no ModelError
    assert all(c.offset == 13 for c in mine)
