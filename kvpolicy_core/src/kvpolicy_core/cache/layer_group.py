"""The caches of one model linked together, for an allocation that sets the layers' budgets from the prompt.

An allocation with ``Needs(layer_stats=True)`` (:mod:`kvpolicy_core.parts.allocation`) needs every layer's
statistics of the prompt before any layer is cut. With ``when="prompt_end"`` that holds at the first decode
step: mlx-lm has run the whole prompt through every layer.

*The state lives in the caches.* Each cache records its own layer's statistic as its prompt chunks pass the
attention hook (:func:`record`: lazy MLX sums, no host sync) in the state of its run of prompt chunks
(``RowState.run``, keys :data:`CHANGE` and :data:`ROWS`), so it is saved, restored, pickled, copied, merged into a
batch and extracted from it with the rest of the cache's state; a layer's budget is its config's ``budget``. The
:class:`LayerGroup` only links the caches of one sequence: the first cache to cut asks it for its budget
(:meth:`LayerGroup.budget_for`), and it reads every member's statistic (one host sync, once per prompt), calls the
allocation once and gives each layer its budget. A later prompt on the same caches (the next turn of a chat) is a
new run, measured and shared again.

*Re-linking.* A group holds what it needs (the allocation's config and its layers' :class:`LayerInfo`) and weak
references to its members, so it pickles and copies with them. Where caches are copied or restored one at a time
(mlx-lm's ``load_prompt_cache`` and batch ``merge``/``extract`` take one layer after another), each cache names its
group (:meth:`LayerGroup.meta`: an id, the mean budget, the layers) and joins the group being assembled under that
name (:func:`restored_group`, :func:`copied_group`); a cache whose layer that group already has starts a new one.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx

from ..config.policy import Policy, build_policy, layer_budgets
from ..errors import KVPolicyError
from ..parts.allocation import LayerInfo, LayerStats

#: query rows measured per prompt chunk and layer (the chunk's last ones: the question when it ends the prompt)
ROWS_MEASURED = 32
#: the keys of a cache's run state that hold its layer statistic: float32 [1] sum of the change, int32 [1] rows
#: measured (shape [1], not scalars: every array of a saved state is hashed as bytes)
CHANGE, ROWS = "kvpolicy_layer_change", "kvpolicy_layer_rows"


def attention_change(out: mx.array, values: mx.array) -> mx.array:
    """``sum_{b, h, i} (1 - cos(o_{h,i}, v_{h,i}))`` float32 scalar: out [B, Hq, R, Dv] the attention output of
    R query tokens, values [B, H, R, Dv] those tokens' own values (Hq a multiple of H: each query head reads
    its KV head's value)."""
    H, Hq = values.shape[1], out.shape[1]
    v = mx.repeat(values, Hq // H, axis=1) if Hq != H else values
    o, v = out.astype(mx.float32), v.astype(mx.float32)
    cos = (o * v).sum(-1) / (mx.sqrt((o * o).sum(-1) * (v * v).sum(-1)) + 1e-12)
    return mx.nan_to_num(1.0 - cos, nan=0.0).sum()


def record(run: dict, out: mx.array, values: mx.array) -> dict:
    """``run`` (a cache's run state) with one prompt chunk's last query rows added to its statistic: out
    [B, Hq, S, Dv] the chunk's attention output, values [B, H, S, Dv] its tokens' own values."""
    R = min(ROWS_MEASURED, out.shape[2])
    change = attention_change(out[:, :, -R:], values[:, :, -R:]).reshape(1)
    rows = mx.array([out.shape[0] * out.shape[1] * R], dtype=mx.int32)
    if CHANGE in run:
        change, rows = run[CHANGE] + change, run[ROWS] + rows
    return {**run, CHANGE: change, ROWS: rows}


def prompt_statistic(run: dict) -> dict:
    """The layer statistic of ``run`` alone (a new run of the same held prompt keeps it; empty when none)."""
    return {k: run[k] for k in (CHANGE, ROWS) if k in run}


class LayerGroup:
    """The caches of one sequence under a data-driven allocation (see the module).

    Args:
        config: the method's config with the mean ``budget`` (:class:`~kvpolicy_core.config.cache_config.
            KVCacheConfig`); the allocation is :func:`~kvpolicy_core.config.policy.layer_budgets` of it.
        infos: one :class:`~kvpolicy_core.parts.allocation.LayerInfo` per member layer (the layers with a policy
            cache), in order.
    """

    def __init__(self, config: Any, infos: Sequence[LayerInfo]) -> None:
        self.config, self.infos = config, [LayerInfo(*i) for i in infos]
        self.id = secrets.token_hex(8)  #: unique among live groups (a copy or a restored group gets a new one)
        self._members: Dict[int, weakref.ref] = {}
        self._decided: Optional[Dict[int, int]] = None
        self._policies: Dict[str, Policy] = {}

    # ------------------------------------------------------------------ membership
    def join(self, cache) -> None:
        """Link ``cache`` (a policy cache of one of :attr:`infos`' layers) to this group."""
        self._members[cache.layer] = weakref.ref(cache)

    def has(self, layer: int) -> bool:
        ref = self._members.get(layer)
        return ref is not None and ref() is not None

    def stale(self) -> None:
        """A member measured a prompt chunk: the next cut decides again."""
        self._decided = None

    # ------------------------------------------------------------------ the cut
    def budget_for(self, layer: int, default: int) -> int:
        """``layer``'s budget for this prompt's cut: ``default`` when a member's statistic is missing (a layer saw no
        prompt chunk: a one-token prompt; a member not linked: a cache copied or restored alone)."""
        if self._decided is None:
            runs = []
            for info in self.infos:
                ref = self._members.get(info.index)
                cache = ref() if ref is not None else None
                run = cache.row_state().run if cache is not None else {}
                if CHANGE not in run:
                    return default
                runs.append(run)
            sums, rows = mx.concatenate([r[CHANGE] for r in runs]), mx.concatenate([r[ROWS] for r in runs])
            mx.eval(sums, rows)  # one host sync per prompt, at its end
            stats = [LayerStats(v / max(n, 1), n) for v, n in zip(sums.tolist(), rows.tolist())]
            budgets = layer_budgets(self.config, self.infos, stats)
            self._decided = dict(zip((i.index for i in self.infos), budgets))
        return self._decided.get(layer, default)

    def policy_for(self, config: Any, budget: int) -> Policy:
        """``config`` (a member's) with ``budget``, built once per distinct config (members with equal ones share)."""
        config = config.replace(budget=budget)
        key = config.model_dump_json()
        if key not in self._policies:
            self._policies[key] = build_policy(config)
        return self._policies[key]

    # ------------------------------------------------------------------ persistence
    def meta(self) -> dict:
        """What a member's meta JSON records of its group: id, mean budget, layers (index, layers, window)."""
        return {"id": self.id, "budget": self.config.policy.budget, "layers": [list(i) for i in self.infos]}

    def __getstate__(self) -> dict:
        return {"config": self.config, "infos": [tuple(i) for i in self.infos]}

    def __setstate__(self, state: dict) -> None:  # unpickled: the members join again (PolicyCache.__setstate__)
        self.__init__(state["config"], state["infos"])

    def __deepcopy__(self, memo) -> "LayerGroup":  # the copied members join the copy (PolicyCache.__deepcopy__)
        new = type(self)(self.config, self.infos)
        memo[id(self)] = new
        return new


def check_group_meta(group: Any, layer: int) -> dict:
    """A meta JSON's ``group`` entry checked (:meth:`LayerGroup.meta`'s form, ``layer`` among its layers), or a
    :class:`KVPolicyError` naming what is wrong."""
    where = "PolicyCache meta state: group"
    if not isinstance(group, dict) or not isinstance(group.get("id"), str) or not group["id"]:
        raise KVPolicyError(f"{where} must be an object with a non-empty string id (got {group!r})")
    budget = group.get("budget")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise KVPolicyError(f"{where}.budget must be an int >= 1 (got {budget!r})")
    layers = group.get("layers")
    ok = isinstance(layers, list) and layers and all(isinstance(x, list) and len(x) == 3 for x in layers)
    ints = ok and all(
        not isinstance(v, bool) and isinstance(v, int) and v >= (1 if k else 0)
        for x in layers
        for k, v in enumerate(x)
        if not (k == 2 and v is None)
    )
    if not ints or layer not in [x[0] for x in layers]:
        raise KVPolicyError(
            f"{where}.layers must list [index, layers, window or null] per member, this layer ({layer}) among them "
            f"(got {layers!r})"
        )
    return group


def check_run_stats(run: dict, where: str) -> None:
    """A restored run state's layer statistic (:data:`CHANGE`, :data:`ROWS`) checked: both or neither, float32 [1]
    finite and >= 0, int32 [1] >= 0; else a :class:`KVPolicyError` naming the key (one host sync, when restoring)."""
    if CHANGE not in run and ROWS not in run:
        return
    change, rows = run.get(CHANGE), run.get(ROWS)
    ok = (
        isinstance(change, mx.array)
        and isinstance(rows, mx.array)
        and change.shape == (1,)
        and rows.shape == (1,)
        and change.dtype == mx.float32
        and rows.dtype == mx.int32
    )
    if not ok or not bool(mx.isfinite(change).all().item() and (change >= 0).all().item() and (rows >= 0).all().item()):
        raise KVPolicyError(
            f"{where}: the run's layer statistic ({CHANGE}, {ROWS}) must be a finite float32 [1] >= 0 and an int32 "
            f"[1] >= 0"
        )


#: groups being assembled in this thread, by the name their members carry: ("load", saved id) or ("copy", id)
_assembly = threading.local()


def _assembled(key: tuple, layer: int, make) -> LayerGroup:
    table = getattr(_assembly, "groups", None)
    if table is None:
        table = _assembly.groups = weakref.WeakValueDictionary()
    group = table.get(key)
    if group is None or group.has(layer):  # the first of its layers, or that layer again: another sequence
        group = table[key] = make()
    return group


def restored_group(meta: dict, config: Any, layer: int) -> LayerGroup:
    """The group a cache restored from a meta recording ``meta`` (:meth:`LayerGroup.meta`) joins; ``config``: its
    restored config (the group's is it with the mean budget)."""
    infos: List[LayerInfo] = [LayerInfo(*x) for x in meta["layers"]]
    return _assembled(("load", meta["id"]), layer, lambda: LayerGroup(config.replace(budget=meta["budget"]), infos))


def copied_group(group: LayerGroup, layer: int) -> LayerGroup:
    """The group a copy of ``group``'s member of ``layer`` joins, when members are copied one at a time."""
    return _assembled(("copy", group.id), layer, lambda: LayerGroup(group.config, group.infos))
