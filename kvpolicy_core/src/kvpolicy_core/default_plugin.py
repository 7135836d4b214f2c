"""The parts every method may share, and the ``random`` method: kvpolicy-core's own plugin, registered first by the
plugin host (:mod:`kvpolicy_core.plugin.discovery` imports it by name, as ``llm`` loads its default plugins)."""

from typing import Optional

from pydantic import Field

from .config.policy_config import PolicyConfig
from .parts.allocation import PyramidAllocation, ReachAllocation, UniformAllocation
from .parts.cumulative_attention import CumulativeAttentionScorer
from .parts.drop import DropDisposition
from .parts.expected_attention import ExpectedAttentionScorer
from .parts.hybrid_allocation import HybridAllocation
from .parts.keydiff import KeyDiffScorer
from .parts.lowest_score import LowestScoreSelector
from .parts.observation_window import ObservationWindowScorer
from .parts.random_score import RandomScorer
from .plugin.hookspecs import hookimpl
from .plugin.registry import MethodSpec


class RandomConfig(PolicyConfig):
    """``method="random"``: evict uniformly at random among unprotected tokens (a floor to beat)."""

    recent: Optional[int] = Field(0, ge=0, description="Most recent tokens protected (default 0).")
    salt: int = Field(0, description="Changes the random draw; same salt, same evictions.")


@hookimpl
def register_scorers(register):
    register("cumulative_attention", CumulativeAttentionScorer)
    register("random", RandomScorer)
    register("observation_window", ObservationWindowScorer)
    register("keydiff", KeyDiffScorer)
    register("expected_attention", ExpectedAttentionScorer)


@hookimpl
def register_selectors(register):
    register("lowest_score", LowestScoreSelector)


@hookimpl
def register_dispositions(register):
    register("drop", DropDisposition)


@hookimpl
def register_allocations(register):
    register("reach", ReachAllocation)
    register("uniform", UniformAllocation)
    register("pyramid", PyramidAllocation)
    register("hybrid", HybridAllocation)


@hookimpl
def register_methods(register):
    description = "Random eviction among unprotected tokens: the floor any policy must beat."
    register(MethodSpec("random", RandomConfig, "random", "lowest_score", "drop", description, ignores=("signal",)))
