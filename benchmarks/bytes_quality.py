"""Quality per byte: retrieval and perplexity against the KV bytes kept, for eviction x storage (full precision, 8 and
4 bits), the full cache beside them.

    python benchmarks/hybrid_allocation.py --set heldout --model smollm2 --ppl-tokens 0 --ratios 8 \\
        --methods "cam;cam:kv_bits=8;cam:kv_bits=4" --tag bytes_heldout_smollm2    # (without --model: Gemma 3)
    kvpolicy eval --file benchmarks/data/heldout/estuary.txt --tokens 1024 --budget 256 --budget 128 \\
        --method full --method cam --method cam:kv_bits=8 --method cam:kv_bits=4 ... --json ppl.json
    python benchmarks/bytes_quality.py --retrieval R1.json R2.json --perplexity P1.json P2.json ...

Reads the retrieval results of :mod:`hybrid_allocation` (held-out texts and needle formats, the question at the end of
the prompt, through mlx-lm's ``generate_step``; each row carries the KV bytes its caches keep: the stored rows'
bytes, quantized parts included) and ``kvpolicy eval --json`` perplexity files (token by token), and writes one
table per model (found single needles, two-key answers, mean KV MiB kept, perplexity over the full cache's) as
``bytes_quality[_<tag>].json`` and a plot of the score against the bytes (``.png``, one panel per model).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from _common import parser, result_name, write_json


def storage_of(label: str) -> str:
    m = re.search(r"kv_bits=(\d+)", label)
    return f"{m.group(1)}-bit" if m else "full precision"


def method_of(label: str) -> str:
    """The eviction method of a label, storage and budget fields left out (``cam:kv_bits=4,budget=192`` -> cam)."""
    name, _, fields = label.partition(":")
    kept = [f for f in fields.split(",") if f and not f.startswith(("kv_bits=", "kv_group_size=", "budget="))]
    return name + (":" + ",".join(kept) if kept else "")


def retrieval_rows(paths):
    """{model: {(method, storage, ratio): {single: [scores], twokey: [...], bytes: [...]}}}."""
    out = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for p in paths:
        data = json.loads(Path(p).read_text(encoding="utf-8"))
        model = Path(data["config"]["model"]).name
        for r in data["rows"]:
            key = (method_of(r["method_label"]), storage_of(r["method_label"]), r.get("ratio"))
            out[model][key][r["kind"]].append(r["score"])
            out[model][key]["bytes"].append(r["kv_bytes_kept"])
    return out


def perplexity_rows(paths):
    """{model: {(method, storage, ratio): [ppl / full ppl per text]}} from ``kvpolicy eval --json`` files."""
    out = defaultdict(lambda: defaultdict(list))
    for p in paths:
        data = json.loads(Path(p).read_text(encoding="utf-8"))
        model = Path(str(data.get("model", "model"))).name
        results = data["results"]  # one per method: "spec" (its config string, budget included), "perplexity"
        full = next(r["perplexity"] for r in results if r["spec"] == "full")
        for r in results:
            budget = re.search(r"budget=(\d+)", r["spec"])
            if budget is None:  # the full cache (the denominator) or a cache without a budget
                continue
            ratio = r.get("tokens", data.get("tokens")) / int(budget.group(1))
            key = (method_of(r["spec"]), storage_of(r["spec"]), round(ratio))
            out[model][key].append(r["perplexity"] / full)
    return out


def table(model: str, rows, ppl) -> tuple:
    lines = [
        f"\n{model}: found (single needles, two-key answers), mean KV kept, perplexity / full (held-out texts)",
        "| method | storage | ratio | single | two-key | KV kept MiB | ppl / full |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    records = []
    for (method, storage, ratio), v in sorted(rows.items(), key=lambda kv: (kv[0][2] or 0, kv[0][0], kv[0][1])):
        single, twokey = v.get("single", []), v.get("twokey", [])
        mib = sum(v["bytes"]) / len(v["bytes"]) / 2**20
        ratio_key = None if ratio is None else round(ratio)
        p = ppl.get((method, storage, ratio_key), [])
        rec = {
            "method": method,
            "storage": storage,
            "ratio": ratio,
            "single": [int(sum(single)), len(single)],
            "twokey": [int(sum(twokey)), len(twokey)],
            "kv_mib": round(mib, 3),
            "ppl_over_full": [round(x, 4) for x in p],
        }
        records.append(rec)
        pp = " / ".join(f"{x:.3f}" for x in p) or "-"
        lines.append(
            f"| {method} | {storage} | {'-' if ratio is None else f'{ratio:g}x'} | "
            f"{rec['single'][0]}/{rec['single'][1]} | {rec['twokey'][0]}/{rec['twokey'][1]} | {mib:.2f} | {pp} |"
        )
    return "\n".join(lines), records


def plot(per_model: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = {"full precision": "o", "8-bit": "s", "4-bit": "^"}
    fig, axes = plt.subplots(1, len(per_model), figsize=(6 * len(per_model), 4.5), squeeze=False)
    for ax, (model, records) in zip(axes[0], per_model.items()):
        methods = sorted({r["method"] for r in records})
        colors = {m: f"C{i}" for i, m in enumerate(methods)}
        for r in records:
            n = r["single"][1] + r["twokey"][1]
            score = 100 * (r["single"][0] + r["twokey"][0]) / max(1, n)
            ax.scatter(r["kv_mib"], score, marker=markers[r["storage"]], color=colors[r["method"]], s=50)
        for m in methods:
            ax.scatter([], [], color=colors[m], label=m)
        for s, mk in markers.items():
            ax.scatter([], [], marker=mk, color="gray", label=s)
        ax.set_xscale("log")
        ax.set_xlabel("KV kept (MiB, log)")
        ax.set_ylabel("found (% of single needles and two-key answers)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--retrieval", nargs="+", required=True, help="hybrid_allocation result files")
    p.add_argument("--perplexity", nargs="*", default=[], help="kvpolicy eval --json files")
    args = p.parse_args(argv)
    rows, ppl = retrieval_rows(args.retrieval), perplexity_rows(args.perplexity)
    per_model = {}
    for model, r in rows.items():
        text, records = table(model, r, ppl.get(model, {}))
        print(text)
        per_model[model] = records
    name = result_name("bytes_quality", args)
    path = write_json(name, {"inputs": args.retrieval + args.perplexity, "models": per_model}, Path(args.out))
    plot(per_model, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
