"""Choose the default protected recent window: perplexity vs `recent` on the default model.

    python benchmarks/recent_window.py [--tokens 320] [--budget 64]

Token-by-token perplexity (StreamingLLM recipe) of the default corpus for H2O and CaM at
one budget, for recent = 0 and budget/8, /4, /2, (budget - n_sink - 1). Writes
benchmarks/results/recent_window.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from kvpolicy_core.blas import load_optimized_blas

load_optimized_blas(quiet=True)

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402

from kvpolicy_core.evaluation import perplexity  # noqa: E402
from kvpolicy_core.model.corpus import default_corpus  # noqa: E402
from kvpolicy_core.model.default import ensure_default_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=320)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--methods", default="h2o,cam")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "recent_window.json"))
    args = p.parse_args()
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
    out = {
        "command": " ".join(["python"] + sys.argv),
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "python": platform.python_version()},
        "tokens": len(ids),
        "budget": b,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"full: ppl {rows[0]['perplexity']:.3f}; wrote {args.out}")


if __name__ == "__main__":
    main()
