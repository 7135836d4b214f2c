"""Synthetic (and real) attention-output perturbation: the specification's harness, made complete.

    python benchmarks/perturbation.py                # full sweep + headline cell + real K/V
    python benchmarks/perturbation.py --smoke        # tiny sweep (the test suite runs this)

For each configuration a sequence of K/V is compressed to ``budget`` tokens by a policy cache and
probe queries attend to the compressed and to the full cache; the score is the cosine distance
``1 - cos(o_compressed, o_full)`` averaged over probes and heads (lower is better).
Sweep: seq_len {256, 512, 1024, 2048} x budget {32, 64, 128, 256, 512} x disposition {drop, mean,
sim_weighted} x gate {on, off} + the paper's merge, keys merged or not, several seeds, in prefill
mode (the whole sequence as one chunk). The headline cell (seq 1024, budget 64) is also run in
decode mode (one token at a time), the specification's setting. Real K/V and queries are captured
from the default model (a global and a sliding-window layer of Gemma 3 270M) over the corpus.
Writes perturbation.json/.csv and perturbation.png under benchmarks/results/.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from _common import mx, parser, result_name, write_json

from kvpolicy_core import PolicyCache
from kvpolicy_core.testing.conformance import feed

DISPOSITIONS = {
    "drop": "merge=drop",
    "mean gated": "merge=mean,gate=true",
    "mean ungated": "merge=mean,gate=false",
    "sim_weighted gated": "merge=sim_weighted,gate=true",
    "sim_weighted ungated": "merge=sim_weighted,gate=false",
    "paper": "merge=paper,gate=true",
    "mass": "merge=mass,gate=false",  # CaM's default: keys, min_sim 0.85, decode-step merges only
    "mass every loser": "merge=mass,gate=false,min_sim=-1,prompt=true,keys=false",
    "mass_blend": "merge=mass_blend,gate=false",
}


def attention(q, k, v, log_weights=None):
    """q [B, Hq, P, D], k/v [B, H, L, D] -> [B, Hq, P, D] (GQA by repetition); slots' log-weights [B, H, L] added."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    mask = None
    if log_weights is not None:
        mask = mx.repeat(log_weights, rep, axis=1)[:, :, None, :] if rep > 1 else log_weights[:, :, None, :]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask)


def distance(q, k_full, v_full, k_comp, v_comp, log_weights=None) -> float:
    a, b = attention(q, k_full, v_full), attention(q, k_comp, v_comp, log_weights)
    cos = (a * b).sum(-1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1) + 1e-12)
    return float((1 - cos).mean().item())


def compress(K, V, budget, fields, mode, queries=None, n_sink=4, recent=0):
    cache = PolicyCache(f"cam:budget={budget},n_sink={n_sink},recent={recent},{fields}")
    chunks = (K.shape[2],) if mode == "prefill" else (1,) * K.shape[2]
    feed(cache, K, V, chunks, queries=queries)
    k, v, _, _ = cache.retained()
    return k, v, cache


def run_cell(K, V, Q, budget, name, keys, mode, queries=None, recent=0, signal="proxy"):
    fields = DISPOSITIONS[name] + (",keys=true" if keys else "") + f",signal={signal}"
    fields += ",obs_window=0,pool=1"  # the cumulative scorers this harness was built for
    k, v, cache = compress(K, V, budget, fields, mode, queries=queries, recent=recent)
    return distance(Q, K, V, k, v, cache.retained_log_weights()), cache.merges


def synthetic(seq, seed, H=4, D=64, P=32):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (
        mx.random.normal((1, H, seq, D), key=k1),
        mx.random.normal((1, H, seq, D), key=k2),
        mx.random.normal((1, H, P, D), key=k3),
    )


def capture_real(tokens=1024, probes=32, layers=(5, 0)):
    """K, V (after RoPE) and queries of the given layers of the default model over the corpus."""
    import mlx_lm
    import mlx_lm.models.gemma3_text as g

    from kvpolicy_core.model.corpus import default_corpus
    from kvpolicy_core.model.default import ensure_default_model

    model, tok = mlx_lm.load(str(ensure_default_model()))
    ids = mx.array(tok.encode(default_corpus())[: tokens + probes])[None]
    seen, original = [], g.scaled_dot_product_attention

    def record(queries, keys, values, cache, scale, mask, *a, **kw):
        seen.append((queries, keys, values))
        return original(queries, keys, values, cache, scale, mask, *a, **kw)

    g.scaled_dot_product_attention = record
    try:
        model(ids)
    finally:
        g.scaled_dot_product_attention = original
    out = {}
    for layer in layers:
        q, k, v = seen[layer]
        out[layer] = (k[:, :, :tokens], v[:, :, :tokens], q[:, :, tokens:], q[:, :, :tokens])
    return out


def main():
    p = parser(__doc__)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--no-real", action="store_true", help="skip the real K/V from the default model")
    p.add_argument("--headline-only", action="store_true", help="only the headline cell (and real K/V)")
    p.add_argument("--dispositions", default=None, help="comma-separated subset of: " + ", ".join(DISPOSITIONS))
    args = p.parse_args()
    if args.dispositions:
        keep = [d.strip() for d in args.dispositions.split(",")]
        for name in list(DISPOSITIONS):
            if name not in keep:
                del DISPOSITIONS[name]
    seqs, budgets, seeds = ([256, 512, 1024, 2048], [32, 64, 128, 256, 512], range(args.seeds))
    if args.headline_only:
        seqs = []
    if args.smoke:
        seqs, budgets, seeds, args.no_real = [128], [16, 32], range(1), True
    rows = []
    for seq in seqs:
        for budget in [b for b in budgets if b < seq]:
            for seed in seeds:
                K, V, Q = synthetic(seq, seed)
                for name in DISPOSITIONS:
                    for keys in [False, True] if name.startswith(("mean", "sim")) else [False]:
                        d, merges = run_cell(K, V, Q, budget, name, keys, "prefill")
                        rows.append(
                            {
                                "data": "synthetic",
                                "mode": "prefill",
                                "seq": seq,
                                "budget": budget,
                                "compression": seq / budget,
                                "disposition": name,
                                "merge_keys": keys,
                                "seed": seed,
                                "distance": d,
                                "merges": merges,
                            }
                        )
        print(f"seq {seq} done", flush=True)
    head_seq, head_budget = (1024, 64) if not args.smoke else (128, 16)
    for seed in seeds:
        K, V, Q = synthetic(head_seq, seed)
        for name in DISPOSITIONS:
            d, merges = run_cell(K, V, Q, head_budget, name, False, "decode")
            rows.append(
                {
                    "data": "synthetic",
                    "mode": "decode",
                    "seq": head_seq,
                    "budget": head_budget,
                    "compression": head_seq / head_budget,
                    "disposition": name,
                    "merge_keys": False,
                    "seed": seed,
                    "distance": d,
                    "merges": merges,
                }
            )
    if not args.no_real:
        for layer, (K, V, Qprobe, Qstream) in capture_real().items():
            for budget in (64, 128, 256):
                for name in DISPOSITIONS:
                    for signal in ("proxy", "observed"):
                        d, merges = run_cell(
                            K,
                            V,
                            Qprobe,
                            budget,
                            name,
                            False,
                            "decode",
                            queries=Qstream if signal == "observed" else None,
                            recent=budget // 2,
                            signal=signal,
                        )
                        rows.append(
                            {
                                "data": f"gemma3-270m layer {layer}",
                                "mode": "decode",
                                "seq": K.shape[2],
                                "budget": budget,
                                "compression": K.shape[2] / budget,
                                "disposition": name,
                                "merge_keys": False,
                                "seed": 0,
                                "distance": d,
                                "merges": merges,
                                "signal": signal,
                            }
                        )
                print(f"real layer {layer} budget {budget} done", flush=True)
    headline = headline_table(rows, head_seq, head_budget)
    for line in headline:
        print(line)
    out = Path(args.out)
    tag = result_name("perturbation", args)
    write_json(tag, {"rows": rows, "headline": headline}, out)
    with open(out / f"{tag}.csv", "w", newline="") as f:
        fields = sorted({k for r in rows for k in r})
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    if not args.smoke and not args.headline_only:
        plot(rows, out / f"{tag}.png")
    print(f"wrote {out / (tag + '.json')}")


def headline_table(rows, seq, budget):
    lines = [
        f"headline cell: seq {seq}, budget {budget} ({seq // budget}x), synthetic, mean over seeds (spec: drop 0.955, sim_weighted ungated 0.708)"  # noqa: E501
    ]
    for mode in ("prefill", "decode"):
        for name in DISPOSITIONS:
            ds = [
                r["distance"]
                for r in rows
                if r["data"] == "synthetic"
                and r["mode"] == mode
                and r["seq"] == seq
                and r["budget"] == budget
                and r["disposition"] == name
                and not r["merge_keys"]
            ]
            if ds:
                lines.append(f"  {mode:8} {name:22} {np.mean(ds):.4f} ± {np.std(ds):.4f}")
    return lines


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    syn = [
        r
        for r in rows
        if r["data"] == "synthetic" and r["mode"] == "prefill" and r["seq"] == 1024 and not r["merge_keys"]
    ]
    for name in DISPOSITIONS:
        pts = {}
        for r in syn:
            if r["disposition"] == name:
                pts.setdefault(r["compression"], []).append(r["distance"])
        if pts:
            xs = sorted(pts)
            ax[0].plot(xs, [np.mean(pts[x]) for x in xs], marker="o", label=name)
    ax[0].set(
        xscale="log",
        xlabel="compression (seq / budget)",
        ylabel="1 - cos(out, out_full)",
        title="synthetic K/V, seq 1024, prefill mode",
    )
    ax[0].legend(fontsize=7)
    real = [r for r in rows if r["data"].startswith("gemma") and r.get("signal") == "proxy"]
    for data in sorted({r["data"] for r in real}):
        for name in ("drop", "sim_weighted gated", "sim_weighted ungated", "paper"):
            sub = sorted(
                (r["compression"], r["distance"]) for r in real if r["data"] == data and r["disposition"] == name
            )
            if sub:
                ax[1].plot(*zip(*sub), marker="o", label=f"{data.split()[-1]}: {name}", lw=1)
    ax[1].set(xscale="log", xlabel="compression", ylabel="1 - cos", title="real K/V and queries (Gemma 3 270M), decode")
    ax[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
