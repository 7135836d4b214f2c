"""Batched vs sequential generation: does batching keep its speed-up with policy caches?

For each cache (full, mlx-lm's RotatingKVCache, default h2o and cam at the same budget), in
one run: B prompts of different lengths (all longer than the budget) generated one after
another with ``generate_step``, then the same B prompts together with mlx-lm's
``BatchGenerator`` (``batch_generate``'s engine). Reports tokens/s of both, their ratio, and
whether every batched row produced the tokens of its sequential run. ``--rounds`` repeats
the whole comparison, every cache once per round (interleaved, so a load change on a shared
machine hits every cache alike); the ratio reported is the median over rounds.

    python benchmarks/batch_speed.py                     # B=8, 64-token budget, 16 new tokens, 2 rounds
    python benchmarks/batch_speed.py --batch 8 --new-tokens 32 --prompt-tokens 160
    python benchmarks/batch_speed.py --smoke             # tiny random model (the test suite runs this)

Writes benchmarks/results/batch_speed.json.
"""

from __future__ import annotations

import mlx.core as mx  # noqa: E402  (after the BLAS, via _common)
import mlx_lm  # noqa: E402
from _common import Stopwatch, interleave, median, parser, result_name, write_json
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402

from kvpolicy_core.eval.perplexity import make_caches, parse_spec  # noqa: E402
from kvpolicy_core.integration.builder import attach, detach  # noqa: E402
from kvpolicy_core.model.corpus import load_corpus  # noqa: E402
from kvpolicy_core.model.default import resolve_model_path  # noqa: E402


def sequential(model, prompts, n):
    sw = Stopwatch()
    out = []
    for p in prompts:
        out.append([tok for (tok, _), _ in zip(generate_step(mx.array(p), model, max_tokens=n), range(n))])
    return sw.wall, out


def batched(model, prompts, n):
    sw = Stopwatch()
    gen = BatchGenerator(model, stop_tokens=None, completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    uids = gen.insert(prompts, [n] * len(prompts))
    got = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append(r.token)
    gen.close()
    return sw.wall, [got[u] for u in uids]


def main() -> None:
    ap = parser(
        __doc__,
        rounds=2,
        rounds_help="interleaved repetitions (median ratio reported)",
        smoke_help="tiny random model, batch 3 (checks the program runs)",
    )
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=96, help="mean prompt length (rows vary +-25%%)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--model", help="mlx-lm model directory (default: the embedded Gemma 3 270M)")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.budget, args.prompt_tokens, args.new_tokens, args.rounds = 3, 8, 14, 4, 1
        from kvpolicy_core.testing.tiny_models import VOCAB, tiny_llama

        path, model = "tiny random llama", tiny_llama()
        ids = mx.random.randint(0, VOCAB, (8000,), key=mx.random.key(0)).tolist()
    else:
        path = resolve_model_path(args.model)
        model, tokenizer = mlx_lm.load(str(path))
        model.set_dtype(mx.float32)
        ids = tokenizer.encode(load_corpus())
    B, P = args.batch, args.prompt_tokens
    lengths = [max(args.budget + 8, P + (i * P // 2) // max(B - 1, 1) - P // 4) for i in range(B)]
    prompts = [ids[1000 * i : 1000 * i + n] for i, n in enumerate(lengths)]
    specs = ["full", f"rotating:budget={args.budget}", f"h2o:budget={args.budget}", f"cam:budget={args.budget}"]

    native = model.__dict__.get("make_cache")
    r = 0

    def compare(spec):
        if parse_spec(spec)[0] == "policy":
            attach(model, spec)  # every new sequence gets fresh policy caches
        else:
            model.make_cache = lambda spec=spec: make_caches(model, spec)
        sequential(model, prompts[:1], 2)  # warm-up
        seq_s, seq_tokens = sequential(model, prompts, args.new_tokens)
        bat_s, bat_tokens = batched(model, prompts, args.new_tokens)
        n = B * args.new_tokens
        row = {
            "round": r,
            "sequential_s": seq_s,
            "batched_s": bat_s,
            "sequential_tok_s": n / seq_s,
            "batched_tok_s": n / bat_s,
            "speedup": seq_s / bat_s,
            "rows_identical": sum(a == b for a, b in zip(seq_tokens, bat_tokens)),
        }
        print(
            f"round {r}  {spec:22} sequential {row['sequential_tok_s']:6.2f} tok/s   batched "
            f"{row['batched_tok_s']:6.2f} tok/s   speed-up x{row['speedup']:.2f}   rows identical "
            f"{row['rows_identical']}/{B}",
            flush=True,
        )
        detach(model)
        if native is None:
            model.__dict__.pop("make_cache", None)
        return row

    def next_round(done, _):
        nonlocal r
        r = done + 1

    rounds = interleave({spec: (lambda spec=spec: compare(spec)) for spec in specs}, args.rounds, next_round)
    results = []
    for spec in specs:
        rs = rounds[spec]
        results.append(
            {
                "spec": spec,
                "speedup": median(x["speedup"] for x in rs),
                "sequential_tok_s": median(x["sequential_tok_s"] for x in rs),
                "batched_tok_s": median(x["batched_tok_s"] for x in rs),
                "rows_identical": min(x["rows_identical"] for x in rs),
                "rounds": rs,
            }
        )
    base = results[0]["speedup"]
    rotating = results[1]["speedup"]
    for r in results:
        r["speedup_vs_full_speedup"] = r["speedup"] / base
        r["speedup_vs_rotating_speedup"] = r["speedup"] / rotating
        print(
            f"median  {r['spec']:22} speed-up x{r['speedup']:.2f}   x{r['speedup_vs_rotating_speedup']:.2f} of "
            f"RotatingKVCache's   rows identical {r['rows_identical']}/{B}",
            flush=True,
        )
    out = write_json(
        result_name("batch_speed", args),
        {
            "model": str(path),
            "batch": B,
            "budget": args.budget,
            "prompt_lengths": lengths,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "results": results,
            "note": "one run, side by side; batched RotatingKVCache rows ignore keep=4 (mlx-lm's BatchRotatingKVCache), "  # noqa: E501
            "so its rows may differ from sequential ones",
        },
        args.out,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
