"""How an mlx-lm model is split across distributed ranks, read from the model itself.

mlx-lm's ``sharded_load`` splits a model two ways (``mlx_lm/utils.py``):

- **pipeline** (``model.model.pipeline(group)``, :class:`mlx_lm.models.pipeline.PipelineMixin`):
  rank ``r`` runs the contiguous layers ``start_idx .. end_idx - 1`` and ``model.layers``
  lists only those, so local cache ``i`` belongs to global layer ``start_idx + i``;
- **tensor** (``model.shard(group)``): every layer's ``k_proj``/``v_proj`` become
  ``AllToShardedLinear`` splitting the output rows evenly, so rank ``r`` of ``N`` holds KV
  heads ``r * H .. r * H + H - 1`` of ``N * H`` (``H`` the local head count), with the query
  heads that attend to them.

:func:`shard_layout` recovers both so that :class:`~kvpolicy_core.integration.builder.KVCacheBuilder`
gives every cache its global layer index and head slice: random draws keyed by them make each
head's evictions independent of the split. No collective is called here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from ..errors import ModelError

#: module names (last path component) of the key projection in mlx-lm's attention modules
KEY_PROJECTIONS = ("k_proj", "wk", "key")


class ShardLayout(NamedTuple):
    """Where this process's part of a model sits in the whole model."""

    layer_offset: int = 0  #: global index of local layer 0 (pipeline rank's first layer)
    pipeline: Tuple[int, int] = (0, 1)  #: (rank, size) of the pipeline group
    tensor: Tuple[int, int] = (0, 1)  #: (rank, size) of the tensor group splitting KV heads

    @property
    def mode(self) -> str:
        """``"none"``, ``"tensor"``, ``"pipeline"`` or ``"tensor+pipeline"``."""
        parts = [name for name, (_, size) in (("tensor", self.tensor), ("pipeline", self.pipeline)) if size > 1]
        return "+".join(parts) or "none"


def check_head_shard(head_shard) -> Tuple[int, int]:
    """``head_shard`` as a (rank, size) tuple of ints with ``0 <= rank < size``; ValueError otherwise."""
    try:
        rank, size = head_shard
    except (TypeError, ValueError):
        rank = size = None
    if not (isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size):
        raise ValueError(f"head_shard: must be (rank, size) with 0 <= rank < size (got {head_shard!r})")
    return rank, size


def _sharded_classes():
    from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear

    return AllToShardedLinear, QuantizedAllToShardedLinear


def _tensor_group(layer, index: int) -> Optional[Tuple[int, int]]:
    """(rank, size) if ``layer``'s key projection is split by heads; None if the layer is unsharded."""
    sharded = _sharded_classes()
    group, key_split = None, False
    for name, module in layer.named_modules():
        if isinstance(module, sharded) and module.group.size() > 1:
            group = module.group
            key_split = key_split or name.rsplit(".", 1)[-1] in KEY_PROJECTIONS
    if group is None:
        return None
    if not key_split:
        raise ModelError(
            f"layer {index} is tensor-parallel but its keys are not split by heads (no sharded "
            f"{'/'.join(KEY_PROJECTIONS)}; e.g. multi-head latent attention keeps one shared KV cache): "
            "kvpolicy supports tensor parallelism where each rank holds its own KV heads "
            "(llama, qwen2, qwen3, mistral, ...); use pipeline parallelism for this model"
        )
    return group.rank(), group.size()


def shard_layout(model) -> ShardLayout:
    """The :class:`ShardLayout` of ``model`` (``ShardLayout()`` for a model on one process)."""
    inner = getattr(model, "model", None)
    p_size = int(getattr(inner, "pipeline_size", 1) or 1)
    pipeline = (int(inner.pipeline_rank), p_size) if p_size > 1 else (0, 1)
    offset = int(inner.start_idx) if p_size > 1 else 0
    tensor = (0, 1)
    for i, layer in enumerate(model.layers):
        found = _tensor_group(layer, offset + i)
        if found is not None:
            tensor = found
            break
    return ShardLayout(offset, pipeline, tensor)
