"""One leaderboard: every installed method at 2x-16x on perplexity and the long-context suite, per model.

    python benchmarks/leaderboard.py --size quick                                  # Gemma 3, a few methods
    python benchmarks/leaderboard.py --size headline --tag headline_gemma3         # every method, Gemma 3
    python benchmarks/leaderboard.py --size headline --model smollm2 --tag headline_smollm2
    python benchmarks/leaderboard.py --report benchmarks/results/leaderboard_headline_*.json   # docs + plots
    python benchmarks/leaderboard.py --smoke                    # tiny random model (tests), into a temp folder

Methods: ``full`` (mlx-lm's ``KVCache``), ``rotating`` (mlx-lm's ``RotatingKVCache(budget, keep=4)``:
StreamingLLM as mlx-lm ships it) and every method kvpolicy's registry lists
(``kvpolicy_core.get_registry().methods()``: h2o, cam, snapkv, pyramidkv, chunkkv, tova, streamingllm,
random, ... with their defaults); ``--methods`` chooses (comma list; config strings after ``;``). Each bounded
method runs at every ``--ratios`` with budget = length / ratio (the text's tokens for perplexity, the suite's
length for the suite), on:

- **perplexity** token by token (the StreamingLLM recipe, :func:`kvpolicy_core.eval.perplexity.perplexity`:
  each token's NLL read before the cache is reduced) on ``--texts`` (default CPython's pydoc topics, the
  default corpus, and the docstrings of 40 standard-library modules), reported as the change against the
  full cache on the same tokens;
- **the long-context suite** (:mod:`kvpolicy_core.eval.tasks.ruler`, docs/results/long-context.md): niah_single,
  niah_multikey (and niah_multiquery), both protocols (question-in-prompt and query-agnostic). The full cache
  runs first on each task; a task it scores below ``--min-full`` (60) on, pooled over its contexts and
  protocols, is flagged and the other methods skip it (not in any score).

**Shared work** (``--prefill one-chunk``, the default): every prompt reaches the cache in one chunk (kvpress's
protocol: the context, or the context with its question, prefilled at once and cut when it is in; mlx-lm's own
``generate_step`` does the same for a prompt up to its 2048-token step). That forward does not depend on the
method (every cache starts empty), so it runs once per (context, protocol, question) through plain caches and
is replayed into each method's caches (:func:`kvpolicy_core.eval.tasks.needle.replay_prefill`: the calls a
cache gets inside the model; tested bit for bit against the real forward for every installed method); mlx-lm's
``RotatingKVCache`` masks a chunk by its own window and runs for real. Query-agnostic: the context but its last
token is replayed, the last token is its own step, then each question is asked of a copy; question-in-prompt:
each question's prompt but its last token is replayed and the last token starts the answer (as the
compress-once route does). ``--prefill chunked`` runs :mod:`kvpolicy_core.eval.tasks.ruler_runner` instead
(``--prefill-step`` chunks through each method's caches, only the first chunk shared). Perplexity runs the
texts (one length) as the rows of one batch, the logits read after the last step from every step's hidden
state (the output projection read once, not once a token; NLLs within 1e-4 of ``perplexity``'s).

A method's **score** at a ratio is the mean of its suite scores over the protocols (each the mean over the
unflagged tasks of RULER's score, 0-100), with its 95% interval (Wilson's, at the effective number of questions:
:func:`score_interval`); perplexity changes carry the paired block bootstrap interval against the full cache.
The JSON ranks the methods at 8x (score, then perplexity) and states each one against ``h2o`` there (score
difference and the questions paired with h2o's, with an exact sign test; perplexity ratio pooled over the texts
with a paired block bootstrap interval, :func:`kvpolicy_core.eval.perplexity.pooled_ratio`).

Writes ``leaderboard[_<tag>][_smoke].json`` under ``--out`` (default benchmarks/results; ``--smoke``: a new
temporary folder, printed, so that no smoke file lands among the results; the harness's atomic writer;
rewritten after every step, so a long run can be read while it runs), and per model a markdown table
(``..._<model>.md``) and a plot in the style of NVIDIA kvpress's leaderboard (``..._<model>.png``: score
against compression ratio per protocol, one line per method, error bars at 95%, the full cache as a horizontal
line). ``--report FILE...`` runs nothing (no model is loaded): it merges result files
(a model's runs may be split with ``--tag``) and rewrites the tables of ``--docs`` and the plots (``--plots``,
benchmarks/results). ``--docs`` is one page, or a page per model where it holds ``{model}`` (the default,
docs/results/leaderboard-{model}.md: a page per model keeps each results page under 300 lines).

**Quality per byte** (``--kv-bits none,8,4``): each bounded method runs at each ratio at each storage, as a row of
its own named by its config string (``cam``, ``cam:kv_bits=8``, ``cam:kv_bits=4``: kvpolicy's quantized rows,
``kv_group_size`` 64); ``full`` and ``rotating`` (mlx-lm's caches) stay in full precision (mlx-lm's
``QuantizedKVCache`` is not run: its rows could not be replayed nor counted by the same code). A quantized cache
attends to its stored rows, so its one-chunk prefill runs for real, not replayed (the estimate counts it so).
Every run records what it measured: ``kv_bytes_kept`` / ``kv_bytes_full`` (the caches' K/V rows after the run,
quantized parts included, and what a full cache would hold; per text in a perplexity batch), and MLX's allocator
read against a mark taken just before the run (:func:`memory_mark`: ``mx.get_active_memory()``, the peak counter
reset): ``peak_memory_bytes`` (``mx.get_peak_memory()`` above the mark) and ``active_memory_bytes``
(``mx.get_active_memory()`` above it with the run's caches still alive; a perplexity row's are its batch's, a
suite row's from the start of its prefill, query-agnostic's resident read after the context's cut).
``--report`` given the files of a ``--kv-bits`` run (``config.kv_bits``) writes a "Quality per byte" section on
the model's page (a table of method, ratio, storage, bytes kept, resident and peak memory, score with its interval
and perplexity change) and ``leaderboard_bytes_<model>.png`` (score against the bytes kept, log axis), and leaves
the leaderboard's own section as it is.

Sizes: ``smoke`` (a tiny random-weight model, a few methods, tiny lengths: seconds); ``quick`` (one text, 1024
tokens of perplexity, the 4k suite on one haystack with one context per task, ratios 4 and 8, a few
methods); ``headline`` (every method, ratios 2, 4, 8, 16, two texts of 128 tokens, the 2k suite on niah_single
and niah_multikey: the haystacks and contexts per task chosen so the estimate fits ``--hours``, 1 per model, so
that the two models' headlines together fit 2 h). The estimate, from measured per-row costs (``--costs FILE``:
an earlier leaderboard JSON of the same model; else this model's ``leaderboard_quick_<model>.json`` under
``--out`` if there is one of the same ``--prefill``; else the built-in costs measured here), is printed at the
start.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, parser, result_name, with_budget, write_json
from bytes_quality import method_of, storage_of

ROOT = Path(__file__).resolve().parents[1]
#: --report's pages, one per model (``{model}``: the result files' model key)
DOCS = ROOT / "docs" / "results" / "leaderboard-{model}.md"
SUITE_TASKS = ("niah_single", "niah_multikey", "niah_multiquery")
PROTOCOL_ORDER = ("question-in-prompt", "query-agnostic")
SHORT = {"question-in-prompt": "QiP", "query-agnostic": "QA"}
#: table and plot order; installed methods not named here follow alphabetically
ORDER = ("full", "h2o", "cam", "snapkv", "pyramidkv", "chunkkv", "squeeze", "tova", "streamingllm", "rotating")
MODEL_NAMES = {"gemma3": "Gemma 3 270M", "smollm2": "SmolLM2-135M-Instruct", "tiny": "tiny random llama (smoke)"}
SIZES = {
    "smoke": dict(
        methods="full,rotating,h2o,snapkv",
        ratios="4,8",
        texts="pydoc,stdlib",
        ppl_tokens=96,
        length=640,
        tasks="niah_single,niah_multikey",
        haystacks="noise",
        protocols=",".join(PROTOCOL_ORDER),
        seeds=1,
    ),
    "quick": dict(
        methods="full,rotating,h2o,snapkv",
        ratios="4,8",
        texts="pydoc",
        ppl_tokens=1024,
        length=4096,
        tasks=",".join(SUITE_TASKS),
        haystacks="noise",
        protocols=",".join(PROTOCOL_ORDER),
        seeds=1,
    ),
    "headline": dict(
        methods="all",
        ratios="2,4,8,16",
        texts="pydoc,stdlib",
        ppl_tokens=128,
        length=2048,
        tasks="niah_single,niah_multikey",
        haystacks="noise,pydoc",
        protocols=",".join(PROTOCOL_ORDER),
        seeds=None,  # chosen from the estimate (--hours)
    ),
}
SMOKE_PARAMS = {"niah_multikey": dict(keys=3, questions=2, digits=4)}
#: seconds per unit on 2 shared x86 cores (fp32), used when no measured costs are given (from the per-context
#: costs in docs/results/long-context.md, the demo's tokens/s and the quick run, leaderboard_quick_gemma3.json);
#: at the suite length ``length``: ppl_token: one token-by-token step of one spec; prefill: a query-agnostic
#: context prefill after the shared first chunk; qa_question / qip_question: one question (question-in-prompt:
#: with its own prefill after the shared chunk); record: the shared first chunk, once per context.
COSTS = {
    "gemma3": dict(length=4096, ppl_token=0.2, prefill=25.0, qa_question=5.0, qip_question=25.0, record=20.0),
    "smollm2": dict(length=4096, ppl_token=0.25, prefill=70.0, qa_question=8.0, qip_question=70.0, record=60.0),
    "tiny": dict(length=640, ppl_token=0.002, prefill=0.05, qa_question=0.05, qip_question=0.05, record=0.05),
}
#: the one-chunk suite's and the batched perplexity's costs (seconds at ``length``), measured by the headline
#: runs of docs/results/leaderboard.md on 2 x86 cores running ~12 processes (load average 11-15): each kind's median
#: wall time times the CPU share its process got (0.18-0.30), i.e. the CPU seconds a row used, the stand-in for
#: 2 idle cores; the suite's kinds then scaled (x1.2 Gemma 3, x1.64 SmolLM2) so that the estimate of each run
#: equals the CPU seconds its process used (the medians leave out the slow rows: wrong answers run to the limit).
#: ppl_step: one token-by-token step of one spec with the texts as one batch; record: one prompt's
#: full-cache forward (once per context and protocol and question); replay: a policy cache's replay of it;
#: replay_group: the same for a layer-group method (pyramidkv, squeeze: the attention output is computed); real:
#: a cache that cannot replay (mlx-lm's rotating) runs the forward; answer: one question asked and answered.
ONE_CHUNK_COSTS = {
    "gemma3": dict(length=2048, ppl_step=0.162, record=14.8, replay=0.4, replay_group=0.64, real=14.8, answer=4.3),
    "smollm2": dict(length=2048, ppl_step=0.137, record=44.0, replay=1.0, replay_group=1.4, real=45.0, answer=2.6),
    "tiny": dict(length=640, ppl_step=0.004, record=0.05, replay=0.02, replay_group=0.02, real=0.05, answer=0.05),
}
GROUP_METHODS = ("pyramidkv", "squeeze")  # replayed through the attention call (needle.replay_prefill)


# ----------------------------------------------------------------------------- methods and specs
def installed_methods() -> list:
    """Every method name kvpolicy's registry lists (plugins included), in ORDER."""
    from kvpolicy_core import get_registry

    return sort_methods(list(get_registry().methods()))


def sort_methods(names) -> list:
    return sorted(names, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def method_names(text: str) -> list:
    """``--methods``: ``all`` (full, rotating and every installed method), or a comma list (``;`` when config
    strings with commas are given); ``full`` is always run (every score is read against it)."""
    if text.strip() == "all":
        names = ["full", "rotating"] + installed_methods()
    else:
        names = [m.strip() for m in text.split(";" if ";" in text else ",") if m.strip()]
    known = set(installed_methods()) | {"full", "rotating"}
    for n in names:
        if n.partition(":")[0] not in known:
            raise ValueError(f"--methods: unknown method {n!r}; installed: {', '.join(sorted(known))}")
    return ["full"] + [n for n in dict.fromkeys(names) if n != "full"]


def spec_for(name: str, budget: int) -> str:
    """The cache spec of method ``name`` at ``budget`` (``full`` has none; ``rotating`` is mlx-lm's)."""
    return "full" if name == "full" else with_budget(name, max(8, int(budget)))


def parse_kv_bits(text: str) -> list:
    """``--kv-bits``: ``none,8,4`` -> ``[None, 8, 4]`` (none: the cache's own dtype)."""
    out = []
    for x in (t.strip().lower() for t in text.split(",")):
        if not x:
            continue
        if x in ("none", "full", "fp"):
            out.append(None)
        elif x.isdigit() and 2 <= int(x) <= 8:
            out.append(int(x))
        else:
            raise ValueError(f"--kv-bits: none or a bit width 2-8 (got {x!r})")
    if not out:
        raise ValueError("--kv-bits: at least one of none, 8, 4, ...")
    return list(dict.fromkeys(out))


def with_kv_bits(methods, bits) -> list:
    """Each bounded method at each storage of ``bits`` as its own row, in that order per method (``cam`` ->
    ``cam``, ``cam:kv_bits=8``, ``cam:kv_bits=4``); ``full`` and ``rotating`` (mlx-lm's caches) and a method
    that names its own ``kv_bits`` stay as they are."""
    out = []
    for m in methods:
        if m.partition(":")[0] in ("full", "rotating") or "kv_bits=" in m:
            out.append(m)
            continue
        out += [m if b is None else f"{m}{',' if ':' in m else ':'}kv_bits={b}" for b in bits]
    return list(dict.fromkeys(out))


def runs_for_real(name: str) -> bool:
    """A method whose one-chunk prefill cannot be replayed (:func:`kvpolicy_core.eval.tasks.needle.replayable`):
    mlx-lm's rotating cache and a cache storing quantized rows (``kv_bits``)."""
    return name.partition(":")[0] == "rotating" or storage_of(name) != "full precision"


def budget_for(tokens: int, ratio: float) -> int:
    return max(8, int(tokens / ratio))


def fmt_ratio(r: float) -> str:
    return f"{r:g}x"


# ----------------------------------------------------------------------------- loading
def load(model: str, smoke: bool):
    import mlx.core as mx
    import mlx_lm

    if smoke:
        from kvpolicy_core.testing.tiny_models import write_model_dir

        path = write_model_dir(Path(tempfile.mkdtemp(prefix="leaderboard-tiny-")), "llama", layers=2)
        m, tok = mlx_lm.load(str(path))
        return m, tok, str(path)
    from kvpolicy_core.model.resolve import resolve_model_path

    path = resolve_model_path(None if model == "gemma3" else model)
    m, tok = mlx_lm.load(str(path))
    m.set_dtype(mx.float32)
    return m, tok, str(path)


# ----------------------------------------------------------------------------- the estimate
def measured_costs(files, model_key: str):
    """Median per-row costs of earlier leaderboard JSONs of ``model_key`` (None where none), keys of COSTS."""
    got = {"ppl_token": [], "prefill": [], "qa_question": [], "qip_question": [], "record": []}
    got.update(ppl_step=[], replay=[], replay_group=[], real=[], answer=[])
    length = None
    for f in files:
        data = json.loads(Path(f).read_text(encoding="utf-8"))
        if (data.get("config") or {}).get("model") != model_key:
            continue
        for r in data.get("ppl_rows", []):
            if r.get("seconds") and r.get("tokens"):
                if r.get("batch"):
                    got["ppl_step"].append(r["seconds"] * r["batch"] / (r["tokens"] - 1))
                else:
                    got["ppl_token"].append(r["seconds"] / (r["tokens"] - 1))
        for r in data.get("suite_rows", []):
            length = r["length"]
            if r.get("prefill") == "one-chunk":
                got["answer"].append(r["answer_seconds"])
                if r["question"] == 0 or r["protocol"] == "question-in-prompt":
                    kind = "real" if not r["replayed"] else "replay"
                    if r["replayed"] and r["name"] in GROUP_METHODS:
                        kind = "replay_group"
                    got[kind].append(r["start_seconds"])
                continue
            if r.get("reused"):
                continue
            if r["protocol"] == "query-agnostic":
                got["qa_question"].append(r["seconds"])
                if r["question"] == 0 and r.get("prefill_seconds") is not None:
                    got["prefill"].append(r["prefill_seconds"])
            else:
                got["qip_question"].append(r["seconds"])
        got["record"] += list((data.get("record_seconds") or {}).values())
    out = {k: statistics.median(v) for k, v in got.items() if v}
    return ({**out, "length": length} if out and length else out) or None


def estimate(plan: dict, costs: dict, questions: dict) -> dict:
    """Seconds of a run; the one-chunk suite and batched perplexity (``plan["prefill"] == "one-chunk"``) from
    :data:`ONE_CHUNK_COSTS`'s kinds, else :func:`estimate_chunked`."""
    if plan.get("prefill") != "one-chunk":
        return estimate_chunked(plan, costs, questions)
    bounded = plan["methods"][1:]
    n_r = len(plan["ratios"])
    specs = 1 + len(bounded) * n_r
    ppl = (plan["ppl_tokens"] - 1) * specs * costs["ppl_step"] if plan["texts"] else 0.0
    scale = plan["length"] / costs.get("length", plan["length"])
    real = sum(n_r for m in bounded if runs_for_real(m))
    group = sum(n_r for m in bounded if m.partition(":")[0] in GROUP_METHODS and not runs_for_real(m))
    replay = 1 + len(bounded) * n_r - real - group
    per_record = costs["record"] + replay * costs["replay"] + group * costs["replay_group"] + real * costs["real"]
    n_ctx = plan["seeds"] * len(plan["haystacks"])
    suite = 0.0
    for t in plan["tasks"]:
        q = questions.get(t, 1)
        records = ("query-agnostic" in plan["protocols"]) + q * ("question-in-prompt" in plan["protocols"])
        answers = q * len(plan["protocols"])
        suite += n_ctx * (records * per_record + answers * specs * costs["answer"])
    return {"perplexity_s": round(ppl), "suite_s": round(suite * scale), "total_s": round(ppl + suite * scale)}


def estimate_chunked(plan: dict, costs: dict, questions: dict) -> dict:
    """Seconds of a run: perplexity + suite (every spec on every context, both protocols), from ``costs``
    (scaled linearly from ``costs['length']`` to the plan's length). ``questions``: task -> questions."""
    n_bounded = len(plan["methods"]) - 1
    specs = 1 + n_bounded * len(plan["ratios"])
    ppl = len(plan["texts"]) * (plan["ppl_tokens"] - 1) * specs * costs["ppl_token"]
    scale = plan["length"] / costs.get("length", plan["length"])
    n_ctx = plan["seeds"] * len(plan["haystacks"])
    suite = 0.0
    for t in plan["tasks"]:
        q = questions.get(t, 1)
        per_spec = 0.0
        if "query-agnostic" in plan["protocols"]:
            per_spec += costs["prefill"] + q * costs["qa_question"]
        if "question-in-prompt" in plan["protocols"]:
            per_spec += q * costs["qip_question"]
        suite += n_ctx * (costs["record"] + specs * per_spec)
    return {"perplexity_s": round(ppl), "suite_s": round(suite * scale), "total_s": round(ppl + suite * scale)}


def fit(plan: dict, costs: dict, questions: dict, budget_s: float, args=None) -> list:
    """Choose the headline's sizes so its estimate fits ``budget_s``: at least one context per (task, haystack);
    if that is over, one haystack (the first) unless --haystacks was given, then 256 perplexity tokens per text
    unless --ppl-tokens was given; then as many contexts per (task, haystack) as fit (at most 8). Returns what
    was cut (``plan`` is changed in place); the estimate may still be over when even the smallest is."""
    trims = []
    plan["seeds"] = 1
    given = lambda k: args is not None and getattr(args, k, None) is not None  # noqa: E731
    over = lambda: estimate(plan, costs, questions)["total_s"] > budget_s  # noqa: E731
    if over() and len(plan["haystacks"]) > 1 and not given("haystacks"):
        trims.append(f"suite on one haystack ({plan['haystacks'][0]}; not {', '.join(plan['haystacks'][1:])})")
        plan["haystacks"] = plan["haystacks"][:1]
    if over() and plan["ppl_tokens"] > 256 and not given("ppl_tokens"):
        trims.append(f"perplexity on 256 tokens per text (not {plan['ppl_tokens']})")
        plan["ppl_tokens"] = 256
    while plan["seeds"] < 8 and estimate({**plan, "seeds": plan["seeds"] + 1}, costs, questions)["total_s"] <= budget_s:
        plan["seeds"] += 1
    if over():
        trims.append(
            "still over: split the methods over runs (--methods ... --tag headline_<model>_<part>, each prints its "
            "estimate) and merge them with --report"
        )
    return trims


def task_questions(tasks, preset: str, model_name: str) -> dict:
    from kvpolicy_core.eval.tasks import ruler

    return {t: ruler.preset_params(preset, t, model_name).questions for t in tasks}


# ----------------------------------------------------------------------------- running
def main(argv=None):
    p = parser(
        __doc__,
        out=None,
        smoke_help="a tiny random-weight model, a few methods, tiny lengths: seconds (written to a "
        "temporary folder unless --out is given)",
    )
    p.add_argument("--size", choices=["quick", "headline"], help="a preset of the options below (explicit win)")
    p.add_argument("--model", default="gemma3", help="gemma3 (default), smollm2, or an mlx-lm model directory")
    p.add_argument("--methods", help="all, or a comma list of full, rotating and installed methods")
    p.add_argument("--ratios", help="compression ratios, comma list (budget = tokens / ratio)")
    p.add_argument("--texts", help="perplexity texts, comma list: pydoc, stdlib, license, or a file")
    p.add_argument("--ppl-tokens", type=int, help="tokens of each perplexity text")
    p.add_argument("--length", type=int, help="the suite's sequence length (RULER's max_seq_length)")
    p.add_argument("--tasks", help="suite tasks, comma list (default: " + ",".join(SUITE_TASKS) + ")")
    p.add_argument("--haystacks", help="suite haystacks, comma list: noise, pydoc, stdlib")
    p.add_argument("--protocols", help="comma list of " + ", ".join(PROTOCOL_ORDER))
    p.add_argument("--seeds", type=int, help="contexts per (task, haystack); headline: chosen to fit --hours")
    p.add_argument(
        "--hours",
        type=float,
        default=1.0,
        help="headline: the wall-time this model's estimate must fit (1: the two models' headlines together in 2 h)",
    )
    p.add_argument("--costs", nargs="+", metavar="JSON", help="earlier leaderboard JSONs whose row costs estimate")
    p.add_argument("--min-full", type=float, default=60.0, help="flag a task the full cache scores below this")
    p.add_argument("--prefill-step", type=int, default=2048, help="chunked: generate_step's chunk")
    p.add_argument(
        "--prefill",
        choices=["one-chunk", "chunked"],
        default="one-chunk",
        help="the suite's prompts in one chunk, each forward shared by every method (kvpress's protocol; default), "
        "or in --prefill-step chunks through each method's caches (mlx-lm's generate_step, no sharing past the "
        "first chunk)",
    )
    p.add_argument(
        "--kv-bits",
        help="comma list of none (full precision), 8, 4, ...: each bounded method (not full, rotating) at each, "
        "as its own row (cam, cam:kv_bits=8, ...); the quality-per-byte table and plot of --report",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimate, run nothing")
    p.add_argument("--resume", metavar="JSON", help="a result file of a run cut short: its perplexity rows kept")
    p.add_argument("--no-suite", action="store_true", help="perplexity only")
    p.add_argument("--no-ppl", action="store_true", help="the suite only")
    p.add_argument("--report", nargs="+", metavar="JSON", help="merge result files into --docs and --plots; no run")
    p.add_argument(
        "--docs",
        help="markdown page whose tables --report rewrites; {model} in it: a page per model "
        "(default docs/results/leaderboard-{model}.md)",
    )
    p.add_argument("--plots", help="folder of --report's plots (default: benchmarks/results)")
    args = p.parse_args(argv)
    if args.out is None:  # a smoke run's files are not results: kept out of benchmarks/results
        args.out = tempfile.mkdtemp(prefix="leaderboard-smoke-") if args.smoke and not args.report else str(RESULTS)
    try:
        if args.report:
            report(args.report, Path(args.docs or DOCS), Path(args.plots or args.out))
        else:
            run(args)
    except ValueError as exc:
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        sys.exit(2)


def resolve_plan(args, model_key: str, model_name: str) -> dict:
    size = "smoke" if args.smoke else (args.size or "quick")
    d = SIZES[size]
    pick = lambda k: getattr(args, k) if getattr(args, k) is not None else d[k]  # noqa: E731
    plan = {
        "size": size,
        "methods": method_names(pick("methods")),
        "ratios": [float(x) for x in str(pick("ratios")).split(",") if x],
        "texts": [] if args.no_ppl else [x for x in pick("texts").split(",") if x],
        "ppl_tokens": int(pick("ppl_tokens")),
        "length": int(pick("length")),
        "tasks": [] if args.no_suite else [x for x in pick("tasks").split(",") if x],
        "haystacks": [x for x in pick("haystacks").split(",") if x],
        "protocols": [x for x in pick("protocols").split(",") if x],
        "seeds": args.seeds if args.seeds is not None else d["seeds"],
        "min_full": 0.0 if args.smoke else args.min_full,  # a random model scores 0: nothing flagged
        "prefill_step": 128 if args.smoke else args.prefill_step,
        "prefill": args.prefill,
    }
    if getattr(args, "kv_bits", None):
        plan["kv_bits"] = parse_kv_bits(args.kv_bits)
        plan["methods"] = with_kv_bits(plan["methods"], plan["kv_bits"])
    if any(r < 1 for r in plan["ratios"]) or not plan["ratios"]:
        raise ValueError(f"--ratios: compression ratios >= 1 (got {plan['ratios']})")
    if any(x not in PROTOCOL_ORDER for x in plan["protocols"]):
        raise ValueError(f"--protocols: some of {', '.join(PROTOCOL_ORDER)} (got {plan['protocols']})")
    from kvpolicy_core.eval.tasks import ruler

    bad = [t for t in plan["tasks"] if t not in ruler.TASKS]
    if bad:
        raise ValueError(f"--tasks: unknown task {bad[0]!r}; choose from {', '.join(ruler.TASKS)}")
    if plan["ppl_tokens"] < 2:
        raise ValueError("--ppl-tokens: at least 2")
    return plan


def choose_costs(args, model_key: str):
    files = list(args.costs or [])
    quick = Path(args.out) / f"leaderboard_quick_{model_key}.json"
    if not files and quick.is_file():
        kind = json.loads(quick.read_text(encoding="utf-8")).get("config", {}).get("prefill", "chunked")
        files = [quick] if kind == args.prefill else []
    got = measured_costs(files, model_key) if files else None
    table = ONE_CHUNK_COSTS if args.prefill == "one-chunk" else COSTS
    base = dict(table.get(model_key, table["gemma3"]))
    got = {k: v for k, v in (got or {}).items() if k in base}
    if got:
        base.update(got)
        return base, "measured: " + ", ".join(str(f) for f in files)
    name = "ONE_CHUNK_COSTS" if args.prefill == "one-chunk" else "COSTS"
    return base, f"built-in ({name}: measured on 2 shared x86 cores)"


def run(args):
    start = time.perf_counter()
    model_key = "tiny" if args.smoke else Path(args.model).name
    plan = resolve_plan(args, model_key, "")
    costs, source = choose_costs(args, model_key)
    model_dir = "" if args.smoke else ("gemma3-270m-float32" if model_key == "gemma3" else model_key)
    questions = task_questions(plan["tasks"], "calibrated", model_dir)
    if args.smoke:
        questions.update({t: v["questions"] for t, v in SMOKE_PARAMS.items() if t in questions})
    if plan["seeds"] is None:  # headline: fit --hours (module docstring), what was cut printed and recorded
        plan["trims"] = fit(plan, costs, questions, 3600 * args.hours, args)
        for t in plan["trims"]:
            print(f"to fit {args.hours:g} h: {t}", flush=True)
    est = estimate(plan, costs, questions)
    n_specs = 1 + (len(plan["methods"]) - 1) * len(plan["ratios"])
    print(
        f"leaderboard ({plan['size']}, {model_key}): {len(plan['methods'])} methods x {len(plan['ratios'])} ratios "
        f"= {n_specs} caches; perplexity on {plan['texts']} ({plan['ppl_tokens']} tokens); suite "
        f"{plan['tasks']} at {plan['length']} tokens, {plan['haystacks']}, {plan['seeds']} context(s) per task "
        f"and haystack, {plan['protocols']}",
        flush=True,
    )
    hours = est["total_s"] / 3600
    print(
        f"estimate: {est['total_s']} s ({hours:.2f} h): perplexity {est['perplexity_s']} s, suite {est['suite_s']} s "
        f"(costs {source})" + (f"; over the {args.hours:g} h target" if hours > args.hours else ""),
        flush=True,
    )
    if args.dry_run:
        return
    model, tok, path = load(args.model, args.smoke)
    name = result_name("leaderboard", args)
    out = Path(args.out)
    state = {
        "config": {**plan, "model": model_key, "model_path": path, "costs": costs, "costs_source": source},
        "estimate": est,
        "ppl_rows": [],
        "suite_rows": [],
        "flagged": [],
        "record_seconds": {},
        "errors": [],
    }
    if args.resume:  # a run cut short: its perplexity rows kept, the specs it measured not run again
        prev = read_result(args.resume)
        if prev["config"]["model"] != model_key or prev["config"]["ppl_tokens"] != plan["ppl_tokens"]:
            raise ValueError(f"--resume {args.resume}: another model or --ppl-tokens")
        state["ppl_rows"] = [r for r in prev["ppl_rows"] if r["text"] in plan["texts"]]
        state["errors"] = prev.get("errors", [])
        state["resumed_from"] = {"file": str(args.resume), "seconds": prev.get("seconds")}

    def save():
        state["seconds"] = round(time.perf_counter() - start, 1)
        board = build_board(state["ppl_rows"], state["suite_rows"], plan["min_full"])
        state["board"] = board
        state["rank_vs_h2o"] = rank_vs_h2o(board, state["ppl_rows"], suite_rows=state["suite_rows"])
        write_json(name, state, out)

    if plan["tasks"]:  # the suite first: the score; perplexity breaks its ties
        runner = run_suite_one_chunk if plan["prefill"] == "one-chunk" else run_suite
        runner(model, tok, plan, state, save, Path(path).name if not args.smoke else "", args.smoke)
    if plan["texts"]:
        run_perplexity(model, tok, plan, state, save)
    save()
    board = state["board"]
    print("\n" + side_by_side(board, plan) + "\n", flush=True)
    md = markdown(board, state["rank_vs_h2o"], [str(out / f"{name}.json")], state["seconds"])
    stem = name if name.endswith(f"_{model_key}") else f"{name}_{model_key}"  # the model named once
    (out / f"{stem}.md").write_text(md + "\n", encoding="utf-8")
    plot(out / f"{stem}.png", board, MODEL_NAMES.get(model_key, model_key))
    print(f"wrote {out / (name + '.json')}, {stem}.md and .png in {state['seconds']:.0f} s", flush=True)


def memory_mark() -> int:
    """MLX's active memory now, its peak counter reset: the mark a run's memory is read against."""
    import mlx.core as mx

    mx.synchronize()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def memory_since(mark: int) -> dict:
    """MLX's allocator since :func:`memory_mark`: ``peak_memory_bytes`` (``mx.get_peak_memory``) and
    ``active_memory_bytes`` (``mx.get_active_memory``: what is still held, the caches included while they are
    alive), both above the active memory at the mark (the model's weights and anything held before are left out)."""
    import mlx.core as mx

    mx.synchronize()
    return {
        "peak_memory_bytes": max(0, mx.get_peak_memory() - mark),
        "active_memory_bytes": max(0, mx.get_active_memory() - mark),
    }


def lm_head(model):
    """The model's last projection (hidden state -> logits): its ``lm_head``, or the tied embedding."""
    return model["lm_head"] if "lm_head" in model else model.model.embed_tokens.as_linear


def batched_perplexity(model, rows, spec) -> list:
    """Token-by-token perplexity (:func:`kvpolicy_core.eval.perplexity.perplexity` with ``chunk=1``) of several
    texts of one length at once, one batch row per text (each row's cache evicts on its own), the logits computed
    after the last step from every step's hidden state: a step's hidden state does not depend on when its
    projection is read, and the projection (Gemma 3's is 168M of its 268M weights) is then read once, not once a
    token. Per row: ``{"nll", "perplexity", ...}`` as ``perplexity`` returns."""
    import mlx.core as mx
    import numpy as np

    from kvpolicy_core.eval.perplexity import kv_bytes, make_caches, spec_label

    mark = memory_mark()
    caches = make_caches(model, spec)
    tokens = mx.array([list(r) for r in rows], dtype=mx.int32)
    B, T = tokens.shape
    start = time.perf_counter()
    hidden = []
    for i in range(T - 1):
        h = model.model(tokens[:, i : i + 1], cache=caches)
        mx.eval(h)
        hidden.append(h)
    head = lm_head(model)
    nll = np.zeros((B, T - 1), dtype=np.float64)
    for a in range(0, T - 1, 64):
        b = min(a + 64, T - 1)
        logits = head(mx.concatenate(hidden[a:b], axis=1)).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nll[:, a:b] = np.array(-mx.take_along_axis(logp, tokens[:, a + 1 : b + 1, None], axis=-1)[..., 0])
    seconds = time.perf_counter() - start
    del hidden, logits, logp
    memory = memory_since(mark)  # the caches still alive: resident is mostly theirs
    kept, full = kv_bytes(caches)
    return [
        {
            "spec": spec_label(spec),
            "nll": nll[k],
            "perplexity": math.exp(float(nll[k].mean())),
            "seconds": seconds / B,
            "batch_seconds": seconds,
            "kv_bytes_kept": kept // B,
            "kv_bytes_full": full // B,
            "nan": bool(np.isnan(nll[k]).any()),
            **memory,
        }
        for k in range(B)
    ]


def run_perplexity(model, tok, plan, state, save):
    """Every spec on every text, token by token; the texts (one length) are the rows of one batch."""
    from kvpolicy_core.eval.tasks.haystack import haystack_text

    texts = {}
    for text in plan["texts"]:
        ids = tok.encode(haystack_text(text))[: plan["ppl_tokens"]]
        if len(ids) < plan["ppl_tokens"]:
            raise ValueError(f"--texts {text}: {len(ids)} tokens, fewer than --ppl-tokens {plan['ppl_tokens']}")
        texts[text] = ids
    full = {r["text"]: r for r in state["ppl_rows"] if r["method"] == "full"}  # --resume: rows measured before
    done = {(r["method"], r["ratio"]) for r in state["ppl_rows"]}
    order = [("full", 1.0)] + [(n, r) for r in run_order(plan["ratios"]) for n in plan["methods"][1:]]
    for name, ratio in order:
        if (name, ratio) in done:
            continue
        budget = None if name == "full" else budget_for(plan["ppl_tokens"], ratio)
        spec = spec_for(name, budget or 0)
        try:
            got = batched_perplexity(model, list(texts.values()), spec)
        except Exception as exc:  # a method refusing a budget (recorded; the other specs still run)
            if name == "full":
                raise
            state["errors"].append({"part": "perplexity", "spec": spec, "error": f"{type(exc).__name__}: {exc}"})
            print(f"ppl {spec}: {type(exc).__name__}: {exc}", flush=True)
            save()
            continue
        for text, r in zip(texts, got):
            if name == "full":
                full[text] = r
            row = {
                "text": text,
                "tokens": len(texts[text]),
                "method": name,
                "ratio": ratio,
                "budget": budget,
                "spec": r["spec"],
                "perplexity": r["perplexity"],
                "delta_ppl_pct": 100 * (r["perplexity"] / full[text]["perplexity"] - 1),
                "seconds": round(r["seconds"], 2),
                "batch": len(texts),
                "kv_bytes_kept": r["kv_bytes_kept"],
                "kv_bytes_full": r["kv_bytes_full"],
                "peak_memory_bytes": r["peak_memory_bytes"],
                "active_memory_bytes": r["active_memory_bytes"],
                "nan": r["nan"],
                "nll": [round(float(x), 5) for x in r["nll"]],
            }
            state["ppl_rows"].append(row)
            print(
                f"ppl {text:8} {spec:28} {r['perplexity']:9.3f} ({row['delta_ppl_pct']:+7.1f}%) "
                f"{r['batch_seconds']:.0f} s (batch of {len(texts)})",
                flush=True,
            )
        save()


def suite_contexts(tok, plan, model_name: str, smoke: bool):
    """The suite's contexts of ``plan`` (calibrated prompts, no chat format; the smoke model's own parameters)."""
    from kvpolicy_core.eval.tasks import ruler

    params = {t: ruler.TaskParams(**v) for t, v in SMOKE_PARAMS.items()} if smoke else None
    return ruler.build_suite(
        tok,
        plan["tasks"],
        [plan["length"]],
        plan["haystacks"],
        range(plan["seeds"]),
        model=model_name,
        chat="none",
        preset="calibrated",
        params=params,
    )


def run_suite(model, tok, plan, state, save, model_name: str, smoke: bool):
    from kvpolicy_core.eval.tasks.ruler_runner import record_first_chunk, run_context

    contexts = suite_contexts(tok, plan, model_name, smoke)
    protocols = [p for p in PROTOCOL_ORDER if p in plan["protocols"]]
    for task in plan["tasks"]:
        group = [c for c in contexts if c.task == task]
        records = {}
        for c in group:
            t = time.perf_counter()
            records[c.id] = record_first_chunk(model, c, plan["prefill_step"])
            state["record_seconds"][c.id] = round(time.perf_counter() - t, 2)

        def one(ctx, name, ratio):
            spec = spec_for(name, budget_for(plan["length"], ratio))
            rows = run_context(model, tok, ctx, spec, protocols, plan["prefill_step"], records[ctx.id])
            for r in rows:
                r.update(name=name, ratio=ratio)
                print(
                    f"{r['protocol']:18} {r['method']:26} {r['id']:26} q{r['question']} {r['score']:.2f} "
                    f"{r['output'].strip()[:32]!r:34} {r['seconds']}s",
                    flush=True,
                )
            state["suite_rows"].extend(rows)

        for ctx in group:
            one(ctx, "full", 1.0)
        full = [r["score"] for r in state["suite_rows"] if r["task"] == task and r["name"] == "full"]
        full_score = 100 * sum(full) / len(full)
        save()
        if full_score < plan["min_full"]:
            state["flagged"].append({"task": task, "full": round(full_score, 1)})
            print(
                f"{task}: the full cache scores {full_score:.1f} < {plan['min_full']:g}: flagged, skipped", flush=True
            )
            continue
        for ctx in group:
            for name in plan["methods"][1:]:
                for ratio in plan["ratios"]:
                    one(ctx, name, ratio)
                    save()
        records.clear()


def run_suite_one_chunk(model, tok, plan, state, save, model_name: str, smoke: bool):
    """The suite with every prompt prefilled in one chunk (kvpress's protocol: the whole context, or the whole
    prompt with its question, reaches the cache at once and is cut when it is in), its full-cache forward
    computed once per (context, protocol, question) and replayed into every method's caches
    (:func:`kvpolicy_core.eval.tasks.needle.replay_prefill`: the calls a cache gets inside the model, exact;
    mlx-lm's ``RotatingKVCache`` masks a chunk by its own window and is run for real). Query-agnostic: the
    context but its last token is replayed, the last token is a step of its own (the cut), then each question is
    asked of a copy; question-in-prompt: each question's prompt but its last token is replayed and the last token
    starts the answer (as the compress-once route does, :mod:`kvpolicy_core.eval.tasks.ruler_runner`)."""
    from kvpolicy_core.eval.tasks.needle import record_prefill

    contexts = suite_contexts(tok, plan, model_name, smoke)
    protocols = [p for p in PROTOCOL_ORDER if p in plan["protocols"]]
    items = {}  # context id -> [(protocol, question or None, prompt ids, record)], kept for the run
    unflagged = []

    def one(ctx, name, ratio):
        spec = spec_for(name, budget_for(plan["length"], ratio))
        rows = one_chunk_context(model, tok, ctx, spec, items[ctx.id], plan["prefill_step"])
        for r in rows:
            r.update(name=name, ratio=ratio)
            print(
                f"{r['protocol']:18} {r['method']:26} {r['id']:26} q{r['question']} {r['score']:.2f} "
                f"{r['output'].strip()[:32]!r:34} {r['start_seconds']}+{r['answer_seconds']}s",
                flush=True,
            )
        state["suite_rows"].extend(rows)

    for task in plan["tasks"]:
        group = [c for c in contexts if c.task == task]
        for c in group:
            items[c.id] = []
            prompts = [("query-agnostic", None, c.context_ids)] if "query-agnostic" in protocols else []
            if "question-in-prompt" in protocols:
                prompts += [("question-in-prompt", i, c.full_prompt_ids(i)) for i in range(len(c.questions))]
            for proto, i, ids in prompts:
                t = time.perf_counter()
                rec = record_prefill(model, ids)
                state["record_seconds"][f"{c.id}:{SHORT[proto]}{'' if i is None else i}"] = round(
                    time.perf_counter() - t, 2
                )
                items[c.id].append((proto, i, ids, rec))

        for ctx in group:
            one(ctx, "full", 1.0)
        full = [r["score"] for r in state["suite_rows"] if r["task"] == task and r["name"] == "full"]
        full_score = 100 * sum(full) / len(full)
        save()
        if full_score < plan["min_full"]:
            state["flagged"].append({"task": task, "full": round(full_score, 1)})
            print(
                f"{task}: the full cache scores {full_score:.1f} < {plan['min_full']:g}: flagged, skipped", flush=True
            )
            for c in group:
                items.pop(c.id)
            continue
        unflagged += group
    for ratio in run_order(plan["ratios"]):  # every method at the ranking's ratio first (run_order)
        for ctx in unflagged:
            for name in plan["methods"][1:]:
                one(ctx, name, ratio)
                save()
    items.clear()


def run_order(ratios, at: float = 8.0) -> list:
    """The ratios in the order they are run: the ranking's (``at``, 8x) first, then the nearest, so a run cut
    short still ranks every method."""
    return sorted(ratios, key=lambda r: (abs(math.log(r / at)), -r))


def one_chunk_context(model, tok, ctx, spec, items, step: int) -> list:
    """``spec``'s rows on one context from its recorded one-chunk prefills (:func:`run_suite_one_chunk`); each
    row has ``start_seconds`` (the replay, or the real forward, and the query-agnostic cut), ``answer_seconds``
    (the question and the answer) and ``seconds`` (their sum for question-in-prompt, as the chunked runner's)."""
    import mlx.core as mx

    from kvpolicy_core.eval.perplexity import kv_bytes, make_caches
    from kvpolicy_core.eval.tasks.needle import needle_kept, replay_prefill, replayable
    from kvpolicy_core.eval.tasks.ruler_runner import copy_caches, greedy, method_label, result_row

    rows = []
    label = method_label(spec)
    replayed = replayable(spec)
    statements = [p for a, b in ctx.spans for p in range(a, b)]

    def start(ids, rec):
        if replayed:
            return replay_prefill(model, spec, rec)
        caches = make_caches(model, spec)
        model(mx.array(list(ids[:-1]), dtype=mx.uint32)[None], cache=caches)
        mx.eval([c.state for c in caches])
        return caches

    def ask(caches, ids, q):
        return greedy(model, tok, caches, ids, q.max_new_tokens, ctx.stop_ids, step, q.answers, ctx.metric)

    def row(protocol, i, got, caches, start_s, answer_s, extra, mark):
        seconds = answer_s + (start_s if protocol == "question-in-prompt" else 0.0)
        timing = {"start_seconds": round(start_s, 2), "answer_seconds": round(answer_s, 2)}
        memory = memory_since(mark)  # question-in-prompt: after the answer, its caches alive
        if protocol == "query-agnostic":  # resident: the context's caches after the cut, before any copy
            memory["active_memory_bytes"] = extra["context_active_memory_bytes"]
        more = {"prefill": "one-chunk", "replayed": replayed, **timing, **memory, **extra}
        rows.append(result_row(ctx, label, protocol, i, got, caches, seconds, more))

    for proto, i, ids, rec in items:
        mark = memory_mark()  # the recorded forward (shared by every method) is held before it
        t = time.perf_counter()
        caches = start(ids, rec)
        if proto == "query-agnostic":  # the context's last token: its own step, before any question exists
            model(mx.array(list(ids[-1:]), dtype=mx.uint32)[None], cache=caches)
            mx.eval([c.state for c in caches])
            start_s = time.perf_counter() - t
            ctx_kept, ctx_full = kv_bytes(caches)
            extra = {
                "prefill_seconds": round(start_s, 2),
                "statements_kept": needle_kept(caches, statements) if ctx.spans else None,
                "context_kv_bytes_kept": ctx_kept,
                "context_kv_bytes_full": ctx_full,
                "context_active_memory_bytes": memory_since(mark)["active_memory_bytes"],
            }
            for qi, q in enumerate(ctx.questions):
                t = time.perf_counter()
                asked = copy_caches(caches)
                got = ask(asked, q.question_ids, q)
                row(proto, qi, got, asked, start_s, time.perf_counter() - t, extra, mark)
        else:
            start_s = time.perf_counter() - t
            t = time.perf_counter()
            got = ask(caches, ids[-1:], ctx.questions[i])
            row(proto, i, got, caches, start_s, time.perf_counter() - t, {}, mark)
        del caches
    return rows


# ----------------------------------------------------------------------------- the board
Z95 = 1.959963984540054  # the normal quantile of a two-sided 95% interval


def wilson(p: float, n: float, z: float = Z95):
    """The Wilson score interval (low, high) of a proportion ``p`` seen over ``n`` trials; ``n`` may be an
    effective (non-integer) number of trials. None when ``n`` is 0."""
    if n <= 0:
        return None
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(max(0.0, p * (1 - p)) / n + z * z / (4 * n * n)) / d
    low = 0.0 if p <= 0 else max(0.0, centre - half)  # exact at the ends (no rounding residue)
    return low, 1.0 if p >= 1 else min(1.0, centre + half)


def score_interval(items) -> dict:
    """A weighted score's 95% interval: ``items`` = [(score 0-1, weight)], one per question answered. The score
    is the weighted mean (a task's questions share the task's weight, as RULER's mean over tasks does), the
    interval Wilson's at Kish's effective number of questions ``1 / sum(w^2)`` (weights summing to 1): 3
    questions weighted 1/2, 1/4, 1/4 (niah_single's one, niah_multikey's two) count as 2.7. Percent."""
    total = sum(w for _, w in items)
    if not items or total <= 0:
        return {}
    p = sum(s * w for s, w in items) / total
    n_eff = total * total / sum(w * w for _, w in items)
    low, high = wilson(p, n_eff)
    return {"n": len(items), "n_eff": round(n_eff, 2), "low": round(100 * low, 1), "high": round(100 * high, 1)}


def sign_test(b: int, c: int) -> float:
    """Exact two-sided sign test (McNemar's exact test) of ``b`` against ``c`` discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def ppl_interval(pairs):
    """The perplexity ratio of ``pairs`` = [(nll, nll_reference)] pooled over texts with its paired block
    bootstrap 95% interval (:func:`kvpolicy_core.eval.perplexity.pooled_ratio`); None where there are too few
    tokens for one (fewer than two 32-token blocks per text)."""
    from kvpolicy_core.eval.perplexity import pooled_ratio

    try:
        pr = pooled_ratio(pairs)
    except ValueError:
        return None
    return {k: round(pr[k], 4) for k in ("ratio", "low", "high")}


def build_board(ppl_rows, suite_rows, min_full: float = 60.0) -> dict:
    """Per method (``full`` included) per ratio: perplexity change per text (and their mean), the suite score per
    protocol (mean over unflagged tasks of RULER's score; none where some unflagged task was not run, as in a run
    cut short) and ``score`` (the mean over the protocols)."""
    ppl_rows = label_texts(ppl_rows)
    texts = list(dict.fromkeys(r["text"] for r in ppl_rows))
    full_ppl = {r["text"]: r["perplexity"] for r in ppl_rows if r["method"] == "full"}
    tasks = [t for t in SUITE_TASKS if any(r["task"] == t for r in suite_rows)]
    tasks += sorted({r["task"] for r in suite_rows} - set(tasks))
    protocols = [p for p in PROTOCOL_ORDER if any(r["protocol"] == p for r in suite_rows)]
    full_task = {}
    for r in suite_rows:
        if r["name"] == "full":
            full_task.setdefault(r["task"], []).append(r["score"])
    full_by_task = {t: 100 * sum(v) / len(v) for t, v in full_task.items()}
    flagged = sorted(t for t, s in full_by_task.items() if s < min_full)
    full_nll = {r["text"]: r["nll"] for r in ppl_rows if r["method"] == "full" and r.get("nll")}
    cells = {}
    new_cell = lambda: {"ppl": {}, "ppl_abs": {}, "ppl_ci": {}, "suite": {}, "tasks": {}, "items": {}}  # noqa: E731
    for r in ppl_rows:
        c = cells.setdefault((r["method"], r["ratio"]), new_cell())
        c["ppl"][r["text"]] = (
            round(100 * (r["perplexity"] / full_ppl[r["text"]] - 1), 2) if r["text"] in full_ppl else None
        )
        c["ppl_abs"][r["text"]] = round(r["perplexity"], 4)
        if r["method"] != "full" and r.get("nll") and r["text"] in full_nll:
            c.setdefault("nll_pairs", []).append((r["nll"], full_nll[r["text"]]))
            ci = ppl_interval([(r["nll"], full_nll[r["text"]])])
            if ci:
                c["ppl_ci"][r["text"]] = [round(100 * (ci["low"] - 1), 1), round(100 * (ci["high"] - 1), 1)]
    per = {}
    for r in suite_rows:
        per.setdefault((r["name"], r["ratio"], r["protocol"], r["task"]), []).append(r["score"])
    for (name, ratio, protocol, task), v in per.items():
        c = cells.setdefault((name, ratio), new_cell())
        c["tasks"].setdefault(protocol, {})[task] = round(100 * sum(v) / len(v), 1)
        c["items"].setdefault(protocol, {})[task] = v
    needed = [t for t in full_by_task if t not in flagged]  # a score needs every task the full cache can do
    rows, items = [], {}  # items: (method, ratio) -> {protocol: [(score, weight)]}, for the intervals
    for (name, ratio), c in cells.items():
        for protocol, by_task in c["tasks"].items():
            ok = [s for t, s in by_task.items() if t not in flagged]
            whole = all(t in by_task for t in needed)  # a run cut short mid-ratio: no score from some tasks
            c["suite"][protocol] = round(sum(ok) / len(ok), 1) if ok and whole else None
            if c["suite"][protocol] is not None:
                answers = {t: v for t, v in c["items"][protocol].items() if t not in flagged}
                items.setdefault((name, ratio), {})[protocol] = [
                    (x, 1 / (len(answers) * len(v))) for v in answers.values() for x in v
                ]
        scores = [c["suite"].get(p) for p in protocols if c["suite"].get(p) is not None]
        deltas = [c["ppl"][t] for t in texts if c["ppl"].get(t) is not None]
        score = round(sum(scores) / len(scores), 1) if scores and len(scores) == len(protocols) else None
        mine = items.get((name, ratio), {})
        rows.append(
            {
                "method": name,
                "ratio": ratio,
                "ppl_delta_pct": c["ppl"],
                "ppl_delta_ci": c["ppl_ci"],
                "ppl": c["ppl_abs"],
                "ppl_delta_mean_pct": round(sum(deltas) / len(deltas), 2) if deltas else None,
                "ppl_ratio_pooled": ppl_interval(c["nll_pairs"]) if c.get("nll_pairs") else None,
                "suite": c["suite"],
                "suite_ci": {p: score_interval(v) for p, v in mine.items()},
                "suite_tasks": c["tasks"],
                "score": score,
                "score_ci": score_interval([(x, w / len(mine)) for v in mine.values() for x, w in v])
                if score is not None
                else {},
            }
        )
    rows.sort(key=lambda r: (sort_key(r["method"]), r["ratio"]))
    pooled = {}  # per method over every ratio it has a score at: the score's mean and its interval
    all_ratios = sorted({r["ratio"] for r in rows if r["method"] != "full"})
    for m in dict.fromkeys(r["method"] for r in rows if r["method"] != "full"):
        got = {x: items[(m, x)] for x in all_ratios if (m, x) in items and len(items[(m, x)]) == len(protocols)}
        if not got or len(got) < len(all_ratios):
            continue
        k = len(got)
        e = {"ratios": sorted(got), "suite": {}}
        for p in protocols:
            its = [(x, w / k) for v in got.values() for x, w in v[p]]
            e["suite"][p] = {"score": round(100 * sum(x * w for x, w in its), 1), **score_interval(its)}
        its = [(x, w / (k * len(protocols))) for v in got.values() for q in v.values() for x, w in q]
        e.update(score=round(100 * sum(x * w for x, w in its), 1), **score_interval(its))
        pooled[m] = e
    models = {r["model"] for r in suite_rows}
    return {
        "texts": texts,
        "tasks": tasks,
        "protocols": protocols,
        "flagged": {t: round(full_by_task[t], 1) for t in flagged},
        "full_by_task": {t: round(s, 1) for t, s in full_by_task.items()},
        "ratios": sorted({r["ratio"] for r in rows if r["method"] != "full"}),
        "suite_model": sorted(models),
        "pooled": pooled,
        "questions": {
            t: sum(1 for r in suite_rows if r["task"] == t and r["name"] == "full" and r["protocol"] == protocols[0])
            for t in tasks
        },
        "rows": rows,
    }


def label_texts(ppl_rows) -> list:
    """The rows with a text measured at several lengths (merged runs) labelled per length: ``pydoc@512``."""
    sizes = {}
    for r in ppl_rows:
        sizes.setdefault(r["text"], set()).add(r["tokens"])
    return [{**r, "text": r["text"] if len(sizes[r["text"]]) == 1 else f"{r['text']}@{r['tokens']}"} for r in ppl_rows]


def sort_key(name: str):
    base = name.partition(":")[0]
    return (ORDER.index(base) if base in ORDER else len(ORDER), name)


def rank_vs_h2o(board: dict, ppl_rows, at: float = 8.0, suite_rows=None) -> dict:
    """Each method against ``h2o`` at ``at``x (else the ratio nearest it): the rank of every method there (score
    descending, then the mean perplexity change ascending), the score difference and the perplexity ratio to
    h2o pooled over the texts (paired block bootstrap, 95%), and a verdict per measure. With ``suite_rows``, the
    suite's questions paired with h2o's (same context, protocol and question): how many only h2o answers, how
    many only the method, and the exact sign test's p of that split (``suite_vs_h2o_p``; below 0.05 needs at
    least 6 questions answered by one and missed by the other, none the other way)."""
    from kvpolicy_core.eval.perplexity import pooled_ratio

    ratios = board["ratios"]
    if not ratios:
        return {}
    ratio = min(ratios, key=lambda r: (abs(math.log(r / at)), -r))
    rows = [r for r in board["rows"] if r["ratio"] == ratio and r["method"] != "full"]
    inf = float("inf")
    ordered = sorted(
        rows,
        key=lambda r: (
            -(r["score"] if r["score"] is not None else -inf),
            r["ppl_delta_mean_pct"] if r["ppl_delta_mean_pct"] is not None else inf,
            sort_key(r["method"]),
        ),
    )
    h2o = next((r for r in rows if r["method"] == "h2o"), None)
    nll = {(r["method"], r["text"]): r["nll"] for r in label_texts(ppl_rows) if r["ratio"] == ratio}
    out = {"ratio": ratio, "order": [r["method"] for r in ordered], "methods": {}}
    answered = {}  # method -> {(context, protocol, question): score}, the unflagged tasks at ``ratio``
    for r in suite_rows or []:
        if r["ratio"] == ratio and r["task"] not in board["flagged"]:
            answered.setdefault(r["name"], {})[(r["id"], r["protocol"], r["question"])] = r["score"]

    def key(r):
        return (
            -(r["score"] if r["score"] is not None else -inf),
            r["ppl_delta_mean_pct"] if r["ppl_delta_mean_pct"] is not None else inf,
        )

    rank = {r["method"]: 1 + sum(key(o) < key(r) for o in rows) for r in rows}  # ties share a rank
    for r in ordered:
        e = {"rank": rank[r["method"]], "score": r["score"], "ppl_delta_mean_pct": r["ppl_delta_mean_pct"]}
        if h2o is not None and r["method"] != "h2o":
            e["h2o_rank"] = rank["h2o"]
            if r["score"] is not None and h2o["score"] is not None:
                d = r["score"] - h2o["score"]
                e["score_minus_h2o"] = round(d, 1)
                e["suite_vs_h2o"] = "above" if d > 0 else "below" if d < 0 else "tie"
            mine, theirs = answered.get(r["method"], {}), answered.get("h2o", {})
            common = [k for k in mine if k in theirs]
            if common:
                only_h2o = sum(theirs[k] > mine[k] for k in common)
                only_me = sum(mine[k] > theirs[k] for k in common)
                e["suite_paired_vs_h2o"] = {"questions": len(common), "only_h2o": only_h2o, "only_method": only_me}
                e["suite_vs_h2o_p"] = round(sign_test(only_h2o, only_me), 4)
            pairs = [
                (nll[(r["method"], t)], nll[("h2o", t)])
                for t in board["texts"]
                if (r["method"], t) in nll and ("h2o", t) in nll
            ]
            if pairs:
                try:
                    pr = pooled_ratio(pairs)
                    e["ppl_ratio_vs_h2o"] = {k: round(pr[k], 4) for k in ("ratio", "low", "high")}
                    e["ppl_vs_h2o"] = "better" if pr["high"] < 1 else "worse" if pr["low"] > 1 else "indistinguishable"
                except ValueError as exc:  # too few tokens for the interval
                    e["ppl_ratio_vs_h2o"] = {
                        "ratio": round(
                            math.exp(sum(sum(a) - sum(b) for a, b in pairs) / sum(len(a) for a, _ in pairs)), 4
                        )
                    }
                    e["ppl_vs_h2o_note"] = str(exc)
        out["methods"][r["method"]] = e
    return out


# ----------------------------------------------------------------------------- output
def _cell(v, fmt="{:.1f}"):
    return "" if v is None else fmt.format(v)


def side_by_side(board: dict, plan=None) -> str:
    texts, protocols = board["texts"], board["protocols"]
    head = f"{'method':16} {'ratio':>5} " + " ".join(f"{'ppl ' + t[:8]:>14}" for t in texts)
    head += " " + " ".join(f"{SHORT.get(p, p):>6}" for p in protocols) + f" {'score':>6}"
    lines = [head, "-" * len(head)]
    for r in board["rows"]:
        ppl = []
        for t in texts:
            if r["method"] == "full":
                ppl.append(f"{_cell(r['ppl'].get(t), '{:.3f}'):>14}")
            else:
                ppl.append(f"{_cell(r['ppl_delta_pct'].get(t), '{:+.1f}%'):>14}")
        lines.append(
            f"{r['method'][:16]:16} {fmt_ratio(r['ratio']):>5} "
            + " ".join(ppl)
            + " "
            + " ".join(f"{_cell(r['suite'].get(p)):>6}" for p in protocols)
            + f" {_cell(r['score']):>6}"
        )
    if board["flagged"]:
        lines.append(
            "flagged (full cache below 60, not scored): " + ", ".join(f"{t} ({s})" for t, s in board["flagged"].items())
        )
    return "\n".join(lines)


def _num(v) -> str:
    """A score as the tables print it: 75, 87.5, 0."""
    return f"{v:.1f}".rstrip("0").rstrip(".")


def _with_ci(v, ci) -> str:
    """``75 [36, 95]``: a score and its 95% interval (nothing where there is no score)."""
    if v is None:
        return ""
    if not ci or "low" not in ci:
        return _num(v)
    return f"{_num(v)} [{ci['low']:.0f}, {ci['high']:.0f}]"


def _ppl_with_ci(v, ci) -> str:
    """``+90.2% [+62, +122]``: a perplexity change against the full cache and its paired 95% interval."""
    if v is None:
        return ""
    if not ci:
        return f"{v:+.1f}%"
    f = "{:+.1f}" if max(abs(ci[0]), abs(ci[1])) < 10 else "{:+.0f}"
    return f"{v:+.1f}% [{f.format(ci[0])}, {f.format(ci[1])}]"


def _questions(rows) -> str:
    got = sorted({r["score_ci"].get("n") for r in rows if r.get("score_ci")} - {None})
    return "/".join(str(n) for n in got)


def markdown(board: dict, ranks: dict, files, seconds=None) -> str:
    """The docs' tables of one model: the leaderboard (score per method per ratio with its 95% interval, the
    number of questions behind it, the mean over the ratios, the rank at 8x), the same per protocol over the
    ratios, the detail (perplexity change per text with its paired interval, suite score per protocol) and
    each method against h2o at 8x (questions paired, perplexity ratio), the full cache as its own row."""
    texts, protocols, ratios = board["texts"], board["protocols"], board["ratios"]
    by = {(r["method"], r["ratio"]): r for r in board["rows"]}
    methods = list(dict.fromkeys(r["method"] for r in board["rows"]))
    full = by.get(("full", 1.0))
    pooled = board.get("pooled") or {}
    span = f"{fmt_ratio(ratios[0])}-{fmt_ratio(ratios[-1])}" if len(ratios) > 1 else ""
    lines = []
    src = ", ".join(f"`{Path(f).name}`" for f in files)
    lines.append(f"Result files: {src}" + (f" ({seconds:.0f} s)." if seconds else "."))
    lines.append("")
    if protocols:
        rk = ranks.get("ratio")
        head = ["method", "questions"] + [fmt_ratio(x) for x in ratios]
        head += [f"mean {span}"] if span else []
        head += [f"rank at {fmt_ratio(rk)}"] if rk else []
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + " --- |" * len(head))
        for m in methods:
            mine = [r for r in board["rows"] if r["method"] == m]
            if m == "full":
                cells = [_with_ci(full["score"], full["score_ci"])] + [""] * (len(ratios) - 1) if full else []
                cells = cells or [""] * len(ratios)
            else:
                got = [by.get((m, x)) or {} for x in ratios]
                cells = [_with_ci(r.get("score"), r.get("score_ci")) for r in got]
            if span:
                p = pooled.get(m)
                cells.append(_with_ci(p["score"], p) if p else "")
            e = (ranks.get("methods") or {}).get(m)
            if rk:
                cells.append(str(e["rank"]) if e else "")
            name = "**full cache**" if m == "full" else m
            lines.append(f"| {name} | {_questions(mine)} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(
            "Score: the long-context suite's mean over " + " and ".join(protocols) + " (RULER's score, 0-100, "
            "mean over the tasks the full cache can do); the full cache's score in the first column. "
            "Questions: the questions behind each score (every protocol's). In brackets the 95% interval: "
            "Wilson's score interval at the effective number of questions (a task's questions share its weight, "
            "so the questions do not count equally"
            + (
                f": {full['score_ci']['n']} count as {full['score_ci']['n_eff']:g}"
                if full and full.get("score_ci")
                else ""
            )
            + "); the questions are few, so the intervals are wide, and two methods whose intervals overlap are "
            "not separated. "
            + (
                f"Mean {span}: the score's mean over the ratios, its interval over all their questions (the same "
                "questions at each ratio: the answers are not independent, so this interval is narrower than "
                "the evidence; read it as a summary, not a test)."
                if span
                else ""
            )
        )
        lines.append("")
        if span and pooled:
            head = ["method", "questions per protocol"] + [f"{p}, mean {span}" for p in protocols]
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + " --- |" * len(head))
            for m in methods:
                p = pooled.get(m)
                if not p:
                    continue
                n = p["suite"][protocols[0]]["n"]
                cells = [_with_ci(p["suite"][q]["score"], p["suite"][q]) for q in protocols]
                lines.append(f"| {m} | {n} | " + " | ".join(cells) + " |")
            lines.append("")
    head = "| method | ratio | " + " | ".join(f"Δppl {t}" for t in texts)
    head += (" | " if texts else "") + " | ".join(protocols) + (" | score |" if protocols else " |")
    lines.append(head.replace("|  |", "|"))
    n = 2 + len(texts) + len(protocols) + (1 if protocols else 0)
    lines.append("|" + " --- |" * n)
    for r in board["rows"]:
        if r["method"] == "full":
            ppl = [f"ppl {_cell(r['ppl'].get(t), '{:.3f}')}" for t in texts]
            name = "**full cache**"
        else:
            ppl = [_ppl_with_ci(r["ppl_delta_pct"].get(t), (r.get("ppl_delta_ci") or {}).get(t)) for t in texts]
            name = r["method"]
        suite = [_with_ci(r["suite"].get(p), (r.get("suite_ci") or {}).get(p)) for p in protocols]
        lines.append(
            f"| {name} | {fmt_ratio(r['ratio']) if r['method'] != 'full' else '1x'} | "
            + " | ".join(ppl + suite + ([_with_ci(r["score"], r.get("score_ci"))] if protocols else []))
            + " |"
        )
    lines.append("")
    notes = []
    if texts:
        notes.append(
            "Δppl: perplexity token by token against the full cache on the same tokens, in brackets its paired "
            "95% interval (block bootstrap over 32-token blocks of the text's NLL differences, "
            "`kvpolicy_core.eval.perplexity.pooled_ratio`)"
        )
    if board["tasks"]:
        qs = ", ".join(f"{t} {board['questions'].get(t, 0)}" for t in board["tasks"])
        notes.append(f"suite tasks (questions per protocol with the full cache): {qs}")
    if board["flagged"]:
        notes.append(
            "flagged (the full cache scores below 60; other methods not run, not scored): "
            + ", ".join(f"{t} (full {s})" for t, s in board["flagged"].items())
        )
    lines.append(". ".join(notes) + ("." if notes else ""))
    rows = [(m, ranks["methods"][m]) for m in ranks.get("order", []) if m != "h2o" and m in ranks["methods"]]
    rows = [(m, e) for m, e in rows if "suite_vs_h2o" in e or "ppl_ratio_vs_h2o" in e]
    if rows:
        h2o = ranks["methods"].get("h2o", {})
        at = fmt_ratio(ranks["ratio"])
        lines.append("")
        h2o_score = _num(h2o["score"]) if h2o.get("score") is not None else ""
        lines.append(f"Against `h2o` at {at} (h2o: rank {h2o.get('rank', '')}, score {h2o_score}):")
        lines.append("")
        lines.append(
            "| method | rank | score − h2o's | questions only h2o / only the method answers (of) | sign test p "
            "| ppl / h2o's [95%] |"
        )
        lines.append("|" + " --- |" * 6)
        for m, e in rows:
            pq = e.get("suite_paired_vs_h2o")
            paired = f"{pq['only_h2o']} / {pq['only_method']} ({pq['questions']})" if pq else ""
            pval = f"{e['suite_vs_h2o_p']:.2g}" if "suite_vs_h2o_p" in e else ""
            pr = e.get("ppl_ratio_vs_h2o")
            ppl = ""
            if pr:
                ppl = f"x{pr['ratio']:.3f}" + (f" [{pr['low']:.3f}, {pr['high']:.3f}]" if "low" in pr else "")
            diff = f"{e['score_minus_h2o']:+.1f}" if "score_minus_h2o" in e else ""
            lines.append(f"| {m} | {e['rank']} | {diff} | {paired} | {pval} | {ppl} |")
        lines.append("")
        lines.append(
            "Questions paired: the same context, protocol and question asked of both caches; the sign test (exact, "
            "two-sided) reads only the questions one answers and the other misses, and needs at least 6 of them, "
            "all one way, to reach p < 0.05. Perplexity: the ratio pooled over the texts, paired block bootstrap."
        )
    return "\n".join(lines)


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p")
LINESTYLES = ("-", "--", ":", "-.")


def plot(path: Path, board: dict, title: str) -> None:
    """kvpress's leaderboard style, made readable: score against compression ratio, one panel per suite
    protocol and one for perplexity (ratio to the full cache's, pooled over the texts), stacked; one line per
    method, each with its own marker and line style as well as colour, the points of a ratio spread sideways so
    that their 95% error bars do not hide each other; the full cache a horizontal dashed line. The score axes
    are linear (0-100); perplexity's is logarithmic where it spans more than 10x (it reaches hundreds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    panels = list(board["protocols"]) + (["perplexity"] if board["texts"] else [])
    n = max(1, len(panels))
    fig, axes = plt.subplots(n, 1, figsize=(9.5, 3.1 * n + 0.6), squeeze=False)
    methods = [m for m in dict.fromkeys(r["method"] for r in board["rows"]) if m != "full"]
    full = next((r for r in board["rows"] if r["method"] == "full"), None)
    ratios = board["ratios"] or [1.0]
    slot = {x: i for i, x in enumerate(ratios)}
    width = 0.8 / max(1, len(methods))
    colors = list(plt.get_cmap("tab10").colors) + ["#000080", "#808000", "#00a0a0"]  # 13 before a colour repeats
    handles = {}
    for ax, panel in zip(axes[:, 0], panels):
        for i, m in enumerate(methods):
            xs, ys, lo, hi = [], [], [], []
            for r in sorted((r for r in board["rows"] if r["method"] == m), key=lambda r: r["ratio"]):
                if r["ratio"] not in slot:
                    continue
                if panel == "perplexity":
                    pr = r.get("ppl_ratio_pooled")
                    if pr:
                        y, a, b = pr["ratio"], pr.get("low", pr["ratio"]), pr.get("high", pr["ratio"])
                    elif r["ppl_delta_mean_pct"] is not None:
                        y = a = b = 1 + r["ppl_delta_mean_pct"] / 100
                    else:
                        continue
                else:
                    v = r["suite"].get(panel)
                    if v is None:
                        continue
                    ci = (r.get("suite_ci") or {}).get(panel) or {}
                    y, a, b = v, ci.get("low", v), ci.get("high", v)
                xs.append(slot[r["ratio"]] - 0.4 + width * (i + 0.5))
                ys.append(y)
                lo.append(max(0.0, y - a))
                hi.append(max(0.0, b - y))
            if not xs:
                continue
            color = colors[i % len(colors)]
            style = dict(marker=MARKERS[i % len(MARKERS)], color=color, ms=5, label=m)
            ax.plot(xs, ys, ls=LINESTYLES[i % len(LINESTYLES)], lw=0.9, alpha=0.55, color=color)  # the method's line
            h = ax.errorbar(xs, ys, yerr=[lo, hi], ls="none", elinewidth=0.8, capsize=2, **style)
            handles.setdefault(m, (h, ax.plot([], [], ls=LINESTYLES[i % len(LINESTYLES)], **style)[0]))
        if panel == "perplexity":
            ref = ax.axhline(1.0, color="black", ls="--", lw=1.2, label="full cache")
            low, high = ax.get_ylim()
            if high / max(low, 1e-9) > 10:
                ax.set_yscale("log")
                ticks = [t for t in (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if low / 1.5 <= t <= high * 1.5]
                ax.yaxis.set_major_locator(FixedLocator(ticks))
                ax.yaxis.set_minor_locator(NullLocator())
                ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
            ax.set_ylabel("perplexity / full cache's")
            ax.set_title(
                "perplexity token by token, pooled over " + ", ".join(board["texts"]) + " (95% paired interval)",
                fontsize=9,
            )
        else:
            ref = None
            if full is not None and full["suite"].get(panel) is not None:
                ref = ax.axhline(full["suite"][panel], color="black", ls="--", lw=1.2, label="full cache")
            ax.set_ylim(-5, 105)
            ax.set_yticks([0, 25, 50, 75, 100])
            ax.set_ylabel("score (0-100)")
            nq = {r["suite_ci"][panel]["n"] for r in board["rows"] if (r.get("suite_ci") or {}).get(panel)}
            qs = f", {'/'.join(str(x) for x in sorted(nq))} questions a point" if nq else ""
            ax.set_title(f"long-context suite, {panel}{qs} (95% Wilson interval)", fontsize=9)
        if ref is not None:
            handles.setdefault("full cache", ref)
        ax.set_xlim(-0.5, len(ratios) - 0.5)
        ax.set_xticks(range(len(ratios)), [fmt_ratio(x) for x in ratios])
        for k in range(1, len(ratios)):
            ax.axvline(k - 0.5, color="grey", lw=0.5, alpha=0.4)
        ax.grid(axis="y", alpha=0.3)
    axes[-1, 0].set_xlabel("compression ratio (budget = tokens / ratio)")
    if handles:
        shown = [h[1] if isinstance(h, tuple) else h for h in handles.values()]  # marker and line style
        fig.legend(shown, list(handles.keys()), loc="center left", bbox_to_anchor=(0.83, 0.5), fontsize=8)
    fig.suptitle(f"kvpolicy leaderboard: {title}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------- quality per byte
def fmt_bytes(n) -> str:
    if n is None:
        return ""
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v >= 999.5 else f"{v:.3g} {unit}"  # 1000 KiB, not 1e+03 KiB
    return f"{n:.0f} B"


def bytes_rows(board: dict, ppl_rows, suite_rows) -> list:
    """One row per (method, ratio) of a ``--kv-bits`` run: the eviction method, its storage (full precision,
    8-bit, ...), the suite's score with its interval and the pooled perplexity ratio (from ``board``), and the
    measured bytes: ``kv_bytes_kept`` (the suite's caches after each answer, mean), ``active_memory_bytes`` (MLX's
    active memory above the mark before the row, its caches alive, median over the suite's rows),
    ``peak_suite_bytes`` and ``peak_ppl_bytes`` (``mx.get_peak_memory`` above that mark: the largest over the
    suite's rows, and the perplexity batch's)."""
    suite, ppl = {}, {}
    for r in suite_rows:
        suite.setdefault((r["name"], r["ratio"]), []).append(r)
    for r in ppl_rows:
        ppl.setdefault((r["method"], r["ratio"]), []).append(r)
    out = []
    for b in board["rows"]:
        key = (b["method"], b["ratio"])
        got = [r for r in suite.get(key, []) if r.get("kv_bytes_kept") is not None]
        act = sorted(r["active_memory_bytes"] for r in got if r.get("active_memory_bytes") is not None)
        peaks = [r["peak_memory_bytes"] for r in got if r.get("peak_memory_bytes") is not None]
        ppeaks = [r["peak_memory_bytes"] for r in ppl.get(key, []) if r.get("peak_memory_bytes") is not None]
        out.append(
            {
                "method": method_of(b["method"]),
                "storage": storage_of(b["method"]),
                "ratio": b["ratio"],
                "kv_bytes_kept": round(statistics.mean(r["kv_bytes_kept"] for r in got)) if got else None,
                "active_memory_bytes": act[len(act) // 2] if act else None,
                "peak_suite_bytes": max(peaks) if peaks else None,
                "peak_ppl_bytes": max(ppeaks) if ppeaks else None,
                "replayed": all(r.get("replayed") for r in got) if got else None,
                "score": b["score"],
                "score_ci": b["score_ci"],
                "ppl_ratio_pooled": b.get("ppl_ratio_pooled"),
                "ppl_delta_mean_pct": None if b["method"] == "full" else b.get("ppl_delta_mean_pct"),
            }
        )
    bits = lambda r: 0 if r["storage"] == "full precision" else 100 - int(r["storage"].split("-")[0])  # noqa: E731
    return sorted(out, key=lambda r: (sort_key(r["method"]), bits(r), r["ratio"]))  # full precision, 8, 4 bits


def bytes_markdown(rows, files, seconds=None, page: Path | None = None) -> str:
    """The "Quality per byte" table of one model: every method x ratio x storage with its measured bytes; the
    result files linked relative to ``page`` where it is given."""
    rel = lambda f: Path(os.path.relpath(Path(f).resolve(), page.resolve().parent)).as_posix()  # noqa: E731
    src = ", ".join(f"[`{Path(f).name}`]({rel(f)})" if page else f"`{Path(f).name}`" for f in files)
    lines = [f"Result files: {src}" + (f" ({seconds:.0f} s)." if seconds else "."), ""]
    head = ["method", "ratio", "storage", "KV kept", "resident", "peak, suite", "peak, ppl", "score", "Δppl [95%]"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        pr = r["ppl_ratio_pooled"]
        dppl = "" if r["ppl_delta_mean_pct"] is None else f"{r['ppl_delta_mean_pct']:+.1f}%"
        if pr:
            dppl = f"{100 * (pr['ratio'] - 1):+.1f}%"
            if "low" in pr:
                dppl += f" [{100 * (pr['low'] - 1):+.0f}, {100 * (pr['high'] - 1):+.0f}]"
        name = "**full cache**" if r["method"] == "full" else r["method"]
        peak = fmt_bytes(r["peak_suite_bytes"]) + (" (r)" if r["replayed"] else "")
        cells = [name, fmt_ratio(r["ratio"]), r["storage"], fmt_bytes(r["kv_bytes_kept"])]
        cells += [fmt_bytes(r["active_memory_bytes"]), peak, fmt_bytes(r["peak_ppl_bytes"])]
        cells += [_with_ci(r["score"], r["score_ci"]), dppl]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "KV kept: the K/V rows the caches hold after each answer (quantized parts included), mean over the suite's "
        "questions. Resident and peak: MLX's allocator (`mx.get_active_memory`, `mx.get_peak_memory`) above its "
        "active memory before the row (the model's weights left out); resident is read with the row's caches alive "
        "(the full cache and kvpolicy's caches allocate ahead of what they keep). Peak, suite: (r) marks rows whose "
        "one-chunk prefill was replayed from a forward recorded once (its activations not counted); quantized rows "
        "run that forward themselves. Peak, ppl: the token-by-token perplexity batch, the same path for every row. "
        "Score: the suite's, 95% Wilson interval; Δppl: perplexity over the full cache's, pooled over the texts "
        "(paired block bootstrap; without an interval: the mean "
        "change over the texts, too few tokens to pool).",
    ]
    return "\n".join(lines)


BITS_COLORS = {"full precision": "tab:blue", "8-bit": "tab:orange", "4-bit": "tab:red"}


def bytes_plot(path: Path, rows, title: str) -> None:
    """Score against the KV bytes kept (log axis): a marker per method, a colour per storage, each ratio's
    point labelled, 95% error bars; the full cache a black star. The methods' points at one byte count are
    nudged apart sideways (a few percent) so that equal scores do not hide each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "full"]
    storages = list(dict.fromkeys(r["storage"] for r in rows if r["method"] != "full"))
    extra = iter(("tab:green", "tab:purple", "tab:brown", "tab:gray"))
    colors = {s: BITS_COLORS.get(s) or next(extra) for s in storages}
    for r in rows:
        if r["score"] is None or not r["kv_bytes_kept"]:
            continue
        ci = r["score_ci"] or {}
        y, lo, hi = r["score"], ci.get("low", r["score"]), ci.get("high", r["score"])
        x = r["kv_bytes_kept"] / 2**20
        if r["method"] != "full":  # the methods at one byte count side by side, not on top of each other
            x *= 1.07 ** (methods.index(r["method"]) - (len(methods) - 1) / 2)
        if r["method"] == "full":
            ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], marker="*", ms=13, color="black", capsize=2)
            continue
        style = dict(marker=MARKERS[methods.index(r["method"]) % len(MARKERS)], color=colors[r["storage"]], ms=7)
        ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], elinewidth=0.6, capsize=2, alpha=0.85, **style)
        ax.annotate(fmt_ratio(r["ratio"]), (x, y), xytext=(4, 3), textcoords="offset points", fontsize=7)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("KV bytes kept (MiB, log; the methods nudged apart at each byte count)")
    ax.set_ylabel("score (0-100)")
    ax.set_ylim(-5, 105)
    ax.grid(alpha=0.3)
    handles = [Line2D([], [], marker="*", color="black", ls="none", ms=11, label="full cache")]
    handles += [
        Line2D([], [], marker=MARKERS[i % len(MARKERS)], color="grey", ls="none", label=m)
        for i, m in enumerate(methods)
    ]
    handles += [Line2D([], [], marker="s", color=colors[s], ls="none", label=s) for s in storages]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    ax.set_title(f"kvpolicy leaderboard, quality per byte: {title} (95% Wilson interval)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bytes_section(key: str, m: dict, page: Path, plots: Path) -> None:
    """Rewrite the "Quality per byte" section of ``page`` (between its markers; added at the end, with its
    heading, where it has none) and write ``leaderboard_bytes_<model>.png`` under ``plots``."""
    from kvpolicy_core.eval.tasks.cli_options import atomic_write_text

    board = build_board(m["ppl_rows"], m["suite_rows"], m["min_full"])
    rows = bytes_rows(board, m["ppl_rows"], m["suite_rows"])
    png = plots / f"leaderboard_bytes_{key}.png"
    name = MODEL_NAMES.get(key, key)
    bytes_plot(png, rows, name)
    rel = Path(os.path.relpath(Path(png).resolve(), page.resolve().parent)).as_posix()
    body = bytes_markdown(rows, m["files"], m["seconds"], page)
    body += f"\n\n![Quality per byte of {name}: score against the KV bytes kept, per method and storage]({rel})"
    begin, end = f"<!-- leaderboard-bytes:{key} -->", f"<!-- /leaderboard-bytes:{key} -->"
    section = f"{begin}\n{body}\n{end}"
    text = page.read_text(encoding="utf-8") if page.is_file() else f"# Leaderboard: {name}\n"
    if begin in text and end in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: section, text, flags=re.S)
    else:
        text = text.rstrip("\n") + f"\n\n## Quality per byte\n\n{section}\n"
    page.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(page, text, "--docs")
    print(f"wrote {png} and {page}", flush=True)


# ----------------------------------------------------------------------------- --report
def read_result(f) -> dict:
    path = Path(f)
    if not path.is_file():
        raise ValueError(f"--report {f}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"--report {f}: not a JSON file ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict) or "ppl_rows" not in data:
        raise ValueError(f"--report {f}: not a leaderboard result file (no config / ppl_rows)")
    return data


def merge(files) -> dict:
    """model -> {"ppl_rows", "suite_rows", "files", "seconds", "min_full"}; a row measured twice kept once (the
    first file's)."""
    models = {}
    for f in files:
        data = read_result(f)
        key = data["config"]["model"]
        m = models.setdefault(
            key, {"ppl_rows": [], "suite_rows": [], "files": [], "seconds": 0.0, "min_full": 60.0, "seen": set()}
        )
        m["files"].append(str(f))
        m["seconds"] += data.get("seconds") or 0.0
        m["min_full"] = data["config"].get("min_full", 60.0)
        for r in data["ppl_rows"]:
            k = ("ppl", r["text"], r["tokens"], r["method"], r["ratio"])
            if k not in m["seen"]:
                m["seen"].add(k)
                m["ppl_rows"].append(r)
        for r in data.get("suite_rows", []):
            k = ("suite", r["id"], r["name"], r["ratio"], r["protocol"], r["question"])
            if k not in m["seen"]:
                m["seen"].add(k)
                m["suite_rows"].append(r)
    return models


def report(files, docs: Path, plots: Path) -> None:
    """Rewrite each model's section of ``docs`` (between its markers) and its plot under ``plots``; where ``docs``
    holds ``{model}``, each model's section is on a page of its own (``{model}`` replaced by its key). Files of a
    ``--kv-bits`` run go to the model's "Quality per byte" section instead (:func:`bytes_section`), the
    leaderboard's own section left as it is."""
    plots.mkdir(parents=True, exist_ok=True)
    bits = [f for f in files if read_result(f)["config"].get("kv_bits")]
    if bits:
        for key, m in merge(bits).items():
            page = Path(str(docs).replace("{model}", key))
            bytes_section(key, m, page, plots)
    files = [f for f in files if f not in bits]
    if not files:
        return
    if "{model}" in str(docs):
        for key, m in merge(files).items():
            page = Path(str(docs).replace("{model}", key))
            title = f"# Leaderboard: {MODEL_NAMES.get(key, key)}\n"
            if (page.parent / "leaderboard.md").is_file():
                title += "\nPart of [the leaderboard](leaderboard.md).\n"
            _report_page({key: m}, page, plots, title)
        return
    _report_page(merge(files), docs, plots)


def _report_page(models: dict, docs: Path, plots: Path, title: str | None = None) -> None:
    """Rewrite the sections of ``models`` in the page ``docs``; a new page starts with ``title`` (a model's own
    page: its section under the title) or with "# Leaderboard" and a heading per model."""
    text = docs.read_text(encoding="utf-8") if docs.is_file() else (title or "# Leaderboard\n")
    for key, m in models.items():
        board = build_board(m["ppl_rows"], m["suite_rows"], m["min_full"])
        ranks = rank_vs_h2o(board, m["ppl_rows"], suite_rows=m["suite_rows"])
        png = plots / f"leaderboard_{key}.png"
        plot(png, board, MODEL_NAMES.get(key, key))
        print(f"{key}:\n{side_by_side(board)}\n", flush=True)
        rel = Path(os.path.relpath(Path(png).resolve(), docs.resolve().parent)).as_posix()
        name = MODEL_NAMES.get(key, key)
        where = f"![The leaderboard of {name}: score per protocol and perplexity against compression ratio]({rel})"
        body = markdown(board, ranks, m["files"], m["seconds"]) + "\n\n" + where
        begin, end = f"<!-- leaderboard:{key} -->", f"<!-- /leaderboard:{key} -->"
        section = f"{begin}\n{body}\n{end}"
        if begin in text and end in text:
            text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: section, text, flags=re.S)
        elif title:
            text = text.rstrip("\n") + f"\n\n{section}\n"
        else:
            text = text.rstrip("\n") + f"\n\n### {MODEL_NAMES.get(key, key)}\n\n{section}\n"
        print(f"wrote {png}", flush=True)
    from kvpolicy_core.eval.tasks.cli_options import atomic_write_text

    docs.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(docs, text, "--docs")
    print(f"wrote {docs}", flush=True)


if __name__ == "__main__":
    main()
