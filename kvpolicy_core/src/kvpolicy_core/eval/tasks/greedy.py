"""Greedy decoding through given caches with mlx-lm's ``generate_step``, shared by the retrieval tasks."""

from __future__ import annotations

from typing import Any, Callable, Collection, List, Optional, Sequence

import mlx.core as mx


def greedy_tokens(
    model,
    tokenizer,
    ids: Sequence[int],
    caches: List[Any],
    max_tokens: int,
    prefill_step: int,
    stop_ids: Collection[int],
    done: Optional[Callable[[str], bool]] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> List[int]:
    """The greedy continuation of ``ids`` (prefilled in chunks of ``prefill_step`` tokens) through ``caches``.

    Stops before a token of ``stop_ids``, after ``max_tokens`` tokens, or once ``done(text so far)`` is true
    (that token kept). ``progress``: mlx-lm's prompt progress callback ``(done, total)``.
    """
    from mlx_lm.generate import generate_step

    out: List[int] = []
    for tok, _ in generate_step(
        mx.array(list(ids), dtype=mx.uint32),
        model,
        max_tokens=max_tokens,
        prompt_cache=caches,
        prefill_step_size=prefill_step,
        **({} if progress is None else {"prompt_progress_callback": progress}),
    ):
        if tok in stop_ids:
            break
        out.append(tok)
        if done is not None and done(tokenizer.decode(out)):
            break
    return out
