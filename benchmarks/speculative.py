"""Speculative decoding with policy caches: greedy agreement with plain decoding, acceptance and speed.

    python benchmarks/speculative.py [--prompt 512] [--generate 256] [--ratio 4] [--draft-tokens 3]
    python benchmarks/speculative.py --smoke          # tiny random models

The target is the default model (Gemma 3 270M, float32); the draft is a 4-bit copy of it made once with
``mlx_lm.convert`` into ``$KVPOLICY_CACHE/gemma3-270m-q4`` (the draft keeps mlx-lm's own cache). For each method
(the full cache, H2O and CaM at ``budget = (prompt + generate) / ratio``), one greedy run through mlx-lm's
``generate_step`` and one through ``speculative_generate_step`` with the same fresh caches: the tokens equal
from the start (``prefix``) and position by position (``agree``), the draft's acceptance rate (accepted draft
tokens over drafted ones) and tokens/s of each (the whole generation, prefill included; one run each: a shared
machine's timings are noisy). Writes benchmarks/results/speculative.json.
"""

from __future__ import annotations

import time
from pathlib import Path

from _common import mx, parser, result_name, write_json

from kvpolicy_core.eval.perplexity import make_caches

TEXT = Path(__file__).resolve().parent / "data" / "heldout" / "clockmaker.txt"


def load(smoke: bool):
    """(target, draft, prompt ids, draft description)."""
    if smoke:
        from kvpolicy_core.testing.tiny_models import tiny_llama

        return tiny_llama(seed=0), tiny_llama(seed=1), None, "tiny llama, seed 1"
    import mlx_lm
    from mlx_lm import convert

    from kvpolicy_core.model.default import cache_root, ensure_default_model

    target_dir = ensure_default_model()
    draft_dir = cache_root() / "gemma3-270m-q4"
    if not (draft_dir / "config.json").exists():
        convert(str(target_dir), mlx_path=str(draft_dir), quantize=True, q_bits=4, q_group_size=64)
    model, tokenizer = mlx_lm.load(str(target_dir))
    draft, _ = mlx_lm.load(str(draft_dir))
    return model, draft, tokenizer, f"{draft_dir.name}: mlx_lm.convert -q --q-bits 4 of the target"


def greedy(model, caches, prompt, n):
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    out = [int(t) for t, _ in zip((t for t, _ in generate_step(prompt, model, prompt_cache=caches)), range(n))]
    return out, time.perf_counter() - t0


def speculative(model, draft, caches, prompt, n, k):
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    steps = list(
        speculative_generate_step(
            prompt, model, draft, prompt_cache=caches + make_prompt_cache(draft), max_tokens=n, num_draft_tokens=k
        )
    )
    seconds = time.perf_counter() - t0
    tokens = [int(t) for t, _, _ in steps]
    accepted = sum(bool(d) for _, _, d in steps)
    rounds = len(steps) - accepted  # every verify step yields one token of the target's own
    return tokens, seconds, accepted, rounds


def agreement(a, b):
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return prefix, sum(x == y for x, y in zip(a, b)) / max(1, min(len(a), len(b)))


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (from the held-out narrative)")
    p.add_argument("--generate", type=int, default=256, help="tokens generated")
    p.add_argument("--ratio", type=float, default=4.0, help="budget = (prompt + generate) / ratio")
    p.add_argument("--draft-tokens", type=int, default=3, help="mlx-lm's num_draft_tokens")
    p.add_argument("--methods", default="full,h2o,cam")
    args = p.parse_args(argv)
    if args.smoke:
        args.prompt, args.generate = 40, 24
    model, draft, tokenizer, draft_name = load(args.smoke)
    if tokenizer is None:
        ids = [3 + i % 90 for i in range(args.prompt)]
    else:
        ids = list(tokenizer.encode(TEXT.read_text()))[: args.prompt]
    prompt = mx.array(ids, dtype=mx.uint32)
    budget = int((args.prompt + args.generate) / args.ratio)
    reference = None
    rows = []
    for method in args.methods.split(","):
        spec = method if method == "full" else f"{method}:budget={budget}"
        plain, t_plain = greedy(model, make_caches(model, spec), prompt, args.generate)
        spec_tokens, t_spec, accepted, rounds = speculative(
            model, draft, make_caches(model, spec), prompt, args.generate, args.draft_tokens
        )
        reference = plain if reference is None else reference
        prefix, agree = agreement(plain, spec_tokens)
        drafted = max(1, rounds * args.draft_tokens)
        row = {
            "spec": spec,
            "prefix": prefix,
            "agree": round(agree, 4),
            "agree_with_first_plain": round(agreement(reference, spec_tokens)[1], 4),
            "plain_agree_with_first_plain": round(agreement(reference, plain)[1], 4),
            "acceptance": round(accepted / drafted, 4),
            "accepted_per_round": round(accepted / max(1, rounds), 3),
            "plain_tps": round(len(plain) / t_plain, 2),
            "speculative_tps": round(len(spec_tokens) / t_spec, 2),
            "speedup": round(t_plain / t_spec * len(spec_tokens) / len(plain), 3),
        }
        rows.append(row)
        print(row, flush=True)
    payload = {
        "prompt": args.prompt,
        "generate": args.generate,
        "budget": budget,
        "ratio": args.ratio,
        "draft_tokens": args.draft_tokens,
        "draft": draft_name,
        "rows": rows,
    }
    print(f"wrote {write_json(result_name('speculative', args), payload, args.out)}")


if __name__ == "__main__":
    main()
