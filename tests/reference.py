"""Plain, slow reference implementations used only by the tests (loops everywhere, numpy)."""

from __future__ import annotations

import math

import numpy as np


def _softmax(x):
    x = x - x.max()
    e = np.exp(x)
    return e / e.sum()


def reference_h2o(K, chunks, budget, n_sink, recent, Q=None, scale=None):
    """Per (batch, head) H2O with the semantics documented in kvpolicy: returns {(b, h): {pos: score}}.

    K [B, H, T, D]; Q [B, Hq, T, D] selects the observed signal (scores from real queries).
    Each call: settle (evict the E lowest unprotected), append the chunk, score it.
    """
    B, H, T, D = K.shape
    out = {}
    for b in range(B):
        for h in range(H):
            kept = {}  # pos -> score
            t0 = 0

            def settle(offset):
                E = len(kept) - budget
                if E <= 0:
                    return
                cands = sorted((s, p) for p, s in kept.items() if not (p < n_sink or p >= offset - recent))
                for _, p in cands[:E]:
                    del kept[p]

            for S in chunks:
                settle(t0)
                for t in range(t0, t0 + S):
                    kept[t] = 0.0
                if Q is None:
                    for t in range(t0, t0 + S):
                        prior = sorted(p for p in kept if p < t)
                        if prior:
                            w = _softmax(np.array([K[b, h, p] @ K[b, h, t] for p in prior]) / math.sqrt(D))
                            for p, wi in zip(prior, w):
                                kept[p] += wi
                else:
                    Hq = Q.shape[1]
                    rep = Hq // H
                    for g in range(h * rep, (h + 1) * rep):
                        for t in range(t0, t0 + S):
                            seen = sorted(p for p in kept if p <= t)
                            w = _softmax(np.array([Q[b, g, t] @ K[b, h, p] * scale for p in seen]))
                            for p, wi in zip(seen, w):
                                kept[p] += wi
                t0 += S
            settle(t0)
            out[(b, h)] = kept
    return out


def _pool_sorted(mass_by_pos, P):
    """Max over the P nearest retained neighbours in position order: {pos: value}."""
    order = sorted(mass_by_pos)
    r = (P - 1) // 2
    return {
        p: max(mass_by_pos[order[k]] for k in range(max(0, i - r), min(len(order), i + r + 1)))
        for i, p in enumerate(order)
    }


def reference_window(K, chunks, budget, n_sink, recent, W, P, Q=None, scale=None):
    """Per (batch, head) observation-window scoring with H2O's selector: {(b, h): {pos: score}}.

    Each call: settle (evict the E lowest unprotected), append the chunk, then score. Chunks of
    S > 1 tokens with no eviction between them form a run, scored as one chunk: the run's last
    min(W, T) rows (W == 0: all) give their attention mass (real queries Q over positions <= t
    summed over the GQA group, or the new keys over positions < t), max-pooled over P retained
    neighbours, added to the scores the run began with. A single token adds its mass unpooled.
    """
    B, H, T, D = K.shape
    out = {}
    for b in range(B):
        for h in range(H):
            kept = {}
            t0 = 0
            run = None  # (first position of the run, scores when it began)

            def settle(offset):
                E = len(kept) - budget
                if E <= 0:
                    return False
                cands = sorted((s, p) for p, s in kept.items() if not (p < n_sink or p >= offset - recent))
                for _, p in cands[:E]:
                    del kept[p]
                return True

            for S in chunks:
                if settle(t0) or S == 1:
                    run = None
                if S > 1 and run is None:
                    run = (t0, dict(kept))
                start = t0 if S == 1 else run[0]
                for t in range(t0, t0 + S):
                    kept[t] = 0.0
                n_rows = t0 + S - start
                rows = range(t0 + S - (n_rows if W == 0 else min(W, n_rows)), t0 + S)
                mass = {p: 0.0 for p in kept}
                if Q is None:
                    for t in rows:
                        prior = sorted(p for p in kept if p < t)
                        if prior:
                            w = _softmax(np.array([K[b, h, p] @ K[b, h, t] for p in prior]) / math.sqrt(D))
                            for p, wi in zip(prior, w):
                                mass[p] += wi
                else:
                    rep = Q.shape[1] // H
                    for g in range(h * rep, (h + 1) * rep):
                        for t in rows:
                            seen = sorted(p for p in kept if p <= t)
                            w = _softmax(np.array([Q[b, g, t] @ K[b, h, p] * scale for p in seen]))
                            for p, wi in zip(seen, w):
                                mass[p] += wi
                if S > 1:
                    if P > 1:
                        mass = _pool_sorted(mass, P)
                    kept = {p: run[1].get(p, 0.0) + mass[p] for p in kept}
                else:
                    for p in kept:
                        kept[p] += mass[p]
                t0 += S
            settle(t0)
            out[(b, h)] = kept
    return out
