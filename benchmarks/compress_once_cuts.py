"""Compress-once cuts side by side: the same reconstruction scores cut every way, each cut asked its questions.

Per context (a task of the long-context suite, ``--task``, default ``niah_single``, at chosen needle depths), one
full prefill and one reconstruction pass computing both normalisations (the whole-context softmax and kvpress's
per-chunk one); then every (normalisation, pool width, allocation) cut of those scores is loaded into ``cam`` caches
and asked each of the context's questions (greedy, query-agnostic, a fresh copy of the cut per question).
``allocation``: ``layer`` keeps the budget in every layer (``kvzip-layerwise``), ``model`` shares ``n_layers x
budget`` out by one ranking (``kvzip``), ``shareS`` (e.g. ``share50``) guarantees every layer S % of the budget
and shares the rest by the ranking (``compress_once.model_budgets``). Any allocation suffixed ``+spans`` (e.g.
``model+spans``) first raises the task's statement spans above every score: an oracle that keeps each statement
whole in every layer and head (a window layer: where its window still sees it), what a perfect query-agnostic
statement detector would keep. ``--full`` also asks every question of the uncompressed cache. Writes
``compress_once_cuts[_TAG].json`` with one row per (context, cut), each with the share of every statement's positions
the cut kept (``spans_kept``), and prints the hits per cut.

    python benchmarks/compress_once_cuts.py --model gemma3 --haystacks pydoc,noise --depths 0.3,0.5,0.7
    python benchmarks/compress_once_cuts.py --model smollm2 --ratios 4,8 --pools 1,3,7,15 --normalisations context \
        --allocations model --tag smollm2_pools
    python benchmarks/compress_once_cuts.py --model smollm2 --task niah_multikey --depths seed --ratios 4,8 \
        --pools 1,3,7,15 --tag smollm2_multikey
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from collections import defaultdict

from _common import parser, result_name, write_json  # BLAS loads here, before mlx

# isort: split
import numpy as np
from long_context import load

from kvpolicy_core.eval.tasks import ruler
from kvpolicy_core.eval.tasks.ruler_runner import copy_caches, greedy
from kvpolicy_core.integration import compress_once as co
from kvpolicy_core.integration import reconstruction as rc


def both_scores(model, contexts, chunks, spans, n_sink):
    """{"context": [B, H, L] per layer, "chunk": [B, H, L] per layer} from one reconstruction pass."""
    whole = []
    chunk = rc.reconstruction_scores(model, contexts, chunks, spans, n_sink, whole=whole)
    return {"context": [np.array(s) for s in whole], "chunk": [np.array(s) for s in chunk]}


def with_spans(score, spans, top=2.0):
    """``score`` [B, H, L] with every position of ``spans`` raised to ``top``, above any attention weight."""
    out = score.copy()
    for a, b in spans:
        out[..., a:b] = top
    return out


def spans_kept(kept, spans, L):
    """Per statement span, the share of its positions kept, over every layer and head (``kept``: [B, H, b_l])."""
    held = []
    for k in kept:
        mask = np.zeros(k.shape[:2] + (L,), dtype=bool)
        np.put_along_axis(mask, k.astype(np.int64), True, axis=-1)
        held.append(mask.reshape(-1, L))
    held = np.concatenate(held)
    return [round(float(held[:, a:b].mean()), 3) for a, b in spans]


def full_caches(model, ids, step=2048):
    """The uncompressed cache of ``ids``: the model's own caches (mlx-lm's), prefilled in chunks of ``step``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    caches = make_prompt_cache(model)
    for a in range(0, len(ids), step):
        model(mx.array(ids[a : a + step], dtype=mx.uint32)[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def ask_all(model, tok, ctx, caches, row):
    """One row per question of ``ctx``, each asked of a fresh copy of ``caches``: ``row`` plus its answer and score."""
    out = []
    for qi, q in enumerate(ctx.questions):
        got = greedy(
            model, tok, copy_caches(caches), q.question_ids, q.max_new_tokens, ctx.stop_ids, 2048, q.answers, ctx.metric
        )
        score = ruler.score(got["output"], q.answers, ctx.metric)
        out.append({**row, "question": qi, "output": got["output"], "score": score})
    return out


def main():
    p = parser(__doc__, smoke_help="a tiny random-weight model, seconds (checks the program runs)")
    p.add_argument("--model", default="gemma3", help="gemma3 (default), smollm2, or an mlx-lm model directory")
    p.add_argument("--task", default="niah_single", choices=ruler.TASKS)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--haystacks", default="pydoc,noise")
    p.add_argument(
        "--depths", default="0.3,0.5,0.7", help="comma list of needle depths; 'seed': the suite's placement (seed i)"
    )
    p.add_argument("--ratios", default="4", help="compression ratios, comma list: every ratio cuts the same scores")
    p.add_argument("--pools", default="1,7,15")
    p.add_argument("--normalisations", default="context,chunk", help="context, chunk (comma list)")
    p.add_argument("--allocations", default="layer,model", help="layer, model, shareS e.g. share50 (comma list)")
    p.add_argument("--method", default="cam")
    p.add_argument("--full", action="store_true", help="also ask every question of the uncompressed cache")
    args = p.parse_args()
    for allocation in args.allocations.split(","):
        rule, _, oracle = allocation.partition("+")
        if not (rule in ("layer", "model") or re.fullmatch(r"share\d+(\.\d+)?", rule)) or oracle not in ("", "spans"):
            p.error(f"--allocations: {allocation!r} is not layer, model or shareS, each optionally suffixed +spans")
    if args.smoke:
        args.length, args.haystacks, args.depths, args.pools = 640, "noise", "0.5", "1,7"
        args.allocations, args.full = "layer,model,model+spans", True
    start = time.perf_counter()
    model, tok, path = load(args.model, args.smoke)
    name = path.rstrip("/").split("/")[-1]
    repeat = co.repeat_prompt(tok)
    ratios = [float(x) for x in args.ratios.split(",")]
    pools = [int(x) for x in args.pools.split(",")]
    norms, allocations = args.normalisations.split(","), args.allocations.split(",")
    rows = []
    for hay in args.haystacks.split(","):
        for i, depth in enumerate(None if d == "seed" else float(d) for d in args.depths.split(",")):
            params = dataclasses.replace(ruler.preset_params("calibrated", args.task, name), depth=depth)
            ctx = ruler.build_context(tok, args.task, args.length, hay, i, model=name, chat="none", params=params)
            ids, L = ctx.context_ids, len(ctx.context_ids)
            contexts = co.prefill_full(model, ids, 2048)
            chunks = rc.repeat_chunks(ids, repeat.first, repeat.later, repeat.suffix, 2048, repeat.tail)
            chunk_spans = [(a, min(a + 2048, L)) for a in range(0, L, 2048)]
            scores = both_scores(model, contexts, chunks, chunk_spans, co.parse_config(args.method).policy.n_sink)
            where = {"context": ctx.id, "haystack": hay, "depth": depth}
            if args.full:
                full = full_caches(model, ids)
                sizes = [c.size() for c in full]
                cut = {"ratio": 1.0, "normalise": "-", "pool": 0, "allocation": "full", "budgets": sizes}
                rows += ask_all(model, tok, ctx, full, {**where, **cut})
                del full
            for (norm, s), ratio, P, allocation in itertools.product(scores.items(), ratios, pools, allocations):
                if norm not in norms:
                    continue
                budget = int(args.length / ratio)
                config = co.parse_config(f"{args.method}:budget={budget},pool={P}")
                rule, oracle = allocation.split("+")[0], allocation.endswith("+spans")
                share = float(rule[5:]) / 100 if rule.startswith("share") else 0.0
                cut_scores = [with_spans(x, ctx.spans) for x in s] if oracle else s
                compressed = co.cut(model, config, contexts, cut_scores, L, layerwise=rule == "layer", share=share)
                cut = {
                    "ratio": ratio, "normalise": norm, "pool": P, "allocation": allocation,
                    "budgets": [c.budget for c in compressed.caches],
                    "spans_kept": spans_kept(compressed.kept, ctx.spans, L),
                }  # fmt: skip
                rows += ask_all(model, tok, ctx, compressed.caches, {**where, **cut})
            del contexts
    hits = defaultdict(list)
    for r in rows:
        hits[(r["ratio"], r["normalise"], r["pool"], r["allocation"])].append(r["score"])
    print("ratio  normalise  pool  allocation  score (questions)")
    for (ratio, norm, P, allocation), s in sorted(hits.items()):
        print(f"{ratio:5g}  {norm:9s}  {P:4d}  {allocation:10s}  {sum(s):g} / {len(s)}")
    payload = {"model": path, "task": args.task, "length": args.length, "ratios": ratios, "method": args.method}
    payload["rows"] = rows
    payload["seconds"] = round(time.perf_counter() - start, 1)
    print("wrote", write_json(result_name("compress_once_cuts", args), payload, args.out))


if __name__ == "__main__":
    main()
