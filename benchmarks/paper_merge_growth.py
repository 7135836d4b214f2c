"""Growth of retained values under CaM's merges over a long decode: max |V| of the retained
values of every layer at checkpoints, for merge="paper" (the paper's unnormalised additive spread),
"sim_weighted" (kvpolicy's adaptation) and "drop" (no merging: the model's own value scale), side by side
in one run on the tiny random-weight llama (greedy decoding of its own output). Writes
benchmarks/results/paper_merge_growth.json.

    .venv/bin/python benchmarks/paper_merge_growth.py [--steps 4000] [--budget 64]
"""

from _common import mx, parser, result_name, write_json  # the BLAS first

from kvpolicy_core import KVCacheBuilder  # noqa: E402
from kvpolicy_core.testing.tiny_models import tiny_llama  # noqa: E402


def run(merge: str, steps: int, budget: int, checkpoints):
    model = tiny_llama(layers=2)
    caches = KVCacheBuilder.for_model(model, f"cam:budget={budget},merge={merge},seed=1")
    token = mx.array([[1, 2, 3, 4, 5, 6, 7, 8]])
    out = {}
    for step in range(1, steps + 1):
        logits = model(token, cache=caches)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
        if step in checkpoints:
            out[step] = max(float(mx.abs(c.retained()[1]).max()) for c in caches)
    return out


def main():
    ap = parser(__doc__, smoke_help="40 steps, budget 16")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--budget", type=int, default=64)
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.budget = 40, 16
    checkpoints = sorted({s for s in (250, 1000, 2000, args.steps) if s <= args.steps})
    res = {m: run(m, args.steps, args.budget, checkpoints) for m in ("paper", "sim_weighted", "drop")}
    for m, r in res.items():
        print(f"{m:>13}: " + ", ".join(f"{s} steps max|V| {v:.2f}" for s, v in r.items()))
    path = write_json(
        result_name("paper_merge_growth", args),
        {"steps": args.steps, "budget": args.budget, "max_abs_v": res},
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
