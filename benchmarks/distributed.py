"""Policy caches under mlx-lm's distributed inference: tokens/s and KV bytes per rank, 1 rank vs 2 ranks.

    python benchmarks/distributed.py                    # qwen2-shaped random model, 512 + 64 tokens
    python benchmarks/distributed.py --prompt 256 --decode 32 --budget 64
    python benchmarks/distributed.py --smoke            # tiny model, a few tokens

Writes a random-weight mlx-lm model directory (qwen2: it supports both tensor and pipeline
parallelism), then runs the same worker three ways, side by side in one run: one process,
``mlx.launch --backend ring -n 2`` tensor parallel, and the same pipeline parallel (both ranks
on this machine, over 127.0.0.1). Each run: full cache, h2o and cam at ``--budget``; prefill
(the prompt in one chunk) and greedy decode tokens/s, the KV bytes each rank holds, and a
check that every configuration generated the same tokens.

Two ranks on one 2-core machine measure the *overhead* of splitting (collectives, two
processes sharing two cores), not a speed-up: a split pays off when each rank has its own
machine (memory, bandwidth). Writes benchmarks/results/distributed.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _harness import RESULTS, Stopwatch, parser, result_name, write_json  # _common (the BLAS) loads per process

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- worker (every rank)
def worker(args) -> None:
    from _common import mx

    from kvpolicy_core.eval.perplexity import kv_bytes, make_caches
    from kvpolicy_core.runtime.distributed import load_sharded, world

    rank, size = world()
    if size > 1:
        model, _, mode = load_sharded(args.model_dir, args.parallel)
    else:
        import mlx_lm

        model, mode = mlx_lm.load(args.model_dir)[0], "none"
    vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    prompt = mx.random.randint(3, vocab, (1, args.prompt), key=mx.random.key(7))
    barrier = lambda: mx.eval(mx.distributed.all_sum(mx.array(1.0)))  # noqa: E731
    rows = []
    for spec in args.methods.split(";"):
        caches = make_caches(model, spec)
        barrier()
        sw = Stopwatch()
        tok = mx.argmax(model(prompt, cache=caches)[:, -1:], axis=-1)
        mx.eval(tok)
        t_prefill = sw.wall
        tokens = [tok.item()]
        sw.restart()
        for _ in range(args.decode):
            tok = mx.argmax(model(tok, cache=caches)[:, -1:], axis=-1)
            tokens.append(tok.item())
        t_decode = sw.wall
        kept, full = kv_bytes(caches)
        rows.append(
            {
                "spec": spec,
                "prefill_tps": args.prompt / t_prefill,
                "decode_tps": args.decode / t_decode,
                "kv_bytes_kept": kept,
                "kv_bytes_full": full,
                "tokens": tokens,
            }
        )
    out = Path(args.out_file)
    out.with_name(f"{out.stem}.rank{rank}.json").write_text(
        json.dumps({"rank": rank, "size": size, "mode": mode, "layers": len(model.layers), "rows": rows})
    )


# ----------------------------------------------------------------------------- driver
def run_config(label, ranks, parallel, model_dir, work, args):
    out = work / f"{label}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--model-dir",
        str(model_dir),
        "--out-file",
        str(out),
        "--parallel",
        parallel,
        "--methods",
        ";".join(args.specs),
        "--prompt",
        str(args.prompt),
        "--decode",
        str(args.decode),
    ]
    if ranks > 1:
        from kvpolicy_core.runtime.distributed import free_port_pair

        launcher = str(Path(sys.executable).parent / "mlx.launch")
        cmd = [launcher, "--backend", "ring", "-n", str(ranks), "-p", str(free_port_pair()), "--", *cmd]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=args.timeout, cwd=HERE)
    files = [out.with_name(f"{out.stem}.rank{r}.json") for r in range(ranks)]
    if proc.returncode != 0 or "exited with code" in proc.stderr or not all(f.is_file() for f in files):
        raise SystemExit(f"{label} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(f.read_text()) for f in files]


def main() -> None:
    p = parser(__doc__, smoke_help="tiny model, a few tokens")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per configuration before it is killed")
    # worker mode (started by the driver, once per rank)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out-file", help=argparse.SUPPRESS)
    p.add_argument("--parallel", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--methods", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    import _common  # noqa: F401  (the BLAS, before mlx)

    from kvpolicy_core.testing.tiny_models import write_model_dir

    if args.smoke:
        args.prompt, args.decode, args.budget, args.hidden, args.layers = 48, 8, 16, 64, 2
    args.specs = ["full", f"h2o:budget={args.budget}", f"cam:budget={args.budget}"]
    heads = max(4, args.hidden // 64)
    sizes = dict(
        hidden=args.hidden,
        layers=args.layers,
        heads=heads,
        kv_heads=heads // 2,
        intermediate=2 * args.hidden,
        vocab=512,
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = write_model_dir(work / "model", "qwen2", **sizes)
        configs = [("1 rank", 1, "auto"), ("2 ranks tensor", 2, "tensor"), ("2 ranks pipeline", 2, "pipeline")]
        results = {}
        for label, ranks, parallel in configs:
            sw = Stopwatch()
            results[label] = run_config(label.replace(" ", "_"), ranks, parallel, model_dir, work, args)
            print(f"{label}: {sw.wall:.1f} s", file=sys.stderr)

    base = {r["spec"]: r for r in results["1 rank"][0]["rows"]}
    rows = []
    print(
        f"model: qwen2-shaped random weights {sizes} | prompt {args.prompt} | decode {args.decode} | "
        f"budget {args.budget}\n(two ranks on one machine: this measures the overhead of splitting, not a speed-up)"
    )
    header = (
        f"{'config':18} {'method':14} {'prefill tok/s':>13} {'decode tok/s':>12} {'x 1 rank':>8} "
        f"{'KV kept/rank':>13} {'KV full/rank':>13} {'same tokens':>11}"
    )
    print(header + "\n" + "-" * len(header))
    for label, ranks_out in results.items():
        for i, spec in enumerate(args.specs):
            r0 = ranks_out[0]["rows"][i]
            per_rank = [ro["rows"][i] for ro in ranks_out]
            row = {
                "config": label,
                "ranks": len(ranks_out),
                "mode": ranks_out[0]["mode"],
                "spec": spec,
                "prefill_tps": r0["prefill_tps"],
                "decode_tps": r0["decode_tps"],
                "decode_vs_1_rank": r0["decode_tps"] / base[spec]["decode_tps"],
                "prefill_vs_1_rank": r0["prefill_tps"] / base[spec]["prefill_tps"],
                "kv_bytes_kept_per_rank": [r["kv_bytes_kept"] for r in per_rank],
                "kv_bytes_full_per_rank": [r["kv_bytes_full"] for r in per_rank],
                "same_tokens_as_1_rank": all(r["tokens"] == base[spec]["tokens"] for r in per_rank),
            }
            rows.append(row)
            mib = lambda b: f"{max(b) / 2**20:.2f} MiB" if max(b) >= 2**20 else f"{max(b) / 2**10:.1f} KiB"  # noqa: E731
            print(
                f"{label:18} {spec:14} {row['prefill_tps']:13.1f} {row['decode_tps']:12.1f} "
                f"{row['decode_vs_1_rank']:8.2f} {mib(row['kv_bytes_kept_per_rank']):>13} "
                f"{mib(row['kv_bytes_full_per_rank']):>13} {str(row['same_tokens_as_1_rank']):>11}"
            )
    path = write_json(
        result_name("distributed", args),
        {
            "model": {"type": "qwen2", **sizes},
            "prompt": args.prompt,
            "decode": args.decode,
            "budget": args.budget,
            "note": "two ranks share one machine's cores: overhead, not speed-up",
            "rows": rows,
        },
        args.out or RESULTS,
    )
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
