"""Registers the parts and the two methods through kvpolicy's hooks."""

from kvpolicy_core import MethodSpec, hookimpl

from .config import StreamingConfig, TovaConfig
from .current_attention import CurrentAttentionScorer
from .neighbour_merge import NeighbourMergeDisposition
from .oldest import ConstantScorer, OldestSelector


@hookimpl
def register_scorers(register):
    register("constant", ConstantScorer)
    register("current_attention", CurrentAttentionScorer)


@hookimpl
def register_selectors(register):
    register("oldest", OldestSelector)


@hookimpl
def register_dispositions(register):
    register("neighbour_average", NeighbourMergeDisposition)


@hookimpl
def register_methods(register):
    register(
        MethodSpec(
            "streamingllm",
            StreamingConfig,
            "constant",
            "oldest",
            "drop",
            description="StreamingLLM: attention sinks + the most recent tokens.",
            ignores=("recent", "signal"),
        )
    )
    register(
        MethodSpec(
            "streamingmerge",
            StreamingConfig,
            "constant",
            "oldest",
            "neighbour_average",
            description="StreamingLLM whose evicted tokens are averaged into the next kept token.",
            ignores=("recent", "signal"),
        )
    )
    register(
        MethodSpec(
            "tova",
            TovaConfig,
            "current_attention",
            "lowest_score",
            "drop",
            description="TOVA: evict the token the current query attends to least.",
        )
    )
