"""The cross-policy equivalence kit: two method specs that must evict and attend identically, checked bit for bit.

A method that generalises another states it as a test (``cam:merge=drop`` is ``h2o``; ``chunkkv:chunk_size=1``
is ``h2o``; a flat pyramid is uniform)::

    from kvpolicy_core.testing.equivalence import assert_equivalent

    def test_cam_with_drop_is_h2o():
        assert_equivalent("cam:budget=16,merge=drop", "h2o:budget=16")

:func:`assert_equivalent` runs both methods on the same tiny random-weight mlx-lm model (or ``model``) over the
same tokens: a prompt in chunks, then decode steps, first as one sequence, then as ``rows`` sequences of
different prompt lengths batched the way mlx-lm's server batches them (``BatchPolicyCache``, whose steady
decode steps run stacked). After every update it compares, layer by layer, the kept positions, keys, values and
scores, and the model's logits, with ``mx.array_equal``. The first difference raises ``AssertionError`` naming
the phase, the step, the layer and the field.

A pass must mean something: a phase in which no policy cache evicted anything (a budget above the sequence, a
model whose layers all keep mlx-lm's own cache) fails, naming the phase and the budgets, as does a layer that is a
policy cache under one method and mlx-lm's own under the other. Layers that keep mlx-lm's own cache under both
(``layers="unbounded"`` on a sliding-window model) are batched by mlx-lm's ``merge`` and compared through the
logits. What the kit cannot see is a disposition that has not started yet: a method with a warm-up (``cam``'s
``merge_after``, merges only once ``offset >= merge_after * budget``) must be given ``prompt_chunks`` and
``decode_steps`` that run past it, or both methods merely evict alike. Invalid arguments raise ``ValueError``
naming the argument.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from ..cache.batch import BatchPolicyCache
from ..cache.policy_cache import PolicyCache
from ..integration.builder import KVCacheBuilder
from .tiny_models import VOCAB, tiny_llama

__all__ = ["assert_equivalent", "kept"]

_FIELDS = ("positions", "keys", "values", "scores")


def kept(cache) -> dict:
    """A policy cache's retained tokens in temporal order: positions, keys, values, scores (settled first)."""
    k, v, pos, scores = cache.retained()
    return dict(positions=pos, keys=k, values=v, scores=scores)


def _kind(cache) -> str:
    return "a policy cache" if isinstance(cache, PolicyCache) else f"mlx-lm's {type(cache).__name__}"


def _same_caches(a: Sequence[Any], b: Sequence[Any], where: str) -> None:
    for layer, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, PolicyCache) != isinstance(y, PolicyCache):
            raise AssertionError(f"{where}, layer {layer}: the first method keeps {_kind(x)}, the second {_kind(y)}")
        if not isinstance(x, PolicyCache):
            continue
        assert x.budget == y.budget, f"{where}, layer {layer}: budgets {x.budget} and {y.budget} differ"
        assert x.offset == y.offset, f"{where}, layer {layer}: offsets {x.offset} and {y.offset} differ"
        if x.keys is None or y.keys is None:
            assert x.keys is None and y.keys is None, f"{where}, layer {layer}: one cache is empty"
            continue
        kx, ky = kept(x), kept(y)
        for field in _FIELDS:
            assert mx.array_equal(kx[field], ky[field]), f"{where}, layer {layer}: kept {field} differ"


def _same(x: mx.array, y: mx.array, what: str) -> None:
    assert x.shape == y.shape and mx.array_equal(x, y), f"{what} differ"


def _evicted(caches: Sequence[Any], phase: str) -> None:
    """Fail unless some policy cache of ``caches`` holds fewer tokens than it has seen (something was evicted)."""
    policy = [c for c in caches if isinstance(c, PolicyCache)]
    if not any(c.n < c.offset for c in policy):
        why = (
            "no layer keeps a policy cache"
            if not policy
            else f"budgets {sorted({c.budget for c in policy})}, {max(c.offset for c in policy)} tokens seen"
        )
        raise AssertionError(
            f"{phase}: nothing was evicted ({why}), so the methods were never compared evicting: give a budget "
            "below the prompt (or longer prompt_chunks / more decode_steps)"
        )


def _check_arguments(prompt_chunks, decode_steps, rows, seed) -> list:
    def whole(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    chunks = list(prompt_chunks) if isinstance(prompt_chunks, (list, tuple)) else None
    if not chunks or not all(whole(S) and S >= 1 for S in chunks):
        raise ValueError(f"prompt_chunks must be a non-empty list or tuple of ints >= 1 (got {prompt_chunks!r})")
    if not whole(decode_steps) or decode_steps < 1:
        raise ValueError(f"decode_steps must be an int >= 1 (got {decode_steps!r})")
    if not whole(rows) or not 1 <= rows <= sum(chunks):
        raise ValueError(
            f"rows must be an int in [1, sum(prompt_chunks) = {sum(chunks)}] (row r's prompt is "
            f"sum(prompt_chunks) - r tokens; got {rows!r})"
        )
    if not whole(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0 (got {seed!r})")
    return chunks


def assert_equivalent(
    a: Any,
    b: Any,
    model=None,
    prompt_chunks: Sequence[int] = (7, 13, 5),
    decode_steps: int = 10,
    rows: int = 2,
    seed: int = 0,
) -> None:
    """Assert that methods ``a`` and ``b`` (config strings, dicts or configs) are the same policy bit for bit.

    Phases: one sequence fed ``prompt_chunks`` then ``decode_steps`` single tokens (``budget`` should be below the
    prompt so that both prompt chunks and decode steps evict); then ``rows`` sequences whose prompts are the
    first ``sum(prompt_chunks) - r`` tokens of row r's tokens, prefilled one by one, merged into one batch per layer
    (mlx-lm's ``BatchPolicyCache``) and decoded together. Compared after every update: logits, and per layer the
    kept positions, keys, values and scores (:func:`kept`).
    """
    prompt_chunks = _check_arguments(prompt_chunks, decode_steps, rows, seed)
    model = tiny_llama(seed=1) if model is None else model
    T = sum(prompt_chunks) + decode_steps
    tokens = mx.random.randint(0, VOCAB, (rows, T), key=mx.random.key(seed))
    built = [KVCacheBuilder.for_model(model, m) for m in (a, b)]
    # one sequence: prompt chunks, then decode steps
    t = 0
    for step, S in enumerate(list(prompt_chunks) + [1] * decode_steps):
        where = f"one sequence, update {step} ({S} tokens)"
        logits = [model(tokens[:1, t : t + S], cache=c) for c in built]
        mx.eval(logits)
        _same(logits[0], logits[1], f"{where}: logits")
        _same_caches(built[0], built[1], where)
        t += S
    for c in built:
        _evicted(c, "one sequence")
    # batched rows of different lengths, decoded together
    batches = []
    for m in (a, b):
        per_row = []
        for r in range(rows):
            caches = KVCacheBuilder.for_model(model, m)
            n = sum(prompt_chunks) - r
            model(tokens[r : r + 1, :n], cache=caches)
            per_row.append(caches)
        layers = len(per_row[0])
        batches.append(
            [  # a layer that keeps mlx-lm's own cache (layers="unbounded") is batched by mlx-lm
                (BatchPolicyCache if isinstance(per_row[0][i], PolicyCache) else type(per_row[0][i])).merge(
                    [per_row[r][i] for r in range(rows)]
                )
                for i in range(layers)
            ]
        )
    steps = [tokens[r, sum(prompt_chunks) - r] for r in range(rows)]
    step_tokens = mx.array(steps).reshape(rows, 1)
    for step in range(decode_steps):
        where = f"{rows} batched rows, decode step {step}"
        logits = [model(step_tokens, cache=c) for c in batches]
        mx.eval(logits)
        _same(logits[0], logits[1], f"{where}: logits")
        for r in range(rows):
            rows_of = [[c.extract(r) if isinstance(c, BatchPolicyCache) else c for c in batch] for batch in batches]
            _same_caches(rows_of[0], rows_of[1], f"{where}, row {r}")
        step_tokens = mx.argmax(logits[0][:, -1:, :], axis=-1).astype(mx.int32)
    for batch in batches:
        _evicted([c.extract(r) for c in batch if isinstance(c, BatchPolicyCache) for r in range(rows)], "batched rows")
