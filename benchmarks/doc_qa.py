"""Held-out document QA through mlx-lm's generate_step, with caches exactly as attach sets them up.

A check on text the long-context suite does not use (its default corpus is ``pydoc``): the docstrings of 40
standard-library modules (``kvpolicy_core.eval.tasks.haystack``'s ``stdlib``, the leaderboard's second text),
with N=4 statements of another wording than the suite's ("The archive code of the {key} project is {value}.",
adjective-noun keys, 7-digit values) inserted at depths spread over a document of ``--length`` tokens (4096 or
8192, question and answer included). One prompt per statement, ending with ONE question about it and an answer
prefix that repeats the statement's words up to the value (a small model copies what follows the best match)::

    [BOS] chat-prefix intro document "\\n\\nQuestion: " question turn-end answer-prefix

(``--chat auto``: the tokenizer's chat template where it has one, else none; ``gemma``/``chatml`` force one).
Each prompt goes through ``mlx_lm.generate.generate_step`` (chunks of 2048, then the last token as the first
decode step) with the caches a user gets: ``full`` is mlx-lm's own (``make_prompt_cache``); a kvpolicy method is
``attach(model, spec)`` then ``make_prompt_cache`` (which calls the attached ``make_cache``, i.e.
``KVCacheBuilder.for_model``); ``kvzip+cam`` is compress-once (``compress_context`` over the prompt but its last
token, then that token starts the answer, as the suite's question-in-prompt protocol does). Greedy, at most 12
new tokens, stopped at a stop id or once a 7-digit number is out. An answer is right when it holds the value.

``--explain`` records, for the prompt_end cut, compress-once and streaming methods, which positions of every
statement each layer and KV head keeps after the prompt (``PolicyCache.positions``), the cut's per-layer budgets,
the observation window's scores at the cut (the last W queries' attention, pooled as the cut uses it: is the
statement in each head's top budget?) and what the window's W tokens are; it prints the analysis of every
statement the full cache answers and a method loses.

    python benchmarks/doc_qa.py --smoke                       # tiny random model, seconds (tests/test_doc_qa.py)
    python benchmarks/doc_qa.py --explain                     # Gemma 3 270M, 4096 tokens, all methods
    python benchmarks/doc_qa.py --model smollm2 --explain
    python benchmarks/doc_qa.py --length 8192 --methods full,cam8
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from _common import Stopwatch, parser, result_name, write_json  # BLAS loads here (mlx and numpy: imported after it)

from kvpolicy_core.eval.tasks import ruler
from kvpolicy_core.eval.tasks.tokens import bos_ids, encode

HAYSTACK = "stdlib"
STATEMENT = "The archive code of the {key} project is {value}."
QUESTION = "What is the archive code of the {key} project?"
ANSWER = "The archive code of the {key} project is"
INTRO = (
    "Read the following document. It states the archive codes of some projects; "
    "a question about one of them comes after it.\n\n"
)
DEPTHS = (0.2, 0.4, 0.6, 0.8)
DIGITS = 7
MAX_NEW = 12
W_DEFAULT = 32  # the observation window of the shipped h2o/cam (attention_config.WINDOW_DEFAULTS)

#: method name -> config string at the budget of its ratio (``{b}``); full is mlx-lm's own cache
METHODS = {  # in the order they run: the 8x rows the issue asks about first
    "full": (None, 1),
    "cam8": ("cam:budget={b}", 8),
    "h2o8": ("h2o:budget={b}", 8),
    "kvzip+cam8": ("kvzip+cam:budget={b},obs_window=32", 8),
    "cam8-stream": ("cam:budget={b},when=stream", 8),
    "cam4": ("cam:budget={b}", 4),
    "h2o4": ("h2o:budget={b}", 4),
}
SMOKE_METHODS = "full,cam8,cam8-stream,kvzip+cam8"  # one of each route


# -- the task ---------------------------------------------------------------------------------------------------


def chat_parts(tok, chat: str):
    """(prefix ids, turn-end text, name) of the prompt format: the tokenizer's template (``auto`` where it has one),
    else one of ``ruler.CHATS``."""
    if chat == "auto":
        template = getattr(tok, "chat_template", None) or getattr(getattr(tok, "_tokenizer", None), "chat_template", 0)
        if template:
            marker = "<kvpolicy-doc-qa>"
            text = tok.apply_chat_template(
                [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
            )
            pre, post = text.split(marker)
            return encode(tok, pre), post, "template"
        chat = "none"
    fmt = ruler.CHATS[chat]
    return bos_ids(tok) + encode(tok, fmt.user_prefix), fmt.turn_end, chat


def build(tok, length: int, seed: int = 0, chat: str = "auto", n: int = 4) -> Dict[str, Any]:
    """The document (token ids, built piece by piece), its statements' spans and the N prompts."""
    rng = random.Random(f"doc_qa:{length}:{seed}")
    keys = ruler._keys(rng, n)
    used: set = set()
    values = [ruler._number(rng, DIGITS, used) for _ in keys]
    head, turn_end, chat_name = chat_parts(tok, chat)
    head = head + encode(tok, INTRO)
    stmts = [encode(tok, " " + STATEMENT.format(key=k, value=v)) for k, v in zip(keys, values)]
    tails = [encode(tok, "\n\nQuestion: " + QUESTION.format(key=k) + turn_end + ANSWER.format(key=k)) for k in keys]
    fixed = len(head) + max(map(len, tails)) + MAX_NEW + sum(map(len, stmts))
    if fixed >= length:
        raise ValueError(f"length {length} leaves no room for a document ({fixed} fixed tokens)")
    units = ruler._haystack_units(tok, HAYSTACK, rng, length - fixed)
    depths = DEPTHS if n == len(DEPTHS) else [(i + 1) / (n + 1) for i in range(n)]
    order = sorted(range(n), key=lambda i: rng.random())  # which key goes at which depth
    points = {round(d * len(units)): order[j] for j, d in enumerate(depths)}
    ids, spans = list(head), [None] * n
    for u_i in range(len(units) + 1):
        if u_i in points:
            s = points[u_i]
            spans[s] = (len(ids), len(ids) + len(stmts[s]))
            ids += stmts[s]
        if u_i < len(units):
            ids += units[u_i]
    return {
        "keys": keys,
        "values": values,
        "chat": chat_name,
        "doc_ids": ids,
        "spans": spans,
        "statement_parts": [parts_of(tok, stmts[i], keys[i], values[i]) for i in range(n)],
        "prompts": [ids + t for t in tails],
        "stop_ids": ruler.stop_ids(tok, chat_name if chat_name in ruler.CHATS else "none"),
    }


def parts_of(tok, ids: Sequence[int], key: str, value: str) -> Dict[str, List[int]]:
    """Offsets (within the statement's ids) of the tokens that spell the key and those that spell the value."""
    text = tok.decode(list(ids))
    ends = [len(tok.decode(list(ids[: i + 1]))) for i in range(len(ids))]
    starts = [0] + ends[:-1]

    def covering(word: str) -> List[int]:
        a = text.find(word)
        if a < 0:
            return []
        b = a + len(word)
        return [i for i, (s, e) in enumerate(zip(starts, ends)) if s < b and e > a]

    return {"key": covering(key), "value": covering(value)}


SEVEN = re.compile(r"\d{7}")


# -- running one prompt -----------------------------------------------------------------------------------------


def positions_of(c):
    """int [H, n]: the absolute positions a PolicyCache holds (batch row 0, slot order)."""
    import numpy as np

    return np.array(c.positions[0, :, : c.n])


class Recorder:
    """The caches' state at the end-of-prompt cut: scores and positions before it (progress callback after the
    last prefill chunk), positions and budgets right after it (the first decode update of each layer)."""

    def __init__(self, caches):
        from kvpolicy_core.cache.policy_cache import PolicyCache

        self.caches = caches
        self.layers = [i for i, c in enumerate(caches) if isinstance(c, PolicyCache)]
        self.before: Dict[int, Dict[str, Any]] = {}
        self.after: Dict[int, Dict[str, Any]] = {}
        for i in self.layers:
            self._wrap(i, caches[i])

    def _wrap(self, i, c):
        original = c.update_and_fetch

        def update_and_fetch(keys, values):
            out = original(keys, values)
            if keys.shape[2] == 1 and i not in self.after:
                self.after[i] = {"positions": positions_of(c), "budget": int(c.budget)}
            return out

        c.update_and_fetch = update_and_fetch

    def progress(self, done: int, total: int) -> None:
        import mlx.core as mx
        import numpy as np

        if done == total - 1 and total > 1 and not self.before:
            for i in self.layers:
                c = self.caches[i]
                self.before[i] = {
                    "positions": positions_of(c),
                    "scores": np.array(c.scores[0, :, : c.n].astype(mx.float32)),
                    "budget": int(c.budget),
                }


def run_one(model, tok, spec: Optional[str], prompt: List[int], stop_ids, explain: bool, prefill_step: int):
    """Greedy answer of ``prompt`` under ``spec``; (output text, tokens, seconds, record or None)."""
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from kvpolicy_core import attach, detach
    from kvpolicy_core.eval.tasks.greedy import greedy_tokens
    from kvpolicy_core.integration.compress_once import compress_context, repeat_prompt, split_spec

    record, progress = None, None
    t = time.perf_counter()
    once = split_spec(spec) if spec else None
    if once is not None:
        comp = compress_context(
            model, prompt[:-1], once.config, scorer=once.scorer, prefill_step=prefill_step, repeat=repeat_prompt(tok)
        )
        caches, feed = comp.caches, prompt[-1:]
        if explain:
            record = {
                "after": {
                    i: {"positions": np.array(k[0]), "budget": int(c.budget)}
                    for i, (k, c) in enumerate(zip(comp.kept, caches))
                },
                "before": {i: {"positions": None, "scores": np.array(s[0])} for i, s in enumerate(comp.scores)},
            }
    else:
        if spec:
            attach(model, spec)
        try:
            caches = make_prompt_cache(model)  # what generate_step makes when given none: the attached caches
        finally:
            if spec:
                detach(model)
        feed = prompt
        if explain and spec:
            rec = Recorder(caches)
            progress = rec.progress
    done = lambda text: SEVEN.search(text) is not None  # noqa: E731
    out = greedy_tokens(model, tok, feed, caches, MAX_NEW, prefill_step, stop_ids, done, progress)
    seconds = time.perf_counter() - t
    if progress is not None:
        record = {"before": rec.before, "after": rec.after}
    del caches
    return tok.decode(out), len(out), seconds, record


# -- the analysis -----------------------------------------------------------------------------------------------


def kept_in(pos, offsets: Sequence[int], start: int) -> List[int]:
    """Per head: how many of the statement tokens ``start + offsets`` the head keeps."""
    import numpy as np

    want = np.array([start + o for o in offsets])
    return [int(np.isin(want, row).sum()) for row in pos]


def analyse(task, q: int, record, W: int, n_sink: int = 4) -> Dict[str, Any]:
    """Per layer and KV head, what the cut kept of the asked statement (and of each other one) and where the
    window's pooled scores ranked it (a head keeps its best ``k`` evictable tokens, ``k`` read from what it kept)."""
    import numpy as np

    a, b = task["spans"][q]
    L1 = len(task["prompts"][q]) - 1  # tokens held at the cut (the last one arrives with it)
    parts = task["statement_parts"][q]
    layers = []
    for i in sorted(record["after"]):
        aft = record["after"][i]
        pos = aft["positions"]
        row = {
            "layer": i,
            "budget": aft["budget"],
            "kept": int(pos.shape[-1]),
            "statement": kept_in(pos, range(b - a), a),
            "lost": [[o for o in range(b - a) if a + o not in set(row.tolist())] for row in pos],  # offsets, per head
            "key": kept_in(pos, parts["key"], a),
            "value": kept_in(pos, parts["value"], a),
            "others": [
                sum(kept_in(pos, range(s[1] - s[0]), s[0])) // pos.shape[0]
                for j, s in enumerate(task["spans"])
                if j != q
            ],
        }
        bef = record["before"].get(i)
        if bef is not None and bef.get("scores") is not None:
            sc = bef["scores"]
            bpos = (
                bef["positions"]
                if bef.get("positions") is not None
                else np.broadcast_to(np.arange(sc.shape[-1]), sc.shape)
            )
            ranks, in_top = [], []
            for h in range(sc.shape[0]):
                evictable = (bpos[h] >= n_sink) & (bpos[h] < L1 - W)
                s_h, p_h = sc[h][evictable], bpos[h][evictable]
                order = p_h[np.argsort(-s_h, kind="stable")]
                k = int(((pos[h] >= n_sink) & (pos[h] < L1 - W)).sum()) if pos.shape[-1] else 0
                rank = {int(p): r for r, p in enumerate(order)}
                vals = [rank.get(a + o, -1) for o in parts["value"]]
                ranks.append(max(vals) if vals else -1)  # the worst-ranked value digit
                in_top.append(bool(vals) and max(vals) < k)
            row["value_worst_rank"] = ranks
            row["value_in_top"] = in_top
        layers.append(row)
    return {"question": q, "layers": layers}


def window_text(tok, prompt: List[int], W: int, key: str) -> Dict[str, Any]:
    """The W tokens whose queries score the cut (the prompt's last W but the final one) and whether the key is in
    them."""
    win = prompt[len(prompt) - 1 - W : len(prompt) - 1]
    text = tok.decode(win)
    adj, noun = key.split("-")
    return {"W": W, "text": text, "key_words_in_window": [w for w in (adj, noun) if w in text]}


def template_share(tok, W: int = W_DEFAULT) -> Dict[str, Any]:
    """For each prompt format: how many of the window's W tokens are the format's own (turn end) and not the
    question or answer prefix."""
    out = {}
    for name, fmt in ruler.CHATS.items():
        n = len(encode(tok, fmt.turn_end)) if name != "none" else 0
        q = len(encode(tok, "\n\nQuestion: " + QUESTION.format(key="amber-anchor") + fmt.turn_end))
        a = len(encode(tok, ANSWER.format(key="amber-anchor")))
        out[name] = {"template_tokens": n, "question_tokens": q - n, "answer_prefix_tokens": a, "W": W}
    return out


def print_analysis(name: str, task, an: Dict[str, Any], heads_note: str = "") -> None:
    q = an["question"]
    print(f"\n### {name}: question {q} ({task['keys'][q]} = {task['values'][q]}), statement at {task['spans'][q]}")
    print(
        "| layer | budget | kept | statement tokens kept per head | value digits kept | window rank (worst digit) "
        "| other statements kept |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    n_stmt = task["spans"][q][1] - task["spans"][q][0]
    for r in an["layers"]:
        rank = r.get("value_worst_rank")
        rank_s = "-" if rank is None else ", ".join(f"{x}{'*' if t else ''}" for x, t in zip(rank, r["value_in_top"]))
        print(
            f"| {r['layer']} | {r['budget']} | {r['kept']} | {r['statement']} / {n_stmt} | {r['value']} | {rank_s} "
            f"| {r['others']} |"
        )


def report(data: Dict[str, Any], full_runs: Sequence[str] = ()) -> None:
    """Print the table of a result file (and the analysis of what a method lost where the full cache answered).
    ``full_runs``: other result files of the same task whose rows join these (e.g. the full cache's)."""
    rows = list(data["rows"])
    for f in full_runs or ():
        have = {(x["method"], x["question"]) for x in rows}
        rows += [r for r in json.loads(Path(f).read_text())["rows"] if (r["method"], r["question"]) not in have]
    cfg = data["config"]
    task = {k: cfg[k] for k in ("keys", "values", "spans")}
    n = len(task["keys"])
    names = list(dict.fromkeys(r["method"] for r in rows))
    heads = " | ".join(f"q{q} {k}" for q, k in enumerate(task["keys"]))
    print(f"\n| method | spec | {heads} | right | time |")
    print("| --- | --- |" + " --- |" * n + " --- | --- |")
    for m in names:
        rs = {r["question"]: r for r in rows if r["method"] == m}
        cells = []
        for q in range(n):
            r = rs.get(q)
            if r is None:
                cells.append("-")
                continue
            cell = r["number"] or repr(r["output"].strip()[:16])
            if not r["correct"] and r["other_key"]:
                cell += f" ({r['other_key'][0]}'s)"
            cells.append(("**ok** " if r["correct"] else "") + cell)
        spec = next(iter(rs.values()))["spec"]
        right = sum(r["correct"] for r in rs.values())
        secs = sum(r["seconds"] for r in rs.values())
        print(f"| {m} | `{spec}` | {' | '.join(cells)} | {right}/{len(rs)} | {secs:.0f} s |")
    explain = data.get("explain") or {}
    if not explain:
        return
    print("\nwindows (the last W=32 tokens whose queries score the cut):")
    for q, w in enumerate(data["windows"]):
        print(f"  q{q}: key words in window {w['key_words_in_window']}: {w['text']!r}")
    full = {r["question"]: r["correct"] for r in rows if r["method"] == "full"}
    for r in data["rows"]:
        key = f"{r['method']}/{r['question']}"
        if full.get(r["question"], True) and not r["correct"] and key in explain:
            print_analysis(key, task, explain[key])


# -- main -------------------------------------------------------------------------------------------------------


def load(model: str, smoke: bool):
    """The model as the long-context suite loads it; the smoke model has sliding-window layers (gemma3_text)."""
    from long_context import load as load_model

    return load_model(model, smoke, tiny="gemma3_text", tiny_layers=4)


def main(argv=None):
    p = parser(__doc__, seed=0, smoke_help="a tiny random-weight model, seconds (checks the program runs)")
    p.add_argument("--model", default="gemma3", help="gemma3 (default), smollm2, or an mlx-lm model directory")
    p.add_argument("--length", type=int, default=4096, help="prompt + answer tokens (4096 or 8192)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list from: " + ", ".join(METHODS))
    p.add_argument("--chat", default="auto", choices=["auto", *ruler.CHATS], help="prompt format")
    p.add_argument("--prefill-step", type=int, default=2048)
    p.add_argument("--report", nargs="+", metavar="FILE", help="print the table and analysis of result files; no run")
    p.add_argument("--full-from", nargs="*", default=(), help="result files whose rows join the table (--report)")
    p.add_argument("--questions", help="comma list of the statements to ask (0-3; default: all)")
    p.add_argument("--explain", action="store_true", help="record and print what each cut kept (module docstring)")
    args = p.parse_args(argv)
    if args.report:
        for f in args.report:
            report(json.loads(Path(f).read_text()), args.full_from)
        return 0
    if args.smoke:
        args.length, args.prefill_step, args.explain = 1024, 256, True
        if args.methods == ",".join(METHODS):
            args.methods = SMOKE_METHODS
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in names:
        if m not in METHODS:
            p.error(f"unknown method {m!r} (known: {', '.join(METHODS)})")
    model, tok, model_name = load(args.model, args.smoke)
    task = build(tok, args.length, args.seed, args.chat)
    n = len(task["keys"])
    asked = [int(x) for x in args.questions.split(",")] if args.questions else list(range(n))
    print(f"model {model_name}; {len(task['doc_ids'])} document tokens, prompts {[len(x) for x in task['prompts']]}")
    print(f"statements (key = value @ span): {list(zip(task['keys'], task['values'], task['spans']))}")
    name = result_name(f"doc_qa_{Path(model_name).name if not args.smoke else 'tiny'}", args)
    wall = Stopwatch()
    rows: List[Dict[str, Any]] = []
    explain: Dict[str, Any] = {}
    windows = [window_text(tok, task["prompts"][q], W_DEFAULT, task["keys"][q]) for q in range(n)]

    def save():
        data = {
            "config": {
                "model": model_name,
                "length": args.length,
                "haystack": HAYSTACK,
                "chat": task["chat"],
                "seed": args.seed,
                "methods": {m: METHODS[m][0] and METHODS[m][0].format(b=args.length // METHODS[m][1]) for m in names},
                "statement": STATEMENT,
                "question": QUESTION,
                "answer_prefix": ANSWER,
                "keys": task["keys"],
                "values": task["values"],
                "spans": task["spans"],
                "statement_parts": task["statement_parts"],
                "prompt_tokens": [len(x) for x in task["prompts"]],
                "max_new_tokens": MAX_NEW,
                "prefill_step": args.prefill_step,
            },
            "rows": rows,
            "windows": windows,
            "template_share": template_share(tok),
            "explain": explain,
            "wall_seconds": round(wall.wall, 1),
        }
        return write_json(name, data, args.out)

    for m in names:
        fmt, ratio = METHODS[m]
        spec = fmt.format(b=args.length // ratio) if fmt else None
        for q in asked:
            out, n_tok, secs, record = run_one(
                model, tok, spec, task["prompts"][q], set(task["stop_ids"]), args.explain, args.prefill_step
            )
            value = task["values"][q]
            got = SEVEN.findall(out)
            other = [task["keys"][j] for j, v in enumerate(task["values"]) if j != q and v in out]
            row = {
                "method": m,
                "spec": spec or "full (mlx-lm's own cache)",
                "ratio": ratio,
                "question": q,
                "key": task["keys"][q],
                "answer": value,
                "output": out,
                "new_tokens": n_tok,
                "correct": value in out,
                "number": got[0] if got else None,
                "other_key": other,
                "seconds": round(secs, 1),
            }
            if record is not None:
                an = analyse(task, q, record, 0 if ("stream" in m or "kvzip" in m) else W_DEFAULT)
                row["global_kept"] = {r["layer"]: r["statement"] for r in an["layers"]}
                explain[f"{m}/{q}"] = an
            rows.append(row)
            mark = "ok " if row["correct"] else "NO "
            print(f"{m:12s} q{q} {mark} {out!r} ({secs:.1f} s)", flush=True)
            save()

    report(json.loads(Path(save()).read_text()), full_runs=args.full_from)
    print(f"\nwall {wall.wall:.0f} s; wrote {save()}")


if __name__ == "__main__":
    sys.exit(main())
