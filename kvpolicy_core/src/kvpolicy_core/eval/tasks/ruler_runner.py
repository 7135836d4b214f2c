"""The long-context suite's two protocols on mlx-lm, for any cache spec (see :mod:`.ruler` for the tasks).

- ``query-agnostic`` (kvpress's RULER protocol): the context is prefilled through mlx-lm's
  ``generate_step`` (chunks of ``prefill_step`` tokens, then its last token as a step, exactly as
  ``mlx_lm.generate`` prefills a prompt) into the method's caches before any question exists. Each
  question is then asked against its own copy of those compressed caches: the question ids are fed
  with positions continuing after the context (``cache.offset`` is absolute) and the answer is
  decoded greedily. One prefill serves every question; no question sees another.
- ``question-in-prompt``: each question's full prompt (context + question) goes through
  ``generate_step`` into fresh caches; the cache sees the question before it compresses the context.

Bounded caches stay bounded while the question and the answer are fed (they evict as they do for any
new token). Decoding stops at a stop id, after ``max_new_tokens`` tokens, or once every answer is in
the output (a score can only grow with more text, so this changes no score).

A compress-once method (``"kvzip+h2o:budget=N"``, :mod:`kvpolicy_core.integration.compress_once`) runs the
same protocols with the context cut at once instead of streamed: query-agnostic, the context is prefilled
into full caches, scored by reconstruction and cut to the budget, then every question is asked of copies of
that one compressed cache (``prefill_seconds`` includes the scoring); question-in-prompt, each question's
prompt but its last token is compressed the same way, and the last token starts the answer.

Shared work, exact by construction: the first ``prefill_step`` tokens of a context reach every cache
empty, so their keys, values and queries do not depend on the method (nor on the protocol, nor on the
question). They are computed once per context (:func:`~.needle.record_prefill`) and replayed into each
method's caches (mlx-lm's ``RotatingKVCache`` masks a chunk by its own window, so it is run for real).
Every later chunk is computed by the model through the method's caches, as ``generate_step`` chunks it.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx

from ...cache.policy_cache import PolicyCache
from ...errors import KVPolicyError
from ...integration.compress_once import compress_context, repeat_prompt, split_spec
from ...runtime.progress import labelled, reporter
from ..perplexity import kv_bytes, make_caches, parse_spec, spec_label
from .greedy import greedy_tokens
from .needle import needle_kept, record_prefill, replay_prefill, replayable
from .ruler import Context, score

PROTOCOLS = ("query-agnostic", "question-in-prompt")
DEFAULT_PREFILL_STEP = 2048  # mlx-lm's generate_step default


def copy_caches(caches: Sequence[Any]) -> List[Any]:
    """Independent copies of one generation's caches (a policy's stateless parts stay shared)."""
    from ...cache.batch import copy_row

    return [copy_row(c) if isinstance(c, PolicyCache) else copy.deepcopy(c) for c in caches]


def prefill(model, caches: List[Any], ids: Sequence[int], prefill_step: int, done: int = 0) -> None:
    """Feed ``ids`` into ``caches`` with mlx-lm's own prompt processing (``generate_step``, no token kept); its
    progress on stderr counts the ``done`` tokens already in the caches (:mod:`kvpolicy_core.runtime.progress`)."""
    from mlx_lm.generate import generate_step

    for _ in generate_step(
        mx.array(list(ids), dtype=mx.uint32),
        model,
        max_tokens=0,
        prompt_cache=caches,
        prefill_step_size=prefill_step,
        prompt_progress_callback=reporter("prefill", offset=done),
    ):
        pass
    mx.eval([c.state for c in caches])


def greedy(
    model,
    tokenizer,
    caches: List[Any],
    ids: Sequence[int],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    prefill_step: int,
    answers: Optional[Sequence[str]] = None,
    metric: str = "all",
) -> Dict[str, Any]:
    """Greedy continuation of ``ids`` through ``caches`` (mlx-lm's ``generate_step``); ``{"output", "tokens"}``.

    Stops at a stop id, after ``max_new_tokens``, or once ``answers`` score 1 in the text so far.
    """
    answered = None if answers is None else (lambda text: score(text, answers, metric) == 1.0)
    out = greedy_tokens(model, tokenizer, ids, caches, max_new_tokens, prefill_step, set(stop_ids), answered)
    return {"output": tokenizer.decode(out), "tokens": len(out)}


def shared_prefix(ctx: Context, prefill_step: int) -> int:
    """Tokens of the context every method and protocol prefills identically into empty caches: the first
    chunk when ``generate_step`` cuts a whole one from the context (``len - 1 >= prefill_step``), else 0."""
    return prefill_step if len(ctx.context_ids) - 1 >= prefill_step else 0


def record_first_chunk(model, ctx: Context, prefill_step: int) -> Optional[List[tuple]]:
    """The recorded first chunk of ``ctx`` (:func:`~.needle.record_prefill`), or None if there is none."""
    n = shared_prefix(ctx, prefill_step)
    return record_prefill(model, ctx.context_ids[: n + 1]) if n else None


def first_chunk_caches(model, spec: Any, ctx: Context, prefill_step: int, record: Optional[List[tuple]]):
    """Caches for ``spec`` holding the context's shared first chunk (replayed from ``record`` or computed)."""
    n = shared_prefix(ctx, prefill_step)
    if n == 0:
        return make_caches(model, spec)
    if record is not None and replayable(spec):
        return replay_prefill(model, spec, record)
    caches = make_caches(model, spec)
    model(mx.array(ctx.context_ids[:n], dtype=mx.uint32)[None], cache=caches)  # generate_step's first chunk
    mx.eval([c.state for c in caches])
    return caches


def method_label(spec: Any) -> str:
    """The spec's label with its budget always written (a config string leaves out a default budget)."""
    kind, value = parse_spec(spec)
    label = spec_label(spec)
    config = value.config if kind == "compress-once" else value if kind == "policy" else None
    budget = getattr(getattr(config, "policy", None), "budget", None)
    if budget is not None and "budget=" not in label:
        label += f"{',' if ':' in label else ':'}budget={budget}"
    return label


def _statement_positions(ctx: Context) -> List[int]:
    return [p for a, b in ctx.spans for p in range(a, b)]


def result_row(ctx: Context, label: str, protocol: str, i: int, got, caches, seconds: float, extra) -> Dict[str, Any]:
    """One result row: question ``i`` of ``ctx`` asked of ``label``'s ``caches`` under ``protocol`` (``got``: the
    greedy answer), its score and KV bytes, then ``extra``."""
    q = ctx.questions[i]
    kept, full = kv_bytes(caches)
    return {
        "id": ctx.id,
        "task": ctx.task,
        "length": ctx.length,
        "haystack": ctx.haystack,
        "seed": ctx.seed,
        "model": ctx.model,
        "method": label,
        "protocol": protocol,
        "question": i,
        "context_tokens": len(ctx.context_ids),
        "question_tokens": len(q.question_ids),
        "answers": q.answers,
        "output": got["output"],
        "new_tokens": got["tokens"],
        "score": score(got["output"], q.answers, ctx.metric),
        "kv_bytes_kept": kept,
        "kv_bytes_full": full,
        "seconds": round(seconds, 2),
        **extra,
    }


def _row_maker(ctx: Context, label: str, rows: List[Dict[str, Any]], log):
    """``row(protocol, i, got, caches, seconds, extra)``: appends one :func:`result_row` (and logs it)."""

    def row(protocol, i, got, caches, seconds, extra):
        r = result_row(ctx, label, protocol, i, got, caches, seconds, extra)
        rows.append(r)
        if log:
            log(r)

    return row


def _run_compressed(model, tokenizer, ctx: Context, once, protocols, prefill_step, early_stop, label, log):
    """:func:`run_context` for a compress-once method (module docstring)."""
    repeat = repeat_prompt(tokenizer)
    rows: List[Dict[str, Any]] = []
    row = _row_maker(ctx, label, rows, log)
    answers = lambda q: q.answers if early_stop else None

    def compress(ids):
        return compress_context(model, ids, once.config, scorer=once.scorer, prefill_step=prefill_step, repeat=repeat)

    def ask(caches, ids, i):
        q = ctx.questions[i]
        return greedy(
            model, tokenizer, caches, ids, q.max_new_tokens, ctx.stop_ids, prefill_step, answers(q), ctx.metric
        )

    if "query-agnostic" in protocols:
        t = time.perf_counter()
        caches = compress(ctx.context_ids).caches
        prefill_seconds = time.perf_counter() - t
        kept_frac = needle_kept(caches, _statement_positions(ctx)) if ctx.spans else None
        ctx_kept, ctx_full = kv_bytes(caches)
        extra = {
            "prefill_seconds": round(prefill_seconds, 2),
            "statements_kept": kept_frac,
            "context_kv_bytes_kept": ctx_kept,
            "context_kv_bytes_full": ctx_full,
        }
        for i, q in enumerate(ctx.questions):
            t = time.perf_counter()
            asked = copy_caches(caches)
            got = ask(asked, q.question_ids, i)
            row("query-agnostic", i, got, asked, time.perf_counter() - t, extra)
        del caches
    if "question-in-prompt" in protocols:
        for i in range(len(ctx.questions)):
            t = time.perf_counter()
            prompt = ctx.full_prompt_ids(i)
            asked = compress(prompt[:-1]).caches
            got = ask(asked, prompt[-1:], i)
            row("question-in-prompt", i, got, asked, time.perf_counter() - t, {})
    return rows


def run_context(
    model,
    tokenizer,
    ctx: Context,
    spec: Any,
    protocols: Sequence[str] = PROTOCOLS,
    prefill_step: int = DEFAULT_PREFILL_STEP,
    record: Optional[List[tuple]] = None,
    early_stop: bool = True,
    log=None,
) -> List[Dict[str, Any]]:
    """Every question of ``ctx`` under ``spec`` in each protocol; one row per (protocol, question). Long steps
    (prefill, reconstruction) report their progress on stderr named by the context and the method
    (:mod:`kvpolicy_core.runtime.progress`; silenced inside its ``quiet()``)."""
    try:
        name = f"{ctx.id} {method_label(spec)}"
    except (KVPolicyError, ValueError, TypeError):  # a bad spec: refused below, as before
        name = ctx.id
    with labelled(name):
        return _run_context(model, tokenizer, ctx, spec, protocols, prefill_step, record, early_stop, log)


def _run_context(model, tokenizer, ctx, spec, protocols, prefill_step, record, early_stop, log):
    """:func:`run_context` (its arguments as given)."""
    for p in protocols:
        if p not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)} (got {p!r})")
    if prefill_step < 1:
        raise ValueError(f"prefill_step must be >= 1 (got {prefill_step})")
    label = method_label(spec)
    once = split_spec(spec)
    if once is not None:
        return _run_compressed(model, tokenizer, ctx, once, protocols, prefill_step, early_stop, label, log)
    n = shared_prefix(ctx, prefill_step)
    start = time.perf_counter()
    base = first_chunk_caches(model, spec, ctx, prefill_step, record)
    base_seconds = time.perf_counter() - start
    rows: List[Dict[str, Any]] = []

    row = _row_maker(ctx, label, rows, log)

    def ask(caches, ids, q):
        stop_early = q.answers if early_stop else None
        return greedy(
            model, tokenizer, caches, ids, q.max_new_tokens, ctx.stop_ids, prefill_step, stop_early, ctx.metric
        )

    if "query-agnostic" in protocols:
        t = time.perf_counter()
        caches = copy_caches(base) if "question-in-prompt" in protocols else base
        prefill(model, caches, ctx.context_ids[n:], prefill_step, done=n)
        prefill_seconds = base_seconds + time.perf_counter() - t
        kept_frac = needle_kept(caches, _statement_positions(ctx)) if ctx.spans else None
        ctx_kept, ctx_full = kv_bytes(caches)
        for i, q in enumerate(ctx.questions):
            t = time.perf_counter()
            asked = copy_caches(caches)
            got = ask(asked, q.question_ids, q)
            row(
                "query-agnostic",
                i,
                got,
                asked,
                time.perf_counter() - t,
                {
                    "prefill_seconds": round(prefill_seconds, 2),
                    "statements_kept": kept_frac,
                    "context_kv_bytes_kept": ctx_kept,
                    "context_kv_bytes_full": ctx_full,
                },
            )
        del caches
    if "question-in-prompt" in protocols:
        for i, q in enumerate(ctx.questions):
            t = time.perf_counter()
            asked = copy_caches(base)
            got = ask(asked, ctx.full_prompt_ids(i)[n:], q)
            row("question-in-prompt", i, got, asked, base_seconds + time.perf_counter() - t, {})
    return rows


def run_suite(
    model,
    tokenizer,
    contexts: Sequence[Context],
    specs: Sequence[Any],
    protocols: Sequence[str] = PROTOCOLS,
    prefill_step: int = DEFAULT_PREFILL_STEP,
    share_first_chunk: bool = True,
    early_stop: bool = True,
    log=None,
) -> List[Dict[str, Any]]:
    """Every context under every spec; the first chunk recorded once per context (``share_first_chunk``)."""
    rows: List[Dict[str, Any]] = []
    for ctx in contexts:
        record = record_first_chunk(model, ctx, prefill_step) if share_first_chunk else None
        for spec in specs:
            rows += run_context(model, tokenizer, ctx, spec, protocols, prefill_step, record, early_stop, log)
        del record
    return rows


# ----------------------------------------------------------------------------- summaries
def summarize(rows: Sequence[Dict[str, Any]], min_full: float = 60.0) -> List[Dict[str, Any]]:
    """RULER scores (0-100) per (model, length, haystack, protocol, method): per task and their mean.

    Each entry carries the full cache's scores on the same questions (``full``) where the rows have them,
    and ``flagged``: the tasks whose full-cache score is below ``min_full`` (the model cannot do them
    uncompressed, so a method's score there says little).
    """
    groups: Dict[tuple, Dict[str, List[float]]] = {}
    for r in rows:
        key = (r["model"], r["length"], r["haystack"], r["protocol"], r["method"])
        groups.setdefault(key, {}).setdefault(r["task"], []).append(r["score"])
    out = []
    for (model, length, hay, protocol, method), tasks in groups.items():
        per_task = {t: round(100 * sum(v) / len(v), 1) for t, v in tasks.items()}
        full = groups.get((model, length, hay, protocol, "full"))
        full_task = {t: round(100 * sum(v) / len(v), 1) for t, v in full.items()} if full else None
        out.append(
            {
                "model": model,
                "length": length,
                "haystack": hay,
                "protocol": protocol,
                "method": method,
                "tasks": per_task,
                "mean": round(sum(per_task.values()) / len(per_task), 1),
                "questions": {t: len(v) for t, v in tasks.items()},
                "full": full_task,
                "flagged": sorted(t for t, s in (full_task or {}).items() if s < min_full),
            }
        )
    return out


def pooled(rows: Sequence[Dict[str, Any]], haystacks_together: bool = True) -> List[Dict[str, Any]]:
    """:func:`summarize` with every haystack pooled into one ``"all"`` group (cwe's word list included)."""
    return summarize([{**r, "haystack": "all"} for r in rows]) if haystacks_together else summarize(rows)


def format_table(summary: Sequence[Dict[str, Any]], tasks: Sequence[str]) -> str:
    """One line per (model, length, haystack, protocol, method): task scores and mean; flagged tasks marked *."""
    short = {
        "niah_single": "single",
        "niah_multikey": "mkey",
        "niah_multivalue": "mval",
        "niah_multiquery": "mquery",
        "vt": "vt",
        "cwe": "cwe",
    }
    cols = [short.get(t, t[:7]) for t in tasks]
    head = f"{'protocol':18} {'haystack':8} {'len':>5} {'method':28} " + " ".join(f"{c:>7}" for c in cols) + "    mean"
    lines = [head, "-" * len(head)]
    for s in summary:
        cells = []
        for t in tasks:
            v = s["tasks"].get(t)
            mark = "*" if t in s["flagged"] else " "
            cells.append(f"{'':>7}" if v is None else f"{v:6.1f}{mark}")
        lines.append(
            f"{s['protocol']:18} {s['haystack'][:8]:8} {s['length']:5d} {s['method'][:28]:28} "
            + " ".join(cells)
            + f" {s['mean']:7.1f}"
        )
    lines.append("* the full cache scores below 60 on this task: the model cannot do it uncompressed")
    return "\n".join(lines)
