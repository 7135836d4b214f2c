"""The policy work of one batched decode step: stacked rows vs the per-row loop vs one sequence.

No model: per layer, B policy-cache rows at their budget take decode steps (update_and_fetch and
the attention hook's before_attention with random queries), shaped like the default model's
layers (18 layers, 1 KV head, 4 query heads, head dim 256). Compared side by side, in
interleaved rounds: one sequence (B=1), B rows stacked (batch_rows.py), and the same B rows
with stacking turned off (the per-row loop). Reports ms per step (median over rounds).

    python benchmarks/batch_policy_step.py               # B=8, budget 64, h2o and cam, 3 rounds
    python benchmarks/batch_policy_step.py --smoke       # tiny (the test suite runs this)

Writes benchmarks/results/batch_policy_step.json.
"""

from __future__ import annotations

import mlx.core as mx  # noqa: E402  (after the BLAS, via _common)
from _common import Stopwatch, interleave, parser, result_name, summarize, write_json

from kvpolicy_core.cache import batch as batch_cache  # noqa: E402
from kvpolicy_core.cache.batch import BatchPolicyCache  # noqa: E402
from kvpolicy_core.cache.policy_cache import PolicyCache  # noqa: E402


def layers_of(spec: str, B: int, n_layers: int, D: int, prompt: int):
    """Per layer: B rows that saw a prompt (lengths prompt .. prompt + B - 1), as one batch (or a row if B=1)."""
    out = []
    for layer in range(n_layers):
        rows = []
        for b in range(B):
            c = PolicyCache(spec, layer=layer)
            k = mx.random.normal((1, 1, prompt + b, D), key=mx.random.key(layer * 100 + b))
            c.update_and_fetch(k, k)
            c.before_attention(mx.random.normal((1, 4, prompt + b, D), key=mx.random.key(7)), D**-0.5, "causal")
            rows.append(c)
        out.append(BatchPolicyCache(rows) if B > 1 else rows[0])
    return out


def ms_per_step(spec: str, B: int, n_layers: int, D: int, prompt: int, steps: int, stacked: bool) -> float:
    saved = batch_cache.can_stack
    if not stacked:
        batch_cache.can_stack = lambda rows: False
    try:
        layers = layers_of(spec, B, n_layers, D, prompt)
        k = mx.random.normal((B, 1, 1, D), key=mx.random.key(1))
        q = mx.random.normal((B, 4, 1, D), key=mx.random.key(2))
        mx.eval(k, q)

        def step():
            outs = []
            for c in layers:
                kk, _ = c.update_and_fetch(k, k)
                c.before_attention(q, D**-0.5, None)
                outs.append(kk)
            mx.eval(outs)

        for _ in range(3):  # the first steps settle the prompt and stack the rows
            step()
        sw = Stopwatch()
        for _ in range(steps):
            step()
        return sw.wall / steps * 1000
    finally:
        batch_cache.can_stack = saved


def main() -> None:
    ap = parser(__doc__, rounds=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.budget, args.layers, args.head_dim, args.steps, args.rounds = 3, 8, 2, 16, 3, 1
    B, prompt = args.batch, args.budget + 6
    specs = [f"h2o:budget={args.budget}", f"cam:budget={args.budget}"]
    kinds = [("one sequence", 1, True), (f"{B} rows stacked", B, True), (f"{B} rows, per-row loop", B, False)]
    fns = {
        (spec, name): (
            lambda spec=spec, b=b, stacked=stacked: ms_per_step(
                spec, b, args.layers, args.head_dim, prompt, args.steps, stacked
            )
        )
        for spec in specs
        for name, b, stacked in kinds
    }

    def progress(r, got):
        for (spec, name), ms in got.items():
            print(f"round {r}  {spec:16} {name:22} {ms:8.1f} ms/step", flush=True)

    runs = interleave(fns, args.rounds, progress)
    results = []
    for spec in specs:
        rows = summarize({name: runs[(spec, name)] for name, _, _ in kinds}, baseline=kinds[0][0])
        for name, b, stacked in kinds:
            ms, x = rows[name]["median"], rows[name]["ratio"]
            results.append(
                {
                    "spec": spec,
                    "kind": name,
                    "batch": b,
                    "stacked": stacked,
                    "ms_per_step": ms,
                    "x_one_sequence": x,
                    "rounds_ms": runs[(spec, name)],
                }
            )
            print(f"median  {spec:16} {name:22} {ms:8.1f} ms/step   x{x:.2f} of one sequence", flush=True)
    out = write_json(
        result_name("batch_policy_step", args),
        {
            "batch": B,
            "budget": args.budget,
            "layers": args.layers,
            "head_dim": args.head_dim,
            "kv_heads": 1,
            "q_heads": 4,
            "steps": args.steps,
            "rounds": args.rounds,
            "results": results,
            "note": "policy work only (no model); one run, interleaved rounds on a shared machine",
        },
        args.out,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
