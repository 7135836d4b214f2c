"""Registers ``method="h2o"``: cumulative attention + lowest score + drop (all from core)."""

from kvpolicy_core import MethodSpec, hookimpl

from .config import H2OConfig


@hookimpl
def register_methods(register):
    register(
        MethodSpec(
            name="h2o",
            config_class=H2OConfig,
            scorer=H2OConfig.scorer_name.fget,
            selector="lowest_score",
            disposition="drop",
            description="H2O: evict the lowest cumulative attention mass outside sinks and a recent window; drop it.",
        )
    )
