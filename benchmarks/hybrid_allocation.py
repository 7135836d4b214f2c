"""Hybrid sliding-window/global models: where a method's budget goes between the layers (``allocation``), measured
by retrieval with the question in the prompt and by perplexity token by token, the full cache beside every method.

    python benchmarks/hybrid_allocation.py --set tuning --shares 0.25,0.5,0.75 --tag tuning      # choose s here
    python benchmarks/hybrid_allocation.py --set heldout --tag heldout                            # then report
    python benchmarks/hybrid_allocation.py --set heldout --model smollm2 --tag heldout_smollm2    # all layers global
    python benchmarks/hybrid_allocation.py --smoke                                                # tiny model

Sets (benchmarks/data/): ``tuning`` (the suite's pydoc and stdlib haystacks, RULER's needle wording, 7 digits)
and ``heldout`` (two original texts and needle formats of their own, 6 digits, other seeds), each a
``needles.json``. A constant is chosen on ``tuning`` only; ``heldout`` reports it.

Retrieval (``question-in-prompt``, :func:`kvpolicy_core.eval.tasks.ruler_runner.run_context`: the prompt through
mlx-lm's ``generate_step`` into the builder's caches, greedy answer): ``single``, a number stated once at each
``--depths`` share of a ``--lengths``-token context; ``twokey``, two keys stated at that depth, each asked in
turn. For every text and depth, the full cache and then each method at each ``--ratios`` (budget = length /
ratio). Perplexity (``--ppl-tokens`` > 0): the first ``--ppl-tokens`` tokens of each text fed one token at a
time (:func:`kvpolicy_core.eval.perplexity.perplexity`) at ``--ppl-ratio``, each method's ppl over the full
cache's, and its ratio to the first method's with the paired block-bootstrap interval
(:func:`kvpolicy_core.eval.perplexity.paired_ratio`).

``--shares a,b`` registers allocations ``hybrid_s<a>`` (the hybrid rule with share ``a``) in this process and adds
``<first method>:allocation=hybrid_s<a>`` to the methods. Writes hybrid_allocation[_<tag>][_smoke].json (after
every context: a long run can be read while it runs) and .png under benchmarks/results/ (--out). ``--report``
prints each cell as found/asked with its 95% Wilson interval (the questions counted as independent; a ``twokey``
context's two are not quite); ``--pool`` one table over several files' rows (more depths asked in a second run
with ``--seed-offset``: new needles, not the first run's again).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from _common import parser, result_name, with_budget, write_json

DATA = Path(__file__).resolve().parent / "data"
SETS = ("tuning", "heldout")
TASKS = {"single": "niah_single", "twokey": "niah_multikey"}


def load_set(name: str) -> dict:
    """The set's needles.json, its texts resolved (a file of the set's folder, or a haystack name)."""
    folder = DATA / name
    spec = json.loads((folder / "needles.json").read_text(encoding="utf-8"))
    spec["texts"] = [str(folder / t) if (folder / t).is_file() else t for t in spec["texts"]]
    return spec


def register_shares(shares):
    """Allocations ``hybrid_s<share>`` (the hybrid rule at each share) in this process's registry; their names."""
    from kvpolicy_core.parts.hybrid_allocation import HybridAllocation
    from kvpolicy_core.plugin.discovery import get_registry

    names = []
    for s in shares:
        name = "hybrid_s" + f"{s:g}".replace(".", "")

        def from_config(cls, config, _s=s):
            return HybridAllocation(_s, HybridAllocation.from_config(config).floor)

        part = type(name, (HybridAllocation,), {"from_config": classmethod(from_config)})
        reg = get_registry()
        if name not in reg.parts["allocations"]:
            reg.add("allocations", name, part, "benchmarks/hybrid_allocation.py")
        names.append(name)
    return names


def text_label(t: str) -> str:
    return Path(t).stem


def contexts_for(tok, spec, task, lengths, depths, model_name, smoke, seed_offset=0):
    from kvpolicy_core.eval.tasks import ruler

    fmt = spec[task]
    out = []
    for text in spec["texts"]:
        for length in lengths:
            for i, d in enumerate(depths):
                params = ruler.TaskParams(
                    keys=fmt.get("keys", 1),
                    questions=fmt.get("questions", 1),
                    digits=4 if smoke else fmt["digits"],
                    statement=fmt["statement"],
                    answer="echo",
                    depth=d,
                )
                ctx = ruler.build_context(
                    tok, TASKS[task], length, text, spec["seed_base"] + seed_offset + i, model=model_name, params=params
                )
                out.append((text_label(text), d, ctx))
    return out


def budgets_of(model, spec):
    """The per-layer budgets the builder gives ``spec`` on ``model`` (None for the full cache)."""
    if spec == "full":
        return None
    from kvpolicy_core.integration.builder import KVCacheBuilder

    return [int(c.budget) for c in KVCacheBuilder.for_model(model, spec)]


def main(argv=None):
    p = parser(__doc__, smoke_help="a tiny random-weight Gemma 3 (sliding + global layers), seconds")
    p.add_argument("--set", choices=SETS, default="tuning")
    p.add_argument("--model", default="gemma3", help="gemma3 (default), smollm2, or an mlx-lm model directory")
    p.add_argument("--methods", default="h2o;h2o:allocation=hybrid", help="';'-separated config strings, no budget")
    p.add_argument("--shares", default="", help="comma list: also the first method with allocation hybrid_s<share>")
    p.add_argument("--tasks", default="single,twokey", help="comma list of: " + ", ".join(TASKS))
    p.add_argument("--lengths", default="1536", help="context tokens, comma list")
    p.add_argument("--ratios", default="4,8,16")
    p.add_argument("--depths", default="0.05,0.25,0.45,0.65,0.85", help="needle depths in [0, 1], comma list")
    p.add_argument("--texts", type=int, default=0, help="use only the set's first N texts (0: all)")
    p.add_argument(
        "--seed-offset",
        type=int,
        default=0,
        help="the i-th depth's needles take seed seed_base + offset + i: --seed-offset 5 with 5 new depths asks "
        "what the 6th-10th depths of one 10-depth run would (more questions without rerunning the first run's)",
    )
    p.add_argument("--ppl-tokens", type=int, default=1024, help="tokens per text for perplexity (0: none)")
    p.add_argument("--ppl-ratio", type=float, default=8.0)
    p.add_argument("--ppl-only", action="store_true", help="perplexity only, no retrieval")
    p.add_argument("--prefill-step", type=int, default=2048)
    p.add_argument("--report", nargs="+", metavar="JSON", help="print the tables of result files and stop")
    p.add_argument("--pool", action="store_true", help="--report: one table over the rows of all the files")
    args = p.parse_args(argv)
    if args.report:
        files = [(f, json.loads(Path(f).read_text(encoding="utf-8"))) for f in args.report]
        for f, data in files:
            print(f"{Path(f).name}: {data['config']['model']}, {data['config']['set']} set, {data['seconds']:.0f} s")
            if not args.pool:
                print(table(data["rows"], data["perplexity"], data["config"]["methods"]) + "\n")
        if args.pool:
            methods = list(dict.fromkeys(m for _, d in files for m in d["config"]["methods"]))
            print(
                table([r for _, d in files for r in d["rows"]], [e for _, d in files for e in d["perplexity"]], methods)
            )
        return
    try:
        run(args)
    except ValueError as exc:
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        sys.exit(2)


def run(args):
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    from kvpolicy_core.eval.perplexity import paired_ratio, perplexity
    from kvpolicy_core.eval.tasks.cli_options import number_list
    from kvpolicy_core.eval.tasks.ruler_runner import record_first_chunk, run_context
    from kvpolicy_core.eval.tasks.tokens import bos_ids, encode

    spec = load_set(args.set)
    if args.texts:
        spec["texts"] = spec["texts"][: args.texts]
    ratios = number_list(args.ratios, "ratios", float, minimum=1.0)
    depths = number_list(args.depths, "depths", float, minimum=0.0, maximum=1.0)
    lengths = number_list(args.lengths, "lengths", positive=True)
    shares = number_list(args.shares, "shares", float, minimum=0.0, maximum=1.0) if args.shares else []
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks or any(t not in TASKS for t in tasks):
        raise ValueError(f"--tasks: expected some of {', '.join(TASKS)} (got {args.tasks!r})")
    methods = [m.strip() for m in args.methods.split(";") if m.strip()]
    if any("budget=" in m for m in methods):
        raise ValueError("--methods: give no budget= (each ratio sets it)")
    for name in register_shares(shares):
        methods.append(f"{methods[0]}{',' if ':' in methods[0] else ':'}allocation={name}")
    if args.smoke:
        import tempfile

        from kvpolicy_core.testing.tiny_models import build_model, model_config, save_model_dir

        cfg = {**model_config("gemma3_text", layers=6), "sliding_window": 256}  # budgets below the window
        path = save_model_dir(Path(tempfile.mkdtemp(prefix="kvpolicy-tiny-")), build_model(cfg, 0, 3.0), cfg)
        model, tok = mlx_lm.load(str(path))
        lengths, depths, ratios, args.ppl_tokens = [1024], depths[:2], ratios[-2:], 96
        spec["texts"] = spec["texts"][:1]
        model_name = "tiny-gemma3"
    else:
        from kvpolicy_core.model.resolve import resolve_model_path

        path = resolve_model_path(None if args.model == "gemma3" else args.model)
        model, tok = mlx_lm.load(str(path))
        model.set_dtype(mx.float32)
        model_name = Path(path).name
    tag = result_name("hybrid_allocation", args)
    out = Path(args.out)
    windows = _windows(model)
    config = {
        "set": args.set,
        "model": str(path),
        "windows": windows,
        "methods": methods,
        "shares": shares,
        "tasks": tasks,
        "lengths": lengths,
        "ratios": ratios,
        "depths": depths,
        "seed_offset": args.seed_offset,
        "texts": [text_label(t) for t in spec["texts"]],
        "needles": {t: spec[t] for t in tasks},
        "prefill_step": args.prefill_step,
        "ppl_tokens": args.ppl_tokens,
        "ppl_ratio": args.ppl_ratio,
        "budgets": {},
    }
    rows, ppl = [], []
    start = time.perf_counter()

    def save():
        payload = {"config": config, "seconds": round(time.perf_counter() - start, 1), "summary": summarize(rows)}
        payload["same_answers_as_first"] = same_answers(rows, methods)
        payload["perplexity"] = ppl
        payload["rows"] = rows
        return write_json(tag, payload, out)

    def budget_for(length, ratio):
        return max(8, int(length / ratio))

    n_runs = len(tasks) * len(spec["texts"]) * len(lengths) * len(depths) * (1 + len(methods) * len(ratios))
    print(f"{model_name}: windows {windows}; {n_runs} retrieval runs", flush=True)
    for m in methods:
        for length in lengths:
            for r in ratios:
                b = budget_for(length, r)
                config["budgets"][with_budget(m, b)] = budgets_of(model, with_budget(m, b))
    for k, v in config["budgets"].items():
        print(f"  {k}: {v}", flush=True)
    done = 0
    for task in [] if args.ppl_only else tasks:
        for text, depth, ctx in contexts_for(
            tok, spec, task, lengths, depths, model_name, args.smoke, args.seed_offset
        ):
            meta = {"text": text, "depth": depth, "kind": task}

            def log(r, extra):
                r.update(extra, **meta)
                rows.append(r)
                print(
                    f"[{done}/{n_runs} {time.perf_counter() - start:.0f}s] {task:6} {text:10} d={depth:.2f} "
                    f"{r['method_label']:44} q{r['question']} {r['score']:.0f} {r['output'].strip()[:30]!r}",
                    flush=True,
                )

            plan = [("full", "full", None, None)] + [
                (m, with_budget(m, budget_for(ctx.length, r)), r, budget_for(ctx.length, r))
                for r in ratios
                for m in methods
            ]
            record = record_first_chunk(model, ctx, args.prefill_step)  # the shared first chunk, computed once
            for method, s, ratio, budget in plan:
                extra = {"method_label": method, "ratio": ratio, "budget": budget}
                run_context(
                    model,
                    tok,
                    ctx,
                    s,
                    ["question-in-prompt"],
                    args.prefill_step,
                    record,
                    log=lambda r, e=extra: log(r, e),
                )
                done += 1
            save()
    if args.ppl_tokens:
        from kvpolicy_core.eval.tasks.haystack import haystack_text

        for text in spec["texts"]:
            ids = (bos_ids(tok) + encode(tok, haystack_text(text)))[: args.ppl_tokens]
            if len(ids) < args.ppl_tokens:
                raise ValueError(f"text {text}: {len(ids)} tokens, fewer than --ppl-tokens {args.ppl_tokens}")
            b = max(8, int(args.ppl_tokens / args.ppl_ratio))
            nll = {}
            for m in ["full"] + methods:
                s = "full" if m == "full" else with_budget(m, b)
                t = time.perf_counter()
                res = perplexity(model, ids, s, chunk=1, progress=False)
                nll[m] = np.asarray(res["nll"], dtype=np.float64)
                print(
                    f"[ppl {time.perf_counter() - start:.0f}s] {text_label(text):10} {m:44} "
                    f"ppl {float(np.exp(nll[m].mean())):.3f} ({time.perf_counter() - t:.0f}s)",
                    flush=True,
                )
            for m in methods:
                entry = {
                    "text": text_label(text),
                    "tokens": len(ids),
                    "budget": b,
                    "method": m,
                    "ppl": float(np.exp(nll[m].mean())),
                    "ppl_full": float(np.exp(nll["full"].mean())),
                    "vs_full": paired_ratio(nll[m], nll["full"]),
                    "vs_first": None if m == methods[0] else paired_ratio(nll[m], nll[methods[0]]),
                    "identical_to_first": bool(np.array_equal(nll[m], nll[methods[0]])),
                    "nll": [round(float(x), 5) for x in nll[m]],
                }
                ppl.append(entry)
                v = entry["vs_first"]
                if v is not None:
                    print(
                        f"  {text_label(text)}: {m} / {methods[0]} = {v['ratio']:.4f} "
                        f"[{v['low']:.4f}, {v['high']:.4f}]",
                        flush=True,
                    )
            save()
    path_json = save()
    print(table(rows, ppl, methods))
    if not args.smoke:
        plot(out / f"{tag}.png", rows, ppl, methods, f"{model_name}, {args.set} set")
    print(f"wrote {path_json} in {time.perf_counter() - start:.0f} s")


def _windows(model):
    """Each cache's sliding window (None: global), as the builder reads them from the model's own caches."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    return [c.max_size if type(c) is RotatingKVCache else None for c in make_prompt_cache(model)]


def summarize(rows):
    """Per (task, ratio, method): questions found / asked, and the full cache's on the same questions."""
    full = {(r["kind"], r["id"], r["question"]): r["score"] for r in rows if r["method_label"] == "full"}
    groups = {}
    for r in rows:
        if r["method_label"] == "full":
            continue
        key = (r["kind"], r["ratio"], r["method_label"])
        g = groups.setdefault(key, {"found": 0, "asked": 0, "full_found": 0})
        g["found"] += int(r["score"] == 1.0)
        g["asked"] += 1
        g["full_found"] += int(full.get((r["kind"], r["id"], r["question"]), 0) == 1.0)
    return [
        {"task": k[0], "ratio": k[1], "method": k[2], **v}
        for k, v in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2]))
    ]


def same_answers(rows, methods):
    """Per method: of its answers, how many are word for word the first method's on the same question and ratio."""
    first = {(r["id"], r["question"], r["ratio"]): r["output"] for r in rows if r["method_label"] == methods[0]}
    out = {}
    for m in methods[1:]:
        mine = [r for r in rows if r["method_label"] == m]
        out[m] = {"same": sum(first.get((r["id"], r["question"], r["ratio"])) == r["output"] for r in mine),
                  "of": len(mine)}  # fmt: skip
    return out


def found_cell(found: int, asked: int) -> str:
    """``found/asked [low-high%]``: the 95% Wilson interval of the share found (questions counted as independent)."""
    from leaderboard import wilson

    low, high = wilson(found / asked, asked)
    return f"{found}/{asked} [{100 * low:.0f}-{100 * high:.0f}%]"


def table(rows, ppl, methods):
    lines = ["| task | ratio | full | " + " | ".join(methods) + " |", "|" + " --- |" * (3 + len(methods))]
    s = summarize(rows)
    for task, ratio in dict.fromkeys((x["task"], x["ratio"]) for x in s):
        cells = {x["method"]: x for x in s if (x["task"], x["ratio"]) == (task, ratio)}
        any_ = next(iter(cells.values()))
        lines.append(
            f"| {task} | {ratio:g}x | {found_cell(any_['full_found'], any_['asked'])} | "
            + " | ".join(found_cell(cells[m]["found"], cells[m]["asked"]) if m in cells else "" for m in methods)
            + " |"
        )
    if ppl:
        lines += [
            "",
            "| text | method | ppl | vs full | vs " + methods[0] + " [95%] |",
            "| --- | --- | --- | --- | --- |",
        ]
        for e in ppl:
            v = e["vs_first"]
            lines.append(
                f"| {e['text']} | {e['method']} | {e['ppl']:.3f} | {100 * (e['vs_full']['ratio'] - 1):+.1f}% | "
                + (f"{v['ratio']:.4f} [{v['low']:.4f}, {v['high']:.4f}]" if v else "(reference)")
                + " |"
            )
    return "\n".join(lines)


def plot(path, rows, ppl, methods, title):
    """Retrieval found (%) per ratio, one panel per task, the full cache dashed; perplexity ratios to the full."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summarize(rows)
    tasks = list(dict.fromkeys(x["task"] for x in s))
    n = len(tasks) + (1 if ppl else 0)
    if n == 0:
        return
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for k, m in enumerate(methods):
            pts = sorted(
                (x["ratio"], 100 * x["found"] / x["asked"]) for x in s if x["task"] == task and x["method"] == m
            )
            ax.plot([p[0] for p in pts], [p[1] + 0.8 * k for p in pts], marker="o", label=m[:40])
        pts = sorted({(x["ratio"], 100 * x["full_found"] / x["asked"]) for x in s if x["task"] == task})
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "k--", label="full cache")
        ax.set(xlabel="compression ratio", ylabel="found (%)", title=f"{task}, question in the prompt", ylim=(-5, 110))
        ax.set_xticks(sorted({p[0] for p in pts}))
        ax.legend(fontsize=7)
    if ppl:
        ax = axes[0][-1]
        texts = list(dict.fromkeys(e["text"] for e in ppl))
        width = 0.8 / max(1, len(methods))
        for k, m in enumerate(methods):
            vals = [
                next((100 * (e["vs_full"]["ratio"] - 1) for e in ppl if e["text"] == t and e["method"] == m), 0)
                for t in texts
            ]
            ax.bar([i + k * width for i in range(len(texts))], vals, width, label=m[:40])
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(texts))], texts)
        ax.set(ylabel="ppl over the full cache (%)", title=f"perplexity token by token, {ppl[0]['budget']} tokens")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
