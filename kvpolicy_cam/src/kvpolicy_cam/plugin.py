"""Registers the CaM dispositions and ``method="cam"`` (H2O's scorer and selector, merged losers)."""

from kvpolicy_core import MethodSpec, hookimpl

from .config import CamConfig
from .gated_merge import GatedMergeDisposition
from .mass_merge import MassMergeDisposition
from .paper_merge import PaperMergeDisposition


@hookimpl
def register_dispositions(register):
    register("gated_merge", GatedMergeDisposition)
    register("paper_merge", PaperMergeDisposition)
    register("mass_merge", MassMergeDisposition)


def _disposition(config: CamConfig) -> str:
    return {"drop": "drop", "paper": "paper_merge", "mass": "mass_merge", "mass_blend": "mass_merge"}.get(
        config.merge, "gated_merge"
    )


@hookimpl
def register_methods(register):
    register(
        MethodSpec(
            name="cam",
            config_class=CamConfig,
            scorer=CamConfig.scorer_name.fget,
            selector="lowest_score",
            disposition=_disposition,
            description="CaM: H2O's loser merged into its most similar survivor, weighted by attention mass.",
        )
    )
