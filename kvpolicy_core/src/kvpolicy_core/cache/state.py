"""Persistence of a policy cache: mlx-lm's ``state``/``meta_state`` protocol and rebuilding from it.

The meta JSON carries the config, offset, layer, window, the parts' counters and (on a
tensor-parallel rank) the head shard, so mlx-lm's own ``save_prompt_cache``/``load_prompt_cache``
round-trip a kvpolicy cache (``state`` is settled first, in place). :mod:`kvpolicy_core.integration.persistence`
saves the
unsettled buffers. The meta also names the modules of the attention hook the cache holds, so every restore route
installs it again, in any process.
"""

from __future__ import annotations

import copy
import json
from typing import Dict

import mlx.core as mx

from ..attention import hook as attention
from ..config.parse import parse_config
from ..errors import KVPolicyError, ModelError
from ..runtime.sharding import check_head_shard
from .diagnostics import LEGACY_COUNTERS
from .restore_checks import check_restored
from .slots import SlotStore


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
    layer = meta["layer"]
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise KVPolicyError(f"PolicyCache meta state: layer must be an int >= 0 (got {layer!r})")
    window = meta["window"]
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise KVPolicyError(f"PolicyCache meta state: window must be null or an int >= 1 (got {window!r})")
    try:
        check_head_shard(tuple(meta.get("head_shard", (0, 1))))
    except (TypeError, ValueError) as exc:
        raise KVPolicyError(f"PolicyCache meta state: {exc}") from None
    hook = meta.get("hook")
    if hook is not None and not (isinstance(hook, list) and hook and all(isinstance(m, str) and m for m in hook)):
        raise KVPolicyError(f"PolicyCache meta state: hook must be a list of module names (got {hook!r})")
    if not isinstance(meta.get("attended", True), bool):
        raise KVPolicyError(f"PolicyCache meta state: attended must be true or false (got {meta['attended']!r})")
    stats = meta.get("stats")
    items = stats.items() if isinstance(stats, dict) else enumerate(stats) if isinstance(stats, list) else None
    if stats is not None and (items is None or any(isinstance(v, bool) or not isinstance(v, int) for _, v in items)):
        raise KVPolicyError(f"PolicyCache meta state: stats must map counter names to ints (got {stats!r})")
    return meta


def meta_config(meta: dict) -> dict:
    """The config dict of a parsed meta (the policy fields at the top level, as config strings give them)."""
    data = dict(meta["config"])
    data.update(data.pop("policy"))
    return data


#: the message of a restored cache that needs the attention hook but was saved without a record of one
NO_HOOK_RECORD = (
    "it was restored from a state that does not record the attention hook's modules; restore it "
    "with the model (load_caches(path, model=model), PolicyCache.from_state(state, model=model))"
)


class CacheState:
    """Mixin of :class:`~kvpolicy_core.cache.policy_cache.PolicyCache`: state, meta state, rebuilding and
    restoring the hook.

    A restored cache continues as the saved one would: the same slots, offset, counters, run of prompt
    chunks, and the same attention hook (re-installed on the modules the meta names, and held by the cache),
    or it is refused before its first update. Every route is checked by :func:`.restore_checks.check_restored`.
    """

    @property
    def state(self):
        """(keys, values, positions, scores, meta JSON) of the retained tokens, settled.

        A policy with attention log-weights appends them: (..., meta JSON, log_weights [B, H, n]); a run of
        prompt chunks in progress appends its scorer state (a dict of arrays), so a restored cache scores
        the next chunk as part of the same run. An empty cache gives ``(None, None, None, None, meta JSON)``,
        so that mlx-lm's ``save_prompt_cache``/``load_prompt_cache`` keep one cache per layer.
        """
        if not (self._holds_prompt and self._run_open):  # a held prompt is saved whole, cut at its end
            self.settle()
        if self.keys is None:
            return None, None, None, None, self._meta_json()
        n = self.n
        state = (
            self.keys[..., :n, :],
            self.values[..., :n, :],
            self.positions[..., :n],
            self.scores,
            self._meta_json(),
        )
        if self._slots.log_weights is not None:
            state += (self._slots.log_weights,)
        run = self._open_run()
        return state + (run,) if run else state

    @state.setter
    def state(self, v) -> None:
        self._set_state(v)

    def _open_run(self) -> dict:
        """The arrays of the run of prompt chunks in progress ({} when none)."""
        if not self._run_open:
            return {}
        return {k: x for k, x in self._run.items() if isinstance(x, mx.array)}

    def _set_state(self, v, *, settled: bool = True, model=None) -> None:
        """Restore ``v`` (a ``state`` tuple with its meta JSON) all-or-nothing: checked against the meta and this
        cache's policy, the attention hook re-installed where the cache needs it. ``settled=False``: the buffers of
        :func:`~kvpolicy_core.integration.persistence.save_caches` (a pending eviction may hold more than the
        budget)."""
        if not isinstance(v, (tuple, list)) or len(v) < 5 or not isinstance(v[4], str):
            raise KVPolicyError(
                "PolicyCache state must be (keys, values, positions, scores, meta JSON, ...): "
                f"the meta JSON carries the offset and the config (got {_describe(v)})"
            )
        meta = parse_meta(v[4])
        extra = list(v[5:])
        log_weights = extra.pop(0) if extra and (extra[0] is None or isinstance(extra[0], mx.array)) else None
        run = extra.pop(0) if extra and isinstance(extra[0], dict) else {}
        if extra:
            raise KVPolicyError(f"PolicyCache state: unexpected fields after the meta JSON ({_describe(v)})")
        if log_weights is not None and not self._slots.track_log_weights:
            raise KVPolicyError("state carries attention log-weights, but this cache's policy does not use them")
        self._check_same_policy(meta)
        saved, hook, hook_missing = self.row_state(), self.attention_hook, getattr(self, "_hook_missing", None)
        try:
            if v[0] is None:
                self._slots.load(None, None, None, None)
            else:
                keys, values, positions, scores = v[:4]
                if not isinstance(keys, mx.array) or keys.ndim != 4:
                    raise KVPolicyError(
                        f"PolicyCache state: keys must be an mlx array [B, H, n, D] (got {_describe(keys)})"
                    )
                # the scores' invariant (as PolicyStep.scores keeps it): float32, NaN as 0, +-inf as the largest
                if isinstance(scores, mx.array) and mx.issubdtype(scores.dtype, mx.floating):
                    scores = mx.nan_to_num(scores.astype(mx.float32), nan=0.0)
                if (
                    log_weights is not None
                    and isinstance(log_weights, mx.array)
                    and mx.issubdtype(log_weights.dtype, mx.floating)
                ):
                    log_weights = log_weights.astype(mx.float32)
                self._slots.load(keys, values, positions, scores, log_weights)
            self.offset = meta["offset"]
            held = settled and self._holds_prompt  # a state of a held prompt (when="prompt_end") exceeds the budget
            check_restored(self._slots, self.offset, self.budget, settled=settled and not held, where=self._where())
            if not all(isinstance(x, mx.array) for x in run.values()):
                raise KVPolicyError(f"{self._where()}: the run of prompt chunks must hold mlx arrays")
            self._run, self._run_open = dict(run), bool(run)
            # restored nonzero log-weights are applied (one host sync when restoring: not on the decode path)
            lw = self._slots.log_weights
            self._lw_used = log_weights is not None and lw is not None and bool(mx.any(lw != 0).item())
            self._counters = {
                **{k: mx.array(0, dtype=mx.int32) for k in self._counters},
                **counters_from_meta(meta.get("stats")),
            }
            self._restore_hook(meta, model)
        except BaseException:
            self.set_row_state(saved)
            self.attention_hook, self._hook_missing = hook, hook_missing
            raise

    def _where(self) -> str:
        return f"PolicyCache state (layer {self.layer})"

    def _check_same_policy(self, meta: dict) -> None:
        """A state restores only into a cache of the policy, layer, window and head shard that made it."""
        try:
            config = parse_config(meta_config(meta))
        except Exception as exc:
            raise KVPolicyError(f"{self._where()}: its config is invalid ({type(exc).__name__}: {exc})") from None
        theirs = (config, meta["layer"], meta["window"], tuple(meta.get("head_shard", (0, 1))))
        mine = (self.policy.config, self.layer, self.window, self.head_shard)
        if theirs != mine:
            fields = [name for name, a, b in zip(("config", "layer", "window", "head_shard"), theirs, mine) if a != b]
            raise KVPolicyError(
                f"{self._where()}: made by {config.method} (budget {config.policy.budget}, layer {meta['layer']}, "
                f"window {meta['window']}) but this cache is {self.policy.config.method} (budget {self.budget}, "
                f"layer {self.layer}, window {self.window}); {', '.join(fields)} differ: rebuild it with "
                "PolicyCache.from_state(state)"
            )

    @property
    def needs_hook(self) -> bool:
        """Whether this cache's attention must go through kvpolicy's hook: an observed signal, attention
        log-weights or a sliding window."""
        return self.window is not None or self._step.needs.attention or self.uses_log_weights

    def _restore_hook(self, meta: dict, model=None) -> None:
        """Hold the attention hook the saved cache held: installed on ``model``'s modules (checked against the
        recorded ones) or on the modules the meta names; without either, a cache that needs the hook and has
        seen tokens refuses its next update (:data:`NO_HOOK_RECORD`) unless the meta records a manually driven
        cache (no hook, ``attended``)."""
        self._hook_missing = None
        if not self.needs_hook:
            self.attention_hook = None
            self._attended = True
            return
        recorded = meta.get("hook")
        current = self.attention_hook
        if model is not None:
            found = attention.model_modules(model)
            if recorded is not None and sorted(recorded) != found:
                raise ModelError(
                    f"{self._where()}: saved with the attention hook on {', '.join(recorded)}, but the "
                    f"model's attention is in {', '.join(found) or 'no mlx-lm module'}: these caches "
                    "belong to another model family"
                )
            recorded = recorded or found
        held = current is not None and current.active and recorded is not None and current.modules == sorted(recorded)
        if recorded is not None and not held:
            current = attention.install_modules(recorded)
        self.attention_hook = current
        attended = meta.get("attended")
        if attended is None and current is None and self.offset > 0:
            self._attended, self._hook_missing = False, NO_HOOK_RECORD
        else:
            self._attended = True if attended is None else attended

    def _meta_json(self) -> str:
        meta = {
            "config": json.loads(self.policy.config.model_dump_json()),
            "offset": self.offset,
            "layer": self.layer,
            "window": self.window,
            "stats": self.stats(),
            "attended": self._attended,
        }
        if self.attention_hook is not None:  # restored on these modules (attention.install_modules)
            meta["hook"] = list(self.attention_hook.modules)
        if self.head_shard != (0, 1):  # only when sharded: an unsharded cache's JSON is unchanged
            meta["head_shard"] = list(self.head_shard)
        return json.dumps(meta)

    @property
    def meta_state(self):
        return (self._meta_json(),)

    @classmethod
    def from_state(cls, state, meta_state=None, *, model=None):
        """Rebuild a cache from ``state`` (and optionally ``meta_state``); the config comes with them.

        The attention hook is installed again where the cache needs it (on ``model``'s modules when given, else
        on the modules the meta records); raises :class:`~kvpolicy_core.errors.ModelError` when it cannot be.
        """
        meta_json = meta_state[0] if meta_state else (state[4] if len(state) > 4 else None)
        if meta_json is None:
            raise KVPolicyError("PolicyCache.from_state needs the meta JSON (state[4] or meta_state)")
        obj = cls.from_meta(meta_json)
        obj._set_state((*state[:4], meta_json, *state[5:]), model=model)
        return obj

    @classmethod
    def from_meta(cls, meta_json: str, *, model=None):
        """An empty cache with the config, layer, window, head shard and attention hook recorded in ``meta_json``."""
        meta = parse_meta(meta_json)
        obj = cls(
            meta_config(meta),
            layer=int(meta["layer"]),
            window=meta["window"],
            head_shard=tuple(meta.get("head_shard", (0, 1))),
        )
        obj._restore_hook(meta, model)
        return obj

    # ------------------------------------------------------------------ copies and pickling
    def __deepcopy__(self, memo):
        """A faithful copy (no restore checks): the same attention-hook install, the policy's parts shared when
        ``memo`` says so (:func:`~kvpolicy_core.cache.batch.copy_row`)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def __setstate__(self, d: dict) -> None:
        """Unpickling: the attention hook re-installs through its handle (:class:`~kvpolicy_core.attention.hook.
        AttentionHook`); the slots are checked like every restored state, and key norms recomputed."""
        self.__dict__.update(d)
        if not isinstance(d.get("_slots"), SlotStore) or not isinstance(d.get("offset"), int):
            raise KVPolicyError("unpickled PolicyCache: not a PolicyCache's pickled state")
        self._slots.key_norms = None
        check_restored(self._slots, self.offset, self.budget, settled=False, where=self._where())


def _describe(x) -> str:
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of {len(x)}: ({', '.join(_describe(e) for e in x[:6])})"
    if isinstance(x, mx.array):
        return f"array {str(x.dtype).removeprefix('mlx.core.')} {list(x.shape)}"
    return type(x).__name__
