"""Measured KV memory through a long prompt: the peak during the prompt and the resident after it, per cache.

Each row runs in a process of its own (MLX's peak counter is per process): a model, a prompt of ``L`` tokens
through mlx-lm's ``generate_step`` (prefill step 512), 8 decode tokens. Reported, from MLX's allocator, above
the model's own memory: ``peak`` (``mx.get_peak_memory``) and ``resident`` after (``mx.get_active_memory``),
beside what the caches account for: ``kv_state_bytes`` (their kept K/V rows) and ``cache_bytes`` (a policy cache's
``nbytes``: its K/V rows and each slot's position, score and per-slot statistics). Rows: mlx-lm's ``KVCache``
(the 1.0x), its ``RotatingKVCache`` and ``QuantizedKVCache`` (``kv_bits`` 4 and 8), and kvpolicy methods at
``L / ratio``.

The default shape is KV-dominated (a random-weight 16-layer llama, hidden 512, 8 KV heads of 64, float32), as
in the measurement that opened this work; ``--model default|smollm2`` runs a real model instead.

    python benchmarks/memory.py --lengths 8192,16384 --methods "full;rotating;kv4;kv8;cam;cam:hold=2;cam:when=stream"
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _common import RESULTS, parser, result_name, write_json

ROWS = "full;rotating;kv4;kv8;cam;cam:hold=2;cam:hold=4;h2o;cam:when=stream"


def kv_shape_model():
    """The KV-dominated shape: 16 layers, hidden 512, 8 heads and 8 KV heads of 64, float32, random weights."""
    from kvpolicy_core.testing.tiny_models import build_model, model_config

    cfg = model_config("llama", hidden=512, layers=16, heads=8, kv_heads=8, intermediate=1024, vocab=1024)
    return build_model(cfg, seed=0)


def load(model_name: str):
    if model_name == "kv-shape":
        return kv_shape_model(), 1024
    import mlx_lm

    from kvpolicy_core.model.resolve import resolve_model_path

    model, tok = mlx_lm.load(str(resolve_model_path(None if model_name == "default" else model_name)))
    return model, tok.vocab_size if hasattr(tok, "vocab_size") else 32000


def caches_for(model, row: str, L: int, ratio: int):
    """(caches, kv_bits) for one row: mlx-lm's own caches, or a kvpolicy method at budget L / ratio."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from kvpolicy_core.integration.builder import KVCacheBuilder

    budget = L // ratio
    if row == "full":
        return [KVCache() for _ in model.layers], None
    if row == "native":  # the model's own caches (Gemma 3: RotatingKVCache on its sliding-window layers)
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(model), None
    if row == "rotating":
        return [RotatingKVCache(max_size=budget, keep=4) for _ in model.layers], None
    if row in ("kv4", "kv8"):
        return [KVCache() for _ in model.layers], int(row[2:])
    method, _, fields = row.partition(":")
    spec = f"{method}:budget={budget}" + (f",{fields}" if fields else "")
    return KVCacheBuilder.for_model(model, spec), None


def measure_row(model_name: str, row: str, L: int, ratio: int, step: int) -> dict:
    """One row in this process: peak and resident bytes above the model's memory."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, vocab = load(model_name)
    mx.eval(model.parameters())
    prompt = mx.random.randint(0, vocab, (L,), key=mx.random.key(0))
    mx.eval(prompt)
    caches, bits = caches_for(model, row, L, ratio)
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    kw = {} if bits is None else {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": 0}
    for _ in zip(
        generate_step(prompt, model, prompt_cache=caches, max_tokens=8, prefill_step_size=step, **kw), range(8)
    ):
        pass
    mx.eval([c.state for c in caches])
    peak, resident = mx.get_peak_memory() - base, mx.get_active_memory() - base
    from mlx.utils import tree_flatten

    kept = sum(int(a.nbytes) for c in caches for _, a in tree_flatten(list(c.state)[:2]) if isinstance(a, mx.array))
    # what the caches account for: a policy cache's buffers (K/V rows and each slot's position, score and the parts'
    # per-slot statistics); mlx-lm's caches hold their K/V only
    held = sum(int(getattr(c, "nbytes", 0)) for c in caches if hasattr(c, "policy"))
    held += sum(
        int(a.nbytes)
        for c in caches
        if not hasattr(c, "policy")
        for _, a in tree_flatten(list(c.state)[:2])
        if isinstance(a, mx.array)
    )
    return {"row": row, "length": L, "peak": peak, "resident": resident, "kv_state_bytes": kept, "cache_bytes": held}


def main(argv=None):
    p = parser(__doc__)
    p.add_argument("--model", default="kv-shape", help="kv-shape (default), default (Gemma 3 270M) or smollm2")
    p.add_argument("--lengths", default="8192", help="prompt lengths, comma-separated")
    p.add_argument("--ratio", type=int, default=8, help="compression of the budgeted rows: budget = length / ratio")
    p.add_argument(
        "--methods", default=ROWS, help="rows, ';'-separated (full, native, rotating, kv4, kv8, kvpolicy specs)"
    )
    p.add_argument("--prefill-step", type=int, default=512)
    p.add_argument("--row", default=None, help=argparse_hidden())
    args = p.parse_args(argv)
    if args.smoke:
        args.lengths, args.methods, args.model = "256", "full;kv4;cam;cam:hold=2", "kv-shape"
    if args.row is not None:  # a child: one row, printed as JSON
        L = int(args.lengths)
        print(json.dumps(measure_row(args.model, args.row, L, args.ratio, args.prefill_step)))
        return
    results = []
    for L in (int(x) for x in args.lengths.split(",")):
        full = None
        for row in args.methods.split(";"):
            cmd = [sys.executable, str(Path(__file__).resolve()), "--row", row, "--lengths", str(L)]
            cmd += ["--model", args.model, "--ratio", str(args.ratio), "--prefill-step", str(args.prefill_step)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            full = r if row == "full" else full
            if full is not None:
                r["peak_vs_full"] = r["peak"] / full["peak"]
                r["resident_vs_full"] = r["resident"] / full["resident"]
            results.append(r)
            write_json(result_name(f"memory_{args.model}", args), {"rows": results, "ratio": args.ratio}, args.out)
            print(
                f"{L:>6} {row:<22} peak {r['peak'] / 2**20:8.1f} MiB  resident {r['resident'] / 2**20:8.1f} MiB  "
                f"state {r['kv_state_bytes'] / 2**20:8.1f} MiB  cache {r.get('cache_bytes', 0) / 2**20:8.1f} MiB"
                + (f"  peak x{r['peak_vs_full']:.2f}" if full else ""),
                flush=True,
            )
    print(f"wrote {RESULTS_OF(args)}")


def RESULTS_OF(args) -> Path:
    """Where the rows are written (after each row: a run stopped part-way keeps what it measured)."""
    return Path(args.out or RESULTS) / f"{result_name(f'memory_{args.model}', args)}.json"


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
