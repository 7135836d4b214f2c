"""The method specs the distributed tests run: every installed method plus variants with their own parts or draws."""

from kvpolicy_core.plugins import get_registry


def shipped_methods(budget: int = 10):
    """Every installed method at its defaults, plus cam's paper and mean merges and h2o's observed signal."""
    fields = f"budget={budget},n_sink=2"
    specs = [f"{name}:{fields}" for name in sorted(get_registry().methods())]
    return specs + [f"cam:{fields},merge=paper", f"cam:{fields},merge=mean", f"h2o:{fields},signal=observed"]
