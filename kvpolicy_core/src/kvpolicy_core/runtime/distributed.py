"""Running kvpolicy under ``mlx.launch``: the world, sharded loading, rank-0 output, per-rank files.

kvpolicy adds no transport of its own: ``mlx.launch`` starts one process per rank,
``mx.distributed.init()`` connects them (ring, MPI, JACCL, NCCL) and mlx-lm's
``sharded_load`` splits the model by heads (tensor parallel) or by layers (pipeline).
The caches then follow the model (:mod:`kvpolicy_core.runtime.sharding`). Every rank runs the
same generation loop and gets the same logits, so every rank feeds the same tokens.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import socket
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx

from ..errors import KVPolicyError, ModelError

PARALLEL_MODES = ("auto", "tensor", "pipeline")


def world() -> Tuple[int, int]:
    """(rank, size) of this process in ``mx.distributed``'s world group; (0, 1) alone."""
    group = mx.distributed.init()
    return group.rank(), group.size()


@contextlib.contextmanager
def rank_zero_output():
    """Silence stdout and stderr on ranks other than 0 for the duration (exceptions still propagate)."""
    rank, size = world()
    if rank == 0:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


# ----------------------------------------------------------------------------- sharded loading
def _lazy_model(path: Path):
    from mlx_lm.utils import load_model

    return load_model(path, lazy=True, strict=False)


def supported_modes(model) -> Tuple[str, ...]:
    """The parallelisms mlx-lm offers for ``model``: a subset of ("tensor", "pipeline")."""
    modes = []
    if hasattr(model, "shard"):
        modes.append("tensor")
    if hasattr(getattr(model, "model", None), "pipeline"):
        modes.append("pipeline")
    return tuple(modes)


def choose_mode(path, parallel: str, size: int) -> str:
    """The parallelism to load ``path`` with over ``size`` ranks; clear errors when it cannot work.

    ``auto`` prefers tensor parallelism (every rank holds every layer, each a slice of the heads),
    as mlx-lm's ``sharded_load`` does, and falls back to pipeline.
    """
    if parallel not in PARALLEL_MODES:
        raise KVPolicyError(f"parallel: must be one of {', '.join(PARALLEL_MODES)} (got {parallel!r})")
    path = Path(path)
    model, config = _lazy_model(path)
    model_type = config.get("model_type", type(model).__name__)
    modes = supported_modes(model)
    if not modes:
        raise ModelError(
            f"{path}: mlx-lm's {model_type!r} model supports neither tensor nor pipeline parallelism, "
            f"so it cannot run on {size} ranks; run it in one process, or use a model whose mlx-lm module "
            "has Model.shard (llama, qwen2, qwen3, ...) or pipeline support (qwen2, deepseek, ...)"
        )
    mode = modes[0] if parallel == "auto" else parallel
    if mode not in modes:
        raise ModelError(
            f"{path}: mlx-lm's {model_type!r} model does not support {mode} parallelism "
            f"(it supports: {', '.join(modes)})"
        )
    if mode == "tensor":
        for field in ("num_key_value_heads", "num_attention_heads"):
            heads = config.get(field)
            if isinstance(heads, int) and heads % size:
                raise ModelError(
                    f"{path}: tensor parallelism over {size} ranks needs {field} ({heads}) divisible by {size}"
                )
    else:
        layers = len(model.model.layers)
        if layers < size:
            raise ModelError(
                f"{path}: pipeline parallelism over {size} ranks needs at least {size} layers (has {layers})"
            )
        if not (path / "model.safetensors.index.json").is_file():
            raise ModelError(
                f"{path}: pipeline loading needs model.safetensors.index.json (mlx_lm.convert and "
                "mlx_lm.utils.save_model write it)"
            )
    return mode


def load_sharded(path, parallel: str = "auto"):
    """Load ``path`` split over the world with mlx-lm's ``sharded_load``; returns (model, tokenizer, mode).

    Every rank must call this (it ends with a collective). Errors are raised on every rank
    before any collective, so no rank is left waiting.
    """
    from mlx_lm.utils import sharded_load

    group = mx.distributed.init()
    mode = choose_mode(path, parallel, group.size())
    model, tokenizer = sharded_load(
        str(path),
        pipeline_group=group if mode == "pipeline" else None,
        tensor_group=group if mode == "tensor" else None,
    )
    return model, tokenizer, mode


def describe(model, mode: str, size: int) -> str:
    """One line saying how the model is split, e.g. for the CLI."""
    from .sharding import shard_layout

    layout = shard_layout(model)
    n_layers = len(model.layers)
    if mode == "tensor":
        return (
            f"tensor parallel over {size} ranks: every rank runs all {n_layers} layers with "
            f"1/{size} of the attention heads (and of the KV cache)"
        )
    return (
        f"pipeline parallel over {size} ranks: rank {layout.pipeline[0]} runs layers "
        f"{layout.layer_offset}..{layout.layer_offset + n_layers - 1}"
    )


# ----------------------------------------------------------------------------- per-rank cache files
_RANK_TAG = re.compile(r"\.rank(\d+)-of-(\d+)$")


def rank_path(path, shard: Tuple[int, int]) -> Path:
    """``run.safetensors`` -> ``run.rank1-of-2.safetensors`` for rank 1 of 2; unchanged for (0, 1)."""
    path = Path(path)
    rank, size = shard
    if size == 1 or _RANK_TAG.search(path.stem):
        return path
    return path.with_name(f"{path.stem}.rank{rank}-of-{size}{path.suffix}")


def resolve_shard(shard: Optional[Tuple[int, int]]) -> Tuple[int, int]:
    """``shard`` checked, or this process's (rank, size) when None."""
    if shard is None:
        return world()
    rank, size = shard
    if not (isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size):
        raise KVPolicyError(f"shard: must be (rank, size) with 0 <= rank < size (got {shard!r})")
    return rank, size


def _siblings(path: Path) -> str:
    """The cache files next to ``path`` that share its name (any rank tag), for error messages."""
    stem = _RANK_TAG.sub("", path.stem)
    found = sorted(
        p.name
        for p in path.parent.glob(f"{glob.escape(stem)}*{glob.escape(path.suffix)}")
        if _RANK_TAG.sub("", p.stem) == stem
    )
    return ", ".join(found)


def missing_rank_file(base: Path, path: Path, shard: Tuple[int, int]) -> str:
    """The error message when ``path`` (the file of ``shard`` for ``base``) does not exist."""
    others = _siblings(base)
    if not others:
        return f"{path}: no such cache file"
    rank, size = shard
    who = "a single process" if size == 1 else f"rank {rank} of {size}"
    return (
        f"{path}: no such cache file for {who} (files of this name: {others}); a run over N ranks "
        "writes one file per rank and loads them back only on the same ranks of a run over N ranks"
    )


def check_shard(path: Path, saved, shard: Tuple[int, int], error) -> None:
    """Raise ``error`` unless the file's recorded (rank, size) ``saved`` is this process's ``shard``."""
    saved = tuple(saved or (0, 1))
    if saved == tuple(shard):
        return
    s_rank, s_size = saved
    rank, size = shard
    by = "one process" if s_size == 1 else f"rank {s_rank} of {s_size}"
    this = "a single process" if size == 1 else f"rank {rank} of {size}"
    raise error(
        f"{path}: these caches were saved by {by}, but this is {this}: a rank's caches hold only its "
        "own heads or layers; load each rank's file on the same rank of a run with the same world size "
        f"(or pass shard=({s_rank}, {s_size}) to inspect this file)"
    )


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (mlx.launch's ring backend listens on one port per
    rank from ``-p``): for launching local ranks in tests and benchmarks."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports on 127.0.0.1")
