"""The per-layer policy cache: runs any scorer/selector/disposition under mlx-lm's cache contract.

Layout. ``keys``/``values`` are preallocated buffers ``[B, H, cap, D]`` whose first ``n``
slots are valid; ``positions`` ``[B, H, cap]`` holds each slot's absolute position and
``scores`` ``[B, H, n]`` the scorer's running scores. Slots are *not* in temporal order
after decode evictions: attention does not need order (keys carry their RoPE rotation,
masks come from ``positions``), and :meth:`PolicyCache.retained` sorts on request.

Step. ``update_and_fetch(k, v)`` with S new tokens:

1. *Settle*: if the previous call left ``n > budget`` slots, the selector picks
   ``E = n - budget`` losers from the scores accumulated so far (including the previous
   step's attention), the disposition updates survivors, and the losers are removed.
   Decode (``S == 1``, ``E == 1``) writes the new token straight into the loser's slot
   (O(D) work per head); otherwise survivors are compacted in temporal order.
2. *Append* the S new tokens (positions ``offset .. offset+S-1``, score 0).
3. *Score*: ``scorer.on_append`` (and, for observed signals, ``on_attention`` from the
   attention hook just before the model's attention).
4. Return everything this step attends to: ``min(n, budget) + S`` slots.

So the cache holds ``budget`` tokens between steps plus the step's new tokens during it,
exactly "attend, then return to the budget"; doing the removal at the start of the next
call lets it happen in place after the previous step was evaluated.

``offset`` is the number of tokens seen: mlx-lm rotates queries with it, so RoPE stays
exact after evictions without any re-rotation.
"""

from __future__ import annotations

import contextlib
import json
from typing import Optional, Tuple

import mlx.core as mx

from .errors import KVPolicyError, ModelError, PluginError
from .parts.base import CacheView, MergeUpdate
from .parts.cumulative_attention import causal_allowed
from .policy import Policy, build_policy, step_key

_INT_MAX = 2**31 - 1


class PolicyCache:
    """An mlx-lm compatible KV cache holding at most ``budget`` tokens under a policy.

    Args:
        policy: a :class:`~kvpolicy_core.policy.Policy` (or anything :func:`build_policy` takes).
        layer: the layer index (decorrelates random draws between layers).
        window: the sliding window of the layer, or None for global attention. Tokens
            outside the window of every future query are evicted first and masked out.
        head_shard: ``(rank, size)`` of the tensor-parallel group that splits this layer's KV
            heads evenly (mlx-lm's ``model.shard``): this cache holds global heads
            ``rank * H .. rank * H + H - 1`` of ``size * H``; ``(0, 1)`` when unsharded.
            Random draws are keyed by global head, so they do not depend on the split.
    """

    step = 256

    def __init__(self, policy, layer: int = 0, window: Optional[int] = None,
                 head_shard: Tuple[int, int] = (0, 1)) -> None:
        rank, size = head_shard
        if not (isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size):
            raise ValueError(f"head_shard: must be (rank, size) with 0 <= rank < size (got {head_shard!r})")
        self.head_shard = (rank, size)
        self.policy: Policy = policy if isinstance(policy, Policy) else build_policy(policy)
        self.budget = self.policy.budget
        self.layer = layer
        self.window = window
        self.keys = self.values = self.positions = self.scores = None
        self.n = 0  # valid slots
        self.offset = 0  # tokens seen = absolute position of the next token
        self._stats = mx.zeros((2,), dtype=mx.int32)  # gate draws, merges
        self._attended = True
        self._last_S = 0
        self._updates = 0

    # ------------------------------------------------------------------ mlx-lm contract
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """keys [B, H, S, D], values [B, H, S, Dv] -> all keys/values this step attends to."""
        self._check_input(keys, values)
        self._check_observation()
        S = keys.shape[2]
        with self._transaction():
            over = self.n - self.budget
            if over == 1 and S == 1:
                losers = self._evict(1)
                self._write_into(losers, keys, values)
            else:
                if over > 0:
                    self._compact(over)
                self._append(keys, values)
            self.offset += S
            new_positions = mx.arange(self.offset - S, self.offset, dtype=mx.int32)
            scores = self._call("scorer", self.policy.scorer.on_append, self._view(S), keys, new_positions)
            self._set_scores(scores)
            self._attended = False
        self._bound_graph()
        return self.keys[..., : self.n, :], self.values[..., : self.n, :]

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        """The mask for N new tokens attending to ``min(n, budget) + N`` slots.

        Global layers need only causality among the new tokens (every retained token is
        in the past). Sliding-window masks depend on each layer's retained positions,
        so the attention hook rebuilds them per layer (:meth:`before_attention`).
        """
        L = min(self.n, self.budget) + N
        if N == 1 and not return_array:
            return None
        if return_array or window_size is not None:
            return causal_allowed(N, L)
        return "causal"

    @property
    def state(self):
        """(keys, values, positions, scores, meta JSON) of the retained tokens, settled.

        The JSON carries the config, offset, layer, window and counters, so mlx-lm's own
        ``save_prompt_cache``/``load_prompt_cache`` round-trip a kvpolicy cache.
        """
        self.settle()
        if self.keys is None:
            return []
        n = self.n
        return self.keys[..., :n, :], self.values[..., :n, :], self.positions[..., :n], self.scores, self._meta_json()

    @state.setter
    def state(self, v) -> None:
        if not v:
            self.keys = self.values = self.positions = self.scores = None
            self.n = 0
            return
        self.keys, self.values, self.positions, self.scores = v[:4]
        self.n = self.keys.shape[2]
        if len(v) > 4:
            meta = json.loads(v[4])
            self.offset = int(meta["offset"])
            self._stats = mx.array(meta.get("stats", [0, 0]), dtype=mx.int32)

    def _meta_json(self) -> str:
        meta = {
            "config": json.loads(self.policy.config.model_dump_json()),
            "offset": self.offset,
            "layer": self.layer,
            "window": self.window,
            "stats": self._stats.tolist(),
        }
        if self.head_shard != (0, 1):
            meta["head_shard"] = list(self.head_shard)
        return json.dumps(meta)

    @property
    def meta_state(self):
        return (self._meta_json(),)

    @classmethod
    def from_state(cls, state, meta_state=None):
        """Rebuild a cache from ``state`` (and optionally ``meta_state``); the config comes with them."""
        meta_json = meta_state[0] if meta_state else (state[4] if len(state) > 4 else None)
        if meta_json is None:
            raise KVPolicyError("PolicyCache.from_state needs the meta JSON (state[4] or meta_state)")
        obj = cls.from_meta(meta_json)
        obj.state = (*state[:4], meta_json)
        return obj

    @classmethod
    def from_meta(cls, meta_json: str) -> "PolicyCache":
        """An empty cache with the config, layer and window recorded in ``meta_json``."""
        meta = json.loads(meta_json)
        data = dict(meta["config"])
        data.update(data.pop("policy"))
        return cls(data, layer=int(meta["layer"]), window=meta["window"],
                   head_shard=tuple(meta.get("head_shard", (0, 1))))

    def is_trimmable(self) -> bool:
        """Trimmable only while nothing was ever evicted (then it is a plain cache)."""
        return self.n == self.offset and self.n <= self.budget

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(self.n, n)
        self.n -= n
        self.offset -= n
        if self.scores is not None:
            self.scores = self.scores[..., : self.n]
        return n

    def size(self) -> int:
        return self.tokens_kept

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers this cache holds (keys, values, positions, scores)."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes + self.scores.nbytes

    # ------------------------------------------------------------------ diagnostics
    @property
    def tokens_seen(self) -> int:
        return self.offset

    @property
    def tokens_kept(self) -> int:
        """Tokens retained once the current step is settled (same for every head)."""
        return min(self.n, self.budget)

    def _bytes_per_token(self) -> int:
        if self.keys is None:
            return 0
        B, H, _, D = self.keys.shape
        return B * H * (D * self.keys.itemsize + self.values.shape[-1] * self.values.itemsize)

    @property
    def kept_bytes(self) -> int:
        return self.tokens_kept * self._bytes_per_token()

    @property
    def full_seq_bytes(self) -> int:
        """Bytes a full cache would hold for the tokens seen, in the same dtype."""
        return self.offset * self._bytes_per_token()

    @property
    def compression_ratio(self) -> float:
        """full_seq_bytes / kept_bytes; > 1 means savings, 1.0 for an empty cache."""
        return self.full_seq_bytes / self.kept_bytes if self.kept_bytes else 1.0

    @property
    def merge_mode(self) -> str:
        return getattr(self.policy.config.policy, "merge", "drop")

    @property
    def merge_gate(self) -> bool:
        return bool(getattr(self.policy.config.policy, "merge_gate", False))

    @property
    def gate_draws(self) -> int:
        return int(self._stats[0].item())

    @property
    def merges(self) -> int:
        return int(self._stats[1].item())

    def retained(self):
        """(keys, values, positions, scores) of the retained tokens in temporal order."""
        self.settle()
        if self.keys is None:
            return None
        order = mx.argsort(self.positions[..., : self.n], axis=-1)
        take = lambda x: mx.take_along_axis(x, order[..., None], axis=2)  # noqa: E731
        return (
            take(self.keys[..., : self.n, :]),
            take(self.values[..., : self.n, :]),
            mx.take_along_axis(self.positions[..., : self.n], order, axis=-1),
            mx.take_along_axis(self.scores, order, axis=-1),
        )

    def settle(self) -> None:
        """Apply a pending eviction now (after a step), so exactly ``budget`` tokens remain."""
        if self.n > self.budget:
            with self._transaction():
                self._compact(self.n - self.budget)

    def __repr__(self) -> str:
        return (
            f"PolicyCache(method={self.policy.config.method!r}, layer={self.layer}, budget={self.budget}, "
            f"window={self.window}, kept={self.tokens_kept}, seen={self.offset})"
        )

    # ------------------------------------------------------------------ attention hook
    def before_attention(self, queries: mx.array, scale: float, mask):
        """Called by the attention hook with the real queries [B, Hq, S, D]; returns the mask to use.

        Sliding-window layers get a mask built from this layer's own positions:
        query at position p may attend to key at position q iff ``p - W < q <= p``.
        """
        if self.window is not None and self.offset > self.window:
            mask = self._window_mask(queries.shape[1])
        if self.policy.scorer.needs_attention:
            view = self._view(queries.shape[2])
            self._set_scores(self._call("scorer", self.policy.scorer.on_attention, view, queries, scale, mask))
            self._bound_graph()
        self._attended = True
        return mask

    def _window_mask(self, n_q_heads: int) -> mx.array:
        S = self._last_S
        pos = self.positions[..., : self.n]  # [B, H, L]
        qpos = mx.arange(self.offset - S, self.offset, dtype=mx.int32)[None, None, :, None]
        kpos = pos[:, :, None, :]
        allowed = (kpos <= qpos) & (kpos > qpos - self.window)  # [B, H, S, L]
        H = pos.shape[1]
        if n_q_heads != H:
            allowed = mx.repeat(allowed, n_q_heads // H, axis=1)
        return allowed

    # ------------------------------------------------------------------ internals
    def _check_input(self, keys: mx.array, values: mx.array) -> None:
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"layer {self.layer}: keys and values must be [B, H, S, D] with equal B, H, S "
                f"(got keys {tuple(keys.shape)}, values {tuple(values.shape)})"
            )
        self._last_S = keys.shape[2]
        if self.keys is None:
            return
        have = (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3], self.values.shape[3])
        got = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3])
        if have != got:
            raise ValueError(
                f"layer {self.layer}: (batch, kv_heads, key_dim, value_dim) changed from {have} to {got}; "
                "a cache serves one batch with fixed heads and head dims: build fresh caches"
            )
        if keys.dtype != self.keys.dtype or values.dtype != self.values.dtype:
            raise ValueError(
                f"layer {self.layer}: dtype changed from {self.keys.dtype} to {keys.dtype}; "
                "a cache keeps the dtype it was first given: build fresh caches"
            )

    def _check_observation(self) -> None:
        needs_hook = self.policy.scorer.needs_attention or (self.window is not None and self.offset > self.window)
        if needs_hook and not self._attended and self.offset > 0:
            raise ModelError(
                f"layer {self.layer}: this cache needs kvpolicy's attention hook "
                f"({'observed signal' if self.policy.scorer.needs_attention else 'sliding-window mask'}), "
                "but the model's attention did not call it; build caches with "
                "KVCacheBuilder.for_model(model, config) or kvpolicy_core.attach(model, config)"
            )

    _FIELDS = ("keys", "values", "positions", "scores", "n", "offset", "_stats", "_attended")

    @contextlib.contextmanager
    def _transaction(self):
        """All-or-nothing: if a part (or anything) raises, the cache is left exactly as before.

        Every update below is functional (MLX arrays are values), so keeping references is a
        complete snapshot.
        """
        saved = {name: getattr(self, name) for name in self._FIELDS}
        try:
            yield
        except BaseException:
            for name, value in saved.items():
                setattr(self, name, value)
            raise

    def _bound_graph(self) -> None:
        """Keep the lazy graph of scores and counters bounded over long runs.

        Once over budget, the next step's eviction (hence the model's output) depends on the
        scores, so they are evaluated with the output every step. Below the budget nothing
        depends on them yet: evaluate them asynchronously. Counters depend only on small,
        already evaluated arrays: evaluate them every 256 updates.
        """
        self._updates += 1
        if self.n <= self.budget:
            mx.async_eval(self.scores)
        if self._updates % 256 == 0:
            mx.async_eval(self._stats)

    def _set_scores(self, scores: mx.array) -> None:
        """Store a scorer's result; must be [B, H, n]. NaN scores (from non-finite keys) count as 0."""
        if not isinstance(scores, mx.array) or scores.shape != (*self.keys.shape[:2], self.n):
            raise PluginError(
                f"layer {self.layer}: {self.policy.owners['scorer']} returned scores of shape "
                f"{getattr(scores, 'shape', type(scores).__name__)}, expected {(*self.keys.shape[:2], self.n)}"
            )
        scores = scores.astype(mx.float32)
        self.scores = mx.where(mx.isnan(scores), mx.zeros_like(scores), scores)

    def _view(self, n_new: int) -> CacheView:
        n = self.n
        pos = self.positions[..., :n]
        dead = None
        if self.window is not None and self.offset > self.window and n_new == 0:
            dead = pos <= self.offset - self.window
        H, (rank, size) = self.keys.shape[1], self.head_shard
        return CacheView(self.keys[..., :n, :], self.values[..., :n, :], pos, self.scores, self.offset, n_new, dead,
                         rank * H, size * H)

    def _call(self, kind: str, fn, *args):
        try:
            return fn(*args)
        except KVPolicyError:
            raise
        except Exception as exc:
            raise PluginError(
                f"layer {self.layer}: {self.policy.owners[kind]} raised {type(exc).__name__}: {exc}"
            ) from exc

    def _evict(self, n_evict: int) -> mx.array:
        """Select ``n_evict`` losers and apply the disposition to the survivors; losers [B, H, E]."""
        view = self._view(0)
        losers = self._call("selector", self.policy.selector.select, view, n_evict)
        if losers.shape != (*view.scores.shape[:2], n_evict):
            raise PluginError(
                f"layer {self.layer}: {self.policy.owners['selector']} returned losers of shape "
                f"{tuple(losers.shape)}, expected {(*view.scores.shape[:2], n_evict)}"
            )
        key = step_key(self.policy.config.seed, self.layer, self.offset)
        update = self._call("disposition", self.policy.disposition.dispose, view, losers, key)
        if update is not None:
            self._apply(update)
        return losers.astype(mx.int32)

    def _apply(self, u: MergeUpdate) -> None:
        """Scatter-add a disposition's changes into the buffers (duplicate targets sum)."""
        B, H = self.keys.shape[:2]
        bi = mx.arange(B)[:, None, None]
        hi = mx.arange(H)[None, :, None]
        t = u.targets.astype(mx.int32)
        self.values = self.values.at[bi, hi, t].add(u.d_values.astype(self.values.dtype))
        if u.d_keys is not None:
            self.keys = self.keys.at[bi, hi, t].add(u.d_keys.astype(self.keys.dtype))
        if u.d_scores is not None:
            self.scores = self.scores.at[bi, hi, t].add(u.d_scores.astype(mx.float32))
        self._stats = self._stats + mx.stack([u.draws, u.merges]).astype(mx.int32)

    def _write_into(self, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Decode: the new token [B, H, 1, D] takes the slots [B, H, 1] its loser freed."""
        idx = slots[..., None]  # [B, H, 1, 1]
        self.keys = mx.put_along_axis(self.keys, idx, keys, axis=2)
        self.values = mx.put_along_axis(self.values, idx, values, axis=2)
        pos = mx.full(slots.shape, self.offset, dtype=mx.int32)
        self.positions = mx.put_along_axis(self.positions, slots, pos, axis=2)
        self.scores = mx.put_along_axis(self.scores, slots, mx.zeros(slots.shape, mx.float32), axis=2)

    def _compact(self, n_evict: int) -> None:
        """Evict ``n_evict`` and gather the survivors, in temporal order, into slots [0, budget)."""
        losers = self._evict(n_evict)
        n, keep_n = self.n, self.n - n_evict
        pos = self.positions[..., :n]
        gone = mx.put_along_axis(mx.zeros(pos.shape, mx.bool_), losers, mx.array(True), axis=2)
        order = mx.argsort(mx.where(gone, _INT_MAX, pos), axis=-1)[..., :keep_n]
        take = lambda x: mx.take_along_axis(x[..., :n, :], order[..., None], axis=2)  # noqa: E731
        self.keys, self.values = take(self.keys), take(self.values)
        self.positions = mx.take_along_axis(pos, order, axis=-1)
        self.scores = mx.take_along_axis(self.scores, order, axis=-1)
        self.n = keep_n

    def _append(self, keys: mx.array, values: mx.array) -> None:
        B, H, S, D = keys.shape
        need = self.n + S
        cap = 0 if self.keys is None else self.keys.shape[2]
        if need > cap:
            if need <= self.budget + 1:
                new_cap = min(((need + self.step - 1) // self.step) * self.step, self.budget + 1)
            else:
                new_cap = need
            grow = new_cap - self.n
            k_new = mx.zeros((B, H, grow, D), keys.dtype)
            v_new = mx.zeros((B, H, grow, values.shape[3]), values.dtype)
            p_new = mx.zeros((B, H, grow), mx.int32)
            if self.keys is None:
                self.keys, self.values, self.positions = k_new, v_new, p_new
                self.scores = mx.zeros((B, H, 0), mx.float32)
            else:
                n = self.n
                self.keys = mx.concatenate([self.keys[..., :n, :], k_new], axis=2)
                self.values = mx.concatenate([self.values[..., :n, :], v_new], axis=2)
                self.positions = mx.concatenate([self.positions[..., :n], p_new], axis=2)
        n = self.n
        at = mx.array([0, 0, n, 0])
        self.keys = mx.slice_update(self.keys, keys, at, axes=(0, 1, 2, 3))
        self.values = mx.slice_update(self.values, values, at, axes=(0, 1, 2, 3))
        new_pos = mx.broadcast_to(mx.arange(self.offset, self.offset + S, dtype=mx.int32), (B, H, S))
        self.positions = mx.slice_update(self.positions, new_pos, at[:3], axes=(0, 1, 2))
        self.scores = mx.concatenate([self.scores[..., :n], mx.zeros((B, H, S), mx.float32)], axis=2)
        self.n = need


def _register_with_mlx_lm() -> None:
    """Let mlx-lm's ``load_prompt_cache`` (which looks classes up by name in its own module) find us."""
    import mlx_lm.models.cache as mlx_cache

    if getattr(mlx_cache, "PolicyCache", None) is not PolicyCache:
        mlx_cache.PolicyCache = PolicyCache


_register_with_mlx_lm()
