"""Per-step cost of one cache update (+ eviction) and one attention pass, one layer, side by side.

    python benchmarks/step_cost.py            # full grid
    python benchmarks/step_cost.py --smoke    # tiny grid (the test suite runs this)

For each (budget, head_dim, kv_heads): a decode step = ``update_and_fetch`` of one token plus
``mx.fast.scaled_dot_product_attention`` over what it returns, evaluated. Caches at the same
retained length: mlx-lm ``KVCache`` (trimmed to stay at ``budget``), ``RotatingKVCache(budget+1)``,
H2O and CaM. Also: the proxy scoring alone versus one attention pass. Ratios are to ``KVCache``,
measured in one run. Writes benchmarks/results/step_cost.json and step_cost.png.
"""

from __future__ import annotations

import argparse
import itertools

from _common import RESULTS, mx, timed, write_json

from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvpolicy_core import PolicyCache
from kvpolicy_core.parts.base import CacheView
from kvpolicy_core.parts.cumulative_attention import CumulativeAttentionScorer


def make(kind: str, budget: int):
    if kind == "KVCache":
        return KVCache()
    if kind == "RotatingKVCache":
        return RotatingKVCache(max_size=budget + 1, keep=4)
    return PolicyCache(f"{kind}{',' if ':' in kind else ':'}budget={budget},signal=proxy")  # no model: the proxy signal


def step_time(kind, budget, D, H, steps, q_heads):
    B = 1
    key = mx.random.key(0)
    cache = make(kind, budget)
    pre = mx.random.normal((B, H, budget, D), key=key)
    cache.update_and_fetch(pre, pre)
    if isinstance(cache, PolicyCache):
        cache.before_attention(mx.repeat(pre, q_heads // H, axis=1), D**-0.5, "causal")
    toks = mx.random.normal((steps + 1, B, H, 1, D), key=mx.random.key(1))
    q = mx.random.normal((B, q_heads, 1, D), key=mx.random.key(2))
    mx.eval(toks, q, *[x for x in (getattr(cache, "keys", None),) if x is not None])
    i = [0]

    def one():
        k = toks[i[0] % steps]
        i[0] += 1
        keys, values = cache.update_and_fetch(k, k)
        mask = cache.before_attention(q, D**-0.5, None) if isinstance(cache, PolicyCache) else None  # the hook's work
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask)
        if kind == "KVCache":
            cache.trim(1)  # stay at the same retained length
        mx.eval(out)

    for _ in range(10):
        one()
    return timed(one, steps)


def scoring_vs_attention(budget, D, H, steps, q_heads):
    key = mx.random.key(3)
    K = mx.random.normal((1, H, budget + 1, D), key=key)
    pos = mx.broadcast_to(mx.arange(budget + 1, dtype=mx.int32), (1, H, budget + 1))
    view = CacheView(K, K, pos, mx.zeros((1, H, budget + 1)), budget + 1, 1, None)
    scorer = CumulativeAttentionScorer("proxy")
    newk, newp = K[:, :, -1:], mx.array([budget], dtype=mx.int32)
    q = mx.random.normal((1, q_heads, 1, D), key=key)
    mx.eval(K, pos, q)
    t_score = timed(lambda: mx.eval(scorer.on_append(view, newk, newp)), steps)
    t_attn = timed(lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, K, K, scale=D**-0.5, mask=None)), steps)
    return t_score, t_attn


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--kinds", default="KVCache;RotatingKVCache;h2o;cam",
                   help="';'-separated: KVCache, RotatingKVCache or policy config strings (first is the baseline)")
    p.add_argument("--grid", default=None, help="budget:head_dim:kv_heads triples, comma-separated (e.g. 256:256:1)")
    p.add_argument("--tag", default="", help="suffix of the result file names")
    args = p.parse_args()
    if args.smoke:
        grid, steps = [(64, 32, 1)], 20
    else:
        grid, steps = list(itertools.product([256, 512, 1024, 2048], [64, 128, 256], [1, 4, 8])), args.steps
    if args.grid:
        grid = [tuple(int(x) for x in g.split(":")) for g in args.grid.split(",")]
    kinds = args.kinds.split(";")
    rows = []
    for budget, D, H in grid:
        q_heads = max(H, 4)
        times = {k: step_time(k, budget, D, H, steps, q_heads) for k in kinds}
        t_score, t_attn = scoring_vs_attention(budget, D, H, steps, q_heads)
        row = {"budget": budget, "head_dim": D, "kv_heads": H, **{f"us_{k}": 1e6 * t for k, t in times.items()},
               **{f"ratio_{k}": times[k] / times[kinds[0]] for k in kinds[1:]},
               "us_scoring": 1e6 * t_score, "us_attention": 1e6 * t_attn, "scoring_over_attention": t_score / t_attn}
        rows.append(row)
        print(f"budget={budget:5d} D={D:3d} H={H}: " + "  ".join(f"{k} {1e6 * t:7.1f}us" for k, t in times.items())
              + "  | " + " ".join(f"{k}/{kinds[0]} {row['ratio_' + k]:.2f}" for k in kinds[1:])
              + f" | scoring/attention {row['scoring_over_attention']:.2f}", flush=True)
    from pathlib import Path

    tag = "step_cost" + (f"_{args.tag}" if args.tag else "") + ("_smoke" if args.smoke else "")
    path = write_json(tag, {"rows": rows, "kinds": kinds}, Path(args.out))
    if not args.smoke and {"h2o", "cam"} <= set(kinds):
        plot(rows, Path(args.out) / "step_cost.png")
    print(f"wrote {path}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for D in sorted({r["head_dim"] for r in rows}):
        sub = [r for r in rows if r["head_dim"] == D and r["kv_heads"] == 4]
        for kind, style in (("h2o", "-"), ("cam", "--")):
            ax[0].plot([r["budget"] for r in sub], [r[f"ratio_{kind}"] for r in sub], style, marker="o", label=f"{kind} D={D}")
        ax[1].plot([r["budget"] for r in sub], [r["scoring_over_attention"] for r in sub], marker="o", label=f"D={D}")
    ax[0].axhline(1.0, color="gray", lw=0.8)
    ax[0].set(xscale="log", xlabel="budget (retained tokens)", ylabel="step time / KVCache", title="decode step, 4 KV heads")
    ax[1].axhline(1.0, color="gray", lw=0.8)
    ax[1].set(xscale="log", xlabel="budget", ylabel="proxy scoring / attention pass", title="scoring cost, 4 KV heads")
    ax[0].legend(fontsize=7)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
