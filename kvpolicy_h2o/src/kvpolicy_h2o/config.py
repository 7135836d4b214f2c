"""H2O's configuration: the shared budget fields and the attention scorer's fields."""

from kvpolicy_core.config.attention_config import AttentionPolicyConfig


class H2OConfig(AttentionPolicyConfig):
    """``method="h2o"``: budget, n_sink, recent, signal, obs_window, pool (see :class:`AttentionPolicyConfig`)."""
