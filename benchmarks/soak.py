"""Soak: thousands of decode steps per bounded policy on a tiny model; memory and step time stay flat.

    python benchmarks/soak.py [--tokens 4000] [--seconds 600]
    python benchmarks/soak.py --smoke                       # 150 tokens (the test suite runs this)

Feeds tokens one at a time (the model's own greedy choices) through a tiny random-weight llama with
each bounded policy and with mlx-lm's full KVCache for contrast. Every ``--every`` steps it records
the mean step time and MLX active memory. Flat means: last window / the window at 20% of the run
(after warm-up and after the budget has filled) close to 1 for time, and no memory growth. Stops a policy early when
``--seconds`` (per policy) runs out.
Writes benchmarks/results/soak.json and soak.png.
"""

from __future__ import annotations

from pathlib import Path

from _common import Stopwatch, mx, parser, plot_time_memory, result_name, write_json

from kvpolicy_core.eval.perplexity import make_caches
from kvpolicy_core.testing.tiny_models import tiny_llama

POLICIES = ["full", "h2o:budget=256", "cam:budget=256", "cam:budget=256,merge=paper", "h2o:budget=256,signal=observed"]


def soak(model, spec, tokens, every, seconds):
    caches = make_caches(model, spec)
    tok = mx.array([[1]])
    points, t_window, start = [], 0.0, Stopwatch()
    mx.eval(model(tok, cache=caches))
    for step in range(1, tokens + 1):
        t = Stopwatch()
        logits = model(tok, cache=caches)
        tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(tok)
        t_window += t.wall
        if step % every == 0:
            points.append(
                {"step": step, "ms_per_step": 1e3 * t_window / every, "active_mb": mx.get_active_memory() / 2**20}
            )
            t_window = 0.0
            if start.wall > seconds:
                break
    first, last = points[len(points) // 5], points[-1]  # skip warm-up and the filling of the budget
    return {
        "spec": spec,
        "steps": points[-1]["step"],
        "points": points,
        "time_ratio_last_first": last["ms_per_step"] / first["ms_per_step"],
        "memory_growth_mb": last["active_mb"] - first["active_mb"],
    }


def main():
    p = parser(__doc__)
    p.add_argument("--tokens", type=int, default=4000)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--seconds", type=float, default=600)
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.every = 150, 25
    model = tiny_llama(n_kv_heads=2, n_heads=4, layers=4)
    runs = []
    for spec in POLICIES:
        r = soak(model, spec.replace("256", "64") if args.smoke else spec, args.tokens, args.every, args.seconds)
        runs.append(r)
        print(
            f"{r['spec']:40} steps {r['steps']:5d}  time last/first {r['time_ratio_last_first']:.2f}  "
            f"memory growth {r['memory_growth_mb']:+.2f} MB",
            flush=True,
        )
    out = Path(args.out)
    path = write_json(result_name("soak", args), {"tokens": args.tokens, "runs": runs}, out)
    if not args.smoke:
        plot_time_memory(runs, out / "soak.png", "tiny llama, 4 layers")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
