"""Persistence of a policy cache, as functions: mlx-lm's ``state``/``meta_state`` protocol and rebuilding from it.

The meta JSON carries the config, offset, layer, window, the parts' counters and (on a
tensor-parallel rank) the head shard, so mlx-lm's own ``save_prompt_cache``/``load_prompt_cache``
round-trip a kvpolicy cache (``state`` is settled first, in place). :mod:`kvpolicy_core.integration.persistence`
saves the unsettled buffers. The meta also names the modules of the attention hook the cache holds, so every
restore route installs it again, in any process.

A restored cache continues as the saved one would: the same slots, offset, counters, run of prompt chunks, and
the same attention hook (re-installed on the modules the meta names, and held by the cache), or it is refused
before its first update. Every route is checked by :func:`.restore_checks.check_restored`. The functions read and
write a cache through its public surface and its :class:`~.slots.RowState`; ``PolicyCache.state``,
``meta_state`` and ``from_state`` (what mlx-lm calls) are one-line delegations to them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Dict

import mlx.core as mx

from ..attention import hook as attention
from ..config.parse import parse_config
from ..errors import KVPolicyError, ModelError
from ..runtime.sharding import check_head_shard
from .diagnostics import LEGACY_COUNTERS
from .layer_group import check_group_meta, check_run_stats, restored_group
from .restore_checks import check_restored
from .slots import QuantizedRows, RowState, Snapshot, first_rows, length


def counters_from_meta(stats) -> Dict[str, mx.array]:
    """The meta JSON's counters: {name: int}, or the list form [gate_draws, merges] (:data:`LEGACY_COUNTERS`)."""
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
    if meta.get("group") is not None:
        check_group_meta(meta["group"], layer)
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


def state_of(cache) -> tuple:
    """``cache.state``: (keys, values, positions, scores, meta JSON) of the retained tokens, settled.

    A policy with attention log-weights appends them: (..., meta JSON, log_weights [B, H, n]); a run of
    prompt chunks in progress appends its scorer state (a dict of arrays), so a restored cache scores
    the next chunk as part of the same run. An empty cache gives ``(None, None, None, None, meta JSON)``,
    so that mlx-lm's ``save_prompt_cache``/``load_prompt_cache`` keep one cache per layer.
    """
    if not (cache.holds_prompt and cache.row_state().run_open):  # a held prompt is saved whole, cut at its end
        cache.settle()
    row = cache.row_state()
    if cache.keys is None:
        return None, None, None, None, meta_json(cache)
    n = cache.n
    state = (
        first_rows(cache.keys, n),
        first_rows(cache.values, n),
        cache.positions[..., :n],
        cache.scores,
        meta_json(cache),
    )
    if row.slots.log_weights is not None:
        state += (row.slots.log_weights,)
    run = open_run(row)
    return state + (run,) if run else state


def open_run(row: RowState) -> dict:
    """The arrays of a row's run of prompt chunks in progress ({} when none)."""
    if not row.run_open:
        return {}
    return {k: x for k, x in row.run.items() if isinstance(x, mx.array)}


def loaded_slots(keys, values, positions, scores, log_weights=None, *, track_log_weights: bool = False) -> Snapshot:
    """The slots of a restored state: ``n = keys.shape[2]`` (0 without keys); tracked log-weights not given are all
    zero (checked afterwards by :func:`.restore_checks.check_restored`)."""
    if log_weights is None and track_log_weights and scores is not None:
        log_weights = mx.zeros(scores.shape, mx.float32)
    return Snapshot(keys, values, positions, scores, 0 if keys is None else length(keys), log_weights)


def load_state(cache, v, *, settled: bool = True, model=None) -> None:
    """Restore ``v`` (a ``state`` tuple with its meta JSON) into ``cache`` all-or-nothing (``cache.state = v``):
    checked against the meta and the cache's policy, the attention hook re-installed where the cache needs it.
    ``settled=False``: the buffers of :func:`~kvpolicy_core.integration.persistence.save_caches` (a pending eviction
    may hold more than the budget)."""
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
    if log_weights is not None and not cache.uses_log_weights:
        raise KVPolicyError("state carries attention log-weights, but this cache's policy does not use them")
    check_same_policy(cache, meta)
    check_storage(cache, meta)
    saved, hook, hook_missing = cache.row_state(), cache.attention_hook, cache.hook_missing
    try:
        if v[0] is None:
            slots = loaded_slots(None, None, None, None)
        else:
            keys, values, positions, scores = v[:4]
            keys, values = (tuple(x) if isinstance(x, (tuple, list)) else x for x in (keys, values))
            if cache.storage.bits is not None:
                check_restored(
                    loaded_slots(keys, values, positions, scores),
                    meta["offset"],
                    cache.budget,
                    settled=False,
                    where=where(cache),
                )
            elif not isinstance(keys, mx.array) or keys.ndim != 4:
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
            slots = loaded_slots(keys, values, positions, scores, log_weights, track_log_weights=cache.uses_log_weights)
        offset = meta["offset"]
        held = settled and cache.holds_prompt  # a state of a held prompt (when="prompt_end") exceeds the budget
        check_restored(slots, offset, cache.budget, settled=settled and not held, where=where(cache))
        if not all(isinstance(x, mx.array) for x in run.values()):
            raise KVPolicyError(f"{where(cache)}: the run of prompt chunks must hold mlx arrays")
        check_run_stats(run, where(cache))
        # restored nonzero log-weights are applied (one host sync when restoring: not on the decode path)
        lw = slots.log_weights
        lw_used = log_weights is not None and lw is not None and bool(mx.any(lw != 0).item())
        counters = {
            **{k: mx.array(0, dtype=mx.int32) for k in saved.counters},
            **counters_from_meta(meta.get("stats")),
        }
        cache.set_row_state(
            dataclasses.replace(
                saved,
                slots=slots,
                offset=offset,
                counters=counters,
                run=dict(run),
                run_open=bool(run),
                lw_used=lw_used,
            )
        )
        restore_hook(cache, meta, model)
    except BaseException:
        cache.set_row_state(saved)
        cache.attention_hook, cache.hook_missing = hook, hook_missing
        raise


def where(cache) -> str:
    return f"PolicyCache state (layer {cache.layer})"


def check_same_policy(cache, meta: dict) -> None:
    """A state restores only into a cache of the policy, layer, window and head shard that made it."""
    mine = (cache.policy.config, cache.layer, cache.window, cache.head_shard)
    if meta["config"] == json.loads(cache.policy.config.model_dump_json()):  # the cache's own config, as written
        config = mine[0]
    else:
        try:
            config = parse_config(meta_config(meta))
        except (KVPolicyError, ValueError, TypeError, KeyError) as exc:
            raise KVPolicyError(f"{where(cache)}: its config is invalid ({type(exc).__name__}: {exc})") from None
    theirs = (config, meta["layer"], meta["window"], tuple(meta.get("head_shard", (0, 1))))
    if theirs != mine:
        fields = [name for name, a, b in zip(("config", "layer", "window", "head_shard"), theirs, mine) if a != b]
        raise KVPolicyError(
            f"{where(cache)}: made by {config.method} (budget {config.policy.budget}, layer {meta['layer']}, "
            f"window {meta['window']}) but this cache is {cache.policy.config.method} (budget {cache.budget}, "
            f"layer {cache.layer}, window {cache.window}); {', '.join(fields)} differ: rebuild it with "
            "PolicyCache.from_state(state)"
        )


def check_storage(cache, meta: dict) -> None:
    """A state of quantized rows restores into a cache that stores them so (an empty one of full-precision rows is
    switched to them, as mlx-lm's ``to_quantized`` does), and one of full-precision rows only into such a cache."""
    storage = meta.get("storage") or {}
    if not isinstance(storage, dict):
        raise KVPolicyError(f"{where(cache)}: meta storage must be an object (got {storage!r})")
    bits, group_size = storage.get("bits"), storage.get("group_size")
    if bits is None:
        if cache.storage.bits is not None:
            raise KVPolicyError(
                f"{where(cache)}: the state holds full-precision rows but this cache stores "
                f"kv_bits={cache.storage.bits}"
            )
        return
    try:
        QuantizedRows(bits, group_size)
    except (TypeError, ValueError) as exc:
        raise KVPolicyError(f"{where(cache)}: meta storage: {exc}") from None
    hold = cache.hold_rows
    if hold is not None and cache.keys is None and bits == hold.bits and meta.get("held"):
        cache.hold_rows = QuantizedRows(bits, group_size)  # a held prompt's rows (hold_bits), saved before its cut
        cache._use_rows(cache.hold_rows)
    elif cache.storage.bits is None and cache.keys is None:
        cache.to_quantized(group_size=group_size, bits=bits)
    if (cache.storage.bits, cache.storage.group_size) != (bits, group_size):
        raise KVPolicyError(
            f"{where(cache)}: the state holds rows quantized to kv_bits={bits}, kv_group_size={group_size}, but this "
            f"cache stores {'full-precision rows' if cache.storage.bits is None else f'kv_bits={cache.storage.bits}'}"
        )


def restore_hook(cache, meta: dict, model=None) -> None:
    """Make ``cache`` hold the attention hook the saved cache held: installed on ``model``'s modules (checked against
    the recorded ones) or on the modules the meta names; without either, a cache that needs the hook and has seen
    tokens refuses its next update (:data:`NO_HOOK_RECORD`) unless the meta records a manually driven cache (no
    hook, ``attended``)."""
    cache.hook_missing = None
    if not cache.needs_hook:
        cache.attention_hook = None
        _set_attended(cache, True)
        return
    recorded = meta.get("hook")
    current = cache.attention_hook
    if model is not None:
        found = attention.model_modules(model)
        if recorded is not None and sorted(recorded) != found:
            raise ModelError(
                f"{where(cache)}: saved with the attention hook on {', '.join(recorded)}, but the "
                f"model's attention is in {', '.join(found) or 'no mlx-lm module'}: these caches "
                "belong to another model family"
            )
        recorded = recorded or found
    held = current is not None and current.active and recorded is not None and current.modules == sorted(recorded)
    if recorded is not None and not held:
        current = attention.install_modules(recorded)
    cache.attention_hook = current
    attended = meta.get("attended")
    if attended is None and current is None and cache.offset > 0:
        _set_attended(cache, False)
        cache.hook_missing = NO_HOOK_RECORD
    else:
        _set_attended(cache, True if attended is None else attended)


def _set_attended(cache, attended: bool) -> None:
    cache.set_row_state(dataclasses.replace(cache.row_state(), attended=attended))


def meta_json(cache) -> str:
    """The meta JSON of ``cache`` (``cache.meta_state[0]``): config, offset, layer, window, counters, whether its
    last step was attended, the hook's modules, (when sharded) the head shard and (for a data-driven allocation)
    its :class:`~.layer_group.LayerGroup`."""
    meta = {
        "config": json.loads(cache.policy.config.model_dump_json()),
        "offset": cache.offset,
        "layer": cache.layer,
        "window": cache.window,
        "stats": cache.stats(),
        "attended": cache.row_state().attended,
    }
    if cache.attention_hook is not None:  # restored on these modules (attention.install_modules)
        meta["hook"] = list(cache.attention_hook.modules)
    if cache.head_shard != (0, 1):  # only when sharded: an unsharded cache's JSON is unchanged
        meta["head_shard"] = list(cache.head_shard)
    if cache.group is not None:  # a data-driven allocation: the loaders link the caches of one group again
        meta["group"] = cache.group.meta()
    storage = cache.storage.describe()
    if storage:  # only for rows stored otherwise than in the model's dtype: a full-precision cache's JSON is unchanged
        meta["storage"] = storage
        if cache.storage is cache.hold_rows:  # a held prompt's rows (hold_bits): the kept ones go back at the cut
            meta["held"] = True
    return json.dumps(meta)


def from_state(cls, state, meta_state=None, *, model=None):
    """``cls.from_state``: a cache rebuilt from ``state`` (and optionally ``meta_state``); the config comes with them.

    The attention hook is installed again where the cache needs it (on ``model``'s modules when given, else
    on the modules the meta records); raises :class:`~kvpolicy_core.errors.ModelError` when it cannot be.
    """
    meta = meta_state[0] if meta_state else (state[4] if len(state) > 4 else None)
    if meta is None:
        raise KVPolicyError("PolicyCache.from_state needs the meta JSON (state[4] or meta_state)")
    obj = from_meta(cls, meta)
    load_state(obj, (*state[:4], meta, *state[5:]), model=model)
    return obj


def from_meta(cls, meta_text: str, *, model=None):
    """An empty ``cls`` cache with the config, layer, window, head shard, attention hook and layer group recorded in
    the meta JSON ``meta_text`` (it joins the group being assembled: :func:`.layer_group.restored_group`)."""
    meta = parse_meta(meta_text)
    obj = cls(
        meta_config(meta),
        layer=int(meta["layer"]),
        window=meta["window"],
        head_shard=tuple(meta.get("head_shard", (0, 1))),
    )
    if meta.get("group") is not None:
        obj.group = restored_group(meta["group"], obj.policy.config, obj.layer)
        obj.group.join(obj)
    restore_hook(obj, meta, model)
    return obj


def _describe(x) -> str:
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of {len(x)}: ({', '.join(_describe(e) for e in x[:6])})"
    if isinstance(x, mx.array):
        return f"array {str(x.dtype).removeprefix('mlx.core.')} {list(x.shape)}"
    return type(x).__name__
