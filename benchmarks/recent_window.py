"""Choose the default protected recent window: perplexity vs `recent` on the default model.

    python benchmarks/recent_window.py [--tokens 320] [--budget 64]

Token-by-token perplexity (StreamingLLM recipe) of the default corpus for H2O and CaM at
one budget, for recent = 0 and budget/8, /4, /2, (budget - n_sink - 1). Writes
benchmarks/results/recent_window.json.
"""

from __future__ import annotations

from pathlib import Path

import mlx_lm  # noqa: E402
from _common import RESULTS, parser, result_name, write_json  # the BLAS first

from kvpolicy_core.eval.perplexity import perplexity  # noqa: E402
from kvpolicy_core.model.corpus import default_corpus  # noqa: E402
from kvpolicy_core.model.default import ensure_default_model  # noqa: E402


def main() -> None:
    p = parser(__doc__, smoke_help="40 tokens, budget 16")
    p.add_argument("--tokens", type=int, default=320)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--methods", default="h2o,cam")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.budget = 40, 16
    out = Path(args.out) if args.out else RESULTS  # a folder, or a .json file path
    name = out.stem if out.suffix == ".json" else result_name("recent_window", args)
    out = out.parent if out.suffix == ".json" else out
    model, tok = mlx_lm.load(str(ensure_default_model()))
    ids = tok.encode(default_corpus())[: args.tokens]
    b = args.budget
    recents = sorted({0, b // 8, b // 4, b // 2, b - 4 - 1})
    rows = [{"spec": "full", **{k: v for k, v in perplexity(model, ids, "full").items() if k != "nll"}}]
    for method in args.methods.split(","):
        for r in recents:
            res = perplexity(model, ids, f"{method}:budget={b},recent={r}")
            rows.append({"method": method, "recent": r, **{k: v for k, v in res.items() if k != "nll"}})
            print(f"{method} recent={r}: ppl {res['perplexity']:.3f}", flush=True)
    path = write_json(name, {"tokens": len(ids), "budget": b, "rows": rows}, out)
    print(f"full: ppl {rows[0]['perplexity']:.3f}; wrote {path}")


if __name__ == "__main__":
    main()
