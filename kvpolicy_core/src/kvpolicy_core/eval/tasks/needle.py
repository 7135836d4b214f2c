"""Needle in a haystack: can a bounded cache still answer a question about one fact far back?

``needle``: a random 5-digit number, stated once ("The special magic number is 48213.")
at a chosen depth of a haystack of natural text, asked for at the end of the prompt.
``needle-multikey`` (RULER's multi-key NIAH): ``keys`` such statements, each for a
different key word, at random depths; the question names one of them, whose statement
sits at the chosen depth. Distractors make copying "the first number you see" fail.

Prompt layout (token ids, built piece by piece so the needle's tokens are known)::

    [BOS] intro  haystack[:k]  needle  haystack[k:]  question

``length`` is the haystack's token count; the needle goes after the sentence end
(".", "\\n") nearest before ``depth * length``. Greedy decoding (argmax), at most
``max_tokens`` tokens, stopped after the first number; exact match of that number.
The prompt is prefilled by mlx-lm's ``generate_step`` in chunks of ``prefill_step``
tokens (``None``: one chunk), as ``mlx_lm.generate`` does.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

import mlx.core as mx

from ...cache.policy_cache import PolicyCache
from ..perplexity import kv_bytes, make_caches, parse_spec, spec_label
from . import DEFAULT_DEPTHS
from .cli_options import (
    MAX_LENGTH,
    check_int_option,
    check_output,
    check_seeds_and_steps,
    number_list,
    progress_log,
    write_json,
)
from .greedy import greedy_tokens
from .haystack import haystack_text
from .tokens import bos_ids, encode

TASKS = ("needle", "needle-multikey")
KEY_WORDS = (
    "apple",
    "river",
    "violin",
    "copper",
    "lantern",
    "meadow",
    "falcon",
    "harbor",
    "pepper",
    "glacier",
    "saddle",
    "orchid",
    "compass",
    "thunder",
    "marble",
    "canyon",
)
INTRO = "Below is a long text. Somewhere in it a special magic number is hidden. Read carefully.\n\n"


@dataclasses.dataclass
class Trial:
    """One prompt: ``prompt`` token ids; the needle's number ``answer``; its digits' positions."""

    task: str
    haystack: str
    length: int
    depth: float
    seed: int
    prompt: List[int]
    answer: str
    key: Optional[str]
    needle_positions: List[int]


@functools.lru_cache(maxsize=8)
def _paragraphs(source: str) -> tuple:
    return tuple(p for p in haystack_text(source).split("\n\n") if p.strip())


def haystack_ids(tokenizer, source: str, length: int, seed: int) -> List[int]:
    """``length`` tokens of ``source`` starting at a paragraph chosen by ``seed``."""
    paras = _paragraphs(source)
    rng = random.Random(f"haystack:{source}:{seed}")
    start = rng.randrange(len(paras))
    ids: List[int] = []
    i = start
    while len(ids) < length:
        chunk = "\n\n".join(paras[i : i + 8]) + "\n\n"
        ids.extend(encode(tokenizer, chunk))
        i = (i + 8) % len(paras)
    return ids[:length]


def sentence_cut(tokenizer, ids: Sequence[int], k: int, back: int = 64) -> int:
    """The index after the last sentence end ("." or newline) in ``ids[k-back:k]``, else ``k``."""
    for j in range(k, max(0, k - back), -1):
        piece = tokenizer.decode([ids[j - 1]])
        if piece.rstrip(" ").endswith((".", "\n")):
            return j
    return k


def _statement(key: Optional[str], number: str) -> str:
    return f" The special magic number{'' if key is None else ' for ' + key} is {number}. "


def build_trial(tokenizer, task: str, source: str, length: int, depth: float, seed: int, keys: int = 4) -> Trial:
    """The prompt of one (task, haystack, length, depth, seed); deterministic."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)} (got {task!r})")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] (got {depth})")
    if length < 16:
        raise ValueError(f"length must be at least 16 haystack tokens (got {length})")
    rng = random.Random(f"needle:{task}:{source}:{length}:{depth}:{seed}")
    hay = haystack_ids(tokenizer, source, length, seed)
    n_needles = 1 if task == "needle" else max(1, keys)
    if n_needles > len(KEY_WORDS):
        raise ValueError(f"keys must be at most {len(KEY_WORDS)} (got {keys})")
    words = rng.sample(KEY_WORDS, n_needles) if task != "needle" else [None]
    numbers = [str(rng.randrange(10000, 100000)) for _ in words]
    depths = [depth] + [rng.random() for _ in words[1:]]
    cuts = sorted((sentence_cut(tokenizer, hay, round(d * length)), i) for i, d in enumerate(depths))
    prompt = bos_ids(tokenizer) + encode(tokenizer, INTRO)
    needle_positions: List[int] = []
    prev = 0
    for cut, i in cuts:
        prompt += hay[prev:cut]
        stmt = encode(tokenizer, _statement(words[i], numbers[i]))
        if i == 0:
            digits = [j for j, t in enumerate(stmt) if any(c.isdigit() for c in tokenizer.decode([t]))]
            needle_positions = [len(prompt) + j for j in digits]
        prompt += stmt
        prev = cut
    prompt += hay[prev:]
    key = words[0]
    question = (
        "\n\nQuestion: What is the special magic number"
        + ("" if key is None else f" for {key}")
        + " mentioned in the text above?\nAnswer: The special magic number"
        + ("" if key is None else f" for {key}")
        + " is"
    )
    prompt += encode(tokenizer, question)
    return Trial(task, source, length, depth, seed, prompt, numbers[0], key, needle_positions)


def first_number(text: str) -> Optional[str]:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def greedy_answer(
    model, tokenizer, prompt: Sequence[int], caches: List[Any], prefill_step: Optional[int], max_tokens: int = 10
) -> str:
    """Greedy continuation of ``prompt`` through ``caches``, stopped after the first number."""
    step = max(len(prompt), 1) if prefill_step is None else prefill_step
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    past_a_number = lambda text: bool(re.search(r"\d[^\d]", text)) or "\n" in text.lstrip()
    return tokenizer.decode(greedy_tokens(model, tokenizer, prompt, caches, max_tokens, step, eos, past_a_number))


def needle_kept(caches: List[Any], positions: Sequence[int]) -> Optional[float]:
    """Fraction of the needle's digit tokens retained, averaged over heads and the policy layers
    with global attention (a sliding-window layer drops a far needle whatever the policy)."""
    fracs = []
    want = mx.array(list(positions), dtype=mx.int32)
    policy = [c for c in caches if isinstance(c, PolicyCache) and c.keys is not None]
    if any(c.window is None for c in policy):
        policy = [c for c in policy if c.window is None]
    for c in policy:
        if len(positions):
            pos = c.retained()[2]  # [B, H, n]
            hit = (pos[..., None] == want).any(axis=-2)  # [B, H, P]
            fracs.append(hit.astype(mx.float32).mean().item())
    return sum(fracs) / len(fracs) if fracs else None


def record_prefill(model, prompt: Sequence[int]) -> List[tuple]:
    """Run ``prompt[:-1]`` once, in one chunk, through plain caches; record per layer what a cache sees.

    Returns ``(keys [B, H, S, D], values, queries [B, Hq, S, D], scale, mask)`` per layer: the
    arguments of ``update_and_fetch`` and of the attention call. In one-chunk prefill every cache starts
    empty, so the chunk's attention does not depend on the policy: :func:`replay_prefill` gives a policy
    cache exactly the calls it would get inside the model (tested against the real path).
    """
    import sys

    from mlx_lm.models.cache import KVCache

    from ...attention.hook import ATTR, model_modules

    caches = [KVCache() for _ in model.layers]
    seen: Dict[int, tuple] = {}
    patched = []

    def wrap(original):
        def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, *args, **kwargs):
            seen[id(cache)] = (queries, scale, mask)
            return original(queries, keys, values, cache, scale, mask, *args, **kwargs)

        return scaled_dot_product_attention

    try:
        for name in model_modules(model):
            module = sys.modules[name]
            patched.append((module, getattr(module, ATTR)))
            setattr(module, ATTR, wrap(getattr(module, ATTR)))
        model(mx.array(list(prompt[:-1]), dtype=mx.uint32)[None], cache=caches)
    finally:
        for module, original in reversed(patched):
            setattr(module, ATTR, original)
    record = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :], *seen[id(c)]) for c in caches]
    mx.eval([r[:3] for r in record])
    return record


def replayable(spec: Any) -> bool:
    """Whether a recorded prefill can stand in for ``spec``'s: full and policy caches attend to the whole
    chunk; mlx-lm's ``RotatingKVCache`` masks a chunk with its own window, and a cache storing its rows otherwise
    than in the model's dtype (``kv_bits``, ``kv_dtype``) attends to the stored rows, changing every later layer's
    input, so both are always run for real."""
    kind, value = parse_spec(spec)
    config = getattr(value, "config", value) if kind in ("policy", "compress-once") else None
    return kind != "rotating" and getattr(config, "kv_bits", None) is None and getattr(config, "kv_dtype", None) is None


def _fused_attention(queries, keys, values, cache, scale, mask):
    """mlx's fused attention with mlx-lm's arguments (what the hook's ``fused`` is for unquantized caches)."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def replay_prefill(model, spec: Any, record: List[tuple]) -> List[Any]:
    """Fresh caches for ``spec`` that have received the recorded one-chunk prefill, settled.

    A cache in a layer group (a per-layer allocation: ``squeeze``'s budgets from each layer's attention
    output) gets the attention call itself (``attend``), so the group measures the chunk's output as it does
    inside the model; the others get only ``before_attention`` (their scores), the output never being read.
    """
    caches = make_caches(model, spec)
    for cache, (keys, values, queries, scale, mask) in zip(caches, record):
        keys_all, values_all = cache.update_and_fetch(keys, values)
        if isinstance(cache, PolicyCache):
            if getattr(cache, "group", None) is not None:
                cache.attend(queries, keys_all, values_all, scale, mask, _fused_attention)
            else:
                cache.before_attention(queries, scale, mask)
    mx.eval([c.state for c in caches])
    return caches


def run_trial(
    model, tokenizer, trial: Trial, spec: Any, prefill_step: Optional[int], record: Optional[List[tuple]] = None
) -> Dict[str, Any]:
    """One trial; with ``record`` (one-chunk prefill only) the prefill is replayed, not recomputed."""
    start = time.perf_counter()
    if record is not None:
        if prefill_step is not None:
            raise ValueError("a recorded prefill is one chunk: prefill_step must be None")
        caches = replay_prefill(model, spec, record)
        output = greedy_answer(model, tokenizer, trial.prompt[-1:], caches, None)
    else:
        caches = make_caches(model, spec)
        output = greedy_answer(model, tokenizer, trial.prompt, caches, prefill_step)
    seconds = time.perf_counter() - start
    got = first_number(output)
    kept, full = kv_bytes(caches)
    return {
        "task": trial.task,
        "haystack": trial.haystack,
        "length": trial.length,
        "depth": trial.depth,
        "seed": trial.seed,
        "method": spec_label(spec),
        "prefill_step": prefill_step,
        "prompt_tokens": len(trial.prompt),
        "answer": trial.answer,
        "key": trial.key,
        "output": output,
        "correct": got == trial.answer,
        "needle_kept": needle_kept(caches, trial.needle_positions),
        "seconds": round(seconds, 2),
        "kv_bytes_kept": kept,
        "kv_bytes_full": full,
    }


def run_grid(
    model,
    tokenizer,
    specs: Sequence[Any],
    *,
    task: str = "needle",
    haystacks: Iterable[str] = ("pydoc",),
    lengths: Iterable[int] = (1000,),
    depths: Iterable[float] = DEFAULT_DEPTHS,
    seeds: Iterable[int] = (0,),
    prefill_steps: Iterable[Optional[int]] = (None,),
    keys: int = 4,
    log=None,
    share_prefill: bool = True,
) -> List[Dict[str, Any]]:
    """Every (haystack, length, prefill step, seed, depth, spec) trial; rows as :func:`run_trial`.

    ``share_prefill``: in one-chunk mode, compute each prompt's prefill once and replay it into every
    spec's caches (:func:`record_prefill`); the results are the same, the prefill cost is paid once.
    """
    rows = []
    for source in haystacks:
        for length in lengths:
            for seed in seeds:
                trials = [build_trial(tokenizer, task, source, length, d, seed, keys) for d in depths]
                for step in prefill_steps:
                    shared = share_prefill and step is None and len(specs) > 1
                    for trial in trials:
                        record = record_prefill(model, trial.prompt) if shared else None
                        for spec in specs:
                            r = run_trial(model, tokenizer, trial, spec, step, record if replayable(spec) else None)
                            rows.append(r)
                            if log:
                                log(r)
                        del record
    return rows


def summarize(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Accuracy per (task, haystack, length, prefill step, method), overall and per depth."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["haystack"], r["length"], r["prefill_step"], r["method"]), []).append(r)
    out = []
    for (task, hay, length, step, method), rs in groups.items():
        per_depth: Dict[str, List[bool]] = {}
        for r in rs:
            per_depth.setdefault(f"{r['depth']:g}", []).append(r["correct"])
        out.append(
            {
                "task": task,
                "haystack": hay,
                "length": length,
                "prefill_step": step,
                "method": method,
                "found": sum(r["correct"] for r in rs),
                "trials": len(rs),
                "per_depth": {d: sum(v) / len(v) for d, v in per_depth.items()},
            }
        )
    return out


def format_summary(summary: Sequence[Dict[str, Any]]) -> str:
    depths = sorted({d for s in summary for d in s["per_depth"]}, key=float)
    head = f"{'method':40} {'haystack':9} {'len':>5} {'chunk':>6} " + " ".join(f"{d:>5}" for d in depths) + "  found"
    lines = [head, "-" * len(head)]
    for s in summary:
        cells = " ".join(f"{s['per_depth'].get(d, float('nan')):5.2f}" for d in depths)
        chunk = "one" if s["prefill_step"] is None else str(s["prefill_step"])
        lines.append(
            f"{s['method'][:40]:40} {s['haystack'][:9]:9} {s['length']:5d} {chunk:>6} {cells}  "
            f"{s['found']}/{s['trials']}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line
def cli_run(args, specs: Sequence[Any], load_model) -> int:
    """``kvpolicy eval --task needle ...``: run the grid, print the per-depth table, write JSON."""
    depths = number_list(args.depths, "depths", float, minimum=0.0, maximum=1.0)
    lengths = number_list(
        "1000" if args.lengths is None else args.lengths, "lengths", positive=True, maximum=MAX_LENGTH
    )
    steps = args.prefill_step or [None]
    check_seeds_and_steps(args.seeds, steps)
    if args.task != "needle":
        check_int_option(args.keys, "keys", 1, len(KEY_WORDS))
    check_output(args.json, "--json")
    model, tokenizer, path = load_model(args.model, args.dtype)
    log = progress_log(
        args.no_progress,
        lambda r: (
            f"{r['method']} {r['haystack']} len {r['length']} depth {r['depth']:g}: "
            f"{'found' if r['correct'] else 'missed'} ({r['output'].strip()!r}, answer {r['answer']})"
        ),
    )
    rows = run_grid(
        model,
        tokenizer,
        specs,
        task=args.task,
        haystacks=args.haystack or ["pydoc"],
        lengths=lengths,
        depths=depths,
        seeds=range(args.seeds),
        prefill_steps=steps,
        keys=args.keys,
        log=log,
    )
    summary = summarize(rows)
    print(f"model: {path} | task: {args.task}")
    print(format_summary(summary))
    if args.json:
        write_json({"model": str(path), "task": args.task, "summary": summary, "rows": rows}, args.json)
    return 0
