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

import argparse
import statistics
import time
from pathlib import Path

from _common import RESULTS, write_json

import mlx.core as mx  # noqa: E402  (after the BLAS, via _common)

from kvpolicy_core import batch_cache  # noqa: E402
from kvpolicy_core.batch_cache import BatchPolicyCache  # noqa: E402
from kvpolicy_core.cache import PolicyCache  # noqa: E402


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
        t = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t) / steps * 1000
    finally:
        batch_cache.can_stack = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (checks the program runs)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.budget, args.layers, args.head_dim, args.steps, args.rounds = 3, 8, 2, 16, 3, 1
    B, prompt = args.batch, args.budget + 6
    specs = [f"h2o:budget={args.budget}", f"cam:budget={args.budget}"]
    kinds = [("one sequence", 1, True), (f"{B} rows stacked", B, True), (f"{B} rows, per-row loop", B, False)]
    runs = {(s, k[0]): [] for s in specs for k in kinds}
    for r in range(args.rounds):
        for spec in specs:
            for name, b, stacked in kinds:
                ms = ms_per_step(spec, b, args.layers, args.head_dim, prompt, args.steps, stacked)
                runs[(spec, name)].append(ms)
                print(f"round {r}  {spec:16} {name:22} {ms:8.1f} ms/step", flush=True)
    results = []
    for spec in specs:
        one = statistics.median(runs[(spec, kinds[0][0])])
        for name, b, stacked in kinds:
            ms = statistics.median(runs[(spec, name)])
            results.append({"spec": spec, "kind": name, "batch": b, "stacked": stacked, "ms_per_step": ms,
                            "x_one_sequence": ms / one, "rounds_ms": runs[(spec, name)]})
            print(f"median  {spec:16} {name:22} {ms:8.1f} ms/step   x{ms / one:.2f} of one sequence", flush=True)
    out = write_json("batch_policy_step" + ("_smoke" if args.smoke else ""), {
        "batch": B, "budget": args.budget, "layers": args.layers, "head_dim": args.head_dim, "kv_heads": 1,
        "q_heads": 4, "steps": args.steps, "rounds": args.rounds, "results": results,
        "note": "policy work only (no model); one run, interleaved rounds on a shared machine",
    }, out_dir=Path(args.out))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
