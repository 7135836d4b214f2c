"""What a policy cache reports about itself: sizes, compression and the parts' counters.

Counters belong to the parts: a part declares them with ``stats()`` and reports them in
``MergeUpdate.stats``; the cache only sums them per layer. :meth:`CacheDiagnostics.stats` returns every
counter (one host sync); ``cache.merges`` and ``cache.gate_draws`` name the specification's two. The method's
config is ``cache.config`` (``cache.config.merge_gate``): no config field is ever an attribute of the cache
itself, so a plugin's field named like an mlx-lm cache attribute (``bits``) cannot change how mlx-lm treats it.
"""

from __future__ import annotations

from typing import Dict

#: The counters a saved cache's meta JSON may list by position instead of by name (its list form), in that order.
LEGACY_COUNTERS = ("gate_draws", "merges")


class CacheDiagnostics:
    """Mixin of :class:`~kvpolicy_core.cache.policy_cache.PolicyCache`: read-only diagnostics."""

    @property
    def tokens_seen(self) -> int:
        return self.offset

    @property
    def tokens_kept(self) -> int:
        """Tokens this layer holds (same for every head), once a decode step's pending eviction is applied; a prompt
        held for its cut (``when="prompt_end"``, before its first decode step or :meth:`settle`) counts whole."""
        return self.n if (self.holds_prompt and self._run_open) else self.n - self._n_evict(1)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers this cache holds (keys, values, positions, scores)."""
        return self._slots.nbytes

    @property
    def kept_bytes(self) -> int:
        return self.tokens_kept * self._slots.bytes_per_token()

    @property
    def full_seq_bytes(self) -> int:
        """Bytes a full cache would hold for the tokens seen, in the same dtype."""
        return self.offset * self._slots.bytes_per_token()

    @property
    def compression_ratio(self) -> float:
        """full_seq_bytes / kept_bytes; > 1 means savings, 1.0 for an empty cache."""
        return self.full_seq_bytes / self.kept_bytes if self.kept_bytes else 1.0

    def stats(self) -> Dict[str, int]:
        """Every counter the parts reported on this layer, as ints (one host sync: not for the decode path)."""
        return {name: int(value.item()) for name, value in sorted(self._counters.items())}

    @property
    def config(self):
        """The method's config (a :class:`~kvpolicy_core.config.policy_config.PolicyConfig` subclass), e.g.
        ``cache.config.budget``, ``cache.config.merge_gate``."""
        return self.policy.config.policy

    @property
    def merges(self) -> int:
        """Losers merged into a survivor on this layer (0 for a method that never merges; host sync)."""
        return self._counter("merges")

    @property
    def gate_draws(self) -> int:
        """Merge-gate draws made on this layer (0 without a gate; host sync)."""
        return self._counter("gate_draws")

    @property
    def merge_mode(self) -> str:
        """The merge rule of the method (CaM's ``merge``), ``"drop"`` for methods that never merge."""
        return getattr(self.config, "merge_mode", "drop")

    @property
    def merge_gate(self) -> bool:
        """Whether the method's merges are gated (CaM's Eq. 14 gate); False for methods without one."""
        return bool(getattr(self.config, "merge_gate", False))

    @property
    def n_sink(self) -> int:
        """Initial positions never evicted (0 for a method without sinks)."""
        return int(getattr(self.config, "n_sink", 0))

    def _counter(self, name: str) -> int:
        value = self._counters.get(name)
        return 0 if value is None else int(value.item())

    def __getattr__(self, name: str):
        """Only a clearer AttributeError: counters are in :meth:`stats`, config fields in :attr:`config`."""
        hint = ""
        if not name.startswith("_"):
            counters = self.__dict__.get("_counters", {})
            policy = self.__dict__.get("policy")
            if name in counters:
                hint = f"; it is a counter of this method's parts: cache.stats()[{name!r}]"
            elif policy is not None and name in type(policy.config.policy).model_fields:
                hint = f"; it is a field of the method's config: cache.config.{name}"
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}{hint}")

    def __repr__(self) -> str:
        return (
            f"PolicyCache(method={self.policy.config.method!r}, layer={self.layer}, budget={self.budget}, "
            f"window={self.window}, kept={self.tokens_kept}, seen={self.offset})"
        )
