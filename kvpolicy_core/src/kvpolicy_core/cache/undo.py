"""Taking back the newest tokens of a policy cache: the undo record of its last update, and verify steps.

mlx-lm's speculative decoding (``mlx_lm.generate(..., draft_model=...)``) feeds the target model's cache one
*verify step* per round, the last accepted token and ``k`` draft tokens as one update of ``S = k + 1`` tokens, then
``trim(r)`` with the ``r`` drafts it rejected: the newest tokens of that update, appended after the update's own
eviction, so never yet evicted or merged. This module keeps, for the cache's last update of ``2 <= S <=``
:data:`UNDO_TOKENS` tokens, what that update added on top of the slots it found (:class:`Record`: the slot count,
offset and scores before it, and the scores after each of its tokens), so that ``trim(r)`` puts the cache back
exactly as if the update had brought only its first ``m = S - r`` tokens. A trim reaching further back is refused
with a :class:`~kvpolicy_core.errors.KVPolicyError` (the tokens of earlier updates may have been evicted, merged
into, or scored by later queries that cannot be taken back).

*A multi-token update after the prompt* (the meaning chosen here). An update of ``2 <= S <=`` :data:`UNDO_TOKENS`
tokens that comes right after a ``trim`` (mlx-lm trims after every verify step, by 0 when it accepts every draft) is
``S`` decode steps taken at once:

1. it settles what the previous update left over the budget, ``E = n - budget`` losers at once from the scores so
   far (the first one after a held prompt, ``when="prompt_end"``, is the prompt's cut);
2. appends its ``S`` tokens (positions ``offset .. offset + S - 1``): they attend to the retained slots and causally
   to one another, so the layer holds ``budget + S`` slots during the step;
3. scores them as ``S`` decode steps with nothing evicted between them: token ``i`` (``0 <= i < S``) is scored on
   the view of the ``L_i = n_0 + i + 1`` slots that exist once it has arrived (``n_0``: the slots after step 1),
   with its own query row::

       s^(0) = [s, 0_S]                                    (the S new slots enter with score 0)
       s^(i+1)[:L_i] = scorer(view[:L_i], s^(i)[:L_i], row i),   s^(i+1)[L_i:] = s^(i)[L_i:]

   (``on_append`` with token ``i``'s key, then ``on_attention_weights`` with row ``i`` of the step's attention
   weights over the first ``L_i`` slots, or ``on_attention`` with its query and mask row): H2O's and CaM's scores
   add each query's attention, TOVA's keep the last query's, exactly as ``S`` one-token steps would;
4. the next update evicts the ``S`` (``m`` after a trim) over the budget at once (step 1).

So greedy speculative decoding equals plain greedy decoding while no eviction falls inside a verify step (a budget
above the generation, or a prompt cut before it); where one does, the ``m`` losers leave together where plain decoding
would evict one per token, chosen greedily with the attention of the tokens between them. Any other update of
``S > 1`` tokens is a prompt chunk, as before (the first verify step, which carries the prompt's last token, is one:
the prompt ends at the trim that follows it, and the next verify step cuts a held prompt). A prompt chunk of at most
:data:`UNDO_TOKENS` tokens of a cache asked ``is_trimmable()`` while empty (speculative decoding asks so first) is
taken back by scoring its first ``m`` tokens again as that chunk (the run of prompt
chunks it continued restored): exact when the chunk evicted nothing (a ``hold`` or window eviction at its start
stays as the ``S`` tokens made it).

Cost: an update of one token (plain decoding) keeps no record and pays nothing; a verify step holds references to
arrays it computes anyway (the scores after each token) and makes one scorer call per token, as plain decoding does;
``trim`` slices them (a prompt chunk's trim scores the kept tokens again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import mlx.core as mx

from ..errors import KVPolicyError
from ..parts.base import CacheView, kept_key_norms

#: the longest update a trim can take back (a verify step of up to UNDO_TOKENS - 1 draft tokens); longer updates
#: keep no record. mlx-lm skips the trim of a cache that is not trimmable, so its ``num_draft_tokens`` must stay below
UNDO_TOKENS = 32


@dataclass
class Record:
    """What the last update of ``S`` tokens added on top of the ``n0`` slots it found (after its own eviction)."""

    steps: bool  #: a verify step (decode steps at once) rather than a prompt chunk
    S: int  #: tokens of the update still in the cache (a trim shortens it)
    n0: int  #: slots before the update's tokens were appended
    offset0: int  #: tokens seen before it
    scores0: mx.array  #: scores [B, H, n0] before it
    run0: Any  #: the run of prompt chunks before it (a chunk's ``CacheView.run``)
    keys: mx.array  #: its keys [B, H, S, D] (a chunk's trim scores the kept ones again)
    rows: List[mx.array] = field(default_factory=list)  #: a verify step's scores [B, H, n0 + S] after each token
    appended: List[mx.array] = field(default_factory=list)  #: its scores after each token's on_append, when changed
    #: the attention inputs (weights, queries, scale, mask): a chunk's, or a verify step's whose on_append scored too
    attention: Optional[tuple] = None


def is_steps(cache, S: int) -> bool:
    """Whether an update of ``S`` tokens is a verify step: ``2 <= S <= UNDO_TOKENS`` right after a trim."""
    return 1 < S <= UNDO_TOKENS and cache._verify_next


def start(cache, S: int, steps: bool, keys: mx.array) -> Optional[Record]:
    """The record of an update of ``S`` tokens about to be appended (after its eviction), or None (nothing kept)."""
    if S < 2 or S > UNDO_TOKENS or not (steps or cache._trims):
        return None
    return Record(steps, S, cache.n, cache.offset, cache.scores, cache._run, keys)


def _row_view(view: CacheView, L: int, scores: mx.array, offset: int) -> CacheView:
    """``view`` (the S new slots last) cut to its first ``L`` slots, one new token, tokens seen ``offset``."""
    lw, norms = view.log_weights, kept_key_norms(view)
    return CacheView(
        view.keys[:, :, :L],
        view.values[:, :, :L],
        view.positions[..., :L],
        scores[..., :L],
        offset,
        1,
        None,
        view.head_offset,
        view.heads_total,
        None if lw is None else lw[..., :L],
        None,
        None if norms is None else norms[..., :L],
    )


def _merge_row(full: mx.array, got: mx.array) -> mx.array:
    """The scores of all slots: a row's result ``got`` [B, H, L] then ``full``'s later slots (not yet arrived)."""
    L = got.shape[-1]
    return got if L == full.shape[-1] else mx.concatenate([got, full[..., L:]], axis=-1)


def append_rows(cache, rec: Record, keys: mx.array) -> mx.array:
    """A verify step's ``on_append``, token by token (step 3 of the module docstring); the scores after it."""
    view, scores = cache._view(rec.S), cache.scores
    rows = []
    for i in range(rec.S):
        L, pos = rec.n0 + i + 1, rec.offset0 + i
        row_view = _row_view(view, L, scores, pos + 1)
        got = cache.policy_step.on_append(row_view, keys[:, :, i : i + 1], mx.array([pos], dtype=mx.int32))
        scores = _merge_row(scores, got)
        rows.append(scores)
    rec.rows = rows
    if rows[-1] is not cache.scores:  # the scorer scores on append (else its on_append returned them as they were)
        rec.appended = rows
    return scores


def _mask_row(mask, i: int, S: int, L: int):
    """Row ``i`` of a step's mask (as the scorer got it) over the first ``L`` keys: None for a plain causal row."""
    if not isinstance(mask, mx.array):
        return None
    row = mask[..., i : i + 1, :] if mask.shape[-2] == S else mask
    return row[..., :L] if row.shape[-1] > L else row


def attention_rows(cache, rec: Record, *, weights=None, queries=None, scale=None, mask=None) -> mx.array:
    """A verify step's attention scoring, token by token, from the model's ``weights`` [B, H, G, S, L] (row ``i``
    over its first ``L_i`` keys) or from ``queries`` [B, Hq, S, D] (with the ``scale`` and ``mask`` rows); the scores
    after it. Each token's scores are kept for :func:`take_back`."""
    inputs = (weights, queries, scale, mask)
    rec.attention = inputs if rec.appended else None  # a trim scores the kept rows again
    rec.rows = _attention_rows(cache, rec, cache.scores, rec.S, inputs)
    return rec.rows[-1]


def _attention_rows(cache, rec: Record, scores: mx.array, count: int, inputs=None) -> List[mx.array]:
    """The scores after each of the first ``count`` tokens' attention rows, from ``scores`` [B, H, n0 + count]."""
    weights, queries, scale, mask = rec.attention if inputs is None else inputs
    view, step, S = cache._view(count), cache.policy_step, weights.shape[3] if weights is not None else queries.shape[2]
    rows = []
    for i in range(count):
        L = rec.n0 + i + 1
        row_view = _row_view(view, L, scores, rec.offset0 + i + 1)
        if weights is not None:
            got = step.on_attention_weights(row_view, weights[..., i : i + 1, :L])
        else:
            got = step.on_attention(row_view, queries[:, :, i : i + 1], scale, _mask_row(mask, i, S, L))
        scores = _merge_row(scores, got)
        rows.append(scores)
    return rows


def observe_chunk(rec: Optional[Record], queries: mx.array, scale: float, mask) -> None:
    """A prompt chunk's attention inputs, kept with its record (its trim scores the kept tokens again)."""
    if rec is not None and not rec.steps and rec.attention is None:
        rec.attention = (None, queries, scale, mask)


def trimmable(cache) -> int:
    """How many of the newest tokens :func:`take_back` can take back now (0: none)."""
    rec = cache._undo
    if rec is None or (not rec.steps and cache.group is not None):  # a chunk measured for an allocation: no replay
        return 0
    if not rec.steps and cache._step.needs.attention and rec.attention is None:
        return 0  # the chunk's attention was not seen (no hook): its scores cannot be redone
    return rec.S


def refuse(cache, n: int, can: int) -> KVPolicyError:
    """The error of a trim of ``n`` tokens beyond the ``can`` this cache can take back."""
    return KVPolicyError(
        f"layer {cache.layer}: cannot trim {n} tokens from this policy cache: it can take back only the newest "
        f"{can} (the tokens of its last update, of at most {UNDO_TOKENS}: never evicted or merged, and their "
        "attention still on record); older tokens may have been evicted or merged into the survivors, and their "
        "attention is in every score. Trim right after the update (speculative decoding's verify step does), or "
        "rebuild the cache from the shorter prompt"
    )


def take_back(cache, r: int) -> int:
    """Undo the newest ``r <= trimmable(cache)`` tokens: the cache is as if its last update had brought only its first
    ``m = S - r`` (exactly, for a verify step: its scores after token ``m``); returns ``r``."""
    rec: Record = cache._undo
    m = rec.S - r
    state = cache.row_state()
    try:
        sl = cache._slots
        sl.n = rec.n0 + m
        cache.offset = rec.offset0 + m
        if sl.log_weights is not None:
            sl.log_weights = sl.log_weights[..., : sl.n]
        if m == 0:
            B, H = rec.keys.shape[:2]
            sl.scores = mx.zeros((B, H, 0), mx.float32) if rec.scores0 is None else rec.scores0
        elif rec.steps and not rec.rows:  # nothing scored the step's tokens (the scores it appended, 0 for them)
            sl.scores = sl.scores[..., : sl.n]
        elif rec.steps and rec.attention is None:
            sl.scores = rec.rows[m - 1][..., : sl.n]
        elif rec.steps:  # both hooks scored: the kept tokens' attention again, from their append scores
            sl.scores = _attention_rows(cache, rec, rec.appended[m - 1][..., : sl.n], m)[-1]
        else:
            sl.scores = _redo_chunk(cache, rec, m)
        cache._last_S, cache._attended = m, True
    except BaseException:
        cache.set_row_state(state)
        raise
    if rec.steps and rec.attention is not None:  # the kept tokens' inputs, cut to them
        w, q, scale, mask = rec.attention
        mask = mask[..., :m, :] if isinstance(mask, mx.array) and mask.shape[-2] == rec.S else mask
        rec.attention = (w if w is None else w[..., :m, : rec.n0 + m], q if q is None else q[:, :, :m], scale, mask)
    rec.S, rec.rows = m, [x[..., : rec.n0 + m] for x in rec.rows[:m]]
    rec.appended = [x[..., : rec.n0 + m] for x in rec.appended[:m]]
    if m == 0:
        cache._undo = None
    return r


def _redo_chunk(cache, rec: Record, m: int) -> mx.array:
    """A prompt chunk of ``m`` tokens scored again on the slots before it (its run restored): on_append with the
    kept keys, then its attention from the kept queries (``on_attention``, the mask's first ``m`` rows)."""
    sl, step = cache._slots, cache.policy_step
    B, H = rec.keys.shape[:2]
    new = mx.zeros((B, H, m), mx.float32)
    sl.scores = new if rec.scores0 is None else mx.concatenate([rec.scores0, new], axis=-1)
    run = dict(rec.run0)
    if step.appends:
        positions = mx.arange(rec.offset0, rec.offset0 + m, dtype=mx.int32)
        sl.scores = step.on_append(cache._view(m, run), rec.keys[:, :, :m], positions)
    if rec.attention is not None:
        _, queries, scale, mask = rec.attention
        if isinstance(mask, mx.array):
            mask = mask[..., :m, : sl.n] if mask.shape[-2] > 1 else mask[..., : sl.n]
        else:
            mask = "causal" if m > 1 else None
        sl.scores = step.on_attention(cache._view(m, run), queries[:, :, :m], scale, mask)
    cache._run = run
    return sl.scores
