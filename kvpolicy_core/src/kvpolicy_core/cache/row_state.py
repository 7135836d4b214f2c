"""One policy-cache row's state as a value: what its tokens changed, held by reference (MLX arrays are values).

:meth:`PolicyCache.row_state <kvpolicy_core.cache.policy_cache.PolicyCache.row_state>` gives it and
:meth:`~kvpolicy_core.cache.policy_cache.PolicyCache.set_row_state` takes it back: a step's all-or-nothing
rollback, the stacked decode of batched rows (:mod:`.batch_rows`) and persistence (:mod:`.state`) read and write a
row through it, never through the cache's own attributes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import mlx.core as mx

from .slots import Snapshot


@dataclasses.dataclass(frozen=True, eq=False)
class RowState:
    """The state of one cache row (its batch, for a single cache), as :meth:`PolicyCache.row_state` gives it.

    Change a field with :func:`dataclasses.replace`; ``eq=False``: MLX arrays have no truth value to compare by.
    """

    slots: Snapshot  #: the slot store's buffers and valid count (:meth:`.slots.SlotStore.snapshot`)
    offset: int  #: tokens seen: the absolute position of the next token
    counters: Mapping[str, mx.array]  #: the parts' counters (int32 scalars), summed per layer
    attended: bool  #: the last update's attention ran through the hook (or none was needed yet)
    run: Mapping[str, Any]  #: the scorer's state of the current run of prompt chunks (``CacheView.run``)
    run_open: bool  #: the last update was a prompt chunk and nothing was evicted since
    lw_used: bool  #: some attention log-weight may be nonzero (the attention adds them from then on)
    last_S: int  #: tokens of the last update (the window mask of its attention)
    updates: int  #: updates so far (bounds the counters' lazy graph)
    track_key_norms: bool  #: the store keeps each slot's key norm (a part read them, or its trait asks)
