"""Retrieval: needle-in-a-haystack accuracy of bounded caches, per depth and haystack length.

    python benchmarks/needle.py --budgets 256,128 --lengths 1000 --haystacks pydoc,stdlib
    python benchmarks/needle.py --prefill-steps 256 --tag chunked          # chunked prefill
    python benchmarks/needle.py --task needle-multikey --tag multikey
    python benchmarks/needle.py --model smollm2 --tag smollm2
    python benchmarks/needle.py --smoke          # tiny random model (the test suite runs this)

Methods are names from METHODS or any config string (its budget set by --budgets). Writes
needle_<tag>.json (every trial, and accuracy per depth) and needle_<tag>.png (depth x
length heat-map, one panel per method and budget) under benchmarks/results/.
"""

from __future__ import annotations

from pathlib import Path

from _common import parser, result_name, with_budget, write_json

from kvpolicy_core.eval.tasks.needle import DEFAULT_DEPTHS, format_summary, run_grid, summarize

METHODS = {
    "full": "full",
    "streamingllm": "rotating",
    "h2o": "h2o",
    "cam": "cam",
    "h2o v0.1": "h2o:signal=proxy",
    "cam v0.1": "cam:signal=proxy",
    "h2o observed": "h2o:signal=observed,obs_window=0,pool=1",
}
DEFAULT_METHODS = "full,streamingllm,h2o v0.1,cam v0.1,h2o,cam"


def spec_for(base: str, budget: int) -> str:
    return with_budget(METHODS.get(base, base), budget)


def load(model: str, smoke: bool):
    if smoke:
        from kvpolicy_core.testing.tiny_models import tiny_llama

        class Tok:
            eos_token_id = 0

            def encode(self, text, add_special_tokens=True):
                return ([1] if add_special_tokens else []) + [32 + ord(c) % 60 for c in text]

            def decode(self, ids):
                return "".join(chr(48 + (i % 10)) if i < 42 else chr(i) for i in ids)

        return tiny_llama(), Tok(), "tiny random llama"
    import mlx.core as mx
    import mlx_lm

    from kvpolicy_core.model.resolve import resolve_model_path

    path = resolve_model_path(None if model == "gemma3" else model)
    m, tok = mlx_lm.load(str(path))
    m.set_dtype(mx.float32)
    return m, tok, str(path)


def main():
    p = parser(__doc__)
    p.add_argument("--task", default="needle", choices=["needle", "needle-multikey"])
    p.add_argument("--model", default="gemma3", help="gemma3 (default), smollm2, or an mlx-lm model directory")
    p.add_argument(
        "--methods", default=DEFAULT_METHODS, help="names from: " + ", ".join(METHODS) + "; or config strings"
    )
    p.add_argument("--budgets", default="256,128")
    p.add_argument("--haystacks", default="pydoc,stdlib")
    p.add_argument("--lengths", default="1000")
    p.add_argument("--depths", default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS))
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--prefill-steps", default="one", help="comma list: 'one' (one chunk) or token counts")
    p.add_argument("--keys", type=int, default=4, help="needles of needle-multikey")
    args = p.parse_args()
    if args.smoke:
        args.methods, args.budgets, args.lengths, args.depths = "full,streamingllm,h2o,cam", "24", "40", "0,1"
    model, tok, path = load(args.model, args.smoke)
    names = [m.strip() for m in args.methods.split(";" if ";" in args.methods else ",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    specs = []
    for b in budgets:
        for n in names:
            s = spec_for(n, b)
            if s not in specs:
                specs.append(s)
    steps = [None if s.strip() == "one" else int(s) for s in args.prefill_steps.split(",")]
    tag = result_name("needle", args)
    out = Path(args.out)
    rows = []

    def log(r):
        rows.append(r)
        print(
            f"{r['method']:44} {r['haystack']:7} len {r['length']:5d} step {str(r['prefill_step']):5} "
            f"depth {r['depth']:.2f}: {'OK ' if r['correct'] else 'no '} {r['output']!r:14} "
            f"kept {r['needle_kept'] if r['needle_kept'] is None else round(r['needle_kept'], 2)} {r['seconds']}s",
            flush=True,
        )
        save(out, tag, args, path, rows)

    run_grid(
        model,
        tok,
        specs,
        task=args.task,
        haystacks=args.haystacks.split(","),
        lengths=[int(x) for x in args.lengths.split(",")],
        depths=[float(d) for d in args.depths.split(",")],
        seeds=range(args.seeds),
        prefill_steps=steps,
        keys=args.keys,
        log=log,
    )
    print(format_summary(summarize(rows)))
    if not args.smoke:
        plot(out / f"{tag}.png", rows, f"{args.task}, {Path(path).name}")
    print(f"wrote {out / (tag + '.json')}")


def save(out, tag, args, path, rows):
    write_json(tag, {"task": args.task, "model": path, "rows": rows, "summary": summarize(rows)}, out)


def plot(path, rows, title):
    """Depth (rows) x haystack length (columns) accuracy, one panel per (method, prefill step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = []
    for r in rows:
        key = (r["method"], r["prefill_step"])
        if key not in panels:
            panels.append(key)
    depths = sorted({r["depth"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    cols = min(4, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(2.6 * cols + 1, 2.4 * nrows + 0.6), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (method, step) in zip(axes.flat, panels):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                hits = [
                    r["correct"]
                    for r in rows
                    if (r["method"], r["prefill_step"], r["depth"], r["length"]) == (method, step, d, n)
                ]
                if hits:
                    grid[i, j] = np.mean(hits)
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_title(f"{method[:34]}\nprefill {'one chunk' if step is None else step}", fontsize=7)
        ax.set_xlabel("haystack tokens", fontsize=7)
        ax.set_ylabel("needle depth", fontsize=7)
    fig.suptitle(f"needle found (fraction of haystacks x seeds): {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
