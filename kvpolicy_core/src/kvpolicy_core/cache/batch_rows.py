"""The decode step of B policy-cache rows as one vectorised step (the batch's steady state).

:class:`~kvpolicy_core.cache.batch.BatchPolicyCache` keeps each sequence its own
:class:`~kvpolicy_core.cache.policy_cache.PolicyCache`, which costs B small policy updates per layer and
step. Once every row holds the same number of slots and is at its budget (each decode step
then evicts one token and writes the new one into its slot), the rows are stacked into one
slot store ``[B, H, budget + 1, D]`` and :class:`StackedRows` runs the step for all of them
at once: one selection (one host sync for the index checks), one disposition, one scorer
call, over views whose ``offset`` is the int32 array ``o`` [B, 1, 1] of each row's tokens
seen. For row b, with its slots ``x[b]``, its offset ``o_b`` and its key
``step_key(seed, layer, o_b)``, the step computes exactly what ``PolicyCache.update_and_fetch``
and ``before_attention`` compute for that row alone:

    losers_b = select(view_b, 1);  x[b] += dispose(view_b, losers_b, key_b)
    slot losers_b <- (k_b, v_b, position o_b, score 0);   o_b <- o_b + 1
    scores_b <- on_append(...), then on_attention(q_b, mask_b)

with ``mask_b`` the row's sliding-window mask (``o_b - 1 - W < pos <= o_b - 1``) when its layer
has a window, plus its attention log-weights. This needs parts that declare ``Needs(batch_rows=True)``
(:data:`kvpolicy_core.parts.base.BATCH_ROWS`); rows of other parts keep the per-row loop.
:meth:`StackedRows.split` writes the stacked state back into the row caches (a row leaves or
joins, a row is extracted or saved).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..attention.bias import with_log_weights
from ..attention.window import outside_window, window_mask
from ..parts.base import on_key_norms
from .slots import SlotStore, Snapshot, Token


def can_stack(rows: Sequence) -> bool:
    """Whether ``rows`` (PolicyCache, batch 1 each) can take a decode step as one stacked step."""
    if len(rows) < 2:
        return False
    r0 = rows[0]
    policy = r0.policy
    if not r0.policy_step.needs.batch_rows or r0.policy_step.counts_more:  # stacked steps evict one slot per row
        return False
    n = r0.n
    if r0.keys is None or n != r0.budget + 1 or r0.storage.describe():  # rows stored in the model's dtype only
        return False
    for r in rows:
        if (
            r.n != n
            or r.keys is None
            or r.layer != r0.layer
            or r.window != r0.window
            or r.head_shard != r0.head_shard
            or (r.policy is not policy and r.policy.config != policy.config)
            or r.keys.dtype != r0.keys.dtype
            or r.values.dtype != r0.values.dtype
            or r.keys.shape[1] != r0.keys.shape[1]
            or r.keys.shape[3] != r0.keys.shape[3]
            or r.values.shape[3] != r0.values.shape[3]
        ):
            return False
    return True


class StackedRows:
    """B policy-cache rows of one layer as one slot store, for decode steps (see the module docstring).

    Args:
        rows: PolicyCache rows for which :func:`can_stack` holds; they are left stale until
            :meth:`split` writes the state back into them.
    """

    def __init__(self, rows: Sequence) -> None:
        r0 = rows[0]
        self.rows = list(rows)
        self.policy, self.layer, self.window, self.budget = r0.policy, r0.layer, r0.window, r0.budget
        self.head_shard, self.uses_log_weights = r0.head_shard, r0.uses_log_weights
        self.step = r0.policy_step
        self.hooks = tuple({id(h): h for h in (r.attention_hook for r in rows) if h is not None}.values())
        self.hooked_always = r0.hook_every_step
        states = [r.row_state() for r in rows]
        self.slots = SlotStore(
            r0.step, track_log_weights=self.uses_log_weights, track_key_norms=states[0].track_key_norms
        )
        n = r0.n
        stacked = {}
        for field in Snapshot._fields:
            parts = [getattr(s.slots, field) for s in states]
            if field == "n" or parts[0] is None:
                stacked[field] = n if field == "n" else None
            else:  # buffers [1, H, cap, D] / [1, H, cap] -> [B, H, n(, D)]
                stacked[field] = mx.concatenate([p[:, :, :n] for p in parts])
        self.slots.restore(Snapshot(**stacked))
        self.offsets: List[int] = [s.offset for s in states]
        names = sorted({k for s in states for k in s.counters})
        zero = mx.array(0, dtype=mx.int32)
        self.counters = {k: mx.stack([s.counters.get(k, zero) for s in states]) for k in names}
        self.attended = all(s.attended for s in states)
        self.updates = max(s.updates for s in states)

    def __len__(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------ the step
    def _offsets(self) -> mx.array:
        return mx.array(self.offsets, dtype=mx.int32).reshape(-1, 1, 1)

    def _windowed(self) -> bool:
        return self.window is not None and any(o > self.window for o in self.offsets)

    def _view(self, n_new: int, offs: mx.array, run: Optional[dict] = None):
        dead = None  # per row, the row's rule (PolicyCache._window_dead): from the step its offset reaches the window
        if n_new == 0 and self.window is not None and any(o >= self.window for o in self.offsets):
            pos = self.slots.positions[..., : self.slots.n]
            dead = outside_window(pos, offs, self.window) & (offs >= self.window)
        view = self.slots.view(offs, n_new, dead, self.head_shard, run)
        return view if self.slots.key_norms is not None else on_key_norms(view, self.slots.norms_read)

    def fits(self, keys: mx.array, values: mx.array) -> bool:
        """Whether this decode input (one token per row) matches the stacked buffers."""
        k = self.slots.keys
        return (
            keys.ndim == 4
            and values.ndim == 4
            and keys.shape[2] == 1
            and values.shape[2] == 1
            and keys.shape[0] == k.shape[0]
            and keys.shape[1] == k.shape[1]
            and keys.shape[3] == k.shape[3]
            and values.shape[3] == self.slots.values.shape[3]
            and keys.dtype == k.dtype
            and values.dtype == self.slots.values.dtype
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """keys [B, H, 1, D], values [B, H, 1, Dv] -> every row's slots [B, H, budget + 1, D(v)]."""
        if self.hooks:
            self.step.check_hook(self.hooks, self.hooked_always or self._windowed())
        self.step.check_observed(self._windowed(), self.attended or all(o == 0 for o in self.offsets))
        slots, offsets, counters, attended = self.slots.snapshot(), list(self.offsets), self.counters, self.attended
        try:
            offs = self._offsets()
            view = self._view(0, offs)
            losers, update, counts = self.step.decode(view, list(self.offsets))
            if counts:
                zero = mx.zeros((len(self.rows),), mx.int32)
                self.counters = {**self.counters, **{k: self.counters.get(k, zero) + v for k, v in counts.items()}}
            self.slots.write(Token(keys, values, offs), losers, update)
            self.offsets = [o + 1 for o in self.offsets]
            offs = offs + 1
            self.slots.scores = self.step.on_append(self._view(1, offs, {}), keys, offs - 1)
            self.attended = False
        except BaseException:
            self.slots.restore(slots)
            self.offsets, self.counters, self.attended = offsets, counters, attended
            raise
        self.updates += 1
        if self.updates % 256 == 0 and self.counters:
            mx.async_eval(list(self.counters.values()))
        n = self.slots.n
        return self.slots.keys[..., :n, :], self.slots.values[..., :n, :]

    def before_attention(self, queries: mx.array, scale: float, mask):
        """queries [B, Hq, 1, D]; returns the mask: per-row window masks and log-weights, when used."""
        n = self.slots.n
        if self._windowed():  # each row's window (the row's mask, at its own query position)
            mask = window_mask(self.slots.positions[..., :n], self._offsets(), 1, self.window, queries.shape[1])
        if self.uses_log_weights:
            mask = with_log_weights(mask, self.slots.log_weights[..., :n], queries)
        if self.step.needs.attention:
            self.slots.scores = self.step.on_attention(self._view(1, self._offsets(), {}), queries, scale, mask)
        self.attended = True
        return mask

    # ------------------------------------------------------------------ back to rows
    def split(self) -> List:
        """Write the stacked state back into the row caches (each row's slots, offset, counters) and return them."""
        snap = self.slots.snapshot()
        for b, r in enumerate(self.rows):
            state = r.row_state()
            r.set_row_state(
                dataclasses.replace(
                    state,
                    slots=Snapshot(*(x[b : b + 1] if isinstance(x, mx.array) else x for x in snap)),
                    offset=self.offsets[b],
                    counters={**state.counters, **{k: v[b] for k, v in self.counters.items()}},
                    attended=self.attended,
                    last_S=1,
                    updates=self.updates,
                    run={},  # a decode step ends any run of prompt chunks
                    run_open=False,
                    lw_used=r.uses_log_weights,  # stacked steps may have merged: the row's bias applies from now on
                    track_key_norms=self.slots.track_key_norms,  # a part read them: the row keeps them too
                )
            )
        return self.rows

    @property
    def offset(self) -> mx.array:
        return mx.array(self.offsets, dtype=mx.int32)
