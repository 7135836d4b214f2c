"""End-to-end speed and memory on the default model: full cache, StreamingLLM, H2O and CaM.

    python benchmarks/e2e_speed.py [--prompt 512] [--decode 128] [--budget 256]
    python benchmarks/e2e_speed.py --long 3000      # also a long generation: memory and step time
    python benchmarks/e2e_speed.py --long 2000 --long-methods full,cam --decode 32
    python benchmarks/e2e_speed.py --smoke          # tiny random model
    python benchmarks/e2e_speed.py --rounds 3 --decode 64   # interleaved rounds, medians (a shared machine)
    python benchmarks/e2e_speed.py --interleave --decode 96 # methods alternate at every prefill and step

Measured in one run, one method after the other: prefill tokens/s (the prompt in one chunk),
decode tokens/s, ratios to the full cache and to ``RotatingKVCache`` at the same budget, KV bytes kept
and peak memory (mx.get_peak_memory), and the load average after each run.
``--long N`` decodes N tokens per method recording step time and active memory every 100 steps.
Writes benchmarks/results/e2e_speed.json (and e2e_long.png with --long).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from _common import Stopwatch, interleave, mx, parser, plot_time_memory, result_name, write_json

from kvpolicy_core.eval.perplexity import kv_bytes, make_caches
from kvpolicy_core.testing.tiny_models import VOCAB


def load(smoke):
    if smoke:
        from kvpolicy_core.testing.tiny_models import tiny_llama

        return tiny_llama(layers=4)
    import mlx_lm

    from kvpolicy_core.model.default import ensure_default_model

    return mlx_lm.load(str(ensure_default_model()))[0]


def run(model, spec, prompt, decode, every=100):
    caches = make_caches(model, spec)
    mx.reset_peak_memory()
    sw = Stopwatch()
    logits = model(prompt, cache=caches)
    tok = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(tok)
    t_prefill, c_prefill = sw.wall, sw.cpu
    points, window = [], time.perf_counter()
    sw.restart()
    for step in range(1, decode + 1):
        tok = mx.argmax(model(tok, cache=caches)[:, -1:], axis=-1)
        mx.eval(tok)
        if step % every == 0:
            now = time.perf_counter()
            points.append(
                {"step": step, "ms_per_step": 1e3 * (now - window) / every, "active_mb": mx.get_active_memory() / 2**20}
            )
            window = now
    t_decode, c_decode = sw.wall, sw.cpu
    kept, full = kv_bytes(caches)
    return {
        "spec": spec,
        "prefill_tps": prompt.shape[1] / t_prefill,
        "decode_tps": decode / t_decode,
        "prefill_cpu_ms_per_token": 1e3 * c_prefill / prompt.shape[1],
        "decode_cpu_ms_per_token": 1e3 * c_decode / decode,
        "kv_bytes_kept": kept,
        "kv_bytes_full": full,
        "peak_memory_mb": mx.get_peak_memory() / 2**20,
        "points": points,
    }


def interleaved(model, specs, prompt, decode, prefills=3):
    """Rows as :func:`run`'s, timed method by method at the finest grain: each prefill (``prefills`` times per
    method) and then each decode step alternate over the methods, so a change of load on a shared machine
    hits every method alike within one token; medians of wall and CPU time per prefill and per step."""
    wall = {s: {"prefill": [], "decode": []} for s in specs}
    cpu = {s: {"prefill": [], "decode": []} for s in specs}
    state = {}

    def step(s, phase, caches, tokens):  # one timed forward pass and greedy token
        sw = Stopwatch()
        tok = mx.argmax(model(tokens, cache=caches)[:, -1:], axis=-1)
        mx.eval(tok)
        wall[s][phase].append(sw.wall)
        cpu[s][phase].append(sw.cpu)
        state[s] = (caches, tok)

    interleave({s: (lambda s=s: step(s, "prefill", make_caches(model, s), prompt)) for s in specs}, prefills)
    interleave({s: (lambda s=s: step(s, "decode", *state[s])) for s in specs}, decode)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731  (the upper median, as the rounds' rows)
    rows = []
    for s in specs:
        kept, full = kv_bytes(state[s][0])
        rows.append(
            {
                "spec": s,
                "prefill_tps": prompt.shape[1] / med(wall[s]["prefill"]),
                "decode_tps": 1.0 / med(wall[s]["decode"]),
                "prefill_cpu_ms_per_token": 1e3 * med(cpu[s]["prefill"]) / prompt.shape[1],
                "decode_cpu_ms_per_token": 1e3 * med(cpu[s]["decode"]),
                "kv_bytes_kept": kept,
                "kv_bytes_full": full,
                "peak_memory_mb": mx.get_peak_memory() / 2**20,
                "points": [],
                "load": os.getloadavg()[0],
                "interleaved": {"prefills": prefills, "decode_steps": decode},
            }
        )
    return rows


def median_run(runs):
    """The run with the median decode tokens/s, with the median prefill tokens/s and every round's numbers."""
    runs = sorted(runs, key=lambda r: r["decode_tps"])
    row = dict(runs[len(runs) // 2])
    for k in ("prefill_tps", "prefill_cpu_ms_per_token", "decode_cpu_ms_per_token"):
        row[k] = sorted(r[k] for r in runs)[len(runs) // 2]
    keys = ("prefill_tps", "decode_tps", "prefill_cpu_ms_per_token", "decode_cpu_ms_per_token", "load")
    row["rounds"] = [{k: r[k] for k in keys} for r in runs]
    return row


def main():
    p = parser(
        __doc__,
        rounds=1,
        smoke_help="tiny random model",
        rounds_help="interleaved rounds over the methods (medians reported)",
    )
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--long", type=int, default=0)
    p.add_argument("--long-methods", default="all", help="comma-separated subset of full,rotating,h2o,cam for --long")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="alternate the methods at every prefill and every decode step (medians; peak memory is then "
        "of all methods together): the steadiest ratios on a shared machine",
    )
    p.add_argument(
        "--methods",
        default=None,
        help="';'-separated specs (default: full, rotating, h2o, cam at --budget; a bare name gets the budget)",
    )
    args = p.parse_args()
    if args.smoke:
        args.prompt, args.decode, args.budget, args.long = 64, 16, 32, 0
    model = load(args.smoke)
    prompt = mx.random.randint(0, 1000 if not args.smoke else VOCAB, (1, args.prompt), key=mx.random.key(0))
    specs = ["full", f"rotating:budget={args.budget}", f"h2o:budget={args.budget}", f"cam:budget={args.budget}"]
    if args.methods:
        specs = [s if ":" in s or s == "full" else f"{s}:budget={args.budget}" for s in args.methods.split(";")]
        specs = [s.replace("{budget}", str(args.budget)) for s in specs]
    for s in specs:
        run(model, s, prompt[:, :16], 4)  # warm-up (and the compiled graphs traced)
    if args.interleave:
        rows = interleaved(model, specs, prompt, args.decode, max(args.rounds, 3))
    else:

        def one_run(s):
            return {**run(model, s, prompt, args.decode), "load": os.getloadavg()[0]}

        runs = interleave({s: (lambda s=s: one_run(s)) for s in specs}, args.rounds)  # a load change hits all alike
        rows = [median_run(runs[s]) for s in specs]
    base = rows[0]
    rot = next((r for r in rows if r["spec"].startswith("rotating")), None)
    for r in rows:
        r["prefill_ratio"] = r["prefill_tps"] / base["prefill_tps"]
        r["decode_ratio"] = r["decode_tps"] / base["decode_tps"]
        if rot is not None:
            r["prefill_vs_rotating"] = r["prefill_tps"] / rot["prefill_tps"]
            r["decode_vs_rotating"] = r["decode_tps"] / rot["decode_tps"]
        if rot is not None:  # CPU time per token (all threads): less sensitive to other processes than wall time
            r["prefill_cpu_vs_rotating"] = rot["prefill_cpu_ms_per_token"] / r["prefill_cpu_ms_per_token"]
            r["decode_cpu_vs_rotating"] = rot["decode_cpu_ms_per_token"] / r["decode_cpu_ms_per_token"]
        vs = (
            (
                f"  vs rotating: prefill x{r['prefill_vs_rotating']:.2f} decode x{r['decode_vs_rotating']:.2f}"
                f" (CPU time: x{r['prefill_cpu_vs_rotating']:.2f}, x{r['decode_cpu_vs_rotating']:.2f})"
            )
            if rot
            else ""
        )
        print(
            f"{r['spec']:22} prefill {r['prefill_tps']:8.1f} tok/s (x{r['prefill_ratio']:.2f})  decode "
            f"{r['decode_tps']:6.2f} tok/s (x{r['decode_ratio']:.2f})  KV {r['kv_bytes_kept'] / 2**20:.1f}/"
            f"{r['kv_bytes_full'] / 2**20:.1f} MiB  peak {r['peak_memory_mb']:.0f} MB  load {r['load']:.1f}{vs}",
            flush=True,
        )
    long_rows = []
    if args.long:
        wanted = None if args.long_methods == "all" else set(args.long_methods.split(","))
        for s in [s for s in specs if wanted is None or s.split(":")[0] in wanted]:
            r = run(model, s, prompt[:, :64], args.long)
            long_rows.append(r)
            pts = r["points"]
            print(
                f"long {s:22} ms/step first {pts[0]['ms_per_step']:.1f} last {pts[-1]['ms_per_step']:.1f}  "
                f"active MB first {pts[0]['active_mb']:.0f} last {pts[-1]['active_mb']:.0f}",
                flush=True,
            )
        plot_time_memory(long_rows, Path(args.out) / "e2e_long.png", "long generation")
    out = write_json(
        result_name("e2e_speed", args),
        {"prompt": args.prompt, "decode": args.decode, "budget": args.budget, "rows": rows, "long": long_rows},
        args.out,
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
