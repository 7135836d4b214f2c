"""Expected Attention scorer (arXiv 2510.00636; kvpress ``ExpectedAttentionPress``): the attention future queries
are expected to pay each key, from the statistics of the queries seen so far.

Query-agnostic: it needs no question, only the distribution of the model's own queries. Shapes: ``B`` batch,
``H`` KV heads, ``G`` query heads per KV head (``Hq = H·G``), ``S`` queries this update, ``L`` slots, ``D`` head dim,
``m`` rotated pairs (``2m <= D``), ``F`` = ``n_future``.

*Queries before RoPE.* The model's queries q_i [B, Hq, S, D] arrive rotated at their positions p_i; RoPE is a
rotation R_p (angle ``p·θ_r`` on pair r, ``θ`` the layer's ``rope_freqs``), so ``u_i = R_{-p_i} q_i`` is the
query before RoPE (any constant scale the model's RoPE applies, e.g. YaRN's mscale, stays in u and is exactly what
future queries carry too). Queries at positions ``p_i < n_sink`` are left out (kvpress: outliers).

*Statistics.* Over the N queries of the current *run* (the prompt chunks since the last eviction,
``CacheView.run``; a decode step is a run of its one query), per query head::

    mu    = (1/N) sum_i u_i                           [B, Hq, D]
    Sigma = (1/N) sum_i (u_i - mu)(u_i - mu)^T         [B, Hq, D, D]   (0 for N = 1: decode skips the term)

*Future positions.* The queries to come sit at positions t = offset .. offset + F - 1; kvpress averages their
rotation: ``Rbar = (1/F) sum_t R_t`` (pair r: [[cbar, -sbar], [sbar, cbar]] with cbar = mean_t cos(t·θ_r),
sbar = mean_t sin(t·θ_r)), and ``mu_f = Rbar mu``, ``Sigma_f = Rbar Sigma Rbar^T``.

*Expected attention.* For q ~ N(mu_f, Sigma_f), E[exp(c q·k)] = exp(c mu_f·k + c² k^T Sigma_f k / 2); with ``c``
the model's attention scale (kvpress writes c = 1/sqrt(D), the same for the models whose scale it is)::

    z_{g,j} = c mu_{f,g} . k_j + (c² / 2) k_j^T Sigma_{f,g} k_j          over slots j with pos_j >= n_sink
    a_{h,j} = (1/G) sum_{g in group(h)} softmax_j( z_{g,j} )             [B, H, L]
    s_{h,j} = (a_{h,j} + eps) * ||v_j||          (use_vnorm; else a_{h,j} + eps)
    s_{h,j} = pool_P(s_h)_j                      (pool P > 1: max over the P nearest retained positions)
    s_{h,j} = max_j' s_{h,j'} + 1                for sinks (pos_j < n_sink), as kvpress pads them

Every slot is rescored at each prompt chunk from the run's statistics, and at every ``rescore_every``-th decode
step from that step's query (N = 1; default 0: never, the decode token enters with its row's highest score,
:mod:`.rescore`, so the prompt's scores, the last chunk's, decide the evictions as kvpress's prefill compression
does). Cost per layer: a prompt chunk O(S·D²·Hq) for the statistics plus O(L·D²·Hq) for the covariance term; a
rescoring decode step O(L·D·Hq) (N = 1: no covariance), the order of one step of attention; a held decode step
O(L). A run with no query past the sinks keeps the scores as they are.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import mlx.core as mx

from .attention_scorer import masked_softmax
from .base import CacheView, Needs, Scorer
from .pooling import pool_by_position
from .rescore import at_decode


def rotate_pairs(x: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """RoPE's pair rotation with given cos/sin: x [..., D], cos/sin [..., m] (broadcast) -> [..., D].

    Pair r is (x_r, x_{r+m}) (``traditional=False``, mlx-lm's default layout) or (x_{2r}, x_{2r+1})
    (``traditional=True``); it becomes (x_a cos_r - x_b sin_r, x_a sin_r + x_b cos_r). Dims past 2m pass through.
    With cos = cos(pθ), sin = sin(pθ) this is ``mx.fast.rope`` at position p; with averages, ``Rbar x``.
    """
    m = cos.shape[-1]
    if m == 0:
        return x
    rest = x[..., 2 * m :]
    if traditional:
        pairs = x[..., : 2 * m].reshape(*x.shape[:-1], m, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        rot = mx.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], 2 * m)
    else:
        a, b = x[..., :m], x[..., m : 2 * m]
        rot = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return rot if rest.shape[-1] == 0 else mx.concatenate([rot, rest], axis=-1)


def mean_rotation(offset: mx.array, n_future: int, freqs: mx.array):
    """(cbar, sbar) [Bq, 1, m]: the mean of cos/sin(t·θ) over t = offset .. offset + n_future - 1.

    ``offset`` int32 [Bq, 1, 1] (one per batch row, or one for all), ``freqs`` float32 [m]."""
    t = (offset + mx.arange(n_future, dtype=mx.int32)).astype(mx.float32)  # [Bq, 1, F]
    angles = t[..., None] * freqs  # [Bq, 1, F, m]
    return mx.cos(angles).mean(axis=2), mx.sin(angles).mean(axis=2)


def expected_attention(
    keys: mx.array,
    values: mx.array,
    positions: mx.array,
    mu: mx.array,
    sigma: Optional[mx.array],
    scale: float,
    n_sink: int,
    use_vnorm: bool = True,
    epsilon: float = 0.0,
    pool: int = 1,
) -> mx.array:
    """The module's score from future-query statistics: keys [B, H, L, D], values [B, H, L, Dv], positions
    [B, H, L], mu [B, Hq, D], sigma [B, Hq, D, D] or None (no covariance term) -> s [B, H, L] float32."""
    B, H, L, D = keys.shape
    G = mu.shape[1] // H
    k = keys.astype(mx.float32)
    z = k @ mu.reshape(B, H, G, D).swapaxes(-1, -2) * scale  # [B, H, L, G]: one pass over the keys
    if sigma is not None:  # k_j^T Sigma_g k_j for every g: k @ [Sigma_1 .. Sigma_G] [B, H, D, G·D]
        ks = k @ sigma.reshape(B, H, G, D, D).transpose(0, 1, 3, 2, 4).reshape(B, H, D, G * D)
        z = z + (ks.reshape(B, H, L, G, D) * k[:, :, :, None, :]).sum(axis=-1) * (scale * scale / 2)
    z = z.swapaxes(-1, -2)  # [B, H, G, L]
    sink = positions < n_sink  # [B, H, L]
    a = masked_softmax(z, ~sink[:, :, None]).mean(axis=2)  # [B, H, L]
    s = a + epsilon
    if use_vnorm:
        v = values.astype(mx.float32)
        s = s * mx.sqrt((v * v).sum(axis=-1))
    s = pool_by_position(mx.where(sink, mx.array(0.0, dtype=mx.float32), s), positions, pool)
    top = mx.where(sink, mx.array(-math.inf, dtype=mx.float32), s).max(axis=-1, keepdims=True)
    return mx.where(sink, mx.maximum(top, 0.0) + 1.0, s)


class ExpectedAttentionScorer(Scorer):
    """Expected attention of future queries, from the model's queries of the current run (see the module).

    Needs the attention hook (the model's queries) and the layer's RoPE (``rope_freqs``/``rope_traditional``,
    filled per layer by :meth:`KVCacheBuilder.for_model <kvpolicy_core.integration.builder.KVCacheBuilder.for_model>`
    from the model's attention module: ``Needs(rope=True)``). ``rope_freqs=None``: the model's queries are not rotated
    (a model without RoPE). The run's state (``view.run``): ``ea_n`` [Bq, 1] the queries counted, ``ea_sum``
    [B, Hq, D] their sum and, with the covariance, ``ea_sxx`` [B, Hq, D, D] the sum of u u^T (before RoPE).
    """

    #: the model's queries (attention hook); each layer's RoPE frequencies through the config (rope_freqs),
    #: filled by the builder; per-row offsets and positions broadcast (view.offset [B, 1, 1])
    needs = Needs(attention=True, rope=True, batch_rows=True)

    def __init__(
        self,
        rope_freqs: Optional[Sequence[float]] = None,
        rope_traditional: bool = False,
        n_future: int = 512,
        n_sink: int = 4,
        rescore_every: int = 0,
        use_covariance: bool = True,
        use_vnorm: bool = True,
        epsilon: float = 0.0,
        pool: int = 1,
    ) -> None:
        if n_future < 1:
            raise ValueError(f"n_future must be >= 1 (got {n_future})")
        if pool < 1 or pool % 2 == 0:
            raise ValueError(f"pool must be an odd integer >= 1 (got {pool})")
        self.pool = int(pool)
        self.freqs = mx.array([float(f) for f in rope_freqs or ()], dtype=mx.float32)
        self.traditional = bool(rope_traditional)
        self.n_future, self.n_sink, self.rescore_every = int(n_future), int(n_sink), int(rescore_every)
        self.use_covariance, self.use_vnorm, self.epsilon = bool(use_covariance), bool(use_vnorm), float(epsilon)

    @classmethod
    def from_config(cls, config) -> "ExpectedAttentionScorer":
        return cls(
            rope_freqs=getattr(config, "rope_freqs", None),
            rope_traditional=getattr(config, "rope_traditional", False),
            n_future=getattr(config, "future_positions", 512),
            n_sink=config.n_sink,
            rescore_every=getattr(config, "rescore_interval", 0),
            use_covariance=getattr(config, "uses_covariance", True),
            use_vnorm=getattr(config, "uses_vnorm", True),
            pool=getattr(config, "pool_width", 1),
        )

    def on_attention(self, view: CacheView, queries: mx.array, scale: float, mask) -> mx.array:
        offset = view.offset if isinstance(view.offset, mx.array) else mx.array(view.offset, dtype=mx.int32)
        offset = offset.astype(mx.int32).reshape(-1, 1, 1)  # [Bq, 1, 1]
        run = view.run if view.run is not None else {}
        args = (view.keys, view.values, view.positions, view.scores, queries, offset, self.freqs)
        opts = (float(scale), self.n_future, self.n_sink, self.traditional, self.use_covariance, self.use_vnorm)
        if queries.shape[2] == 1 and "ea_n" not in run:  # a decode step: one compiled graph, no covariance
            fresh = lambda: _scored_compiled(*args, None, None, None, *opts, self.epsilon, self.pool)[0]  # noqa: E731
            return at_decode(fresh, view.scores, view.positions, view.offset, self.rescore_every)
        prior = (run.get("ea_n"), run.get("ea_sum"), run.get("ea_sxx"))
        scores, n, total, sxx = scored(*args, *prior, *opts, self.epsilon, self.pool)
        run["ea_n"], run["ea_sum"] = n, total
        if sxx is not None:
            run["ea_sxx"] = sxx
        return scores


def scored(
    keys, values, positions, scores, queries, offset, freqs, prior_n, prior_sum, prior_sxx,
    scale, n_future, n_sink, traditional, use_covariance, use_vnorm, epsilon, pool=1,
):  # fmt: skip
    """One update of :class:`ExpectedAttentionScorer` (the module's equations): the new scores [B, H, L] and the
    run's sums after it (``n`` [Bq, 1], ``sum`` [B, Hq, D], ``sxx`` [B, Hq, D, D] or None).

    queries [B, Hq, S, D] at positions ``offset - S .. offset - 1`` (offset [Bq, 1, 1] int32), freqs [m]; ``prior_*``
    the run's sums before this update (None: the run starts here)."""
    S = queries.shape[2]
    qpos = offset - S + mx.arange(S, dtype=mx.int32)  # [Bq, 1, S]
    u = queries.astype(mx.float32)
    if freqs.size:  # u_i = R_{-p_i} q_i
        angles = qpos.astype(mx.float32)[..., None] * freqs  # [Bq, 1, S, m]
        u = rotate_pairs(u, mx.cos(angles), -mx.sin(angles), traditional)
    w = (qpos >= n_sink).astype(mx.float32)  # [Bq, 1, S]: queries past the sinks
    uw = u * w[..., None]
    n = w.sum(axis=-1) + (0.0 if prior_n is None else prior_n)  # [Bq, 1]
    total = uw.sum(axis=2) + (0.0 if prior_sum is None else prior_sum)  # [B, Hq, D]
    count = mx.maximum(n, 1.0)[..., None]  # [Bq, 1, 1]
    mu = total / count
    if freqs.size:
        cbar, sbar = mean_rotation(offset, n_future, freqs)
    else:
        cbar = sbar = mx.zeros((1, 1, 0), dtype=mx.float32)
    mu_f = rotate_pairs(mu, cbar, sbar, traditional)
    sxx = sigma_f = None
    if use_covariance and (S > 1 or prior_sxx is not None):  # one query alone: Sigma = 0
        sxx = uw.swapaxes(-1, -2) @ u + (0.0 if prior_sxx is None else prior_sxx)  # [B, Hq, D, D]
        sigma = sxx / count[..., None] - mu[..., :, None] * mu[..., None, :]
        c, s = cbar[:, :, None], sbar[:, :, None]  # [Bq, 1, 1, m]
        half = rotate_pairs(sigma, c, s, traditional)  # Sigma Rbar^T
        sigma_f = rotate_pairs(half.swapaxes(-1, -2), c, s, traditional).swapaxes(-1, -2)  # Rbar Sigma Rbar^T
    new = expected_attention(keys, values, positions, mu_f, sigma_f, scale, n_sink, use_vnorm, epsilon, pool)
    return mx.where((n > 0)[..., None], new, scores), n, total, sxx


#: a decode step's update as one compiled graph (constants: the scale, n_future, n_sink and flags)
_scored_compiled = mx.compile(scored)
