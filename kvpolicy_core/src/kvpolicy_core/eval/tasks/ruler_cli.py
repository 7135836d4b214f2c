"""``kvpolicy eval --task ruler``: the long-context suite from the command line (options and the run).

This module imports no mlx (the parser is built first); the run imports :mod:`.ruler_runner`.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional, Sequence

from .cli_options import (
    MAX_LENGTH,
    check_input_file,
    check_output,
    check_seeds_and_steps,
    number_list,
    progress_log,
    write_json,
)
from .ruler import CHATS, DEFAULT_PRESET, NOISE, PRESETS, TASKS

DEFAULT_RATIOS = "4,8"
DEFAULT_LENGTH = 4096
#: the chat format each known model answers best with at 4k (measured: docs/results/long-context.md)
MODEL_CHAT = {"smollm2": "none"}


def add_ruler_arguments(parser) -> None:
    """The options of ``--task ruler`` (with --lengths, --seeds, --haystack, --prefill-step of retrieval)."""
    g = parser.add_argument_group(
        "long-context suite (--task ruler; also uses --lengths, default 4096, --seeds, "
        "--haystack, default pydoc and noise, --prefill-step, default 2048)"
    )
    g.add_argument("--ruler-tasks", default=",".join(TASKS), help=f"comma-separated, from {', '.join(TASKS)}")
    g.add_argument(
        "--protocol",
        default="query-agnostic,question-in-prompt",
        help="comma-separated: query-agnostic (context compressed before the question), "
        "question-in-prompt (default both)",
    )
    g.add_argument(
        "--ratio",
        default=DEFAULT_RATIOS,
        help="compression ratios: each bounded method gets budget = length / ratio (default 4,8); --budget overrides",
    )
    g.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        choices=sorted(PRESETS),
        help="task settings: calibrated (default: what 135M-270M models can do) or ruler (RULER's)",
    )
    g.add_argument(
        "--chat",
        default="auto",
        choices=["auto", *CHATS],
        help="prompt format: none (plain text), chatml, gemma; auto: the model's measured best",
    )
    g.add_argument("--export-jsonl", metavar="FILE", help="write the generated contexts (token ids) to FILE and stop")
    g.add_argument("--from-jsonl", metavar="FILE", help="run the contexts of FILE instead of generating them")


def specs_for(specs: Sequence[Any], budgets: Sequence[int], with_budget: Callable) -> List[Any]:
    """``full`` first, then every bounded spec at every budget (duplicates dropped)."""
    from ..perplexity import parse_spec, spec_label

    out: List[Any] = ["full"]
    for spec in specs:
        if parse_spec(spec)[0] == "full":
            continue
        for b in budgets:
            item = with_budget(spec, b)
            if spec_label(item) not in [spec_label(s) for s in out]:
                out.append(item)
    return out


def model_max_positions(model) -> Optional[int]:
    """The positions ``model`` was made for: its config's ``max_position_embeddings`` (or its text config's)."""
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        n = (
            source.get("max_position_embeddings")
            if isinstance(source, dict)
            else getattr(source, "max_position_embeddings", None)
        )
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    return None


def check_lengths(model, lengths: Sequence[int], option: str) -> None:
    """Every context length (prompt, question and answer) within the model's positions, else a ValueError naming
    ``option``."""
    limit = model_max_positions(model)
    too_long = [n for n in lengths if limit is not None and n > limit]
    if too_long:
        raise ValueError(
            f"{option}: {too_long[0]} tokens is beyond the model's {limit} positions (max_position_embeddings)"
        )


def cli_run(args, specs: Sequence[Any], with_budget: Callable, load_model) -> int:
    """Generate (or read) the contexts, run every method in each protocol, print the table, write JSON."""
    from pathlib import Path

    from . import ruler

    tasks = [t.strip() for t in args.ruler_tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError(f"--ruler-tasks: no task given; choose from {', '.join(TASKS)}")
    for t in tasks:
        if t not in TASKS:
            raise ValueError(f"--ruler-tasks: unknown task {t!r}; choose from {', '.join(TASKS)}")
    protocols = [p.strip() for p in args.protocol.split(",") if p.strip()]
    if not protocols:
        raise ValueError("--protocol: no protocol given; choose query-agnostic, question-in-prompt")
    for p in protocols:
        if p not in ("query-agnostic", "question-in-prompt"):
            raise ValueError(f"--protocol: unknown protocol {p!r}; choose query-agnostic, question-in-prompt")
    lengths = (
        number_list(args.lengths, "lengths", positive=True, maximum=MAX_LENGTH)
        if args.lengths is not None
        else [DEFAULT_LENGTH]
    )
    ratios = number_list(args.ratio, "ratio", float, positive=True, minimum=1.0)  # budget = length / ratio
    step = (args.prefill_step or [2048])[0]
    check_seeds_and_steps(args.seeds, [step])
    check_input_file(args.from_jsonl, "--from-jsonl")
    check_output(args.json, "--json")
    check_output(args.export_jsonl, "--export-jsonl")
    if not args.from_jsonl:  # every method at every budget it will run with, before the model loads
        for length in lengths:
            specs_for(specs, args.budget or [max(8, int(length / r)) for r in ratios], with_budget)
    model, tokenizer, path = load_model(args.model, args.dtype)
    chat = MODEL_CHAT.get(args.model or "", "none") if args.chat == "auto" else args.chat
    if args.from_jsonl:
        from ...integration.token_ids import model_vocab_size

        contexts = ruler.read_jsonl(args.from_jsonl, model_vocab_size(model))
        if not contexts:
            raise ValueError(f"--from-jsonl {args.from_jsonl}: the file holds no context")
        check_lengths(model, sorted({c.length for c in contexts}), f"--from-jsonl {args.from_jsonl}")
    else:
        check_lengths(model, lengths, "--lengths")
        contexts = ruler.build_suite(
            tokenizer,
            tasks,
            lengths,
            args.haystack or ["pydoc", NOISE],
            range(args.seeds),
            model=Path(path).name,
            chat=chat,
            preset=args.preset,
        )
    if args.export_jsonl:
        ruler.write_jsonl(args.export_jsonl, contexts)
        print(f"wrote {len(contexts)} contexts to {args.export_jsonl}", file=sys.stderr)
        return 0
    from .ruler_runner import format_table, run_suite, summarize

    log = progress_log(
        args.no_progress,
        lambda r: (
            f"{r['protocol']} {r['method']} {r['id']} q{r['question']}: {r['score']:.2f} "
            f"({r['output'].strip()[:60]!r}, answers {r['answers']})"
        ),
    )

    rows = []
    for length in sorted({c.length for c in contexts}):
        budgets = args.budget or [max(8, int(length / r)) for r in ratios]
        runs = specs_for(specs, budgets, with_budget)
        rows += run_suite(model, tokenizer, [c for c in contexts if c.length == length], runs, protocols, step, log=log)
    summary = summarize(rows)
    shown = [t for t in TASKS if any(r["task"] == t for r in rows)]
    print(f"model: {path} | chat: {chat} | preset: {args.preset} | prefill step: {step}")
    print(format_table(summary, shown))
    if args.json:
        payload = {
            "model": str(path),
            "chat": chat,
            "preset": args.preset,
            "prefill_step": step,
            "protocols": protocols,
            "summary": summary,
            "rows": rows,
        }
        write_json(payload, args.json)
    return 0
