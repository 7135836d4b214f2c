"""Model-level quality: perplexity of the default model on the default corpus with bounded caches.

    python benchmarks/quality.py --mode token --tokens 2048 --budgets 256
    python benchmarks/quality.py --mode chunked --chunk 256 --tokens 2048 --budgets 128,256,512,1024 --seeds 3
    python benchmarks/quality.py --smoke          # tiny random model (the test suite runs this)
    python benchmarks/quality.py --text /usr/share/common-licenses/GPL-3 --tag gpl \
        --methods "h2o observed;cam:merge=mass,signal=observed"

``--methods`` takes names from METHODS or raw config strings (then separate them with ``;``); ``--text`` a text
file instead of the default corpus (pydoc topics); ``--tag`` a suffix for the result files.

``token`` mode is the StreamingLLM recipe: one token at a time, each token's NLL read before the
cache is reduced. ``chunked`` mode feeds ``--chunk`` tokens per step (prefill-style, faster; each
chunk attends to all of itself). Policies apply to all layers. Gated methods (CaM with the gate)
run with ``--seeds`` seeds; the spread is reported. Writes quality_<mode>.json/.csv and plots
(perplexity vs budget; running NLL vs position) under benchmarks/results/. Each row keeps its per-token
NLLs, so two methods on the same tokens compare with a paired interval: with ``--reference NAME`` (default
``h2o`` when it is among the methods) every other method is compared to it at each budget
(:func:`kvpolicy_core.eval.perplexity.paired_ratio`, ``paired`` in the json); ``benchmarks/paired.py`` compares
rows of saved files.
"""

from __future__ import annotations

import csv
import hashlib
import os
from pathlib import Path

import numpy as np
from _common import parser, result_name, write_json

from kvpolicy_core.eval.perplexity import paired_ratio, perplexity

METHODS = {  # names keep their v0.1 meaning; "h2o" and "cam" are the current defaults
    "full": "full",
    "streamingllm (mlx-lm rotating)": "rotating",
    "random": "random",
    "h2o proxy": "h2o:signal=proxy",
    "h2o observed": "h2o:signal=observed,obs_window=0,pool=1",
    "h2o": "h2o",
    "cam sim_weighted gated": "cam:merge=sim_weighted,signal=proxy",
    "cam sim_weighted ungated": "cam:merge=sim_weighted,signal=proxy,gate=false",
    "cam mean gated": "cam:signal=proxy,merge=mean",
    "cam paper": "cam:signal=proxy,merge=paper",
    "cam sim_weighted observed": "cam:merge=sim_weighted",
    "cam mass_blend": "cam:merge=mass_blend",
    "cam mass observed": "cam:merge=mass,obs_window=0,pool=1",
    "cam": "cam",
}
GATED = {"cam sim_weighted gated", "cam mean gated", "cam paper", "cam sim_weighted observed"}


def is_gated(name: str) -> bool:
    """Named gated methods, and raw ``cam`` specs whose merge draws the gate."""
    if name in GATED:
        return True
    from kvpolicy_core.config.parse import parse_config

    spec = METHODS.get(name, name)
    if not spec.startswith("cam"):
        return False
    p = parse_config(spec).policy
    return p.merge_gate and p.merge != "drop"


def spec_for(base: str, budget: int, seed: int) -> str:
    if base == "full":
        return "full"
    if base == "rotating":
        return f"rotating:budget={budget}"
    sep = "," if ":" in base else ":"
    extra = f",seed={seed}" if seed else ""
    return f"{base}{sep}budget={budget}{extra}"


def load(smoke: bool, model: str = "gemma3"):
    if smoke:
        from kvpolicy_core.testing.tiny_models import VOCAB, tiny_llama

        class Tok:
            def encode(self, text):
                return [ord(c) % VOCAB for c in text]

        return tiny_llama(), Tok()
    import mlx.core as mx
    import mlx_lm

    from kvpolicy_core.model.resolve import resolve_model_path

    m, tok = mlx_lm.load(str(resolve_model_path(None if model == "gemma3" else model)))
    m.set_dtype(mx.float32)
    return m, tok


def main():
    p = parser(__doc__)
    p.add_argument("--mode", choices=["token", "chunked"], default="token")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--budgets", default="256")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated names from: " + ", ".join(METHODS))
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--model", default="gemma3", help="gemma3 (default), smollm2, or an mlx-lm model directory")
    p.add_argument("--text", default="pydoc", help="pydoc (default corpus), stdlib, license, or a file")
    p.add_argument(
        "--start",
        type=int,
        default=0,
        help="first token of the slice evaluated (another slice of the same text: a second sample)",
    )
    p.add_argument(
        "--reference",
        default="h2o",
        help="method the others are compared to, per budget, with a paired interval (if it ran)",
    )
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.budgets, args.seeds = 80, "16,32", 2
    from kvpolicy_core.eval.tasks.haystack import haystack_text

    model, tok = load(args.smoke, args.model)
    ids = tok.encode(haystack_text(args.text))[args.start : args.start + args.tokens]
    chunk = 1 if args.mode == "token" else args.chunk
    budgets = [int(b) for b in args.budgets.split(",")]
    names = [m.strip() for m in args.methods.split(";" if ";" in args.methods else ",")]
    out = Path(args.out)
    tag = result_name(f"quality_{args.mode}", args)
    rows, curves = [], {}
    base = perplexity(model, ids, "full", chunk=chunk, progress=False)
    rows.append(row("full", None, 0, base, base))
    curves["full"] = base["nll"]
    print(f"full: ppl {base['perplexity']:.3f}", flush=True)
    for budget in budgets:
        for name in names:
            if name == "full":
                continue
            seeds = range(args.seeds) if is_gated(name) else [0]
            for seed in seeds:
                r = perplexity(model, ids, spec_for(METHODS.get(name, name), budget, seed), chunk=chunk, progress=False)
                rows.append(row(name, budget, seed, r, base))
                if seed == 0 and budget == budgets[0]:
                    curves[name] = r["nll"]
                print(
                    f"{name:28} budget {budget:5d} seed {seed}: ppl {r['perplexity']:8.3f} "
                    f"({rows[-1]['delta_ppl_pct']:+.1f}%) {r['tokens_per_s']:.1f} tok/s"
                    + (f", {r['merges_per_eviction']:.0%} of evictions merged" if "merges_per_eviction" in r else ""),
                    flush=True,
                )
                save(out, tag, args, ids, rows)
    paired = compare(rows, args.reference)
    for c in paired:
        print(
            f"{c['method']:28} budget {c['budget']:5d}: ppl x{c['ratio']:.4f} of {c['reference']} "
            f"(95% CI {c['low']:.4f}-{c['high']:.4f})",
            flush=True,
        )
    save(out, tag, args, ids, rows, paired)
    if not args.smoke:
        plot(out / f"{tag}.png", rows, curves, budgets[0], len(ids))
    print(f"wrote {out / (tag + '.json')}")


def row(name, budget, seed, r, base):
    return {
        "method": name,
        "spec": r["spec"],
        "budget": budget,
        "seed": seed,
        "compression": (len(r["nll"]) + 1) / budget if budget else 1.0,
        "perplexity": r["perplexity"],
        "delta_ppl_pct": 100 * (r["perplexity"] / base["perplexity"] - 1),
        "tokens_per_s": r["tokens_per_s"],
        "kv_bytes_kept": r["kv_bytes_kept"],
        "kv_bytes_full": r["kv_bytes_full"],
        "peak_memory": r["peak_memory"],
        "nan": r["nan"],
        **({"merges_per_eviction": r["merges_per_eviction"]} if "merges_per_eviction" in r else {}),
        "nll": [round(float(x), 6) for x in r["nll"]],
    }


def compare(rows, reference: str):
    """Every (method, budget) row of seed 0 against ``reference``'s at the same budget: paired_ratio's fields."""
    ref = {r["budget"]: r for r in rows if r["method"] == reference and r["seed"] == 0}
    try:
        return [
            {
                "method": r["method"],
                "budget": r["budget"],
                "reference": reference,
                **paired_ratio(r["nll"], ref[r["budget"]]["nll"]),
            }
            for r in rows
            if r["seed"] == 0 and r["method"] not in (reference, "full") and r["budget"] in ref
        ]
    except ValueError as exc:  # e.g. too few tokens for the interval: the perplexities stand without it
        print(f"no paired comparison: {exc}", flush=True)
        return []


def summary(rows):
    """Mean and spread over seeds per (method, budget)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["method"], r["budget"]), []).append(r["perplexity"])
    return [
        {"method": m, "budget": b, "ppl_mean": float(np.mean(v)), "ppl_std": float(np.std(v)), "seeds": len(v)}
        for (m, b), v in groups.items()
    ]


def save(out, tag, args, ids, rows, paired=()):
    write_json(
        tag,
        {
            "model": "tiny_llama (smoke)" if args.smoke else args.model,
            "text": args.text,
            "start": args.start,
            "mode": args.mode,
            "chunk": 1 if args.mode == "token" else args.chunk,
            "tokens": len(ids),
            "ids_sha256": hashlib.sha256(np.asarray(ids, np.int64).tobytes()).hexdigest(),
            "rows": rows,
            "summary": summary(rows),
            "paired": list(paired),
        },
        out,
    )
    table = [{k: v for k, v in r.items() if k != "nll"} for r in rows]  # per-token NLLs: in the json only
    path = out / f"{tag}.csv"
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in table for k in r)))
        w.writeheader()
        w.writerows(table)
    os.replace(tmp, path)


def plot(path, rows, curves, budget, T):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    full = next(r["perplexity"] for r in rows if r["method"] == "full")
    methods = sorted({r["method"] for r in rows if r["method"] != "full"})
    for m in methods:
        pts = sorted((s["budget"], s["ppl_mean"], s["ppl_std"]) for s in summary(rows) if s["method"] == m)
        if pts:
            b, mean, std = zip(*pts)
            ax[0].errorbar(b, mean, yerr=std, marker="o", capsize=3, label=m)
    ax[0].axhline(full, color="black", lw=1, ls="--", label="full cache")
    ax[0].set(
        xscale="log",
        yscale="log",
        xlabel="budget (tokens per layer)",
        ylabel="perplexity",
        title=f"perplexity vs budget ({T} tokens)",
    )
    ax[0].legend(fontsize=7)
    k = 64
    for m, nll in curves.items():
        if len(nll) > k:
            ax[1].plot(np.arange(k, len(nll) + 1), np.convolve(nll, np.ones(k) / k, mode="valid"), label=m, lw=1)
    ax[1].axvline(budget, color="gray", lw=0.8, ls=":")
    ax[1].set(xlabel="position", ylabel=f"NLL (moving average, {k})", title=f"running NLL, budget {budget}")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
