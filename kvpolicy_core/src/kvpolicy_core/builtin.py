"""The parts every method may share, registered by kvpolicy-core itself."""

from .hookspecs import hookimpl
from .parts.cumulative_attention import CumulativeAttentionScorer
from .parts.drop import DropDisposition
from .parts.lowest_score import LowestScoreSelector
from .parts.observation_window import ObservationWindowScorer
from .parts.random_score import RandomConfig, RandomScorer
from .registry import MethodSpec


@hookimpl
def register_scorers(register):
    register("cumulative_attention", CumulativeAttentionScorer)
    register("random", RandomScorer)
    register("observation_window", ObservationWindowScorer)


@hookimpl
def register_selectors(register):
    register("lowest_score", LowestScoreSelector)


@hookimpl
def register_dispositions(register):
    register("drop", DropDisposition)


@hookimpl
def register_methods(register):
    register(MethodSpec("random", RandomConfig, "random", "lowest_score", "drop",
                        description="Random eviction among unprotected tokens: the floor any policy must beat."))
