"""One decoder layer's decode step at a long context: a policy cache against a full cache and against the ideal.

    python benchmarks/decode_layer.py                                   # Llama-3.2-1B layer, 16k, budgets 4096 and 2048
    python benchmarks/decode_layer.py --context 32768 --budgets 8192,4096
    python benchmarks/decode_layer.py --smoke                           # a tiny config, a few seconds

The first decoder layer of mlx-lm's model of ``--config`` (random fp32 weights, as in real_shapes.py) decodes one
token per call (projections, RoPE, the cache, attention, MLP), evaluated, with caches filled as a prompt of
``--context`` tokens leaves them (:func:`real_shapes.at_context`). Per budget B the caches take turns of two steps
(order rotated each turn, so a change of load hits all alike):

* ``full``: mlx-lm's ``KVCache`` holding the context;
* ``ideal:B``: a ``KVCache`` holding B + 1 tokens, what a policy cache's steady state attends to (its buffer of
  ``budget + 1`` slots) with nothing else to do: the bound on what any eviction policy can reach;
* each method at ``budget=B``.

Reported per cache: the median wall and CPU ms per step; the median peak memory of a turn above what was in use
before it (``peak_above_mib``: a step that copied the cache's K/V buffers instead of updating them in place would
show them here; a policy cache's K/V at budget B are 2 x B x H x D x 4 bytes); ``over_ideal_ms``: the median over
turns of the turn's difference to ``ideal:B`` (paired: what the policy costs beyond attending to fewer tokens);
``x_full``: full's median over this one's. The parts of the step, timed alone on the same shapes (hot caches, so a
lower bound of their cost inside the layer): ``no_attention_ms`` (the layer over a 16-token KVCache: projections and
MLP), mlx-lm's attention kernel and kvpolicy's composed one (output and weights in one pass) at B + 1 and at the
context, and, for a cache whose disposition merges (CaM), the selection and the disposition's update of one
eviction. Writes benchmarks/results/decode_layer_<config>_<context>[_<tag>].json.
"""

from __future__ import annotations

import statistics
import time

from _common import mx, parser, result_name, write_json
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from real_shapes import CONFIGS, at_context, build_model

from kvpolicy_core.attention.weights import attention_with_weights


def kv_cache(n: int, H: int, D: int, seed: int) -> KVCache:
    """A KVCache holding ``n`` random tokens (offset n)."""
    c = KVCache()
    k1, k2 = mx.random.split(mx.random.key(seed))
    c.keys, c.values = mx.random.normal((1, H, n, D), key=k1), mx.random.normal((1, H, n, D), key=k2)
    c.offset = n
    mx.eval(c.keys, c.values)
    return c


def ms_of(fn, repeat: int) -> float:
    """Median ms of ``fn()`` (evaluated inside) over ``repeat`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def turns(layer, h, caches: dict, n_turns: int, steps: int = 2) -> dict:
    """{name: (wall s per step per turn, CPU s per step per turn, peak MiB above the memory in use before the
    turn)}: the caches take turns of ``steps`` steps. The peak shows a step that copies a cache's buffers instead
    of updating them in place (MLX copies a buffer that an op not yet run still reads)."""
    names, out = list(caches), {n: ([], [], []) for n in caches}
    for name in names:  # warm-up: a policy cache's first steps trace its compiled decode graphs
        for _ in range(3):
            mx.eval(layer(h, None, caches[name]))
    for t in range(n_turns):
        for name in names[t % len(names) :] + names[: t % len(names)]:
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                mx.eval(layer(h, None, caches[name]))
            out[name][0].append((time.perf_counter() - wall) / steps)
            out[name][1].append((time.process_time() - cpu) / steps)
            out[name][2].append((mx.get_peak_memory() - before) / 2**20)
    return out


def attention_parts(H: int, Hq: int, D: int, L: int, repeat: int) -> dict:
    """mlx-lm's kernel and kvpolicy's composed attention (output and weights) for one query at L keys, ms: as the
    kernel computes it (a cache before its first eviction) and grouped (after: one product per KV head)."""
    q = mx.random.normal((1, Hq, 1, D), key=mx.random.key(1))
    k, v = mx.random.normal((1, H, L, D), key=mx.random.key(2)), mx.random.normal((1, H, L, D), key=mx.random.key(3))
    mx.eval(q, k, v)
    scale = D**-0.5
    return {
        "kernel_ms": ms_of(lambda: mx.eval(scaled_dot_product_attention(q, k, v, None, scale, None)), repeat),
        "with_weights_ms": ms_of(lambda: mx.eval(*attention_with_weights(q, k, v, scale, None, compiled=True)), repeat),
        "grouped_ms": ms_of(
            lambda: mx.eval(*attention_with_weights(q, k, v, scale, None, compiled=True, grouped=True)), repeat
        ),
    }


def eviction_parts(cache, repeat: int) -> dict:
    """A policy cache's selection and its disposition's update of one decode eviction, alone, ms."""
    step = cache._step
    view = cache._view(0)
    losers = step.choose(view, 1)
    mx.eval(losers)
    del view  # a view holds the buffers

    def select():
        mx.eval(step.choose(cache._view(0), 1))

    def dispose():
        update, _ = step.dispose(cache._view(0), losers, cache.offset)
        mx.eval([x for x in (update or ()) if isinstance(x, mx.array)])

    return {"select_ms": ms_of(select, repeat), "dispose_ms": ms_of(dispose, repeat)}


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--config", default="llama3.2-1b", choices=list(CONFIGS))
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--budgets", default="4096,2048", help="comma-separated budgets")
    p.add_argument("--methods", default="h2o,cam")
    p.add_argument("--turns", type=int, default=20, help="turns of two steps per cache")
    args = p.parse_args(argv)
    if args.smoke:
        args.config, args.context, args.budgets, args.turns = "tiny", 64, "16", 2
    model = build_model(args.config, 1)
    layer, a = model.layers[0], model.args
    H, Hq = a.num_key_value_heads, a.num_attention_heads
    D = getattr(a, "head_dim", None) or a.hidden_size // Hq
    h = mx.random.normal((1, 1, a.hidden_size), key=mx.random.key(0))
    mx.eval(h)
    N, repeat = args.context, 3 if args.smoke else 20
    short = kv_cache(16, H, D, 5)
    parts = {
        "no_attention_ms": ms_of(lambda: mx.eval(layer(h, None, short)), repeat),
        f"attention_{N}": attention_parts(H, Hq, D, N, repeat),
    }
    blocks = []
    for B in (int(b) for b in args.budgets.split(",")):
        specs = [f"{m}:budget={B}" for m in args.methods.split(",")]
        caches = {"full": kv_cache(N, H, D, 7), f"ideal:{B}": kv_cache(B + 1, H, D, 8)}
        caches.update({s: at_context(model, s, N)[0] for s in specs})
        times = turns(layer, h, caches, args.turns)
        ideal = times[f"ideal:{B}"][0]
        full_ms = 1e3 * statistics.median(times["full"][0])
        rows = []
        for name, (wall, cpu, peak) in times.items():
            ms = 1e3 * statistics.median(wall)
            row = {
                "cache": name,
                "wall_ms": ms,
                "cpu_ms": 1e3 * statistics.median(cpu),
                "peak_above_mib": statistics.median(peak),
                "over_ideal_ms": 1e3 * statistics.median(w - i for w, i in zip(wall, ideal)),
                "x_full": full_ms / ms,
                "turns_ms": [1e3 * w for w in wall],
            }
            if name in specs:
                row.update(eviction_parts(caches[name], repeat))
            rows.append(row)
            print(
                f"context {N} budget {B}: {name:20} {ms:7.2f} ms/step (CPU {row['cpu_ms']:7.2f})  "
                f"over ideal {row['over_ideal_ms']:+6.2f} ms  x full {row['x_full']:.2f}  "
                f"peak +{row['peak_above_mib']:.1f} MiB",
                flush=True,
            )
        blocks.append({"budget": B, "rows": rows, f"attention_{B + 1}": attention_parts(H, Hq, D, B + 1, repeat)})
        del caches
    print(f"parts: {parts}; per budget: {[{k: v for k, v in b.items() if k.startswith('attention')} for b in blocks]}")
    name = result_name(f"decode_layer_{args.config}_{N}", args)
    payload = {"config": args.config, "context": N, "parts": parts, "blocks": blocks}
    print(f"wrote {write_json(name, payload, args.out)}")


if __name__ == "__main__":
    main()
