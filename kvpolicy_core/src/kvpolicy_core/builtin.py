"""The parts every method may share, registered by kvpolicy-core itself."""

from .hookspecs import hookimpl
from .parts.cumulative_attention import CumulativeAttentionScorer
from .parts.drop import DropDisposition
from .parts.lowest_score import LowestScoreSelector


@hookimpl
def register_scorers(register):
    register("cumulative_attention", CumulativeAttentionScorer)


@hookimpl
def register_selectors(register):
    register("lowest_score", LowestScoreSelector)


@hookimpl
def register_dispositions(register):
    register("drop", DropDisposition)
