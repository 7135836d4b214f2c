"""What a policy cache reports about itself: sizes, compression and the parts' counters.

Counters belong to the parts: a part declares them with ``stats()`` and reports them in
``MergeUpdate.stats``; the cache only sums them per layer. ``cache.<counter>`` and
``cache.<method config field>`` are looked up generically (``cache.merges``,
``cache.merge_gate``); :meth:`CacheDiagnostics.stats` returns every counter.
"""

from __future__ import annotations

from typing import Dict

#: Counters of kvpolicy 0.1.0 that every cache answered (0 when its method has none).
LEGACY_COUNTERS = ("gate_draws", "merges")


class CacheDiagnostics:
    """Mixin of :class:`~kvpolicy_core.cache.PolicyCache`: read-only diagnostics."""

    @property
    def tokens_seen(self) -> int:
        return self.offset

    @property
    def tokens_kept(self) -> int:
        """Tokens retained once the current step is settled (same for every head)."""
        return min(self.n, self.budget)

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
        """Every counter the parts reported on this layer, as ints (host sync)."""
        return {name: int(value.item()) for name, value in sorted(self._counters.items())}

    def __getattr__(self, name: str):
        """``cache.<counter>`` or ``cache.<field of the method's config>`` (e.g. merge_gate)."""
        if name.startswith("_"):
            raise AttributeError(name)
        counters = self.__dict__.get("_counters", {})
        if name in counters:
            return int(counters[name].item())
        policy = self.__dict__.get("policy")
        config = policy.config.policy if policy is not None else None
        if config is not None and hasattr(config, name):
            return getattr(config, name)
        if name in LEGACY_COUNTERS:
            return 0
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r} (not a counter of this method's parts: "
            f"{', '.join(sorted(counters)) or 'none'}; nor a field of its config)"
        )

    def __repr__(self) -> str:
        return (
            f"PolicyCache(method={self.policy.config.method!r}, layer={self.layer}, budget={self.budget}, "
            f"window={self.window}, kept={self.tokens_kept}, seen={self.offset})"
        )
