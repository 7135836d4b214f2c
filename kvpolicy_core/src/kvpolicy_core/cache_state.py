"""Persistence of a policy cache: mlx-lm's ``state``/``meta_state`` protocol and rebuilding from it.

The meta JSON carries the config, offset, layer, window, the parts' counters and (on a
tensor-parallel rank) the head shard, so mlx-lm's own ``save_prompt_cache``/``load_prompt_cache``
round-trip a kvpolicy cache (``state`` is settled first). :mod:`kvpolicy_core.persistence` saves the unsettled
buffers for bit-exact resumption.
"""

from __future__ import annotations

import json
from typing import Dict

import mlx.core as mx

from .cache_diagnostics import LEGACY_COUNTERS
from .errors import KVPolicyError


def counters_from_meta(stats) -> Dict[str, mx.array]:
    """The meta JSON's counters: {name: int} (0.2.0) or [gate_draws, merges] (0.1.0)."""
    if isinstance(stats, list):
        stats = dict(zip(LEGACY_COUNTERS, stats))
    return {str(k): mx.array(int(v), dtype=mx.int32) for k, v in (stats or {}).items()}


def parse_meta(meta_json) -> dict:
    """The meta JSON as a dict with the keys a cache needs, or a :class:`KVPolicyError` saying what is wrong."""
    try:
        meta = json.loads(meta_json)
    except (TypeError, ValueError) as exc:
        raise KVPolicyError(f"PolicyCache meta state is not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict):
        raise KVPolicyError(f"PolicyCache meta state must be a JSON object (got {type(meta).__name__})")
    missing = [k for k in ("config", "offset", "layer", "window") if k not in meta]
    if missing:
        raise KVPolicyError(f"PolicyCache meta state lacks {', '.join(missing)}; it was not written by kvpolicy")
    offset = meta["offset"]
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise KVPolicyError(f"PolicyCache meta state: offset must be an int >= 0 (got {offset!r})")
    if not isinstance(meta["config"], dict) or not isinstance(meta["config"].get("policy"), dict):
        raise KVPolicyError("PolicyCache meta state: config must be an object with a policy object")
    return meta


class CacheState:
    """Mixin of :class:`~kvpolicy_core.cache.PolicyCache`: state, meta state and rebuilding."""

    @property
    def state(self):
        """(keys, values, positions, scores, meta JSON) of the retained tokens, settled.

        A policy with attention log-weights appends them: (..., meta JSON, log_weights [B, H, n]).
        An empty cache gives ``(None, None, None, None, meta JSON)``, so that mlx-lm's
        ``save_prompt_cache``/``load_prompt_cache`` keep one cache per layer.
        """
        self.settle()
        if self.keys is None:
            return None, None, None, None, self._meta_json()
        n = self.n
        state = (self.keys[..., :n, :], self.values[..., :n, :], self.positions[..., :n], self.scores,
                 self._meta_json())
        return state + (self._slots.log_weights,) if self._slots.log_weights is not None else state

    @state.setter
    def state(self, v) -> None:
        self._run, self._run_open = {}, False  # a restored cache starts a new run of chunks
        # restored nonzero log-weights are applied (one host sync when restoring: not on the decode path)
        self._lw_used = bool(v) and len(v) > 5 and isinstance(v[5], mx.array) and bool(mx.any(v[5] != 0).item())
        if not v or v[0] is None:
            self._slots.restore((None, None, None, None, 0))
        else:
            keys, values, positions, scores = v[:4]
            # the scores' invariant (as PolicyStep.scores keeps it): float32, NaN as 0, +-inf as the largest finite
            scores = mx.nan_to_num(scores.astype(mx.float32), nan=0.0) if isinstance(scores, mx.array) else scores
            log_weights = v[5] if len(v) > 5 and isinstance(v[5], mx.array) else None
            if log_weights is not None and not self._slots.track_log_weights:
                raise KVPolicyError("state carries attention log-weights, but this cache's policy does not use them")
            if log_weights is not None and tuple(log_weights.shape) != tuple(scores.shape):
                raise KVPolicyError(f"state: log_weights shape {tuple(log_weights.shape)} != scores shape "
                                    f"{tuple(scores.shape)}")
            if log_weights is None:
                self._slots.restore((keys, values, positions, scores, keys.shape[2]))
            else:
                self._slots.restore((keys, values, positions, scores, keys.shape[2],
                                     log_weights.astype(mx.float32)))
        if len(v) > 4:
            meta = parse_meta(v[4])
            if meta["offset"] < self.n:
                n = self.n
                self._slots.restore((None, None, None, None, 0))
                raise KVPolicyError(f"PolicyCache state: offset {meta['offset']} is below the {n} tokens held; "
                                    "offset counts every token seen, so it is at least the tokens held")
            self.offset = int(meta["offset"])
            self._counters = {**self._counters, **counters_from_meta(meta.get("stats"))}

    def _meta_json(self) -> str:
        meta = {
            "config": json.loads(self.policy.config.model_dump_json()),
            "offset": self.offset,
            "layer": self.layer,
            "window": self.window,
            "stats": self.stats(),
        }
        if self.head_shard != (0, 1):  # only when sharded: an unsharded cache's JSON is unchanged
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
        obj.state = (*state[:4], meta_json, *state[5:6])
        return obj

    @classmethod
    def from_meta(cls, meta_json: str):
        """An empty cache with the config, layer, window and head shard recorded in ``meta_json``."""
        meta = parse_meta(meta_json)
        data = dict(meta["config"])
        data.update(data.pop("policy"))
        return cls(data, layer=int(meta["layer"]), window=meta["window"],
                   head_shard=tuple(meta.get("head_shard", (0, 1))))
