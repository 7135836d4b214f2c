"""The optimised-BLAS speed-up of MLX on Linux CPU: fp32 matmul and end-to-end decode, with and without.

    python benchmarks/blas_speedup.py            # matmul 1024^3 + default-model decode
    python benchmarks/blas_speedup.py --smoke    # matmul 256^3 only

Each measurement runs in a fresh subprocess (the BLAS must be chosen before mlx is imported):
``KVPOLICY_BLAS=off`` (MLX's bundled reference BLAS) versus kvpolicy's ``load_optimized_blas()``.
Writes benchmarks/results/blas_speedup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

PROBE = r"""
import json, sys, time
from kvpolicy_core.blas import load_optimized_blas
blas = load_optimized_blas(quiet=True)
import mlx.core as mx
n, decode = int(sys.argv[1]), int(sys.argv[2])
a = mx.random.normal((n, n)); b = mx.random.normal((n, n)); mx.eval(a, b)
mx.eval(a @ b)
t = time.perf_counter(); reps = 5
for _ in range(reps):
    mx.eval(a @ b)
gflops = 2 * n**3 * reps / (time.perf_counter() - t) / 1e9
out = {"blas": blas, "matmul_n": n, "gflops": gflops}
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


def measure(blas_off: bool, n: int, decode: int) -> dict:
    env = dict(os.environ)
    if blas_off:
        env["KVPOLICY_BLAS"] = "off"
    else:
        env.pop("KVPOLICY_BLAS", None)
    proc = subprocess.run([sys.executable, "-c", PROBE, str(n), str(decode)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args()
    n, decode = (256, 0) if args.smoke else (1024, args.decode)
    ref, opt = measure(True, n, decode), measure(False, n, decode)
    result = {"reference": ref, "optimised": opt, "matmul_speedup": opt["gflops"] / ref["gflops"]}
    if decode:
        result["decode_speedup"] = opt["decode_tps"] / ref["decode_tps"]
    print(f"fp32 matmul {n}^3: reference {ref['gflops']:.1f} GFLOP/s, optimised ({opt['blas']}) "
          f"{opt['gflops']:.1f} GFLOP/s -> x{result['matmul_speedup']:.1f}")
    if decode:
        print(f"default model decode: {ref['decode_tps']:.2f} -> {opt['decode_tps']:.2f} tok/s (x{result['decode_speedup']:.1f})")
    sys.path.insert(0, str(HERE))
    from _common import write_json

    print(f"wrote {write_json('blas_speedup' + ('_smoke' if args.smoke else ''), result, Path(args.out))}")


if __name__ == "__main__":
    main()
