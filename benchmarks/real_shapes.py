"""Speed and memory at the shapes users run: full cache, RotatingKVCache, H2O and CaM through mlx-lm's generate_step.

    python benchmarks/real_shapes.py                                    # Llama-3.2-1B shape, 4 layers, 2k, 2x-16x
    python benchmarks/real_shapes.py --prompts 8192 --ratios 4,8 --layers 2
    python benchmarks/real_shapes.py --prompts 16384 --ratios 8 --layers 2 --decode 12
    python benchmarks/real_shapes.py --config gemma3-1b --layers 6      # sliding-window layers (5 local, 1 global)
    python benchmarks/real_shapes.py --config qwen2.5-3b --layers 2     # GQA with 2 KV heads of dim 128
    python benchmarks/real_shapes.py --context 16384,32768 --ratios 4,8 --layers 16   # decode at a long context
    python benchmarks/real_shapes.py --layer-prefill --prompts 2048,8192 --ratios 4,8   # one layer's prefill cost
    python benchmarks/real_shapes.py --smoke                            # a tiny config, a few seconds
    python benchmarks/real_shapes.py --markdown benchmarks/results/real_shapes_llama3.2-1b_4L_2k-8k.json  # tables

The model is mlx-lm's own (``mlx_lm.models.<family>.Model``) built from a real config with random fp32 weights
(speed does not depend on them) and fewer layers (``--layers``; the cost per layer is what matters, and the per-layer
decode time is reported next to the whole step's). Each method gets fresh caches and runs mlx-lm's ``generate_step``
with chunked prefill (``--chunk``, mlx-lm's default ``prefill_step_size`` of 2048), exactly the user's path.
For each prompt length: ``full`` (the model's own caches: ``KVCache`` per layer, Gemma 3's rotating sliding layers)
and, per budget ratio r (budget = prompt / r), ``RotatingKVCache(budget, keep=4)``, ``h2o:budget=`` and
``cam:budget=``, all interleaved:

* prefill: the methods one after the other (in a rotated order per round), the time to the first token
  (the progress callback mlx-lm calls once the prompt is in the caches); tokens/s = prompt / that time;
* decode: the methods take turns of ``--block`` tokens (the order shifted by one each turn), each turn synchronised
  with mlx-lm's generation stream, so a change of load on a shared machine hits every method alike; tokens/s and
  CPU ms per token are medians over turns, and the ratios to full and to rotating are also given turn by turn
  ("paired": median and quartiles of the per-turn ratios);
* the non-layer cost of a decode step (embedding, final norm, LM head, sampling), timed in turns of its own among
  the methods' (the model's forward with its layer list emptied), gives the decode ms per layer
  ``(step - head) / layers`` and the tokens/s extrapolated to the config's real depth;
* memory during prefill: the KV bytes the caches hold at their largest (buffers including per-slot state, summed
  over layers right after each layer's update), against ``(budget + chunk)`` tokens of K/V; the MLX memory resident
  after each chunk above what it was before the prefill (anything a cache keeps alive); and the process's peak
  (``mx.get_peak_memory``, attention activations included) above the same baseline.

Writes benchmarks/results/real_shapes[_context]_<config>_<layers>L_<prompts>[_<tag>].json (the command, versions,
BLAS, the load averages and CPU count added) and a .png of the ratios; ``--layer-prefill`` writes
real_shapes_layer_prefill_<config>_<prompts>.json.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import statistics
import time
from pathlib import Path

from _common import mx, parser, result_name, with_budget, write_json
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from kvpolicy_core import PolicyCache
from kvpolicy_core.integration.builder import KVCacheBuilder, native_caches

_LLAMA3_ROPE = {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
#: name -> (mlx-lm model family, config fields without the layer count, the real number of layers)
CONFIGS = {
    "llama3.2-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            rms_norm_eps=1e-5,
            vocab_size=128256,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
        ),
        16,
    ),
    "llama3.2-3b": (
        "llama",
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            vocab_size=128256,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
        ),
        28,
    ),
    "qwen2.5-3b": (
        "qwen2",
        dict(
            hidden_size=2048,
            intermediate_size=11008,
            num_attention_heads=16,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            vocab_size=151936,
            rope_theta=1e6,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
        36,
    ),
    "gemma3-1b": (
        "gemma3_text",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            rms_norm_eps=1e-6,
            vocab_size=262144,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            query_pre_attn_scalar=256,
            sliding_window=512,
            sliding_window_pattern=6,
            max_position_embeddings=32768,
        ),
        26,
    ),
    "tiny": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=97,
        ),
        2,
    ),
}


def build_model(config: str, layers: int):
    """mlx-lm's model of ``config``'s family with ``layers`` layers and random fp32 weights, evaluated."""
    family, fields, _ = CONFIGS[config]
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs(model_type=family, num_hidden_layers=layers, **fields))
    mx.eval(model.parameters())
    return model


def kv_bytes_per_token(model) -> int:
    """fp32 K and V bytes one token takes in one layer."""
    a = model.args
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    return 2 * a.num_key_value_heads * head_dim * 4


def make(model, spec: str):
    """Fresh caches for ``spec``: ``full`` (the model's own caches), ``rotating:budget=N`` or a kvpolicy config."""
    if spec == "full":
        return native_caches(model)
    if spec.startswith("rotating:budget="):
        return [RotatingKVCache(max_size=int(spec.split("=")[1]), keep=4) for _ in model.layers]
    if spec.startswith("quantized:bits="):  # mlx-lm's QuantizedKVCache (every token, quantized rows)
        return [QuantizedKVCache(group_size=64, bits=int(spec.split("=")[1])) for _ in model.layers]
    return KVCacheBuilder.for_model(model, spec)


def cache_bytes(c) -> int:
    """Bytes of what a cache holds: its K/V buffers (capacity) and, for a policy cache, the per-slot state."""
    if isinstance(c, PolicyCache):
        return c._slots.nbytes
    if isinstance(c, (KVCache, RotatingKVCache)) and c.keys is not None:
        return c.keys.nbytes + c.values.nbytes
    return 0


def watch_kv(caches, record: dict) -> None:
    """Record in ``record["kv_peak"]`` the largest total of :func:`cache_bytes` over the caches, taken right after
    each layer's update (the other layers as they are then). Instance wrappers; :func:`unwatch` removes them."""
    now = [cache_bytes(c) for c in caches]
    record["kv_peak"] = sum(now)
    for i, c in enumerate(caches):

        def wrapped(keys, values, _c=c, _i=i, _orig=c.update_and_fetch):
            out = _orig(keys, values)
            now[_i] = cache_bytes(_c)
            record["kv_peak"] = max(record["kv_peak"], sum(now))
            return out

        c.update_and_fetch = wrapped


def unwatch(caches) -> None:
    for c in caches:
        c.__dict__.pop("update_and_fetch", None)


class Head:
    """The non-layer part of a decode step (embedding, final norm, LM head, sampling) timed like a method's turn."""

    def __init__(self, model):
        self.model, self.decode_wall, self.decode_cpu = model, [], []
        self.tok = mx.array([[1]])

    def _step(self) -> None:
        inner = self.model.model
        layers, inner.layers = inner.layers, []
        try:  # the model's own forward with no layers (a list of None caches for the mask code)
            logits = self.model(self.tok, cache=[None] * max(len(layers), 8))[:, -1, :]
        finally:
            inner.layers = layers
        mx.eval(mx.argmax(logits - mx.logsumexp(logits, keepdims=True), axis=-1))

    def decode_turn(self, block: int) -> None:
        t, c = time.perf_counter(), time.process_time()
        for _ in range(block):
            self._step()
        self.decode_wall.append((time.perf_counter() - t) / block)
        self.decode_cpu.append((time.process_time() - c) / block)


class Run:
    """One method's generate_step: prefill on :meth:`prefill`, then ``block`` tokens per :meth:`decode_turn`."""

    def __init__(self, model, spec: str, prompt: mx.array, chunk: int, max_tokens: int):
        self.spec, self.decode_wall, self.decode_cpu = spec, [], []
        gc.collect()
        self.caches = make(model, spec)
        self.mem: dict = {}
        watch_kv(self.caches, self.mem)
        self.resident, self.ttft, self.total = [], None, prompt.size
        mx.synchronize(generation_stream)
        self.base = mx.get_active_memory()
        mx.reset_peak_memory()
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        self.gen = generate_step(
            prompt,
            model,
            prompt_cache=self.caches,
            max_tokens=max_tokens,
            prefill_step_size=chunk,
            prompt_progress_callback=self._progress,
        )

    def _progress(self, done: int, total: int) -> None:
        if 0 < done < total:  # after a chunk: mlx-lm has just evaluated every cache's state
            self.resident.append(mx.get_active_memory() - self.base)
        elif done == total:  # the prompt is in and the first token computed
            self.ttft, self.ttft_cpu = time.perf_counter() - self.t0, time.process_time() - self.c0

    def prefill(self) -> None:
        next(self.gen)
        mx.synchronize(generation_stream)
        self.peak = mx.get_peak_memory() - self.base
        unwatch(self.caches)

    def decode_turn(self, block: int) -> None:
        t, c = time.perf_counter(), time.process_time()
        for _ in range(block):
            next(self.gen)
        mx.synchronize(generation_stream)
        self.decode_wall.append((time.perf_counter() - t) / block)
        self.decode_cpu.append((time.process_time() - c) / block)

    def close(self) -> None:
        self.gen.close()
        mx.synchronize(generation_stream)


def chunk_sizes(total: int, chunk: int):
    """The update sizes ``generate_step`` feeds a prompt of ``total`` tokens: chunks of ``chunk`` up to one token
    before the end, then that token."""
    sizes, left = [], total
    while left > 1:
        sizes.append(min(chunk, left - 1))
        left -= sizes[-1]
    return sizes + [1]


def layer_prefill(model, specs, P: int, chunk: int, rounds: int = 1) -> dict:
    """Per-layer prefill cost, diagnostic: the model's first decoder layer (projections, RoPE, the cache, attention,
    MLP) on a random hidden state of ``P`` tokens fed in ``generate_step``'s chunks, each chunk's output and cache
    state evaluated (every layer but the last does this work in the model). Methods interleaved chunk by chunk,
    ``rounds`` times with fresh caches. Returns {spec: {"wall_s", "cpu_s"}}: medians over rounds of the sums over
    the chunks, and the rounds' sums."""
    from mlx_lm.models.base import create_attention_mask

    layer, a = model.layers[0], model.args
    window = (
        getattr(a, "sliding_window", None) if getattr(getattr(layer, "self_attn", None), "is_sliding", False) else None
    )
    h = mx.random.normal((1, P, a.hidden_size), key=mx.random.key(7))
    mx.eval(h)
    sums = {s: [] for s in specs}
    for r in range(rounds):
        caches = {s: make(model, s)[0] for s in specs}
        wall, cpu_s, t0 = dict.fromkeys(specs, 0.0), dict.fromkeys(specs, 0.0), 0
        for i, S in enumerate(chunk_sizes(P, chunk)):
            x = h[:, t0 : t0 + S]
            mx.eval(x)
            k = (i + r) % len(specs)
            for s in specs[k:] + specs[:k]:
                c = caches[s]
                t, cpu = time.perf_counter(), time.process_time()
                y = layer(x, create_attention_mask(x, c, window_size=window), c)
                mx.eval(y, c.state)
                wall[s] += time.perf_counter() - t
                cpu_s[s] += time.process_time() - cpu
            t0 += S
        for s in specs:
            sums[s].append((wall[s], cpu_s[s]))
    return {
        s: {
            "wall_s": statistics.median(w for w, _ in v),
            "cpu_s": statistics.median(c for _, c in v),
            "rounds": [{"wall_s": w, "cpu_s": c} for w, c in v],
        }
        for s, v in sums.items()
    }


def at_context(model, spec: str, N: int):
    """Caches for ``spec`` as a prompt of ``N`` tokens would leave them, from random K/V instead of a prefill (the
    prefill of a long prompt at full depth takes far too long on a small CPU; a decode step's cost depends only on
    the shapes): ``KVCache`` holds N tokens, ``RotatingKVCache`` its ``max_size``, a policy cache its budget (random
    scores, positions the last ``budget`` of N), each with ``offset = N``."""
    a = model.args
    H, D = a.num_key_value_heads, getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    caches = make(model, spec)
    for i, c in enumerate(caches):
        full = isinstance(c, (KVCache, QuantizedKVCache))
        n = N if full else min(N, c.max_size if isinstance(c, RotatingKVCache) else c.budget)
        k1, k2 = mx.random.split(mx.random.key(1000 + i))
        K, V = mx.random.normal((1, H, n, D), key=k1), mx.random.normal((1, H, n, D), key=k2)
        bits = getattr(c, "bits", None)
        if bits is not None:  # quantized rows, as the cache stores them
            K, V = (tuple(mx.quantize(x, group_size=c.group_size, bits=bits)) for x in (K, V))
        if isinstance(c, PolicyCache):
            c.offset = N
            pos = mx.broadcast_to(mx.arange(N - n, N, dtype=mx.int32), (1, H, n))
            scores = mx.random.uniform(shape=(1, H, n), key=mx.random.key(2000 + i))
            c.state = (K, V, pos, scores, c.meta_state[0])
        else:
            c.keys, c.values, c.offset = K, V, N
            if isinstance(c, RotatingKVCache):
                c._idx = n
        mx.eval(K, V)
    return caches


class ContextRun(Run):
    """A method's generate_step decoding from :func:`at_context` caches (a one-token prompt: no prefill)."""

    def __init__(self, model, spec: str, N: int, max_tokens: int):
        self.spec, self.decode_wall, self.decode_cpu = spec, [], []
        gc.collect()
        self.caches = at_context(model, spec, N)
        self.gen = generate_step(mx.array([1]), model, prompt_cache=self.caches, max_tokens=max_tokens)
        next(self.gen)
        mx.synchronize(generation_stream)


def measure_context(model, N: int, specs, decode: int, block: int):
    """Decode turns (and :class:`Head`'s) over :class:`ContextRun` caches at context ``N`` -> (rows, head ms)."""
    runs = {s: ContextRun(model, s, N, decode + block + 1) for s in specs}
    return decode_rows(model, runs, specs, decode, block, lambda s, run: {})


def measure(model, prompt, specs, chunk, decode, block, rounds):
    """Interleaved prefill (``rounds`` times; the last round's caches decode) and decode turns (the non-layer
    cost, :class:`Head`, takes its turn too) -> (rows, head ms per token)."""
    prefills = {s: [] for s in specs}
    runs = {}
    for r in range(rounds):
        order = specs[r % len(specs) :] + specs[: r % len(specs)]
        for s in order:
            if s in runs:
                runs[s].close()
            runs[s] = Run(model, s, prompt, chunk, max_tokens=decode + block + 1)
            runs[s].prefill()
            prefills[s].append(runs[s].ttft)
            print(
                f"  prefill {s:24} {runs[s].ttft:7.2f} s  kv peak {runs[s].mem['kv_peak'] / 2**20:7.1f} MiB  "
                f"peak {runs[s].peak / 2**20:7.0f} MiB  load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    rows, head_ms = decode_rows(
        model,
        runs,
        specs,
        decode,
        block,
        lambda s, run: {
            "prefill_s": statistics.median(prefills[s]),
            "prefill_rounds_s": prefills[s],
            "prefill_tps": prompt.size / statistics.median(prefills[s]),
            "prefill_cpu_ms_per_token": 1e3 * run.ttft_cpu / prompt.size,
            "kv_peak_bytes": run.mem["kv_peak"],
            "resident_after_chunk_bytes": max(run.resident, default=0),
            "peak_above_baseline_bytes": run.peak,
        },
    )
    del runs
    gc.collect()
    return rows, head_ms


def decode_rows(model, runs: dict, specs, decode: int, block: int, extra) -> tuple:
    """Interleaved decode turns of ``runs`` (and :class:`Head`'s: the non-layer cost) -> (one row per spec with
    ``extra(spec, run)``'s fields, head ms per token); closes the runs."""
    runs["head"] = Head(model)
    turns = specs + ["head"]
    for turn in range(max(1, decode // block)):
        for s in turns[turn % len(turns) :] + turns[: turn % len(turns)]:
            runs[s].decode_turn(block)
    head_ms = 1e3 * statistics.median(runs.pop("head").decode_wall)
    rows = []
    for s in specs:
        run = runs[s]
        run.close()
        rows.append(
            {
                "spec": s,
                **extra(s, run),
                "decode_tps": 1.0 / statistics.median(run.decode_wall),
                "decode_ms": 1e3 * statistics.median(run.decode_wall),
                "decode_cpu_ms": 1e3 * statistics.median(run.decode_cpu),
                "decode_turns_ms": [1e3 * x for x in run.decode_wall],
                "decode_turns_cpu_ms": [1e3 * x for x in run.decode_cpu],
                "load": os.getloadavg()[0],
            }
        )
    return rows, head_ms


def paired(ref: dict, row: dict, key: str = "decode_turns_ms") -> dict:
    """Decode speed of ``row`` relative to ``ref`` turn by turn (the two ran within one turn of the methods, so a load
    change between turns cancels): median and quartiles over turns of ``ref_ms / row_ms`` (``key``: wall or CPU)."""
    q = sorted(a / b for a, b in zip(ref[key], row[key]))
    at = lambda f: q[min(len(q) - 1, int(f * len(q)))]  # noqa: E731
    return {"median": statistics.median(q), "q25": at(0.25), "q75": at(0.75), "turns": len(q)}


def annotate(rows, prompt_len, chunk, per_token, layers, real_layers, head_ms):
    """Ratios side by side (to the full cache and to RotatingKVCache at the same budget) and the memory bound."""
    for r in rows:
        budget = int(r["spec"].rpartition("budget=")[2]) if "budget=" in r["spec"] else None
        r.update(
            method=r["spec"].partition(":")[0], budget=budget, ratio=None if budget is None else prompt_len / budget
        )
        r["decode_ms_per_layer"] = (r["decode_ms"] - head_ms) / layers
        r["decode_tps_at_real_depth"] = 1e3 / (head_ms + real_layers * r["decode_ms_per_layer"])
    full = next(r for r in rows if r["spec"] == "full")
    prefilled = "prefill_tps" in full  # rows of measure() (prefill and decode), else of measure_context()
    for r in rows:
        r["decode_vs_full"] = r["decode_tps"] / full["decode_tps"]
        r["decode_cpu_vs_full"] = full["decode_cpu_ms"] / r["decode_cpu_ms"]
        r["decode_per_layer_vs_full"] = full["decode_ms_per_layer"] / r["decode_ms_per_layer"]
        r["decode_vs_full_at_real_depth"] = r["decode_tps_at_real_depth"] / full["decode_tps_at_real_depth"]
        r["decode_vs_full_paired"] = paired(full, r)
        r["decode_cpu_vs_full_paired"] = paired(full, r, "decode_turns_cpu_ms")
        if prefilled:
            r["prefill_vs_full"] = r["prefill_tps"] / full["prefill_tps"]
            r["prefill_cpu_vs_full"] = full["prefill_cpu_ms_per_token"] / r["prefill_cpu_ms_per_token"]
        if r["budget"] is None:
            continue
        rot = next((x for x in rows if x["method"] == "rotating" and x["budget"] == r["budget"]), None)
        if rot is not None:
            r["decode_vs_rotating_paired"] = paired(rot, r)
            r["decode_cpu_vs_rotating_paired"] = paired(rot, r, "decode_turns_cpu_ms")
            r["decode_vs_rotating"] = r["decode_tps"] / rot["decode_tps"]
            r["decode_cpu_vs_rotating"] = rot["decode_cpu_ms"] / r["decode_cpu_ms"]
            r["decode_per_layer_vs_rotating"] = rot["decode_ms_per_layer"] / r["decode_ms_per_layer"]
            if prefilled:
                r["prefill_vs_rotating"] = r["prefill_tps"] / rot["prefill_tps"]
                r["prefill_cpu_vs_rotating"] = rot["prefill_cpu_ms_per_token"] / r["prefill_cpu_ms_per_token"]
        if prefilled:
            bound = (r["budget"] + chunk) * per_token * layers
            r["kv_bound_bytes"] = bound
            r["kv_peak_vs_bound"] = r["kv_peak_bytes"] / bound
            r["full_kv_peak_vs_bound"] = full["kv_peak_bytes"] / bound
    return rows


def print_table(rows, prompt_len):
    print(
        f"\ncontext {prompt_len}: decode tokens/s (ratios to full | to rotating at the budget); prefill tokens/s, "
        "KV at its largest in prefill (x of budget + chunk), process peak above baseline"
    )
    for r in rows:
        pr = r.get("decode_vs_rotating_paired")
        vs_rot = (
            f" | x{r['decode_vs_rotating']:.2f}, paired x{pr['median']:.2f} [{pr['q25']:.2f}, {pr['q75']:.2f}], "
            f"CPU x{r['decode_cpu_vs_rotating']:.2f}, per layer x{r['decode_per_layer_vs_rotating']:.2f}"
            if pr
            else ""
        )
        pf = r["decode_vs_full_paired"]
        line = (
            f"  {r['spec']:24} decode {r['decode_tps']:6.2f} (x{r['decode_vs_full']:.2f}, paired "
            f"x{pf['median']:.2f}, per layer x{r['decode_per_layer_vs_full']:.2f}, at depth "
            f"x{r['decode_vs_full_at_real_depth']:.2f}{vs_rot})  per layer {r['decode_ms_per_layer']:6.1f} ms"
        )
        if "prefill_tps" in r:
            kv = f" ({r['kv_peak_vs_bound']:.2f}x bound)" if "kv_peak_vs_bound" in r else ""
            line += (
                f"  prefill {r['prefill_tps']:8.1f} (x{r['prefill_vs_full']:.2f}, CPU "
                f"x{r['prefill_cpu_vs_full']:.2f})  KV {r['kv_peak_bytes'] / 2**20:7.1f} MiB{kv}  peak "
                f"{r['peak_above_baseline_bytes'] / 2**20:6.0f} MiB"
            )
        print(line, flush=True)


def plot(blocks, path: Path, title: str) -> None:
    """Per prompt length (context): decode and (when measured) prefill tokens/s as ratios to the full cache, one bar
    per (method, budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("decode_vs_full", "decode")] + (
        [("prefill_vs_full", "prefill")] if all("prefill_vs_full" in r for b in blocks for r in b["rows"]) else []
    )
    fig, axes = plt.subplots(len(blocks), len(keys), figsize=(6 * len(keys), 3.2 * len(blocks)), squeeze=False)
    colors = {"rotating": "tab:gray", "h2o": "tab:blue", "cam": "tab:orange"}
    for row_axes, b in zip(axes, blocks):
        rows = [r for r in b["rows"] if r["budget"] is not None]
        ratios = sorted({r["ratio"] for r in rows})
        for j, m in enumerate(("rotating", "h2o", "cam")):
            sel = [next((r for r in rows if r["method"] == m and r["ratio"] == q), None) for q in ratios]
            xs = [i + (j - 1) * 0.27 for i in range(len(ratios))]
            for ax, (key, _) in zip(row_axes, keys):
                ax.bar(xs, [0 if r is None else r[key] for r in sel], 0.27, color=colors[m], label=m)
        for ax, (_, what) in zip(row_axes, keys):
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks(range(len(ratios)), [f"{q:g}x" for q in ratios])
            ax.set(ylabel=f"{what} tok/s / full", title=f"{title}, context {b['prompt']}: {what}")
        row_axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(payload) -> str:
    """The markdown tables of a result file of :func:`main` (docs/results/speed.md): per context, each method's
    prefill and decode tokens/s with their ratios to the full cache and to RotatingKVCache at the same budget, and
    the KV bytes at their largest during prefill against the bound (budget + chunk) of K/V; for ``--layer-prefill``,
    one layer's prefill seconds and speed relative to the full cache."""
    out = []
    for b in payload["blocks"]:
        if "layer_prefill" in b:  # --layer-prefill: one layer's prefill, seconds and speed relative to full
            c, f = b["layer_prefill"], b["layer_prefill"]["full"]
            out += [
                f"\n{payload['config']}, one layer's prefill of {b['prompt']} tokens in chunks of {payload['chunk']}, "
                f"median of {payload.get('rounds', 1)} rounds (load {b.get('load', [float('nan')])[0]:.1f})\n",
                "| method | wall s | x full | CPU s | x full (CPU) |",
                "| --- | --- | --- | --- | --- |",
            ]
            out += [
                f"| {s} | {v['wall_s']:.2f} | {f['wall_s'] / v['wall_s']:.2f} | {v['cpu_s']:.2f} | "
                f"{f['cpu_s'] / v['cpu_s']:.2f} |"
                for s, v in c.items()
            ]
            continue
        pre = "prefill_tps" in b["rows"][0]
        rot = any("decode_vs_rotating_paired" in r for r in b["rows"])
        load = b.get("load", payload.get("load_avg", {}).get("end", [float("nan")]))[0]
        out.append(
            f"\n{payload['config']}, {payload['layers']} of {payload['real_layers']} layers, context {b['prompt']}"
            f" (load {load:.1f}; head {b['head_ms']:.0f} ms per token)\n"
        )
        head = "| method | ratio |"
        head += " prefill tok/s | x full (wall, CPU) | x rotating (wall, CPU) |" if pre else ""
        head += " decode tok/s | x full (paired, CPU) | x full at real depth |" + (
            " x rotating (paired, CPU) |" if rot else ""
        )
        head += " KV peak in prefill (MiB) | x bound |" if pre else ""
        out += [head, "|" + " --- |" * (head.count("|") - 1)]
        for r in b["rows"]:
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:g}x"
            cells = [r["method"] if r["budget"] is None else f"{r['method']} ({r['budget']})", ratio]
            if pre:
                cells += [f"{r['prefill_tps']:.1f}", f"{r['prefill_vs_full']:.2f}, {r['prefill_cpu_vs_full']:.2f}"]
                cells += [
                    f"{r['prefill_vs_rotating']:.2f}, {r['prefill_cpu_vs_rotating']:.2f}"
                    if "prefill_vs_rotating" in r
                    else "-"
                ]
            fp = r["decode_vs_full_paired"]["median"]
            cells += [
                f"{r['decode_tps']:.3f}",
                f"{fp:.2f}, {r['decode_cpu_vs_full']:.2f}",
                f"{r['decode_vs_full_at_real_depth']:.2f}",
            ]
            rp = r.get("decode_vs_rotating_paired")
            cells += [f"{rp['median']:.2f}, {r['decode_cpu_vs_rotating']:.2f}" if rp else "-"] if rot else []
            if pre:
                cells += [f"{r['kv_peak_bytes'] / 2**20:.1f}"]
                cells += [
                    f"{r['kv_peak_vs_bound']:.2f} (full {r['full_kv_peak_vs_bound']:.2f})"
                    if "kv_peak_vs_bound" in r
                    else "-"
                ]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def machine(load: dict) -> dict:
    """The load on the machine while the benchmark ran (1, 5 and 15 minute load averages at its start and after
    the last prompt length) and its CPU count: the ratios are paired against load, the absolute numbers are not."""
    return {"load_avg": dict(load), "cpu_count": os.cpu_count()}


def main(argv=None):
    p = parser(__doc__, rounds=1, rounds_help="prefill rounds per method (median)")
    p.add_argument("--config", default="llama3.2-1b", choices=[c for c in CONFIGS if c != "tiny"])
    p.add_argument("--layers", type=int, default=4, help="layers built (the config's real count is far more)")
    p.add_argument("--prompts", default="2048", help="comma-separated prompt lengths")
    p.add_argument("--ratios", default="2,4,8,16", help="comma-separated compression ratios: budget = prompt / ratio")
    p.add_argument(
        "--methods",
        default="rotating,h2o,cam",
        help="methods run at each budget, besides full (';'-separated when one has fields, e.g. "
        "'cam;cam:kv_bits=4;quantized:bits=4': mlx-lm's QuantizedKVCache holding every token)",
    )
    p.add_argument("--chunk", type=int, default=2048, help="prefill_step_size")
    p.add_argument("--decode", type=int, default=16, help="decode tokens timed per method")
    p.add_argument("--block", type=int, default=4, help="tokens per method per interleaved decode turn")
    p.add_argument(
        "--context",
        default="",
        help="comma-separated context lengths: decode only, from caches filled with random K/V to that "
        "context (no prefill), at any depth",
    )
    p.add_argument(
        "--layer-prefill",
        action="store_true",
        help="only the per-layer prefill diagnostic (one decoder layer over the prompt, chunk by chunk)",
    )
    p.add_argument(
        "--markdown", default="", help="print the markdown tables of this result file (docs/results/speed.md) and stop"
    )
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return
    if args.smoke:
        args.config, args.layers, args.prompts, args.ratios = "tiny", 2, "64,128", "4,8"
        args.chunk, args.decode, args.block = 32, 4, 2
    prompts = [int(x) for x in (args.context or args.prompts).split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    model = build_model(args.config, args.layers)
    real_layers = CONFIGS[args.config][2]
    per_token = kv_bytes_per_token(model)
    print(
        f"{args.config}: {args.layers} of {real_layers} layers, fp32, K/V {per_token} B per token per layer", flush=True
    )
    warm = mx.random.randint(0, 97, (40,), key=mx.random.key(1))
    for s in ("full", "rotating:budget=16", "h2o:budget=16", "cam:budget=16"):  # compiled graphs traced once
        w = Run(model, s, warm, 16, 4)
        w.prefill(), w.decode_turn(2), w.close()
    family, fields, _ = CONFIGS[args.config]
    kind = "_context" if args.context else "_layer_prefill" if args.layer_prefill else ""
    shape = "" if args.smoke else f"_{args.config}" + ("" if args.layer_prefill else f"_{args.layers}L")
    shape += "" if args.smoke else "_" + "-".join(f"{P // 1024}k" for P in prompts)
    name = result_name(f"real_shapes{kind}{shape}", args)  # real_shapes[_context|_layer_prefill]_<config>_<N>L_<P>
    load = {"start": os.getloadavg()}
    blocks = []
    for P in prompts:
        prompt = mx.random.randint(0, CONFIGS[args.config][1]["vocab_size"], (P,), key=mx.random.key(P))
        specs = ["full"]
        for q in ratios:
            budget = int(P / q)
            methods = args.methods.split(";" if ";" in args.methods else ",")  # ';' when a method has fields
            specs += [m if m.startswith("quantized:") else with_budget(m, budget) for m in methods]
        print(f"prompt {P}: {', '.join(specs)}", flush=True)
        if args.layer_prefill:
            costs = layer_prefill(model, specs, P, args.chunk, args.rounds)
            for s in specs:
                c, f = costs[s], costs["full"]
                print(
                    f"  one layer's prefill {s:24} wall {c['wall_s']:7.2f} s (x{f['wall_s'] / c['wall_s']:.2f} of "
                    f"full's speed)  CPU {c['cpu_s']:7.2f} s (x{f['cpu_s'] / c['cpu_s']:.2f})",
                    flush=True,
                )
            blocks.append({"prompt": P, "layer_prefill": costs, "load": os.getloadavg()})
            load["end"] = os.getloadavg()
            payload = {"config": args.config, "chunk": args.chunk, "rounds": args.rounds, "blocks": blocks}
            out = write_json(name, {**payload, **machine(load)}, Path(args.out))
            continue
        if args.context:
            rows, head_ms = measure_context(model, P, specs, args.decode, args.block)
        else:
            rows, head_ms = measure(model, prompt, specs, args.chunk, args.decode, args.block, args.rounds)
        rows = annotate(rows, P, args.chunk, per_token, args.layers, real_layers, head_ms)
        print(f"head (embedding, final norm, LM head, sampling): {head_ms:.1f} ms per token")
        print_table(rows, P)
        blocks.append({"prompt": P, "head_ms": head_ms, "rows": rows, "load": os.getloadavg()})
        load["end"] = os.getloadavg()
        payload = {
            "config": args.config,
            "family": family,
            "config_fields": fields,
            "layers": args.layers,
            "real_layers": real_layers,
            "dtype": "float32",
            "chunk": args.chunk,
            "decode": args.decode,
            "block": args.block,
            "rounds": args.rounds,
            "kv_bytes_per_token_layer": per_token,
            "context_mode": bool(args.context),
            "blocks": blocks,
            **machine(load),
        }
        out = write_json(name, payload, Path(args.out))  # after every prompt length: a long run keeps what it has
    if not args.layer_prefill:
        plot(blocks, Path(args.out) / f"{name}.png", f"{args.config} ({args.layers} layers)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
