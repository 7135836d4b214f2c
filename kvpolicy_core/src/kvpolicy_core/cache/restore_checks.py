"""The one check of a restored policy cache: its slots against its meta, before anything runs on them.

Every restore route (the ``state`` setter, hence ``from_state``, mlx-lm's ``load_prompt_cache`` and
:func:`~kvpolicy_core.integration.persistence.load_caches`; unpickling) ends in :func:`check_restored`, so a
file or state that is self-consistent but wrong (positions of another length, integer keys, a
position beyond the offset, repeated positions, more tokens than the budget) is refused when it is
restored, with the field named, instead of failing or running silently wrong at a later step.

Layout checked (``SlotStore``): ``keys`` [B, H, cap, D] and ``values`` [B, H, cap, Dv] of a floating
dtype, ``positions`` [B, H, cap] int32, ``scores`` [B, H, n] float32, ``log_weights`` [B, H, n] float32
when tracked; ``0 <= n <= cap``; each row's positions ``[:n]`` distinct and in ``[0, offset)``; the held keys and
values ``[:n]`` finite.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import KVPolicyError
from .slots import LOG_WEIGHT_BOUND

_INT32_MAX = 2**31 - 1


def _dtype(x: mx.array) -> str:
    return str(x.dtype).removeprefix("mlx.core.")


def check_restored(slots, offset: int, budget: int, *, settled: bool, where: str) -> None:
    """Raise :class:`KVPolicyError` naming the field unless ``slots`` is a valid store for ``offset`` tokens seen.

    ``settled``: the state comes from ``state`` (mlx-lm's protocol), which is settled to the budget, so it holds
    at most ``budget`` tokens; a file of :func:`~kvpolicy_core.integration.persistence.save_caches` may hold a pending
    eviction (more). One host sync for the value checks (restoring is not on the decode path).
    """
    k, v, p, s, n, lw = slots.keys, slots.values, slots.positions, slots.scores, slots.n, slots.log_weights
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise KVPolicyError(f"{where}: the number of tokens held must be an int >= 0 (got {n!r})")
    if k is None:
        given = [name for name, x in (("values", v), ("positions", p), ("scores", s)) if x is not None]
        if given or n:
            raise KVPolicyError(f"{where}: keys are missing but {', '.join(given) or 'tokens'} are given")
        return
    quantized = isinstance(k, tuple) or isinstance(v, tuple)
    if quantized:
        k, v = _quantized_rows(k, v, where)
        k_leaves, v_leaves = k, v
        k, v = k[0], v[0]  # the rows' shapes [B, H, cap, *] for the checks below
    for name, x in (("keys", k), ("values", v), ("positions", p), ("scores", s)) + (
        (("log_weights", lw),) if lw is not None else ()
    ):
        if not isinstance(x, mx.array):
            raise KVPolicyError(f"{where}: {name} must be an mlx array (got {type(x).__name__})")
    if k.ndim != 4 or v.ndim != 4:
        raise KVPolicyError(
            f"{where}: keys and values must be [B, H, L, D] (got keys {tuple(k.shape)}, values {tuple(v.shape)})"
        )
    B, H, cap = k.shape[:3]
    if tuple(v.shape[:3]) != (B, H, cap):
        raise KVPolicyError(
            f"{where}: values {tuple(v.shape)} do not match keys {tuple(k.shape)} in batch, heads or length"
        )
    for name, x in () if quantized else (("keys", k), ("values", v)):
        if not mx.issubdtype(x.dtype, mx.floating):
            raise KVPolicyError(f"{where}: {name} must have a floating dtype (got {_dtype(x)})")
    if tuple(p.shape) != (B, H, cap) or p.dtype != mx.int32:
        raise KVPolicyError(
            f"{where}: positions must be int32 [B, H, L] = {[B, H, cap]} like the keys "
            f"(got {_dtype(p)} {list(p.shape)})"
        )
    if n > cap:
        raise KVPolicyError(f"{where}: {n} tokens held, but the buffers have {cap} slots")
    for name, x in (("scores", s),) + ((("log_weights", lw),) if lw is not None else ()):
        if tuple(x.shape) != (B, H, n) or x.dtype != mx.float32:
            raise KVPolicyError(
                f"{where}: {name} must be float32 [B, H, n] = {[B, H, n]} (got {_dtype(x)} {list(x.shape)})"
            )
    if offset < n:
        raise KVPolicyError(
            f"{where}: offset {offset} is below the {n} tokens held; offset counts every token "
            "seen, so it is at least the tokens held"
        )
    if settled and n > budget:
        raise KVPolicyError(
            f"{where}: holds {n} tokens, more than this cache's budget {budget} (a state is "
            "settled to the budget of the cache that made it)"
        )
    if n == 0:
        return
    pos = p[..., :n]
    ordered = mx.sort(pos, axis=-1)
    flags = [
        mx.any(pos < 0),
        mx.any(pos > min(offset - 1, _INT32_MAX)),
        mx.any(ordered[..., 1:] == ordered[..., :-1]) if n > 1 else mx.array(False),
    ]
    if quantized:  # the rows' scales and biases (the integers are finite by type)
        flags += [
            mx.any(mx.stack([mx.any(~mx.isfinite(x[..., :n, :])) for x in rows[1:]])) for rows in (k_leaves, v_leaves)
        ]
    else:
        flags += [mx.any(~mx.isfinite(k[..., :n, :])), mx.any(~mx.isfinite(v[..., :n, :]))]
    if lw is not None:
        flags.append(mx.any(~(mx.abs(lw) <= LOG_WEIGHT_BOUND)))
    below, beyond, repeated, bad_keys, bad_values, *bad_lw = mx.stack(flags).tolist()
    if below or beyond:
        raise KVPolicyError(
            f"{where}: positions must be in [0, offset) = [0, {offset}) (a position is "
            f"{'negative' if below else 'at or beyond the offset'})"
        )
    if repeated:
        raise KVPolicyError(f"{where}: positions repeat within a row; each held token has its own position")
    if bad_keys or bad_values:
        raise KVPolicyError(
            f"{where}: {'keys' if bad_keys else 'values'} hold NaN or Inf; a cache's keys and values are finite "
            "(a damaged file: every later token's attention would be NaN)"
        )
    if bad_lw and bad_lw[0]:
        raise KVPolicyError(f"{where}: log_weights must be finite with |log-weight| <= {LOG_WEIGHT_BOUND}")


def _quantized_rows(k, v, where: str):
    """Quantized keys and values (``mx.quantize`` triples of arrays [B, H, cap, *]: uint32 words, floating scales
    and biases of one shape), or a :class:`KVPolicyError` naming what is wrong."""
    for name, rows in ("keys", k), ("values", v):
        if not (isinstance(rows, tuple) and len(rows) == 3 and all(isinstance(x, mx.array) for x in rows)):
            raise KVPolicyError(
                f"{where}: quantized {name} must be three mlx arrays (words, scales, biases) "
                f"(got {type(rows).__name__})"
            )
        w, scales, biases = rows
        if w.dtype != mx.uint32 or w.ndim != 4:
            raise KVPolicyError(f"{where}: quantized {name}' words must be uint32 [B, H, L, *] (got {_dtype(w)})")
        for part, x in ("scales", scales), ("biases", biases):
            if x.ndim != 4 or tuple(x.shape) != tuple(scales.shape) or not mx.issubdtype(x.dtype, mx.floating):
                raise KVPolicyError(
                    f"{where}: quantized {name}' {part} must be floating [B, H, L, groups] like the scales "
                    f"(got {_dtype(x)} {list(x.shape)})"
                )
            if tuple(x.shape[:3]) != tuple(w.shape[:3]):
                raise KVPolicyError(f"{where}: quantized {name}' {part} {list(x.shape)} do not match the words")
    return k, v
