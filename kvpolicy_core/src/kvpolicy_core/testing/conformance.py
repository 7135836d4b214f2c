"""A conformance suite for kvpolicy methods: run it against your method with one pytest line.

Subclass :class:`PolicyConformance` in your plugin's tests and name your method::

    from kvpolicy_core.testing.conformance import PolicyConformance

    class TestMyPolicy(PolicyConformance):
        method = "mypolicy:budget=16,n_sink=2"

pytest then runs every check below against it: budget held, sinks kept, each layer's allocated budget (and the
allocation's mean),
batched rows decoding as each row alone, shapes across batch and heads, chunked prefill, determinism with a
seed, ``state`` round trip, the mlx-lm contract on a tiny random-weight model, and clear errors for invalid
configs. Equivalences between two methods are :mod:`kvpolicy_core.testing.equivalence`'s.
``run_conformance(method)`` runs the same checks from a plain function. The kit prefills a few budgets' worth of
tokens, so it runs methods whose budget (and every layer's allocated budget) is at most :data:`KIT_MAX_BUDGET`;
a larger one is refused with a ``ValueError`` before any work.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..cache.policy_cache import PolicyCache
from ..config.parse import parse_config
from ..errors import ConfigError
from ..integration.builder import KVCacheBuilder, detach
from .tiny_models import VOCAB, tiny_llama

__all__ = ["PolicyConformance", "run_conformance", "tiny_llama", "random_kv", "feed", "with_fields", "CHUNK_PATTERNS"]

#: The largest budget (of the method, and of any layer under its allocation) the kit runs: its checks feed up to
#: ``4 * budget + 64`` tokens through tiny models, seconds at this size (a budget of 2**30 ran for minutes and GBs)
KIT_MAX_BUDGET = 4096

#: Update sizes per call: decode, prefill then decode, several chunks, a chunk larger than the budget.
CHUNK_PATTERNS: Tuple[Tuple[int, ...], ...] = ((1,) * 40, (24,) + (1,) * 16, (7, 7, 1, 1, 20, 4), (3, 37))


def random_kv(B: int = 2, H: int = 3, S: int = 40, D: int = 16, seed: int = 0, dtype=mx.float32):
    """Random keys and values [B, H, S, D]."""
    k1, k2 = mx.random.split(mx.random.key(seed))
    return (mx.random.normal((B, H, S, D), key=k1).astype(dtype), mx.random.normal((B, H, S, D), key=k2).astype(dtype))


def fetched_shape(keys, bits: Optional[int]) -> Tuple[int, ...]:
    """The shape [B, H, N, D] of keys as ``update_and_fetch`` returns them: an array, or quantized rows
    ``(packed [B, H, N, D * bits / 32], scales, biases)``."""
    if not isinstance(keys, tuple):
        return tuple(keys.shape)
    packed = keys[0].shape
    return tuple(packed[:-1]) + (packed[-1] * 32 // bits,)


def feed(cache: PolicyCache, keys: mx.array, values: mx.array, chunks: Iterable[int], queries=None, scale=None):
    """Feed K/V [B, H, T, D] through ``cache`` in chunks, calling the attention hook like a model would.

    Returns the shapes [B, H, N, D] of what each call returned (of the keys it stands for where they come as
    quantized rows, ``(packed, scales, biases)``: a held prompt under ``hold_bits``, or ``kv_bits``). ``queries``
    [B, Hq, T, D] defaults to the keys, ``scale`` to ``D ** -0.5``; the mask is None for one token and "causal"
    for a chunk.
    """
    queries = keys if queries is None else queries
    scale = keys.shape[-1] ** -0.5 if scale is None else scale
    shapes, t = [], 0
    for S in chunks:
        k, v = cache.update_and_fetch(keys[:, :, t : t + S], values[:, :, t : t + S])
        cache.before_attention(queries[:, :, t : t + S], scale, None if S == 1 else "causal")
        shapes.append(fetched_shape(k, getattr(cache, "bits", None)))
        t += S
    return shapes


def with_fields(method: str, fields: str) -> str:
    """Append ``fields`` to a config string that may already have some."""
    return f"{method}{',' if ':' in method else ':'}{fields}"


class PolicyConformance:
    """Checks every kvpolicy method must pass. Set ``method`` to a config string."""

    method: str = ""

    # -- helpers -------------------------------------------------------------------------------
    def config(self):
        cfg = parse_config(self.method)
        _bounded(self.method, [cfg.policy.budget])
        return cfg, cfg.policy.budget, cfg.policy.n_sink

    def cache(self, **fields) -> PolicyCache:
        extra = ",".join(f"{k}={v}" for k, v in fields.items())
        return PolicyCache(with_fields(self.method, extra) if extra else self.method)

    # -- checks --------------------------------------------------------------------------------
    def test_budget_held_and_sinks_kept(self):
        """Every update returns the slots the cache holds; decode never holds more than ``budget + 1``; a streaming
        method that evicts exactly the overflow holds ``min(seen, budget) + S`` (a method that cuts at the end of
        the prompt holds the prompt until its first one-token update, and one that evicts whole chunks may hold
        fewer); sinks are kept and positions are distinct."""
        _, budget, n_sink = self.config()
        for chunks in CHUNK_PATTERNS:
            total = sum(chunks)
            keys, values = random_kv(S=total, seed=len(chunks))
            cache = self.cache()
            exact = cache.policy.config.policy.when == "stream" and not cache.policy_step.counts_more
            t = 0
            for S in chunks:
                (shape,) = feed(cache, keys[:, :, t : t + S], values[:, :, t : t + S], (S,), scale=0.25)
                assert shape[2] == cache.n, "update_and_fetch must return every slot the cache holds"
                if exact:
                    assert shape[2] == min(t, budget) + S, "update_and_fetch must return retained + new"
                t += S
                if S == 1:
                    assert cache.n <= budget + 1, "a decode step holds at most budget + 1 slots"
                held = cache.holds_prompt and S > 1  # a prompt held for its cut (when="prompt_end") counts whole
                assert 0 < cache.tokens_kept <= (cache.n if held else min(t, budget)) and cache.offset == t
            pos = np.array(cache.retained()[2])
            assert pos.shape[-1] <= min(total, budget)
            assert (np.diff(pos, axis=-1) > 0).all(), "retained positions must be distinct"
            assert (pos[..., : min(n_sink, total)] == np.arange(min(n_sink, total))).all(), "sinks must be kept"

    def test_each_layer_gets_its_allocated_budget_and_keeps_it(self):
        """Built for a model, each layer's cache has the budget of the method's allocation and keeps at most it."""
        from mlx_lm.generate import generate_step

        from ..config.policy import layer_budgets
        from ..parts.allocation import LayerInfo

        model = tiny_llama(seed=2)
        try:
            caches = KVCacheBuilder.for_model(model, self.method)
            n = len(caches)
            want = layer_budgets(self.method, [LayerInfo(i, n, None) for i in range(n)])
            _bounded(self.method, want)
            assert [c.budget for c in caches] == want, "each layer's budget is its allocation's"
            prompt = mx.random.randint(0, VOCAB, (max(want) + 12,), key=mx.random.key(2))
            for _, _ in zip(generate_step(prompt, model, prompt_cache=caches, prefill_step_size=9), range(4)):
                pass
            assert all(0 < c.tokens_kept <= c.budget for c in caches)
        finally:
            detach(model)

    def test_the_allocation_keeps_its_stated_mean(self):
        """The allocation's budgets (before the floor of ``n_sink + recent + 1``) have mean ``budget``, to within
        rounding (half a token per layer): exactly on a model of global layers; on a sliding-window model, with
        each sliding layer counted at most its window (slots past it are never attended), the usable total is at
        most ``N * budget`` and the total at least ``N * budget`` (the slots a window cannot use go elsewhere).
        An allocation that needs layer statistics is checked at the cut, on made-up statistics, as well."""
        from ..config.policy import allocation_of
        from ..parts.allocation import LayerInfo, LayerStats
        from ..parts.base import needs_of

        cfg, budget, _ = self.config()
        allocation, owner = allocation_of(cfg)
        N = 6
        for windows in ([None] * N, [8, 8, None, 8, 8, None]):
            layers = [LayerInfo(i, N, w) for i, w in enumerate(windows)]
            stats = [None]
            if needs_of(allocation).layer_stats:
                stats.append([LayerStats(0.1 + 0.15 * ((3 * i) % 5), 32) for i in range(N)])
            for st in stats:
                got = list(allocation.budgets(budget, layers, *([] if st is None else [st])))
                usable = sum(b if w is None else min(b, w) for b, w in zip(got, windows))
                where = f"{owner}: budgets {got} for budget {budget} over windows {windows}"
                assert usable <= N * budget + N / 2, f"{where}: more than the mean allows ({N} x {budget})"
                assert sum(got) >= N * budget - N / 2, f"{where}: less than the mean ({N} x {budget})"

    def test_allocation_holds_its_total_on_a_hybrid_model(self):
        """On a model of sliding-window and global layers (Gemma 3 270M's: 15 of 18 slide over 512 tokens; and one
        whose windows are below the budget), the method's allocation gives one int per layer summing to
        ``N * budget`` within one token per layer (rounding), before the config's floor raises any."""
        from ..config.policy import allocation_of
        from ..parts.allocation import LayerInfo, LayerStats
        from ..parts.base import needs_of

        cfg, budget, _ = self.config()
        allocation, owner = allocation_of(cfg)
        for w in (512, max(1, budget // 2)):
            layers = [LayerInfo(i, 18, None if i % 6 == 5 else w) for i in range(18)]
            stats = [LayerStats(0.5 + 0.1 * (i % 3), 32) for i in range(18)]
            got = allocation.budgets(budget, layers, *([stats] if needs_of(allocation).layer_stats else []))
            assert len(got) == 18 and all(isinstance(b, int) for b in got), f"{owner}: one int per layer"
            assert abs(sum(got) - 18 * budget) <= 18, f"{owner}: total {sum(got)} on a hybrid model, not 18 * {budget}"

    def test_batched_rows_decode_each_as_alone(self):
        """Rows of different lengths in mlx-lm's batch cache (``BatchPolicyCache``) decode exactly as each row
        alone, whether the parts declare ``Needs(batch_rows=True)`` (stacked steps) or not (one step per row)."""
        from ..cache.batch import BatchPolicyCache

        _, budget, _ = self.config()
        keys, values = random_kv(B=1, S=budget + 30, seed=4)
        rows, alone = [], []
        for n in (budget + 6, budget + 9):
            for out in (rows, alone):
                cache = self.cache(seed=3)
                feed(cache, keys[:, :, :n], values[:, :, :n], (n,))
                out.append(cache)
        batch = BatchPolicyCache.merge(rows)
        for t in range(8):
            k = mx.concatenate([keys[:, :, budget + 10 + t : budget + 11 + t]] * 2)
            v = mx.concatenate([values[:, :, budget + 10 + t : budget + 11 + t]] * 2)
            batch.update_and_fetch(k, v)
            batch.before_attention(k, 0.25, None)
            for r, cache in enumerate(alone):
                feed(cache, k[r : r + 1], v[r : r + 1], (1,), scale=0.25)
        for r, cache in enumerate(alone):
            got = batch.extract(r)
            for x, y in zip(got.retained(), cache.retained()):
                np.testing.assert_array_equal(np.array(x), np.array(y))

    def test_shapes_across_batch_heads_and_dims(self):
        _, budget, _ = self.config()
        for B, H, D in ((1, 1, 8), (3, 2, 16), (2, 4, 32)):
            keys, values = random_kv(B=B, H=H, S=budget + 9, D=D, seed=B * 10 + H)
            cache = self.cache()
            shapes = feed(cache, keys, values, (budget // 2, budget // 2 + 3, 1, 1, 1, 1, 1, 1))
            (b, h, n, d) = shapes[-1]
            assert (b, h, d) == (B, H, D) and n <= budget + 1  # budget + 1 (fewer for whole-chunk evictions)
            k, v, pos, scores = cache.state[:4]
            kept = cache.tokens_kept
            assert k.shape == (B, H, kept, D) and v.shape == (B, H, kept, D) and kept <= budget
            assert pos.shape == scores.shape == (B, H, kept)

    def test_deterministic_with_a_seed(self):
        keys, values = random_kv(S=60, seed=7)
        runs = []
        for _ in range(2):
            cache = self.cache(seed=11)
            feed(cache, keys, values, (20,) + (1,) * 40)
            runs.append([np.array(x) for x in cache.state[:4]])
        for a, b in zip(*runs):
            np.testing.assert_array_equal(a, b)

    def test_state_round_trip_continues_identically(self):
        keys, values = random_kv(S=60, seed=3)
        a = self.cache(seed=5)
        feed(a, keys[:, :, :40], values[:, :, :40], (30,) + (1,) * 10)
        b = PolicyCache.from_state(a.state, a.meta_state)
        assert b.offset == a.offset and b.tokens_kept == a.tokens_kept
        for cache in (a, b):
            feed(cache, keys[:, :, 40:], values[:, :, 40:], (1,) * 20)
        for x, y in zip(a.state[:4], b.state[:4]):
            np.testing.assert_array_equal(np.array(x), np.array(y))

    def test_mlx_lm_contract_on_a_tiny_model(self):
        from mlx_lm.generate import generate_step

        _, budget, _ = self.config()
        model = tiny_llama(seed=1)
        try:
            tokens = mx.random.randint(0, VOCAB, (1, budget + 20), key=mx.random.key(0))
            # with a budget above the length, logits equal mlx-lm's plain cache exactly
            B = 4 * budget + 64  # every layer's budget (whatever the allocation) above the length
            big = KVCacheBuilder.for_model(model, parse_config(self.method, budget=B), budgets=[B] * len(model.layers))
            logits = []
            for caches in (big, [reference_cache(parse_config(self.method)) for _ in model.layers]):
                out = [model(tokens[:, :10], cache=caches)] + [
                    model(tokens[:, t : t + 1], cache=caches) for t in range(10, 16)
                ]
                logits.append(mx.concatenate(out, axis=1))
            assert mx.array_equal(logits[0], logits[1]), "budget > length must reproduce plain-cache logits"
            # generation with small prefill steps stays within budget and yields tokens
            caches = KVCacheBuilder.for_model(model, self.method)
            out = [
                t
                for (t, _), _ in zip(
                    generate_step(tokens[0], model, prompt_cache=caches, prefill_step_size=7), range(8)
                )
            ]
            assert len(out) == 8
            for c in caches:
                assert 0 < c.tokens_kept <= min(c.budget, c.offset) and c.offset >= tokens.shape[1] + 8
        finally:
            detach(model)

    def test_invalid_configs_are_clear_errors(self):
        cfg, budget, n_sink = self.config()
        base = cfg.method
        for bad, needle in (
            (f"{base}:budget=0", "budget"),
            (f"{base}:n_sink=-1", "n_sink"),
            (f"{base}:budget={n_sink + 1},n_sink={n_sink},recent=1", "budget must be greater than n_sink + recent"),
            (f"{base}:no_such_field=1", "unknown field"),
        ):
            try:
                parse_config(bad)
            except ConfigError as exc:
                assert needle in str(exc), (bad, str(exc))
            else:  # pragma: no cover - a failing plugin
                raise AssertionError(f"{bad!r} was accepted")


def reference_cache(config):
    """mlx-lm's cache that stores rows as ``config`` does: ``QuantizedKVCache`` for ``kv_bits``, a ``KVCache`` whose
    rows are rounded through ``kv_dtype``, else a plain ``KVCache``. A policy cache whose budget exceeds the
    sequence attends exactly as it does."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if config.kv_bits is not None:
        return QuantizedKVCache(config.kv_group_size, config.kv_bits)
    if config.kv_dtype is None:
        return KVCache()
    dtype = getattr(mx, config.kv_dtype)

    class RoundedKVCache(KVCache):
        def update_and_fetch(self, keys, values):
            return super().update_and_fetch(
                keys.astype(dtype).astype(keys.dtype), values.astype(dtype).astype(values.dtype)
            )

    return RoundedKVCache()


def _bounded(method: str, budgets) -> None:
    """Refuse a method whose budgets (the config's, or a layer's under its allocation) exceed the kit's maximum."""
    if max(budgets) > KIT_MAX_BUDGET:
        raise ValueError(
            f"{method!r}: budget {max(budgets)} is above the conformance kit's maximum of {KIT_MAX_BUDGET} (KIT_MAX_"
            "BUDGET; its checks feed up to 4 * budget + 64 tokens): run the kit with a smaller budget"
        )


def run_conformance(method: str) -> List[str]:
    """Run every check of :class:`PolicyConformance` against ``method``; returns the names run."""
    suite = type("Suite", (PolicyConformance,), {"method": method})()
    names = [n for n in dir(PolicyConformance) if n.startswith("test_")]
    for name in names:
        getattr(suite, name)()
    return names
