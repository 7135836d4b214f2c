"""Batched generation with policy caches: mlx-lm's batch-cache protocol over per-row caches.

mlx-lm batches by merging one cache per sequence (``cache.merge``), then drives the merged
cache through ``prepare``/``finalize`` (padded prompts), ``filter`` (rows that finished),
``extend`` (rows that join) and ``extract`` (one row back as a plain cache), as its own
``BatchKVCache`` does. :class:`BatchPolicyCache` implements that protocol for kvpolicy.

Design: B independent :class:`~kvpolicy_core.cache.policy_cache.PolicyCache` rows (batch 1 each). A
policy's parts see one offset per cache (``CacheView.offset``) and draw random numbers
per (seed, layer, step); keeping each row its own cache is what makes a row of a batch
evict exactly what the same prompt evicts alone, for every method, without changing the
part interfaces. Each call hands row b only its real tokens, so padding is never
scored, kept or merged into; the attention step sees the rows left-padded to a common
length ``Lmax`` and a boolean mask:

    keys[b, :, Lmax - L_b:]  = row b's keys this step (L_b = kept_b + S_b), zeros before
    mask[b, :, i, j]         = row b's own mask at (i - lo_b, j - (Lmax - L_b)) for its
                               real queries i in [lo_b, lo_b + S_b), False on padding keys;
                               True for padding queries (their outputs are never used)

where ``lo_b`` is the row's left padding in this call and ``S_b`` its real tokens.
``offset`` is the array ``[B]`` of each row's absolute position of its first new token,
so mlx-lm's RoPE rotates every row at its own positions.

Cost: prefill and rows that differ (lengths, budgets not yet reached) run the rows' policy
work as a loop over the batch (B small updates per layer and step). The steady state of
decoding, every row at its budget with the same number of slots, runs as one vectorised
step over the stacked rows (:mod:`.batch_rows`), with the same result per row; the model's
matmuls, the attention and the sampling always run batched.
"""

from __future__ import annotations

import copy
import math
import threading
from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_map

from ..errors import KVPolicyError
from ..parts.attention_scorer import causal_allowed
from .batch_rows import StackedRows, can_stack
from .layer_group import copied_group

#: the masks :meth:`BatchPolicyCache.make_mask` made last on this thread, with the plan each was made for: mlx-lm
#: builds one mask from the first layer's cache (``create_attention_mask(h, cache[0])``) and hands it to every layer,
#: so a layer whose rows hold other lengths (a compress-once cut keeps a budget per layer) builds its own
_made = threading.local()
_MADE_KEPT = 4  # a model may build two masks per step (gemma3: a global and a sliding one)

#: A row: a :class:`~kvpolicy_core.cache.policy_cache.PolicyCache`. That module imports this one (for
#: ``PolicyCache.merge``), so rows are recognised by :attr:`BatchPolicyCache.row_class`, which it sets.
Row = Any


def copy_row(cache: Row) -> Row:
    """An independent copy of a policy cache. Its policy's parts are shared (they are stateless),
    and so is its attention-hook install (:class:`~kvpolicy_core.attention.hook.AttentionHook` copies
    as itself): the copy keeps the hook alive as the original does. A row of a data-driven allocation's group
    joins the copy of that group that the copies of its other layers join (mlx-lm merges and extracts one layer
    after another: :func:`~.layer_group.copied_group`)."""
    memo = {id(cache.policy): cache.policy}
    if cache.group is not None:
        memo[id(cache.group)] = copied_group(cache.group, cache.layer)
    return copy.deepcopy(cache, memo=memo)


class BatchPolicyCache:
    """B policy-cache rows behind mlx-lm's batch-cache protocol (see the module docstring).

    Args:
        rows: one :class:`PolicyCache` per sequence (batch 1 each, or empty); owned from now on.
    """

    kvpolicy_attention = "batch"  #: the attention hook calls :meth:`before_attention` for this cache
    #: the rows' class, :class:`~kvpolicy_core.cache.policy_cache.PolicyCache` (set by that module, which imports
    #: this one)
    row_class: Optional[type] = None

    def __init__(self, rows: Sequence[Row]) -> None:
        for i, r in enumerate(rows):
            if self.row_class is None or not isinstance(r, self.row_class):
                raise KVPolicyError(f"BatchPolicyCache row {i}: expected a PolicyCache, got {type(r).__name__}")
            r.hold_as_kept()  # one storage for every row of the batch (no hold_bits while batched)
            if r.keys is not None and r._slots.shape()[0] != 1:
                raise KVPolicyError(
                    f"BatchPolicyCache row {i}: a row holds one sequence, but this cache holds "
                    f"a batch of {r._slots.shape()[0]}"
                )
            if r.storage.describe() != rows[0].storage.describe():
                raise KVPolicyError(
                    f"BatchPolicyCache row {i}: its rows are stored as {r.storage.describe() or 'the model dtype'}, "
                    f"row 0's as {rows[0].storage.describe() or 'the model dtype'}: one batch stores its rows alike"
                )
        self._rows: List[Row] = list(rows)
        self._stacked: Optional[StackedRows] = None  # the rows stacked for decode steps (batch_rows.py)
        self._skip = [0] * len(self.rows)  # left padding still to drop from the next input, per row
        self._real: Optional[List[int]] = None  # real tokens left in right-padded input, per row
        self._step: List[Tuple[int, int, int]] = []  # per row this call: (lo, S_b, L_b)

    def __getattr__(self, name: str):
        """``bits`` and ``group_size`` exist only when the rows are stored quantized: mlx-lm's attention takes its
        quantized path for a cache that has them."""
        rows = self.__dict__.get("_rows")
        if name in ("bits", "group_size") and rows and rows[0].storage.bits is not None:
            return getattr(rows[0].storage, name)
        raise AttributeError(name)

    @property
    def rows(self) -> List[Row]:
        """The row caches (brought up to date first if the rows are stacked)."""
        if self._stacked is not None:
            self._stacked.split()
            self._stacked = None
        return self._rows

    @rows.setter
    def rows(self, rows: List[Row]) -> None:
        self._stacked = None
        self._rows = rows

    def _decoding(self, S: int) -> bool:
        """One real token for every row, no padding: a decode step the stacked rows can take."""
        return S == 1 and self._real is None and not any(self._skip)

    # ------------------------------------------------------------------ construction
    @classmethod
    def merge(cls, caches: Sequence[Row]) -> "BatchPolicyCache":
        """One batch from single-sequence caches; the inputs are copied, never modified."""
        return cls([copy_row(c) for c in caches])

    def extract(self, idx: int) -> Row:
        """Row ``idx`` as an independent single-sequence :class:`PolicyCache`."""
        return copy_row(self.rows[idx])

    def filter(self, batch_indices) -> None:
        """Keep only the rows ``batch_indices`` (a list or an int array), in that order."""
        idx = batch_indices.tolist() if isinstance(batch_indices, mx.array) else [int(i) for i in batch_indices]
        self.rows = [self.rows[i] for i in idx]
        self._skip = [self._skip[i] for i in idx]
        if self._real is not None:
            self._real = [self._real[i] for i in idx]

    def extend(self, other: "BatchPolicyCache") -> None:
        """Append ``other``'s rows (joining sequences) after this batch's rows."""
        if not isinstance(other, BatchPolicyCache):
            raise KVPolicyError(f"BatchPolicyCache.extend: cannot batch with a {type(other).__name__}")
        if self._real is not None or other._real is not None:
            mine = self._real or [1 << 62] * len(self.rows)
            theirs = other._real or [1 << 62] * len(other.rows)
            self._real = mine + theirs
        self.rows += other.rows
        self._skip += other._skip

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Declare padding of the next inputs: drop ``left_padding[b]`` leading tokens of row b,
        and with ``right_padding``, use only the first ``lengths[b]`` tokens of row b."""
        if left_padding is not None:
            self._skip = [s + int(p) for s, p in zip(self._skip, _ints(left_padding))]
        if right_padding is not None and max(_ints(right_padding)) > 0:
            self._real = list(_ints(lengths))

    def finalize(self) -> None:
        """End of a padded prompt: later inputs are all real tokens."""
        self._real = None

    # ------------------------------------------------------------------ the cache contract
    @property
    def offset(self) -> mx.array:
        """[B] int32: each row's absolute position of its next real token (for RoPE)."""
        if self._stacked is not None and not any(self._skip):
            return self._stacked.offset
        return mx.array([r.offset - s for r, s in zip(self.rows, self._skip)], dtype=mx.int32)

    def _plan(self, S: int) -> List[Tuple[int, int, int]]:
        """Per row for an input of S tokens: (left padding lo, real tokens S_b, attended L_b)."""
        plan = []
        for b, r in enumerate(self.rows):
            lo = min(self._skip[b], S)
            n = S - lo
            if self._real is not None:
                n = min(n, self._real[b])
            plan.append((lo, n, r.fetched(n) if n else 0))
        return plan

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """keys [B, H, S, D], values [B, H, S, Dv] -> [B, H, Lmax, D], [B, H, Lmax, Dv] (rows left-padded)."""
        B, H, S, _ = keys.shape
        if B != len(self._rows):
            raise ValueError(f"BatchPolicyCache holds {len(self._rows)} rows but got a batch of {B}")
        if self._decoding(S):
            if self._stacked is None and can_stack(self._rows):
                self._stacked = StackedRows(self._rows)
            if self._stacked is not None and self._stacked.fits(keys, values):
                self._step = []
                return self._stacked.update_and_fetch(keys, values)
        plan = self._plan(S)
        outs = []
        for b, (r, (lo, n, _)) in enumerate(zip(self.rows, plan)):
            if n:
                outs.append(r.update_and_fetch(keys[b : b + 1, :, lo : lo + n], values[b : b + 1, :, lo : lo + n]))
            else:
                outs.append(None)
            self._skip[b] -= lo
            if self._real is not None:
                self._real[b] -= n
        self._step = plan
        L = max(p[2] for p in plan)
        if all(o is not None and p[2] == L for o, p in zip(outs, plan)):
            return tuple(tree_map(lambda *x: mx.concatenate(x), *[o[j] for o in outs]) for j in (0, 1))
        like = next(o for o in outs if o is not None)  # a row's output: arrays, or quantized triples

        def padded(o, j):
            if o is None:  # zero rows shaped like another row's (attention masks them out)
                return tree_map(lambda x: mx.zeros((1, H, L, x.shape[-1]), x.dtype), like[j])
            return tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (L - x.shape[2], 0), (0, 0)]), o[j])

        return tuple(tree_map(lambda *x: mx.concatenate(x), *[padded(o, j) for o in outs]) for j in (0, 1))

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **_):
        """The mask for N new tokens (before the update): [B, 1, N, Lmax] bool, or None.

        None only when every row is a plain decode step over the same length. Sliding-window
        layers get their per-row window masks from the attention hook (:meth:`before_attention`), and so does
        every layer whose rows hold other lengths than this (the first) layer's rows.
        """
        if self._stacked is not None and N == 1 and self._decoding(N):  # every row attends to its n = budget + 1 slots
            return mx.ones((len(self._stacked), 1, 1, self._stacked.slots.n), mx.bool_) if return_array else None
        plan = self._plan(N)
        L = max(p[2] for p in plan)
        if N == 1 and not return_array and all(p == (0, 1, L) for p in plan):
            return None
        mask = self._batch_mask(N, L, plan, [None] * len(plan))
        made = getattr(_made, "masks", [])[-(_MADE_KEPT - 1) :]
        _made.masks = [*made, ((N, tuple(plan)), mask)]
        return mask

    def _batch_mask(self, N: int, L: int, plan, row_masks) -> mx.array:
        """Assemble [B, h, N, L] from each row's own mask over its real queries and keys.

        Boolean when every row's mask is; additive (0 / -inf, in the additive masks' dtype) when
        a row's mask is additive, as a row with attention log-weights gives
        (:func:`~kvpolicy_core.attention.bias.with_log_weights`): padding keys get -inf, padding
        queries 0 (their outputs are never used).
        """
        additive = next((m.dtype for m in row_masks if isinstance(m, mx.array) and m.dtype != mx.bool_), None)
        allow, deny = (True, False) if additive is None else (0.0, -math.inf)
        parts = []
        for (lo, n, Lb), m in zip(plan, row_masks):
            if n == 0:
                parts.append(mx.full((1, 1, N, L), allow, dtype=additive or mx.bool_))
                continue
            if m is None or isinstance(m, str):  # None: a decode step; "causal": a chunk
                m = causal_allowed(n, Lb)
            if additive is not None:
                m = (
                    mx.where(m, mx.array(0.0, additive), mx.array(-math.inf, additive))
                    if m.dtype == mx.bool_
                    else m.astype(additive)
                )
            m = m.reshape((1,) * (4 - m.ndim) + tuple(m.shape))
            m = mx.broadcast_to(m, (1, m.shape[1], n, Lb))
            m = mx.pad(m, [(0, 0), (0, 0), (0, 0), (L - Lb, 0)], constant_values=deny)
            if lo or N - lo - n:
                m = mx.pad(m, [(0, 0), (0, 0), (lo, N - lo - n), (0, 0)], constant_values=allow)
            parts.append(m)
        h = max(p.shape[1] for p in parts)
        return mx.concatenate([mx.broadcast_to(p, (1, h, N, L)) for p in parts])

    def before_attention(self, queries: mx.array, scale: float, mask):
        """Called by the attention hook with queries [B, Hq, S, D]; returns the mask to use.

        Each row that observes attention (or has a sliding window past its size) gets its own
        real queries and the mask the model would give it alone; its returned mask replaces
        its part of the batch mask. The mask given is the one mlx-lm built from the first layer's cache: a layer
        whose rows hold other lengths (per-layer budgets of a compress-once cut) gets a mask built from its own
        rows instead. (The hook must be installed for that: :func:`~kvpolicy_core.integration.compress_once.hold_hook`.)
        """
        if self._stacked is not None:
            if queries.shape[0] != len(self._stacked) or queries.shape[2] != 1:
                return mask
            # every stacked row attends to all its n slots: the mask given (built from the first layer, whose rows
            # may hold another number of slots) is replaced by this layer's own
            if isinstance(mask, mx.array):
                mask = mx.ones((len(self._stacked), 1, 1, self._stacked.slots.n), mx.bool_)
            return self._stacked.before_attention(queries, scale, mask)
        plan = self._step
        if not plan or queries.shape[0] != len(plan):
            return mask
        S = queries.shape[2]
        row_masks, changed = [], False
        for b, (r, (lo, n, Lb)) in enumerate(zip(self.rows, plan)):
            m = None
            if n and _needs_hook(r):
                given = _row_mask_in(n, Lb, r.window)
                m = r.before_attention(queries[b : b + 1, :, lo : lo + n], scale, given)
                if m is given:
                    m = None
                else:
                    changed = True
            row_masks.append(m)
        if not changed and _made_for(mask, S, plan):
            return mask
        return self._batch_mask(S, max(p[2] for p in plan), plan, row_masks)

    def after_attention(self, out: mx.array, values: mx.array) -> mx.array:
        """``out`` [B, Hq, S, Dv], the batch's attention output: each row of a data-driven allocation measures its own
        real queries' output against its own new values, as it would alone (:meth:`PolicyCache.after_attention`)."""
        if self._stacked is not None or out.shape[2] == 1 or len(self._step) != out.shape[0]:
            return out  # decode steps: only prompt chunks are measured
        for b, (r, (lo, n, _)) in enumerate(zip(self._rows, self._step)):
            if n > 1 and r.group is not None:  # row b's new tokens are the last n of its slots (left-padded to Lmax)
                own = tree_map(lambda x: x[b : b + 1, :, x.shape[2] - n :], values)
                r.after_attention(out[b : b + 1, :, lo : lo + n], own)
        return out

    # ------------------------------------------------------------------ bookkeeping
    @property
    def state(self):
        """Every row's ``PolicyCache.state`` (each row settled to its budget first): what ``mx.eval`` needs and
        what mlx-lm's ``save_prompt_cache`` writes (``load_prompt_cache`` rebuilds the batch, :meth:`from_state`)."""
        return [r.state for r in self.rows]

    @property
    def meta_state(self):
        return tuple(r.meta_state[0] for r in self.rows)

    @classmethod
    def from_state(cls, state, meta_state=None):
        """A batch from :attr:`state` (one ``PolicyCache`` state per row; ``meta_state`` is not needed)."""
        if not isinstance(state, (list, tuple)) or not all(isinstance(s, (list, tuple)) for s in state):
            raise KVPolicyError("BatchPolicyCache state must be a list of PolicyCache states, one per row")
        return cls([cls.row_class.from_state(s) for s in state])

    def is_trimmable(self) -> bool:
        return all(r.is_trimmable() for r in self.rows)

    def trim(self, n: int) -> int:
        """Trim every row (see :meth:`PolicyCache.trim`); all-or-nothing: refused unless every row can."""
        if n > 0 and not self.is_trimmable():
            raise KVPolicyError(
                "cannot trim this batch: a row's policy cache cannot be trimmed exactly "
                "(see PolicyCache.is_trimmable); check is_trimmable() first"
            )
        return min((r.trim(n) for r in self.rows), default=0)

    def size(self) -> int:
        return max((r.size() for r in self.rows), default=0)

    def empty(self) -> bool:
        return all(r.empty() for r in self.rows)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return f"BatchPolicyCache(rows={len(self.rows)}, kept={[r.tokens_kept for r in self.rows]})"


def _ints(x) -> List[int]:
    return x.tolist() if isinstance(x, mx.array) else [int(v) for v in x]


def _made_for(mask, S: int, plan) -> bool:
    """Is ``mask`` right for a layer whose rows take ``plan`` for ``S`` new tokens: None over rows that all decode
    one token over the same length, or a mask :meth:`BatchPolicyCache.make_mask` made for this very plan."""
    if mask is None:
        L = max(p[2] for p in plan)
        return S == 1 and all(p == (0, 1, L) for p in plan)
    key = (S, tuple(plan))
    return any(m is mask and k == key for k, m in getattr(_made, "masks", ()))


def _needs_hook(row: Row) -> bool:
    """Does this row's attention step need the row's own queries or its own mask?"""
    windowed = row.window is not None and row.offset > row.window
    return row.policy_step.needs.attention or row.uses_log_weights or windowed


def _row_mask_in(n: int, L: int, window: Optional[int]):
    """The mask mlx-lm gives a single-sequence PolicyCache for n new tokens over L slots."""
    if window is not None:
        return causal_allowed(n, L)
    return None if n == 1 else "causal"


def register_with_mlx_lm(cls: type) -> None:
    """Make ``cls`` loadable by mlx-lm's ``load_prompt_cache``, which looks cache classes up by name in
    ``mlx_lm.models.cache``'s globals (idempotent). Run when this module and :mod:`.policy_cache` are imported;
    ``import kvpolicy_core`` imports both as soon as mlx-lm's module is imported too (in either order)."""
    # imported here, not at the top: importing mlx-lm's module runs the package's registration
    # (kvpolicy_core/__init__.py), which imports the modules that import this one
    import mlx_lm.models.cache as mlx_cache

    if getattr(mlx_cache, cls.__name__, None) is not cls:
        setattr(mlx_cache, cls.__name__, cls)


register_with_mlx_lm(BatchPolicyCache)
