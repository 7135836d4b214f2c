"""What batching CaM's decode merge over layers would save: one compiled merge per layer versus one for all.

    python benchmarks/merge_batching.py                 # the default model's shape: 18 layers, 1 KV head, D 256
    python benchmarks/merge_batching.py --smoke         # tiny shapes (the test suite runs this)

Each layer's eviction at step t depends only on its own scores after step t-1, so the merges of all
layers could run at the first layer's call as one graph over the layers stacked as batch rows (CaM's
disposition is ``batch_rows``). This times, side by side in one run: (1) the compiled merge (steady decode
steps are not value-checked: the store guards them on the device), evaluated once per layer as the cache
does now; (2) the same over all layers stacked as
B rows, evaluated once; (3) stacking the six per-slot fields of every layer into those rows (the copy a
design that keeps one slot store per layer would pay each token); (4) one layer's merge update and new-token
write eager (``SlotStore.write``: ``add`` then the token's write) versus as the one compiled call the cache
makes (``SlotStore.write(..., compiled=True)``). Medians of ``--repeat`` runs (after a warm-up). Writes
merge_batching[_tag].json.

    python benchmarks/merge_batching.py --layers 1 --kv-heads 4 --budget 1024 --head-dim 128   # the reference point
"""

from __future__ import annotations

from pathlib import Path

from _common import mx, parser, result_name, timed, write_json

from kvpolicy_core import PolicyCache
from kvpolicy_core.cache.slots import SlotStore, Snapshot, Token
from kvpolicy_core.cache.step import compiled
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


def write_times(f, update, repeat: int):
    """ms of SlotStore.write eager and compiled (a merge update and the new token's write), one layer, evaluated."""
    B, H, L, D = f[0].shape
    store = SlotStore(track_log_weights=True, track_key_norms=True)
    store.restore(Snapshot(*f[:4], L, f[4]))
    store.key_norms = f[5]
    slots = mx.array([[[L - 1]] * H], dtype=mx.int32)  # the new token's slot (not a merge target: a non-sink)
    k = mx.random.normal((B, H, 1, D), key=mx.random.key(9))
    mx.eval(k)
    flush = lambda: mx.eval(
        store.keys,
        store.values,
        store.positions,
        store.scores,
        store.log_weights,  # noqa: E731
        store.key_norms,
    )

    def two():
        store.write(Token(k, k, 4 * L), slots, update)
        flush()

    def one():
        store.write(Token(k, k, 4 * L), slots, update, compiled=True)
        flush()

    return {"write_two_calls_ms": 1e3 * timed(two, repeat), "write_one_call_ms": 1e3 * timed(one, repeat)}


def main():
    p = parser(__doc__)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--repeat", type=int, default=30)
    a = p.parse_args()
    if a.smoke:
        a.layers, a.kv_heads, a.budget, a.head_dim, a.repeat = 3, 1, 16, 8, 3
    n, H, L, D = a.layers, a.kv_heads, a.budget + 1, a.head_dim
    cache = PolicyCache(f"cam:budget={a.budget}")  # holds the disposition (compiled steps hold it weakly)
    merge = compiled(cache.policy.disposition)
    key = mx.random.key(0)

    def run(view, losers):
        u = merge(view, losers, key)
        mx.eval(u.targets, u.d_values, u.d_keys, u.d_scores, u.d_log_weights, *u.stats.values())
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
        "stack_fields_ms": 1e3
        * timed(lambda: mx.eval(*[mx.concatenate([f[i] for f in per], axis=0) for i in range(6)]), a.repeat),
    }
    times.update(write_times(per[0], run(views[0], losers[:1]), a.repeat))
    print(
        f"{n} layers, {H} KV head(s), L={L}, D={D}: merges {merged}/{n * H}; one compiled merge per layer "
        f"{times['per_layer_ms']:.2f} ms, all layers in one {times['batched_ms']:.2f} ms "
        f"(x{times['per_layer_ms'] / times['batched_ms']:.1f}); stacking the six fields {times['stack_fields_ms']:.2f} ms"  # noqa: E501
    )
    print(
        f"one layer's merge update + new-token write: two eager calls {times['write_two_calls_ms'] * 1e3:.0f} µs, "
        f"one compiled call {times['write_one_call_ms'] * 1e3:.0f} µs"
    )
    tag = result_name("merge_batching", a)
    path = write_json(
        tag, {"layers": n, "kv_heads": H, "slots": L, "head_dim": D, "merges": merged, **times}, Path(a.out)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
