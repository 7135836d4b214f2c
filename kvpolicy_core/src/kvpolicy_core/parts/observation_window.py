"""Observation-window scorer (SnapKV's prompt scoring), shared by H2O and CaM.

A prompt chunk is scored by the attention its *last* ``W`` queries pay to every token
(SnapKV's observation window: when the question ends the prompt, these are the queries
that ask it), max-pooled over ``P`` neighbouring positions so that a span the question
needs (a number, a name) is kept or lost as a whole. Decode steps (one query) add that
query's attention, as H2O does.

Chunked prompts: consecutive chunks with no eviction between them are one *run* and are
scored as one chunk (the window is the run's last ``W`` queries), so how a prompt was
split (``prefill_step_size``, a prefix reused from mlx-lm's prompt cache) does not change
its scores while it fits the budget. After an eviction a new run starts: a chunk scored
then cannot see the question of a later chunk (see docs/methods/h2o.md).
"""

from __future__ import annotations

import mlx.core as mx

from .attention_scorer import AttentionScorer, finite_weights, observed_rows, proxy_weights
from .base import CacheView, key_rows_of
from .pooling import pool_by_position

#: the run's keys that recompute a filled window's rows (:meth:`ObservationWindowScorer._earlier_rows`)
WINDOW_QUERIES = ("window_queries", "window_scale", "window_keys", "window_mask", "window_causal")


def window_rows(mask, S: int, W: int):
    """The mask rows of the last ``W`` of ``S`` queries (masks as mlx-lm passes them).

    ``None`` and ``"causal"`` stay as they are ("causal" means queries at the end of
    the keys, which the last ``W`` queries are); arrays ``[..., S, L]`` keep their
    last ``W`` rows (a row axis of size 1 broadcasts and is kept).
    """
    if mask is None or isinstance(mask, str) or W >= S:
        return mask
    return mask[..., -W:, :] if mask.shape[-2] == S else mask


@mx.compile
def _decode_add(scores: mx.array, weights: mx.array) -> mx.array:
    """scores [B, H, L] + the finite weights [B, H, G, 1, L] summed over G: a decode step's update."""
    return scores + finite_weights(weights).sum(axis=(2, 3))


class ObservationWindowScorer(AttentionScorer):
    """Scores from the last ``W`` queries of each step, max-pooled over ``P`` positions.

    A *run* is a sequence of prompt chunks (S > 1) with no eviction between them (the
    cache says so through ``CacheView.run``); its queries ``q_{g,i}`` (G query heads per
    KV head h), numbered over the whole run ``i = 0 .. T - 1``, each with the mask it had
    in its own chunk. With the observation window ``I = {T - min(W, T), ..., T - 1}``
    (the run's last W queries) and ``s^0`` the scores when the run began (0 for tokens
    that arrived in it), after each chunk of the run::

        a_{h,j} = sum_{g in group(h)} sum_{i in I} softmax_j( q_{g,i} . k_j * scale + mask_ij )
        s_{h,j} = s^0_{h,j} + pool_P(a_h)_j              (prompt chunks, S > 1)
        s_{h,j} += a_{h,j}                              (decode, S == 1: H2O's accumulation)

    so a run scores exactly as its tokens would in one chunk (a query never attends to a
    later key, so its row over the run's later tokens is 0). ``pool_P`` is
    :func:`pool_by_position` with ``taper`` (0 streaming; the end-of-prompt cut breaks a pooled
    plateau's ties by distance from the token it pools from: ``TIE_TAPER`` in
    :mod:`kvpolicy_core.config.attention_config`). New tokens enter with 0 and receive their own run's mass.
    The run's state (``view.run``): ``rows`` [B, H, min(W, T), L] the window's attention
    rows summed over G (``W = 0``: their sum, [B, H, 1, L]) and ``base`` [B, H, L] = ``s^0``. A chunk
    that fills the window (``S > W``, rows from this scorer's own pass) keeps instead what computes those
    rows again bit for bit (:data:`WINDOW_QUERIES`: the window's queries [B, Hq, W, D], its mask rows, the
    scale and ``L``), not the ``W x L`` rows: a later chunk of the run needs them only when it is shorter
    than the window. So a held prompt keeps ``W * D`` numbers per query head, not ``W * L`` per KV head.
    A view without a run (None) scores each chunk as a run of its own. ``signal="proxy"`` uses the new keys as the
    queries (over earlier
    positions only, as the cumulative proxy does) and needs no attention hook.
    ``W = 0`` means every row; with ``W = 0, P = 1`` this is exactly
    :class:`~kvpolicy_core.parts.cumulative_attention.CumulativeAttentionScorer`.

    Shapes: queries [B, Hq, S, D], cached keys [B, H, L, D], scores [B, H, L].
    """

    default_signal = "observed"

    def __init__(self, signal: str = None, window: int = 32, pool: int = 7, taper: float = 0.0) -> None:
        super().__init__(signal)
        if window < 0:
            raise ValueError(f"obs_window must be >= 0 (got {window})")
        if pool < 1 or pool % 2 == 0:
            raise ValueError(f"pool must be an odd integer >= 1 (got {pool})")
        if not 0.0 <= taper < 1.0 / pool:
            raise ValueError(f"taper must be in [0, 1/pool) (got {taper})")
        self.window, self.pool, self.taper = window, pool, taper

    @classmethod
    def from_config(cls, config) -> "ObservationWindowScorer":
        return cls(
            signal=config.signal,
            window=getattr(config, "obs_window_rows", 32),
            pool=getattr(config, "pool_width", 7),
            taper=getattr(config, "pool_taper", 0.0),
        )

    def _rows(self, S: int) -> int:
        return S if self.window == 0 else min(self.window, S)

    def rows_observed(self, S: int) -> int:
        """How many of a step's ``S`` query rows the scores read: the window's last ``min(W, S)`` (all when W = 0)."""
        return self._rows(S)

    def combine(self, scores: mx.array, weights: mx.array) -> mx.array:
        """Unpooled accumulation (a decode step): scores [B, H, L] + weights [B, H, G, S, L] summed."""
        return scores + weights.sum(axis=(2, 3))

    def _add(self, view: CacheView, weights: mx.array, S: int, source=None) -> mx.array:
        """weights [B, H, G, R, L] of this step's window rows -> new scores [B, H, L] (see the class).

        ``source``: (queries [B, Hq, R, D], scale, mask rows) that :func:`observed_rows` computed ``weights``
        from, when it did: a chunk filling the window then keeps these in the run instead of the rows."""
        if S == 1:
            return self.combine(view.scores, weights)
        rows = weights.sum(axis=2)  # [B, H, R, L]
        if self.window == 0:
            rows = rows.sum(axis=2, keepdims=True)
        run = view.run if view.run is not None else {}
        base = view.scores
        if "base" in run:  # a later chunk of the run: the slots of earlier chunks are unchanged, new ones appended
            grow = rows.shape[-1] - run["base"].shape[-1]
            base = mx.pad(run["base"], [(0, 0), (0, 0), (0, grow)])
            if self.window == 0 or rows.shape[2] < self.window:  # the earlier rows count (else all fall out)
                earlier = mx.pad(self._earlier_rows(run, view), [(0, 0), (0, 0), (0, 0), (0, grow)])
                rows = earlier + rows if self.window == 0 else mx.concatenate([earlier, rows], axis=2)
                rows = rows[:, :, -self.window :] if self.window else rows
        for key in ("rows",) + WINDOW_QUERIES:
            run.pop(key, None)
        if source is not None and 0 < self.window == source[0].shape[2]:  # this chunk's own queries fill the window
            queries, scale, mask = source  # copies: a slice would keep the whole chunk's queries (and mask) alive
            run["window_queries"], run["window_scale"] = mx.contiguous(queries), mx.array([scale], dtype=mx.float32)
            run["window_keys"] = mx.array([rows.shape[-1]], dtype=mx.int32)  # (arrays of one: a state saves them)
            if isinstance(mask, mx.array):
                run["window_mask"] = mx.contiguous(mask)
            elif mask is not None:
                run["window_causal"] = mx.array([1], dtype=mx.int32)
        else:
            run["rows"] = rows
        run["base"] = base
        return base + pool_by_position(rows.sum(axis=2), view.positions, self.pool, self.taper)

    @staticmethod
    def _earlier_rows(run: dict, view: CacheView) -> mx.array:
        """The run's window rows [B, H, R, L'] over its first L' slots: kept, or computed again from the window's
        queries exactly as they were (the same queries, keys, scale and mask: the same numbers)."""
        if "rows" in run:
            return run["rows"]
        L = int(run["window_keys"].item())
        mask = run.get("window_mask", "causal" if "window_causal" in run else None)
        scale = run["window_scale"].item()
        return observed_rows(run["window_queries"], view.keys[:, :, :L], scale, mask, key_rows_of(view))[:, :, 0]

    def on_append(self, view: CacheView, new_keys: mx.array, new_positions: mx.array) -> mx.array:
        if self.signal != "proxy":
            return view.scores
        S = new_keys.shape[2]
        W = self._rows(S)
        weights = proxy_weights(view.keys, view.positions, new_keys[:, :, S - W :], new_positions[..., S - W :])
        return self._add(view, weights, S)

    def on_attention(self, view: CacheView, queries: mx.array, scale: float, mask) -> mx.array:
        if self.signal != "observed":
            return view.scores
        S = queries.shape[2]
        W = self._rows(S)
        window = (queries[:, :, S - W :], scale, window_rows(mask, S, W))
        return self._add(view, observed_rows(window[0], view.keys, *window[1:], key_rows_of(view)), S, window)

    def on_attention_weights(self, view: CacheView, weights: mx.array) -> mx.array:
        """:meth:`on_attention` from the model's weights [B, H, G, S, L] of the step (see the base class)."""
        if self.signal != "observed":
            return view.scores
        S = weights.shape[3]
        if S == 1:  # decode: one compiled graph (NaN rows to 0, sum over heads, add)
            return _decode_add(view.scores, weights)
        W = self._rows(S)
        return self._add(view, finite_weights(weights if W == S else weights[..., S - W :, :]), S)
