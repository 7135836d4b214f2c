"""Paired comparison of two methods' perplexity on the same tokens, from saved quality results.

    python benchmarks/paired.py benchmarks/results/quality_token_cam_vs_h2o_*.json --a cam --b h2o
    python benchmarks/paired.py --smoke          # two runs of the tiny model (the test suite runs this)

Rows of ``quality.py``'s json files (which keep per-token NLLs) are matched by the tokens they ran on (the
files' ``ids_sha256``), the model, the mode (and chunk), the budget and the seed; for each match, the ratio ``ppl_A /
ppl_B`` with a paired
block-bootstrap interval (:func:`kvpolicy_core.eval.perplexity.paired_ratio`), then per compression ratio (tokens
over budget) pooled over every text and model given (:func:`kvpolicy_core.eval.perplexity.pooled_ratio`, blocks
drawn within each text). Writes paired[_tag].json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import parser, result_name, write_json

from kvpolicy_core.eval.perplexity import paired_ratio, pooled_ratio


def load_rows(paths):
    """Every row with per-token NLLs, tagged with its file's model, text, start and token hash."""
    rows = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        for r in data["rows"]:
            if "nll" in r:
                rows.append(
                    {
                        **r,
                        "file": str(path),
                        "model": data.get("model"),
                        "text": data.get("text"),
                        "start": data.get("start"),
                        "ids": data.get("ids_sha256") or str(path),
                        "mode": data.get("mode"),
                        "chunk": data.get("chunk"),
                    }
                )
    return rows


def compare(rows, a: str, b: str, block: int = 32):
    """ppl ratio of method ``a`` to ``b`` for every (tokens, budget, seed) both ran."""

    def key_of(r):  # the same tokens, model, mode and budget: only the method differs
        return r["ids"], r["model"], r["mode"], r["chunk"], r["budget"], r["seed"]

    ref = {}
    for r in rows:
        if r["method"] == b:
            if key_of(r) in ref:
                raise ValueError(
                    f"{r['file']} and {ref[key_of(r)]['file']}: two {b!r} rows for the same tokens, "
                    f"model, mode, budget and seed; give one of them"
                )
            ref[key_of(r)] = r
    out = []
    for r in rows:
        key = key_of(r)
        if r["method"] != a or key not in ref:
            continue
        if len(r["nll"]) != len(ref[key]["nll"]):
            raise ValueError(f"{r['file']} and {ref[key]['file']}: same token hash, different lengths")
        out.append(
            {
                "model": r["model"],
                "text": r["text"],
                "start": r["start"],
                "budget": r["budget"],
                "compression": round(r["compression"], 2),
                "seed": r["seed"],
                "a": a,
                "b": b,
                "ppl_a": r["perplexity"],
                "ppl_b": ref[key]["perplexity"],
                **paired_ratio(r["nll"], ref[key]["nll"], block=block),
                "_pair": (r["nll"], ref[key]["nll"]),
            }
        )
    return sorted(out, key=lambda c: (str(c["model"]), str(c["text"]), c["start"] or 0, c["budget"] or 0, c["seed"]))


def pooled(found, block: int = 32):
    """One pooled comparison per compression ratio over every (text, model) of ``found`` (seed 0)."""
    groups = {}
    for c in found:
        if c["seed"] == 0:
            groups.setdefault(c["compression"], []).append(c)
    return [
        {
            "compression": x,
            "a": cs[0]["a"],
            "b": cs[0]["b"],
            "cases": [f"{c['model']} {c['text']} {c['start'] or 0}" for c in cs],
            **pooled_ratio([c["_pair"] for c in cs], block=block),
        }
        for x, cs in sorted(groups.items())
    ]


def main():
    p = parser(__doc__)
    p.add_argument("files", nargs="*", help="quality.py result files (json)")
    p.add_argument("--a", default="cam", help="method whose perplexity is the numerator")
    p.add_argument("--b", default="h2o", help="method it is compared to")
    p.add_argument("--block", type=int, default=32, help="bootstrap block length in tokens")
    args = p.parse_args()
    files = args.files
    if args.smoke:
        tmp = Path(tempfile.mkdtemp())
        subprocess.run(
            [
                sys.executable,
                str(Path(__file__).with_name("quality.py")),
                "--smoke",
                "--methods",
                f"{args.a};{args.b}",
                "--out",
                str(tmp),
            ],
            check=True,
            capture_output=True,
        )
        files = [str(tmp / "quality_token_smoke.json")]
    if not files:
        p.error("give quality.py result files (or --smoke)")
    try:
        found = compare(load_rows(files), args.a, args.b, args.block)
    except ValueError as exc:
        sys.exit(f"paired.py: {exc}")
    if not found:
        sys.exit(f"no rows of {args.a!r} and {args.b!r} on the same tokens in {len(files)} file(s)")
    for c in found:
        print(
            f"{c['model']:8} {c['text']:7} start {c['start'] or 0:5} budget {c['budget']:5} seed {c['seed']}: "
            f"{c['a']} {c['ppl_a']:.3f} / {c['b']} {c['ppl_b']:.3f} = x{c['ratio']:.4f} "
            f"(95% CI {c['low']:.4f}-{c['high']:.4f}, P(worse) {c['p_worse']:.2f})"
        )
    pools = pooled(found, args.block)
    for c in pools:
        print(
            f"pooled over {c['texts']} text(s) at {c['compression']:g}x ({c['tokens']} tokens): "
            f"{c['a']} / {c['b']} = x{c['ratio']:.4f} (95% CI {c['low']:.4f}-{c['high']:.4f}, "
            f"P(worse) {c['p_worse']:.2f})"
        )
    tag = result_name("paired", args)
    comparisons = [{k: v for k, v in c.items() if k != "_pair"} for c in found]
    print(f"wrote {write_json(tag, {'files': files, 'comparisons': comparisons, 'pooled': pools}, Path(args.out))}")


if __name__ == "__main__":
    main()
