"""What batching CaM's decode merge over layers would save: one compiled merge per layer versus one for all.

    python benchmarks/merge_batching.py                 # the default model's shape: 18 layers, 1 KV head, D 256
    python benchmarks/merge_batching.py --smoke         # tiny shapes (the test suite runs this)

Each layer's eviction at step t depends only on its own scores after step t-1, so the merges of all
layers could run at the first layer's call as one graph over the layers stacked as batch rows (CaM's
disposition is ``batch_rows``). This times, side by side in one run: (1) the compiled merge and its
value checks, evaluated once per layer as the cache does now; (2) the same over all layers stacked as
B rows, evaluated once; (3) stacking the six per-slot fields of every layer into those rows (the copy a
design that keeps one slot store per layer would pay each token). Medians of ``--repeat`` runs (after a warm-up). Writes
merge_batching[_tag].json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import RESULTS, mx, timed, write_json

from kvpolicy_core import PolicyCache
from kvpolicy_core.compiled_parts import compiled
from kvpolicy_core.parts.base import CacheView


def fields(B: int, H: int, L: int, D: int, seed: int):
    """(keys, values, positions, scores, log_weights, key_norms) of B rows, keys close enough to merge."""
    k = mx.random.key(seed)
    base = mx.random.normal((B, H, 1, D), key=k)
    K = base + 0.5 * mx.random.normal((B, H, L, D), key=mx.random.split(k)[0])
    V = mx.random.normal((B, H, L, D), key=mx.random.split(k)[1])
    pos = mx.broadcast_to(mx.arange(L, dtype=mx.int32), (B, H, L))
    S = mx.random.uniform(shape=(B, H, L), key=k)
    out = (K, V, pos, S, mx.zeros((B, H, L)), mx.sqrt((K * K).sum(-1)))
    mx.eval(*out)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--tag", default="")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args()
    if a.smoke:
        a.layers, a.kv_heads, a.budget, a.head_dim, a.repeat = 3, 1, 16, 8, 3
    n, H, L, D = a.layers, a.kv_heads, a.budget + 1, a.head_dim
    cache = PolicyCache(f"cam:budget={a.budget}")  # holds the disposition (compiled steps hold it weakly)
    merge = compiled(cache.policy.disposition)
    key = mx.random.key(0)

    def run(view, losers):
        u, checks = merge(view, losers, key)
        mx.eval(u.targets, u.d_values, u.d_keys, u.d_scores, u.d_log_weights, *u.stats.values(),
                *[c for c in checks if c is not None])
        return u

    per = [fields(1, H, L, D, i) for i in range(n)]
    views = [CacheView(*f[:4], 4 * L, 0, None, 0, H, f[4], key_norms=f[5]) for f in per]
    stacked = tuple(mx.concatenate([f[i] for f in per], axis=0) for i in range(6))
    mx.eval(*stacked)
    batch = CacheView(*stacked[:4], 4 * L, 0, None, 0, H, stacked[4], key_norms=stacked[5])
    losers = mx.random.randint(4, L, (n, H, 1), key=key).astype(mx.int32)
    mx.eval(losers)
    merged = int(run(batch, losers).stats["merges"].sum().item())
    times = {
        "per_layer_ms": 1e3 * timed(lambda: [run(v, losers[i : i + 1]) for i, v in enumerate(views)], a.repeat),
        "batched_ms": 1e3 * timed(lambda: run(batch, losers), a.repeat),
        "stack_fields_ms": 1e3 * timed(lambda: mx.eval(*[mx.concatenate([f[i] for f in per], axis=0)
                                                         for i in range(6)]), a.repeat),
    }
    print(f"{n} layers, {H} KV head(s), L={L}, D={D}: merges {merged}/{n * H}; one compiled merge per layer "
          f"{times['per_layer_ms']:.2f} ms, all layers in one {times['batched_ms']:.2f} ms "
          f"(x{times['per_layer_ms'] / times['batched_ms']:.1f}); stacking the six fields {times['stack_fields_ms']:.2f} ms")
    tag = "merge_batching" + (f"_{a.tag}" if a.tag else "") + ("_smoke" if a.smoke else "")
    path = write_json(tag, {"layers": n, "kv_heads": H, "slots": L, "head_dim": D, "merges": merged, **times},
                      Path(a.out))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
