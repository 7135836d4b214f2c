"""Long-context suite: RULER-style tasks at 4k+ tokens, both protocols, every method next to the full cache.

    python benchmarks/long_context.py --size quick                   # minutes on 2 CPU cores
    python benchmarks/long_context.py --size headline                # the 4k table of one model (~1 h)
    python benchmarks/long_context.py --size headline --model smollm2
    python benchmarks/long_context.py --lengths 8192 --tasks niah_single,niah_multikey --tag 8k
    python benchmarks/long_context.py --model smollm2 --lengths 8192 --tasks niah_single --depths 0.3,0.5,0.7
    python benchmarks/long_context.py --size headline --export-jsonl benchmarks/results/long_context_4k.jsonl
    python benchmarks/long_context.py --smoke                        # tiny random model (the test suite)

Sizes (measured on 2 shared x86 cores, docs/results/long-context.md):

- ``smoke``: a tiny random-weight model; seconds. Checks that the program runs, not any number.
- ``quick``: 4k tokens, noise haystack, niah_single + niah_multikey, full and h2o at 4x,
  query-agnostic only; a few minutes.
- ``headline``: 4k tokens, pydoc and noise haystacks, all six tasks, one context each, full /
  StreamingLLM (mlx-lm's RotatingKVCache) / H2O / CaM at 4x and 8x, both protocols.

Methods are names from METHODS or config strings; each bounded method gets budget = length / ratio (a config
string that sets its own ``budget=`` runs as given). ``--depths`` builds one context per depth (seed i, the
statements at that share of the haystack) instead of ``--seeds`` random placements; every context's needle
depth (first statement's start / context tokens) is in the JSON's config.
On each task the full cache runs first (``--full-from`` takes its answers from earlier result files instead,
where they hold the same context and questions: rows marked ``reused``); where it scores below --min-full (60)
the other methods are skipped and the task is flagged (--no-skip-flagged runs them anyway).
Common arguments (--smoke, --out, --tag) and result names (long_context[_<tag>][_smoke]) from the benchmark
harness (_common.py); without --tag a run is named by its size and model. Writes long_context_<tag>.json
(config, every answer, scores per task per haystack and pooled, the full cache's score next to every method,
flagged tasks, versions and BLAS) and long_context_<tag>.png under
benchmarks/results/, the JSON after every context (a long run can be read while it runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

from _common import parser, result_name, with_budget, write_json

from kvpolicy_core.eval.tasks import ruler
from kvpolicy_core.eval.tasks.cli_options import (
    MAX_LENGTH,
    check_input_file,
    check_output,
    check_seeds_and_steps,
    number_list,
)
from kvpolicy_core.eval.tasks.ruler_runner import PROTOCOLS, format_table, record_first_chunk, run_context, summarize

#: kvzip+METHOD: METHOD with the context cut at once by KVzip's reconstruction score (docs/methods/compress-once.md)
METHODS = {
    "full": "full",
    "streamingllm": "rotating",
    "h2o": "h2o",
    "cam": "cam",
    "kvzip+h2o": "kvzip+h2o",
    "kvzip+cam": "kvzip+cam",
}
ORDER = {"full": 0, "rotating": 1, "h2o": 2, "cam": 3, "kvzip+h2o": 4, "kvzip+cam": 5}  # table rows
SIZES = {
    "quick": dict(
        lengths="4096",
        tasks="niah_single,niah_multikey",
        haystacks="noise",
        methods="full,h2o",
        ratios="4",
        protocols="query-agnostic",
        seeds=1,
    ),
    "headline": dict(
        lengths="4096",
        tasks=",".join(ruler.TASKS),
        haystacks="pydoc,noise",
        methods="full,streamingllm,h2o,cam",
        ratios="4,8",
        protocols=",".join(PROTOCOLS),
        seeds=1,
    ),
    "smoke": dict(
        lengths="640",
        tasks="niah_multikey,vt",
        haystacks="noise",
        methods="full,streamingllm,h2o,cam",
        ratios="8",
        protocols=",".join(PROTOCOLS),
        seeds=1,
    ),
}
SMOKE_PARAMS = {
    "niah_multikey": ruler.TaskParams(keys=3, questions=3, digits=4),
    "vt": ruler.TaskParams(hops=2, digits=4, few_shot=False),
}
#: the prompt format each model scores best with at 4k with the full cache (calibration in docs/results/long-context.md)
MODEL_CHAT = {"gemma3": "none", "smollm2": "none"}


def spec_for(name: str, budget: int) -> str:
    base = METHODS.get(name, name)
    if "budget=" in base:  # a config string with its own budget runs as given, at every ratio
        return base
    return with_budget(base, budget)


def load(model: str, smoke: bool, tiny: str = "llama", tiny_layers: int = 2):
    """(model, tokenizer, description): ``gemma3`` (the default model), ``smollm2`` or a model directory, in
    float32; with ``smoke`` a tiny random-weight model of family ``tiny`` instead."""
    import mlx.core as mx
    import mlx_lm

    if smoke:
        import tempfile

        from kvpolicy_core.testing.tiny_models import write_model_dir

        path = write_model_dir(Path(tempfile.mkdtemp(prefix="kvpolicy-tiny-")), tiny, layers=tiny_layers)
        m, tok = mlx_lm.load(str(path))
        return m, tok, f"tiny random {tiny}"
    from kvpolicy_core.model.resolve import resolve_model_path

    path = resolve_model_path(None if model == "gemma3" else model)
    m, tok = mlx_lm.load(str(path))
    m.set_dtype(mx.float32)
    return m, tok, str(path)


def main():
    p = parser(__doc__, smoke_help="a tiny random-weight model, seconds (checks the program runs)")
    p.add_argument("--size", choices=sorted(SIZES), help="a preset of the options below (explicit options win)")
    p.add_argument("--model", default="gemma3", help="gemma3 (default), smollm2, or an mlx-lm model directory")
    p.add_argument("--lengths")
    p.add_argument("--tasks")
    p.add_argument("--haystacks", help="comma list: pydoc, stdlib, noise, or a text file")
    p.add_argument("--methods", help="names from: " + ", ".join(METHODS) + "; or config strings (';'-separated)")
    p.add_argument("--ratios", help="compression ratios, comma list (budget = length / ratio)")
    p.add_argument("--protocols", help=", ".join(PROTOCOLS))
    p.add_argument("--seeds", type=int, help="contexts per (task, haystack, length)")
    p.add_argument(
        "--depths", help="comma list of needle depths in [0, 1]: one context per depth (seed i at depth i), not --seeds"
    )
    p.add_argument("--preset", default=ruler.DEFAULT_PRESET, choices=sorted(ruler.PRESETS))
    p.add_argument("--chat", choices=sorted(ruler.CHATS), help="prompt format (default: the model's, MODEL_CHAT)")
    p.add_argument("--prefill-step", type=int, default=2048)
    p.add_argument(
        "--skip-flagged",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run only the full cache on a task it scores below --min-full on (default: on)",
    )
    p.add_argument("--min-full", type=float, default=60.0)
    p.add_argument(
        "--full-from",
        nargs="+",
        metavar="JSON",
        help="reuse the full cache's answers from these result files where they hold the same context and "
        "questions (its prefill is deterministic), instead of running it again",
    )
    p.add_argument("--export-jsonl", help="also write the contexts (token ids) to this JSONL file")
    p.add_argument(
        "--report", nargs="+", metavar="JSON", help="print one markdown table of result files (rows merged) and stop"
    )
    args = p.parse_args()
    try:
        run(args)
    except ValueError as exc:  # an option's error: one line naming it, exit 2 (as kvpolicy's command line)
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        sys.exit(2)


def read_results(f: str, option: str) -> dict:
    """A result file of this script (``config``, ``seconds``, ``rows``), else a ValueError naming ``option``."""
    check_input_file(f, option)
    try:
        data = json.loads(Path(f).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{option} {f}: not a JSON file ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{option} {f}: not a long_context result file (no 'rows' list)")
    keys = ("id", "model", "method", "protocol", "question", "score", "task", "length", "haystack")
    for i, r in enumerate(data["rows"]):
        missing = [k for k in keys if not isinstance(r, dict) or k not in r]
        if missing:
            raise ValueError(f"{option} {f}: row {i} lacks {', '.join(missing)}")
    return data


def run(args):
    if args.report:
        for f in args.report:
            data = read_results(f, "--report")
            model = (data.get("config") or {}).get("model", "?") if isinstance(data.get("config"), dict) else "?"
            seconds = data.get("seconds")
            print(f"{Path(f).name}: {model}, " + (f"{seconds:.0f} s" if isinstance(seconds, (int, float)) else "? s"))
        print("\n" + markdown(merge_rows(args.report)) + "\n")
        return
    size = "smoke" if args.smoke else (args.size or "quick")
    for k, v in SIZES[size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.smoke:  # a random model scores 0 everywhere: run every method anyway
        args.prefill_step, args.skip_flagged = 128, False
    out = Path(args.out)
    lengths = number_list(args.lengths, "lengths", positive=True, maximum=MAX_LENGTH)
    ratios = number_list(args.ratios, "ratios", float, minimum=1.0)  # budget = length / ratio
    depths = number_list(args.depths, "depths", float, minimum=0.0, maximum=1.0) if args.depths else None
    check_seeds_and_steps(args.seeds, [args.prefill_step])
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in ruler.TASKS]
    if not tasks or unknown:
        raise ValueError(f"--tasks: {'unknown task ' + repr(unknown[0]) if unknown else 'no task given'}; "
                         f"choose from {', '.join(ruler.TASKS)}")  # fmt: skip
    protocols = [x for x in args.protocols.split(",") if x]
    if not protocols or any(x not in PROTOCOLS for x in protocols):
        raise ValueError(f"--protocols: expected some of {', '.join(PROTOCOLS)} (got {args.protocols!r})")
    earlier = [read_results(f, "--full-from") for f in args.full_from or []]
    check_output(args.export_jsonl, "--export-jsonl")
    check_output(str(out / "long_context.check"), "--out")
    model, tok, path = load(args.model, args.smoke)
    chat = args.chat or MODEL_CHAT.get(args.model, "none")
    names = [m.strip() for m in args.methods.split(";" if ";" in args.methods else ",")]
    contexts = build_contexts(tok, tasks, lengths, args.haystacks.split(","), args, Path(path).name, chat, depths)
    if args.export_jsonl:
        ruler.write_jsonl(args.export_jsonl, contexts)
        print(f"wrote {args.export_jsonl} ({len(contexts)} contexts)")
    # long_context[_<tag>][_smoke]; without --tag a full run is named by its size and model
    default_tag = "" if args.smoke else f"{size}_{Path(args.model).name.split('-')[0]}"
    tag = result_name("long_context", tag=args.tag or default_tag, smoke=args.smoke)
    config = {
        "size": size,
        "model": path,
        "chat": chat,
        "preset": args.preset,
        "lengths": lengths,
        "tasks": tasks,
        "haystacks": args.haystacks.split(","),
        "methods": names,
        "ratios": ratios,
        "protocols": protocols,
        "seeds": args.seeds,
        "depths": depths,
        "needle_depth": {c.id: round(c.spans[0][0] / len(c.context_ids), 3) for c in contexts if c.spans},
        "prefill_step": args.prefill_step,
        "params": {t: vars(ruler.preset_params(args.preset, t, Path(path).name)) for t in tasks},
    }
    rows = []
    start = time.perf_counter()

    def log(r):
        rows.append(r)
        print(
            f"{r['protocol']:18} {r['method']:22} {r['id']:28} q{r['question']} {r['score']:.2f} "
            f"{r['output'].strip()[:48]!r:50} {r['seconds']}s",
            flush=True,
        )

    earlier_full = []
    for data in earlier:
        earlier_full += [r for r in data["rows"] if r["method"] == "full"]
    flagged = []
    for key in dict.fromkeys((c.task, c.length) for c in contexts):  # one task and length at a time
        group = [c for c in contexts if (c.task, c.length) == key]
        records = {c.id: record_first_chunk(model, c, args.prefill_step) for c in group}
        bounded = []
        for n in names:
            for ratio in ratios:
                s = spec_for(n, max(8, int(key[1] / ratio)))
                if s not in bounded + ["full"]:
                    bounded.append(s)
        done = len(rows)
        for ctx in group:  # the full cache first: it decides whether the task is worth the other methods
            reused = [
                r for r in earlier_full if r["id"] == ctx.id and r["model"] == ctx.model and r["protocol"] in protocols
            ]
            if len(reused) == len(protocols) * len(ctx.questions) and all(
                r["answers"] == ctx.questions[r["question"]].answers and r["context_tokens"] == len(ctx.context_ids)
                for r in reused
            ):
                for r in reused:
                    log({**r, "reused": True})
                continue
            run_context(model, tok, ctx, "full", protocols, args.prefill_step, records[ctx.id], log=log)
        full = [r["score"] for r in rows[done:]]
        save(out, tag, config, rows, time.perf_counter() - start, flagged)  # the full cache's answers count too
        if args.skip_flagged and 100 * sum(full) / len(full) < args.min_full:
            flagged.append({"task": key[0], "length": key[1], "full": round(100 * sum(full) / len(full), 1)})
            print(
                f"{key[0]} at {key[1]} tokens: the full cache scores {flagged[-1]['full']} < {args.min_full}: "
                "flagged, other methods skipped",
                flush=True,
            )
            bounded = []
        for ctx in group:
            for spec in bounded:
                run_context(model, tok, ctx, spec, protocols, args.prefill_step, records[ctx.id], log=log)
            save(out, tag, config, rows, time.perf_counter() - start, flagged)
        del records
    summary = summarize([{**r, "haystack": "all"} for r in rows])
    print(format_table(summary, [t for t in ruler.TASKS if t in tasks]))
    if not args.smoke:
        plot(out / f"{tag}.png", summary, tasks, f"{Path(path).name}, {','.join(map(str, lengths))} tokens")
    print(f"wrote {out / (tag + '.json')} in {time.perf_counter() - start:.0f} s")


def build_contexts(tok, tasks, lengths, haystacks, args, model_name, chat, depths):
    """The suite's contexts; with ``depths``, context ``i`` of each (task, length, haystack) has seed ``i`` and
    its statements at ``depths[i]`` of the haystack (``TaskParams.depth``), else ``args.seeds`` random ones."""
    base = SMOKE_PARAMS if args.smoke else {}
    if depths is None:
        return ruler.build_suite(
            tok,
            tasks,
            lengths,
            haystacks,
            range(args.seeds),
            model=model_name,
            chat=chat,
            preset=args.preset,
            params=base or None,
        )
    out = []
    for task in tasks:
        params = base.get(task) or ruler.preset_params(args.preset, task, model_name)
        for length in lengths:
            for hay in haystacks:
                for i, d in enumerate(depths):
                    out.append(
                        ruler.build_context(
                            tok,
                            task,
                            length,
                            hay,
                            i,
                            model=model_name,
                            chat=chat,
                            params=dataclasses.replace(params, depth=d),
                        )
                    )
    return out


def merge_rows(files) -> list:
    """The rows of several result files as one list; a row asked twice (same context, method, protocol and
    question, e.g. the full cache in two runs on the same contexts) is kept once, the first file's."""
    seen, out = set(), []
    for f in files:
        for r in read_results(f, "--report")["rows"]:
            key = (r["id"], r["model"], r["method"], r["protocol"], r["question"])
            if key not in seen:
                seen.add(key)
                out.append(r)
    return out


def markdown(rows, min_full: float = 60.0) -> str:
    """The docs' table of result rows: per (length, protocol), one line per method, the RULER score per task
    with the haystacks pooled and, in brackets, per haystack (pydoc / noise); the mean over the tasks the full
    cache can do (flagged tasks, full cache below ``min_full``: marked *, not in the mean), that mean minus the
    full cache's on the same questions (same length and protocol), and the share of the full cache's KV bytes a
    method holds after the context (query-agnostic). A haystack a method was not run on shows as -."""
    summary = summarize([{**r, "haystack": "all"} for r in rows], min_full)
    per_hay = {(s["length"], s["protocol"], s["method"], s["haystack"]): s for s in summarize(rows, min_full)}
    hays = [h for h in ("pydoc", "noise", "wordlist") if any(r["haystack"] == h for r in rows)]
    hays += sorted({r["haystack"] for r in rows} - set(hays))
    tasks = [t for t in ruler.TASKS if any(r["task"] == t for r in rows)]
    flagged = {t for s in summary for t in s["flagged"]}
    kept = {}
    for r in rows:
        if r["protocol"] == "query-agnostic" and r.get("context_kv_bytes_full"):
            kept.setdefault((r["length"], r["method"]), []).append(
                r["context_kv_bytes_kept"] / r["context_kv_bytes_full"]
            )
    head = (
        "| tokens | protocol | method | "
        + " | ".join(t + (" *" if t in flagged else "") for t in tasks)
        + " | mean | vs full | KV kept |"
    )
    lines = [head, "|" + " --- |" * (len(tasks) + 6)]

    def mean_of(s):
        ok = [s["tasks"][t] for t in tasks if t not in flagged and t in s["tasks"]]
        return sum(ok) / len(ok) if ok else None

    full_score = {
        (r["length"], r["protocol"], r["id"], r["question"]): r["score"] for r in rows if r["method"] == "full"
    }

    def full_mean_on(s):
        """The full cache's mean on the questions this method was asked (same length and protocol)."""
        asked = [
            r for r in rows if (r["length"], r["protocol"], r["method"]) == (s["length"], s["protocol"], s["method"])
        ]
        by_task = {}
        for r in asked:
            f = full_score.get((r["length"], r["protocol"], r["id"], r["question"]))
            if f is None:
                return None
            by_task.setdefault(r["task"], []).append(f)
        ok = [100 * sum(v) / len(v) for t, v in by_task.items() if t not in flagged]
        return sum(ok) / len(ok) if ok else None

    for s in sorted(
        summary,
        key=lambda s: (
            s["length"],
            PROTOCOLS.index(s["protocol"]) if s["protocol"] in PROTOCOLS else len(PROTOCOLS),
            ORDER.get(s["method"].split(":")[0], len(ORDER)),
            s["method"].split(":")[0],
            -_budget(s["method"]),
            s["method"],
        ),
    ):
        cells = []
        for t in tasks:
            if t not in s["tasks"]:
                cells.append("")
                continue
            by = [per_hay.get((s["length"], s["protocol"], s["method"], h)) for h in hays]
            parts = [f"{b['tasks'][t]:.0f}" if b is not None and t in b["tasks"] else "-" for b in by]
            cells.append(f"{s['tasks'][t]:.1f}" + (f" ({' / '.join(parts)})" if len(parts) > 1 else ""))
        m, fm = mean_of(s), full_mean_on(s)
        gap = f"{m - fm:+.1f}" if m is not None and fm is not None and s["method"] != "full" else ""
        k = kept.get((s["length"], s["method"]))
        lines.append(
            f"| {s['length']} | {s['protocol']} | {s['method']} | "
            + " | ".join(cells)
            + (f" | {m:.1f} | " if m is not None else " |  | ")
            + gap
            + " | "
            + (f"{100 * sum(k) / len(k):.0f}%" if k else "")
            + " |"
        )
    n_q = {
        t: sum(1 for r in rows if r["task"] == t and r["method"] == "full" and r["protocol"] == rows[0]["protocol"])
        for t in tasks
    }
    lines.append("")
    lines.append(
        "Scores: pooled over the haystacks (" + " / ".join(hays) + " in brackets). Questions per task with the full "
        "cache: " + ", ".join(f"{t} {n}" for t, n in n_q.items()) + ". * the full cache scores below "
        f"{min_full:.0f}: flagged, the other methods not run, not in the mean."
    )
    return "\n".join(lines)


def _budget(method: str) -> int:
    m = re.search(r"budget=(\d+)", method)
    return int(m.group(1)) if m else 0


def save(out, tag, config, rows, seconds, flagged):
    write_json(
        tag,
        {
            "config": config,
            "seconds": round(seconds, 1),
            "skipped_flagged": flagged,
            "summary_pooled": summarize([{**r, "haystack": "all"} for r in rows]),
            "summary": summarize(rows),
            "rows": rows,
        },
        out,
    )


def plot(path, summary, tasks, title):
    """Score per task (and the mean) per method, one panel per (protocol, length); the full cache drawn first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(s["protocol"], s["length"]) for s in summary})
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    cols = [t for t in ruler.TASKS if t in tasks] + ["mean"]
    for ax, (protocol, length) in zip(axes[0], panels):
        group = [s for s in summary if (s["protocol"], s["length"]) == (protocol, length)]
        group.sort(key=lambda s: (s["method"] != "full", s["method"]))
        width = 0.8 / max(1, len(group))
        for k, s in enumerate(group):
            vals = [s["tasks"].get(t, 0.0) if t != "mean" else s["mean"] for t in cols]
            ax.bar([i + k * width for i in range(len(cols))], vals, width, label=s["method"][:28])
        ax.set_xticks(
            [i + 0.4 - width / 2 for i in range(len(cols))], [c.replace("niah_", "") for c in cols], fontsize=8
        )
        ax.set_ylim(0, 100)
        ax.set_ylabel("RULER score (0-100)")
        ax.set_title(f"{protocol}, {length} tokens", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"long-context suite: {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
