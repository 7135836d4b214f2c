"""What one MLX op costs on this CPU, and the floor that puts under a policy's decode step.

    python benchmarks/op_cost.py                     # the reference point: budget 1024, 4 KV heads, head_dim 128
    python benchmarks/op_cost.py --grid 256:256:1    # the default model's layer shape (budget 256, D 256, 1 KV head)
    python benchmarks/op_cost.py --smoke             # tiny shapes (the test suite runs this)

Measured side by side in one run, medians of ``--repeat`` evaluations (after a warm-up):

1. The fixed cost of one op that a compiled graph cannot fuse into its neighbours (a gather along the
   slot axis; a reduction over it) on a [1, H, L] array: a compiled chain of 1 and of 1 + ``--chain``
   such ops, evaluated; the cost per op is the slope. Elementwise ops between them are fused and free.
2. One decode step of mlx-lm's ``KVCache`` at the point (one token's update and the attention over
   ``budget`` slots, as benchmarks/step_cost.py times it) and what the speed targets leave for a policy on
   top of it: 0.3x of that step for ``h2o`` (1.3x), 0.5x for ``cam`` (1.5x).
3. CaM's decode eviction in the three compiled calls the cache makes, each timed alone and evaluated:
   the selector's choice, the disposition's merge (no value checks at steady decode), and the merge update with the
   new token's write (``SlotStore.write(..., compiled=True)``). Alone, each pays one evaluation's round trip (the
   one-op chain's time less the per-op cost); the cache evaluates the three in two (its sync before the
   write, then the step), so the sum less two round trips is the eviction's cost in the cache, also given
   as "ops" = that cost / the per-op cost.

If (3) alone exceeds the allowance of (2), no arrangement of these calls meets the target: only fewer
unfused ops per layer (e.g. one merge for all layers) can. Writes op_cost[_tag].json.
"""

from __future__ import annotations

from pathlib import Path

from _common import mx, parser, result_name, timed, write_json
from merge_batching import fields
from step_cost import Stepper

from kvpolicy_core import PolicyCache
from kvpolicy_core.cache.slots import SlotStore, Snapshot, Token
from kvpolicy_core.cache.step import compiled, compiled_choose
from kvpolicy_core.parts.base import CacheView


def per_op_us(H: int, L: int, chain: int, repeat: int) -> dict:
    """µs per unfused op: compiled chains of 1 and 1 + ``chain`` gathers (and reductions) on [1, H, L], evaluated."""
    x = mx.random.uniform(shape=(1, H, L), key=mx.random.key(0))
    idx = mx.random.randint(0, L, (1, H, L), key=mx.random.key(1)).astype(mx.int32)
    mx.eval(x, idx)

    def gathers(n):
        def f(x, idx):
            for _ in range(n):
                x = mx.take_along_axis(x, idx, axis=2) * 0.5 + x  # one gather, the rest fused
            return x

        return mx.compile(f)

    def reductions(n):
        def f(x):
            for _ in range(n):
                x = x - mx.max(x, axis=-1, keepdims=True)  # one reduction, the rest fused
            return x

        return mx.compile(f)

    out = {}
    for name, make, args in (("gather", gathers, (x, idx)), ("reduction", reductions, (x,))):
        short, long = make(1), make(1 + chain)
        t1 = timed(lambda: mx.eval(short(*args)), repeat)
        t2 = timed(lambda: mx.eval(long(*args)), repeat)
        out[f"{name}_us"] = 1e6 * (t2 - t1) / chain
        out[f"{name}_eval_us"] = 1e6 * t1  # one op and the evaluation's own round trip
    out["per_op_us"] = (out["gather_us"] + out["reduction_us"]) / 2
    return out


def cam_parts_us(budget: int, D: int, H: int, repeat: int) -> dict:
    """µs of CaM's three compiled decode calls at one layer with keys close enough to merge, each evaluated."""
    L = budget + 1
    cache = PolicyCache(f"cam:budget={budget},cap=none")  # holds the parts (compiled calls hold them weakly)
    K, V, P, S, LW, N = fields(1, H, L, D, 0)
    P = P + 0  # a buffer of its own, as the cache's
    view = CacheView(K, V, P, S, 4 * L, 0, None, 0, H, LW, key_norms=N)
    n_sink = cache.policy.config.policy.n_sink
    select = lambda view, E: (compiled_choose(cache.policy.selector)(view, n_sink),)  # noqa: E731
    merge = compiled(cache.policy.disposition)
    key = mx.random.key(0)
    losers = select(view, 1)[0]
    mx.eval(losers)
    u = merge(view, losers, key)
    mx.eval(u.targets, u.d_keys, u.d_values, u.d_scores, u.d_log_weights)
    store = SlotStore(track_log_weights=True, track_key_norms=True)
    store.restore(Snapshot(K, V, P, S, L, LW))
    store.key_norms = N
    k = mx.random.normal((1, H, 1, D), key=mx.random.key(9))
    mx.eval(k)

    def merged():
        u = merge(view, losers, key)
        mx.eval(u.targets, u.d_keys, u.d_values, u.d_scores, u.d_log_weights, *u.stats.values())

    def write():
        store.write(Token(k, k, 4 * L), losers, u, compiled=True)
        mx.eval(store.keys, store.values, store.positions, store.scores, store.log_weights, store.key_norms)

    return {
        "select_us": 1e6 * timed(lambda: mx.eval(select(view, 1)[0]), repeat),
        "merge_us": 1e6 * timed(merged, repeat),
        "merge_write_us": 1e6 * timed(write, repeat),
        "merges": int(u.stats["merges"].sum().item()),
    }


def kvcache_step_us(budget: int, D: int, H: int, repeat: int) -> float:
    step = Stepper("KVCache", budget, D, H, H, repeat + 1)
    return 1e6 * timed(step, repeat)


def main():
    p = parser(__doc__)
    p.add_argument("--grid", default="1024:128:4", help="budget:head_dim:kv_heads")
    p.add_argument("--chain", type=int, default=40, help="extra unfused ops in the long chain")
    p.add_argument("--repeat", type=int, default=200)
    a = p.parse_args()
    if a.smoke:
        a.grid, a.chain, a.repeat = "16:8:1", 4, 3
    budget, D, H = (int(x) for x in a.grid.split(":"))
    ops = per_op_us(H, budget + 1, a.chain, a.repeat)
    base = kvcache_step_us(budget, D, H, a.repeat)
    parts = cam_parts_us(budget, D, H, a.repeat)
    # timed alone, each piece pays an evaluation's round trip; the cache evaluates the three in two (a sync, the step)
    trip = max(ops["gather_eval_us"] - ops["gather_us"], 0.0)
    eviction = parts["select_us"] + parts["merge_us"] + parts["merge_write_us"] - 2 * trip
    row = {
        "budget": budget,
        "head_dim": D,
        "kv_heads": H,
        **ops,
        "kvcache_step_us": base,
        "allowance_h2o_us": 0.3 * base,
        "allowance_cam_us": 0.5 * base,
        **parts,
        "eval_round_trip_us": trip,
        "cam_eviction_us": eviction,
        "cam_eviction_ops": eviction / ops["per_op_us"],
        "cam_floor_ratio": (base + eviction) / base,
    }
    print(
        f"budget {budget}, D {D}, {H} KV head(s): one unfused op {ops['per_op_us']:.1f} µs (gather "
        f"{ops['gather_us']:.1f}, reduction {ops['reduction_us']:.1f}; one evaluation with one op "
        f"{ops['gather_eval_us']:.0f} µs)"
    )
    print(
        f"KVCache step {base:.0f} µs: the targets leave {0.3 * base:.0f} µs (h2o, 1.3x) and {0.5 * base:.0f} µs "
        f"(cam, 1.5x) for the policy"
    )
    print(
        f"CaM's decode eviction alone: select {parts['select_us']:.0f} + merge "
        f"{parts['merge_us']:.0f} + merge write {parts['merge_write_us']:.0f} - two evaluations' round "
        f"trips {2 * trip:.0f} = {eviction:.0f} µs "
        f"(~{row['cam_eviction_ops']:.0f} ops): a step of at least {row['cam_floor_ratio']:.2f}x KVCache "
        "before scoring and attention"
    )
    tag = result_name("op_cost", a)
    print(f"wrote {write_json(tag, row, Path(a.out))}")


if __name__ == "__main__":
    main()
