"""MLX fp32 matmul on Linux CPU with each BLAS this machine offers, side by side with numpy's.

    python benchmarks/blas_speedup.py            # matmul 1024^3 per BLAS + numpy, default-model decode
    python benchmarks/blas_speedup.py --smoke    # matmul 256^3 only

Each MLX measurement runs in a fresh subprocess (the BLAS must be chosen before mlx is
imported): MLX's bundled reference BLAS (``KVPOLICY_BLAS=off``), what
``load_optimized_blas()`` picks on its own ("auto"), and every candidate it knows
(``KVPOLICY_BLAS=<path>``), each only after the candidate passed kvpolicy's CPU check:
nothing unproven is ever loaded. Rounds are interleaved so a busy machine slows every
configuration alike; the best round counts. numpy's matmul (its own OpenBLAS) runs in this
process as the yardstick. Target: auto >= 50 GFLOP/s and within 20% of numpy.
Writes benchmarks/results/blas_speedup.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from _harness import Stopwatch, interleave, parser, result_name, write_json  # not _common: no BLAS loaded here

PROBE = r"""
import json, sys, time
from kvpolicy_core.runtime.blas import blas_info, load_optimized_blas
load_optimized_blas(quiet=True)
import mlx.core as mx
n, decode = int(sys.argv[1]), int(sys.argv[2])
a = mx.random.normal((n, n)); b = mx.random.normal((n, n)); mx.eval(a, b)
mx.eval(a @ b)
t = time.perf_counter(); reps = 5
for _ in range(reps):
    mx.eval(a @ b)
info = blas_info()
out = {"blas": info.get("path"), "core": info.get("corename"), "threads": info.get("threads"),
       "gflops": 2 * n**3 * reps / (time.perf_counter() - t) / 1e9}
if decode:
    import mlx_lm
    from kvpolicy_core.model.default import ensure_default_model
    model, tok = mlx_lm.load(str(ensure_default_model()))
    r = None
    for r in mlx_lm.stream_generate(model, tok, "The history of the Roman Empire", max_tokens=decode):
        pass
    out.update({"decode_tps": r.generation_tps, "prompt_tps": r.prompt_tps})
print(json.dumps(out))
"""


def measure(blas: str | None, n: int, decode: int = 0) -> dict:
    """One subprocess: ``blas`` None = auto, "off" = reference, else a library path."""
    env = dict(os.environ)
    env.pop("KVPOLICY_BLAS", None)
    if blas is not None:
        env["KVPOLICY_BLAS"] = blas
    proc = subprocess.run([sys.executable, "-c", PROBE, str(n), str(decode)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"measurement with KVPOLICY_BLAS={blas} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def numpy_gflops(n: int, reps: int = 5) -> float:
    import numpy as np

    a = np.random.standard_normal((n, n)).astype(np.float32)
    b = np.random.standard_normal((n, n)).astype(np.float32)
    a @ b
    sw = Stopwatch()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / sw.wall / 1e9


def proven_candidates() -> list:
    """(source, path) of every candidate that passes the CPU check; the others with reasons."""
    from kvpolicy_core.runtime import blas, blas_check

    flags = blas_check.cpu_flags()
    ok, rejected = [], []
    for source, path in blas.candidates():
        verdict, _ = blas._check(source, path, flags)
        (ok if verdict.get("ok") else rejected).append((source, path, verdict.get("reason")))
    return ok, rejected


def main():
    p = parser(__doc__, rounds=3, smoke_help="matmul 256^3 only", rounds_help="interleaved rounds (the best counts)")
    p.add_argument("--decode", type=int, default=32)
    args = p.parse_args()
    n, decode, rounds = (256, 0, 1) if args.smoke else (1024, args.decode, args.rounds)
    ok, rejected = proven_candidates()
    configs = {"reference": "off", "auto": None, **{f"{src}: {path}": path for src, path, _ in ok}}
    kinds = {name: (lambda blas=blas: measure(blas, n)) for name, blas in configs.items()}
    got = interleave({**kinds, "numpy": lambda: numpy_gflops(n)}, rounds)
    best = {name: max(got[name], key=lambda r: r["gflops"]) for name in configs}
    np_best = max(got["numpy"])
    result = {
        "matmul_n": n,
        "rounds": rounds,
        "cpu_count": os.cpu_count(),
        "numpy_gflops": np_best,
        "configs": best,
        "rejected": [{"source": s, "path": p, "reason": why} for s, p, why in rejected],
    }
    auto = best["auto"]["gflops"]
    result.update(
        matmul_speedup=auto / best["reference"]["gflops"],
        auto_vs_numpy=auto / np_best,
        target_met=bool(auto >= 50 and auto >= 0.8 * np_best),
    )
    print(f"fp32 matmul {n}^3, best of {rounds} interleaved rounds ({os.cpu_count()} cores):")
    for name, r in best.items():
        print(f"  {name:<70} {r['gflops']:8.1f} GFLOP/s  (core {r.get('core')}, threads {r.get('threads')})")
    print(f"  {'numpy (its own OpenBLAS)':<70} {np_best:8.1f} GFLOP/s")
    for s, path, why in rejected:
        print(f"  not loaded: {path} ({s}): {why}")
    print(
        f"auto = x{result['matmul_speedup']:.1f} the reference, {result['auto_vs_numpy']:.2f}x numpy; "
        f"target (>= 50 GFLOP/s and within 20% of numpy): {'met' if result['target_met'] else 'NOT met'}"
    )
    if decode:
        ref, opt = measure("off", n, decode), measure(None, n, decode)
        result.update(
            decode={
                "reference_tps": ref["decode_tps"],
                "auto_tps": opt["decode_tps"],
                "speedup": opt["decode_tps"] / ref["decode_tps"],
            }
        )
        print(
            f"default model decode: {ref['decode_tps']:.2f} -> {opt['decode_tps']:.2f} tok/s "
            f"(x{result['decode']['speedup']:.1f})"
        )
    print(f"wrote {write_json(result_name('blas_speedup', args), result, args.out)}")


if __name__ == "__main__":
    main()
