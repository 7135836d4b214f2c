"""H2O's configuration: the shared budget fields, nothing else."""

from kvpolicy_core.config import PolicyConfig


class H2OConfig(PolicyConfig):
    """``method="h2o"``: budget, n_sink, recent, signal (see :class:`PolicyConfig`)."""
