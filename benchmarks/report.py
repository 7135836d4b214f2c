"""Print the markdown tables of docs/results/benchmarks.md from the JSON under benchmarks/results/.

python benchmarks/report.py > /tmp/tables.md
"""

from __future__ import annotations

import json

import numpy as np
from _harness import RESULTS


def load(name):
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def quality(name):
    d = load(name)
    if not d:
        return
    print(f"\n### {name} ({d['tokens']} tokens, chunk {d['chunk']}); `{d['command']}`\n")
    budgets = sorted({r["budget"] for r in d["rows"] if r["budget"]})
    full = next(r for r in d["rows"] if r["method"] == "full")["perplexity"]
    print("| method | " + " | ".join(f"budget {b} ({d['tokens'] // b}x)" for b in budgets) + " |")
    print("| --- | " + " | ".join("---" for _ in budgets) + " |")
    print(f"| full cache | {full:.3f} |" + " |" * (len(budgets) - 1))
    for m in dict.fromkeys(r["method"] for r in d["rows"] if r["method"] != "full"):
        cells = []
        for b in budgets:
            v = [r["perplexity"] for r in d["rows"] if r["method"] == m and r["budget"] == b]
            if not v:
                cells.append("")
                continue
            spread = f" ± {np.std(v):.2f}" if len(v) > 1 else ""
            cells.append(f"{np.mean(v):.3f}{spread} ({100 * (np.mean(v) / full - 1):+.1f}%)")
        print(f"| {m} | " + " | ".join(cells) + " |")


def perturbation():
    d = load("perturbation")
    if not d:
        return
    print(f"\n### perturbation; `{d['command']}`\n")
    for line in d["headline"]:
        print(f"    {line}")
    rows = [r for r in d["rows"] if r["data"] == "synthetic" and r["mode"] == "prefill" and not r["merge_keys"]]
    names = list(dict.fromkeys(r["disposition"] for r in rows))
    cells = sorted({(r["seq"], r["budget"]) for r in rows})
    print("\n| seq | budget | x | " + " | ".join(names) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in names) + " |")
    for seq, b in cells:
        vals = [
            np.mean([r["distance"] for r in rows if r["seq"] == seq and r["budget"] == b and r["disposition"] == n])
            for n in names
        ]
        print(f"| {seq} | {b} | {seq // b} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    keys = [
        r
        for r in d["rows"]
        if r["data"] == "synthetic" and r["mode"] == "prefill" and r["seq"] == 1024 and r["budget"] == 64
    ]
    for n in ("mean ungated", "sim_weighted ungated"):
        a = np.mean([r["distance"] for r in keys if r["disposition"] == n and not r["merge_keys"]])
        b = np.mean([r["distance"] for r in keys if r["disposition"] == n and r["merge_keys"]])
        print(f"\nkeys merged, seq 1024 budget 64, {n}: values only {a:.3f}, keys too {b:.3f}")
    real = [r for r in d["rows"] if r["data"].startswith("gemma")]
    if real:
        print("\n| real K/V (decode, recent = budget/2) | budget | signal | " + " | ".join(names) + " |")
        print("| --- | --- | --- | " + " | ".join("---" for _ in names) + " |")
        for data in sorted({r["data"] for r in real}):
            for b in sorted({r["budget"] for r in real}):
                for sig in ("proxy", "observed"):
                    vals = [
                        next(
                            (
                                r["distance"]
                                for r in real
                                if r["data"] == data
                                and r["budget"] == b
                                and r["signal"] == sig
                                and r["disposition"] == n
                            ),
                            float("nan"),
                        )
                        for n in names
                    ]
                    print(f"| {data} | {b} | {sig} | " + " | ".join(f"{v:.4f}" for v in vals) + " |")


def speed():
    d = load("step_cost_grid")
    if d:
        print(f"\n### step cost; `{d['command']}`\n")
        print("| budget | D | H | KVCache us | Rotating x | H2O x | CaM x | scoring / attention |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in d["rows"]:
            print(
                f"| {r['budget']} | {r['head_dim']} | {r['kv_heads']} | {r['us_KVCache']:.0f} | {r['ratio_RotatingKVCache']:.2f} | "  # noqa: E501
                f"{r['ratio_h2o']:.2f} | {r['ratio_cam']:.2f} | {r['scoring_over_attention']:.2f} |"
            )
    d = load("e2e_speed_interleaved")
    if d:
        print(f"\n### end to end; `{d['command']}`\n")
        print("| method | prefill tok/s | x full | decode tok/s | x full | KV kept MiB | KV full MiB | peak MB |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in d["rows"]:
            print(
                f"| {r['spec']} | {r['prefill_tps']:.1f} | {r['prefill_ratio']:.2f} | {r['decode_tps']:.2f} | {r['decode_ratio']:.2f} | "  # noqa: E501
                f"{r['kv_bytes_kept'] / 2**20:.1f} | {r['kv_bytes_full'] / 2**20:.1f} | {r['peak_memory_mb']:.0f} |"
            )
        for r in d.get("long", []):
            p = r["points"]
            print(
                f"\nlong {r['spec']}: ms/step {p[0]['ms_per_step']:.1f} -> {p[-1]['ms_per_step']:.1f}, "
                f"active MB {p[0]['active_mb']:.0f} -> {p[-1]['active_mb']:.0f}"
            )
    d = load("soak_10k")
    if d:
        print(f"\n### soak; `{d['command']}`\n")
        print("| method | steps | ms/step first | ms/step last | last/first | active MB first | last |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in d["runs"]:
            p = r["points"]
            print(
                f"| {r['spec']} | {r['steps']} | {p[1]['ms_per_step']:.2f} | {p[-1]['ms_per_step']:.2f} | "
                f"{r['time_ratio_last_first']:.2f} | {p[1]['active_mb']:.1f} | {p[-1]['active_mb']:.1f} |"
            )
    d = load("blas_speedup")
    if d:
        print(f"\n### BLAS; `{d['command']}`\n")
        print(json.dumps({k: v for k, v in d.items() if k not in ("versions", "command")}, indent=1))


if __name__ == "__main__":
    quality("quality_token")
    quality("quality_chunked")
    perturbation()
    speed()
