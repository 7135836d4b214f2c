"""Per-step cost of one cache update (+ eviction) and one attention pass, one layer, side by side.

    python benchmarks/step_cost.py            # the issue's grid: L = 256..4096, head_dim 128, 1/4/8 KV heads
    python benchmarks/step_cost.py --smoke    # tiny grid (the test suite runs this)
    python benchmarks/step_cost.py --grid 1024:128:4 --rounds 5
    python benchmarks/step_cost.py --keys clustered   # keys close to each other: CaM merges at every step

For each (budget, head_dim, kv_heads): a decode step = ``update_and_fetch`` of one token plus the
attention over what it returns, called exactly as the model calls it: through mlx-lm's
``scaled_dot_product_attention`` wrapped by kvpolicy's attention hook (for mlx-lm's caches the hook
calls the original unchanged). So a policy with the observed signal or attention log-weights pays
here what it pays in the model. Caches at the same retained length: mlx-lm ``KVCache`` (trimmed to
stay at ``budget``), ``RotatingKVCache(budget+1)`` and policy configs as given (defaults: the
observed signal). Kinds are interleaved in ``--rounds`` rounds; each time is the median over all
rounds' steps. ``--keys random`` (the default): independent Gaussian keys, whose cosines are ~0, so
CaM's default (a threshold of 0.85) never merges and its step is the search alone; ``--keys clustered``:
each key is a direction shared by all plus 0.3x noise (cosines ~0.9), so every loser has a survivor
within the threshold and merges unless that survivor is at the cap (default ``cam``: ~13% of evictions
merge; ``cam:cap=none``: all; on the default model ~60% do); the rows record the merges per eviction.
Also: the proxy scoring alone versus one attention pass. Ratios are to the first kind, measured in one
run. Writes benchmarks/results/step_cost[_tag].json (and step_cost.png).
"""

from __future__ import annotations

import itertools
import os
import time

from _common import interleave, mx, parser, result_name, timed, write_json
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import KVCache, RotatingKVCache

from kvpolicy_core import PolicyCache
from kvpolicy_core.attention.hook import _wrap
from kvpolicy_core.parts.base import CacheView
from kvpolicy_core.parts.cumulative_attention import CumulativeAttentionScorer

#: what the model calls: mlx-lm's attention behind kvpolicy's hook
sdpa = _wrap(getattr(mlx_base.scaled_dot_product_attention, "__wrapped__", mlx_base.scaled_dot_product_attention))


def make(kind: str, budget: int):
    if kind == "KVCache":
        return KVCache()
    if kind == "RotatingKVCache":
        return RotatingKVCache(max_size=budget + 1, keep=4)
    return PolicyCache(f"{kind}{',' if ':' in kind else ':'}budget={budget}")


class Stepper:
    """One cache filled to ``budget`` tokens, then one decode step (update + attention) per call."""

    def __init__(self, kind, budget, D, H, q_heads, steps, keys="random"):
        self.kind, self.D = kind, D
        self.cache = make(kind, budget)
        scale = D**-0.5
        pre = mx.random.normal((1, H, budget, D), key=mx.random.key(0))
        toks = mx.random.normal((steps + 1, 1, H, 1, D), key=mx.random.key(1))
        if keys == "clustered":  # a shared direction per head plus 0.3x noise: pairwise cosines ~0.9
            common = mx.random.normal((1, H, 1, D), key=mx.random.key(5))
            pre, toks = common + 0.3 * pre, common + 0.3 * toks
        qpre = mx.random.normal((1, q_heads, budget, D), key=mx.random.key(4))
        for t in range(0, budget, 512):  # the prompt in chunks of 512 (bounded attention matrices)
            k, v = self.cache.update_and_fetch(pre[:, :, t : t + 512], pre[:, :, t : t + 512])
            mx.eval(sdpa(qpre[:, :, t : t + 512], k, v, self.cache, scale, "causal"))
        self.toks = toks
        self.q = mx.random.normal((1, q_heads, 1, D), key=mx.random.key(2))
        mx.eval(self.toks, self.q)
        self.i, self.steps = 0, steps

    def __call__(self):
        k = self.toks[self.i % self.steps]
        self.i += 1
        keys, values = self.cache.update_and_fetch(k, k)
        out = sdpa(self.q, keys, values, self.cache, self.D**-0.5, None)
        if self.kind == "KVCache":
            self.cache.trim(1)  # stay at the same retained length
        mx.eval(out)


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCK["wall"]


def samples(fn, n):
    out = []
    for _ in range(n):
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def step_times(kinds, budget, D, H, steps, q_heads, rounds, keys="random"):
    """(median step time per kind, merges per decode eviction per kind that counts merges)."""
    steppers = {k: Stepper(k, budget, D, H, q_heads, steps, keys) for k in kinds}
    for s in steppers.values():
        samples(s, 10)  # warm-up: past the first evictions and the eager checks
    per_round = max(steps // rounds, 1)
    by_round = interleave({k: (lambda s=s: samples(s, per_round)) for k, s in steppers.items()}, rounds)
    got = {k: [t for r in v for t in r] for k, v in by_round.items()}  # load changes hit every kind alike
    merged = {
        k: int(s.cache.merges) / (H * max(s.cache.offset - budget, 1))
        for k, s in steppers.items()
        if hasattr(s.cache, "merges")
    }
    return {k: sorted(v)[len(v) // 2] for k, v in got.items()}, merged


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
    p = parser(__doc__, rounds=3, rounds_help="interleaved rounds over the kinds")
    p.add_argument("--steps", type=int, default=300, help="decode steps timed per kind (over all rounds)")
    p.add_argument(
        "--kinds",
        default="KVCache;RotatingKVCache;h2o;cam;h2o:signal=proxy;cam:signal=proxy",
        help="';'-separated: KVCache, RotatingKVCache or policy config strings (first is the baseline)",
    )
    p.add_argument("--grid", default=None, help="budget:head_dim:kv_heads triples, comma-separated (e.g. 256:256:1)")
    p.add_argument(
        "--keys",
        choices=["random", "clustered"],
        default="random",
        help="random: cosines ~0 (CaM never merges); clustered: cosines ~0.9 (CaM merges up to its cap)",
    )
    p.add_argument(
        "--clock",
        choices=sorted(CLOCK),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (all threads; less sensitive to other load)",
    )
    args = p.parse_args()
    global clock
    clock = CLOCK[args.clock]
    if args.smoke:
        grid, steps, rounds = [(64, 32, 1)], 20, 2
    else:
        grid = list(itertools.product([256, 1024, 4096], [128], [1, 4, 8])) + [(512, 128, 4), (2048, 128, 4)]
        steps, rounds = args.steps, args.rounds
    if args.grid:
        grid = [tuple(int(x) for x in g.split(":")) for g in args.grid.split(",")]
    kinds = args.kinds.split(";")
    rows = []
    for budget, D, H in grid:
        q_heads = max(H, 4)
        times, merged = step_times(kinds, budget, D, H, steps, q_heads, rounds, args.keys)
        t_score, t_attn = scoring_vs_attention(budget, D, H, steps, q_heads)
        row = {
            "budget": budget,
            "head_dim": D,
            "kv_heads": H,
            "q_heads": q_heads,
            "load": os.getloadavg()[0],
            **{f"us_{k}": 1e6 * t for k, t in times.items()},
            **{f"ratio_{k}": times[k] / times[kinds[0]] for k in kinds[1:]},
            **{f"merges_per_eviction_{k}": m for k, m in merged.items()},
            "us_scoring": 1e6 * t_score,
            "us_attention": 1e6 * t_attn,
            "scoring_over_attention": t_score / t_attn,
        }
        rows.append(row)
        print(
            f"budget={budget:5d} D={D:3d} H={H} load {row['load']:.1f}: "
            + "  ".join(f"{k} {1e6 * t:7.1f}us" for k, t in times.items())
            + "  | "
            + " ".join(f"{k} {row['ratio_' + k]:.2f}x" for k in kinds[1:])
            + f" | scoring/attention {row['scoring_over_attention']:.2f}",
            flush=True,
        )
    from pathlib import Path

    tag = result_name("step_cost", args)
    path = write_json(tag, {"rows": rows, "kinds": kinds, "clock": args.clock, "keys": args.keys}, Path(args.out))
    if not args.smoke and {"h2o", "cam"} <= set(kinds):
        plot(rows, Path(args.out) / f"{tag}.png")
    print(f"wrote {path}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for H in sorted({r["kv_heads"] for r in rows}):
        sub = sorted((r for r in rows if r["kv_heads"] == H and r["head_dim"] == 128), key=lambda r: r["budget"])
        for kind, style in (("h2o", "-"), ("cam", "--")):
            ax[0].plot(
                [r["budget"] for r in sub], [r[f"ratio_{kind}"] for r in sub], style, marker="o", label=f"{kind} H={H}"
            )
        ax[1].plot([r["budget"] for r in sub], [r["scoring_over_attention"] for r in sub], marker="o", label=f"H={H}")
    ax[0].axhline(1.0, color="gray", lw=0.8)
    ax[0].set(
        xscale="log", xlabel="budget (retained tokens)", ylabel="step time / KVCache", title="decode step, head_dim 128"
    )
    ax[1].axhline(1.0, color="gray", lw=0.8)
    ax[1].set(
        xscale="log", xlabel="budget", ylabel="proxy scoring / attention pass", title="scoring cost, head_dim 128"
    )
    ax[0].legend(fontsize=7)
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
