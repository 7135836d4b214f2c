"""Decode-step cost of value-checking every disposition update (one host sync each) against the cache's default
(the first few decode evictions checked, the rest guarded on the device): the same cache both ways, alternated.

    python benchmarks/validation_cost.py [--rounds 3] [--steps 600]
    python benchmarks/validation_cost.py --smoke

Prints ms/step (the best of the interleaved rounds) and writes benchmarks/results/validation_cost.json.
"""

from __future__ import annotations

from _common import Stopwatch, interleave, mx, parser, result_name, write_json  # the BLAS first

from kvpolicy_core import PolicyCache  # noqa: E402
from kvpolicy_core.testing.conformance import random_kv  # noqa: E402


def ms_per_step(method: str, steps: int, validated: bool, prompt: int = 256) -> float:
    K, V = random_kv(B=1, H=8, S=prompt + steps, D=64, seed=1)
    c = PolicyCache(method)
    c._step.checked_decode = 10**9 if validated else 0  # every decode eviction checked, or none
    k, v = c.update_and_fetch(K[:, :, :prompt], V[:, :, :prompt])
    c.before_attention(K[:, :, :prompt], 64**-0.5, "causal")  # the attention hook, queries = keys
    mx.eval(k, v, c.scores)
    sw = Stopwatch()
    for i in range(prompt, prompt + steps):
        k, v = c.update_and_fetch(K[:, :, i : i + 1], V[:, :, i : i + 1])
        c.before_attention(K[:, :, i : i + 1], 64**-0.5, None)
        mx.eval(k, v)
    return sw.wall / steps * 1e3


def main() -> None:
    p = parser(__doc__, rounds=3, rounds_help="interleaved rounds (the best counts)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--budget", type=int, default=256)
    args = p.parse_args()
    if args.smoke:
        args.steps, args.budget, args.rounds = 20, 16, 1
    rows = []
    for method in (f"h2o:budget={args.budget}", f"cam:budget={args.budget}"):
        got = interleave(
            {
                mode: (lambda mode=mode: ms_per_step(method, args.steps, mode == "on", args.budget))
                for mode in ("on", "off")
            },
            args.rounds,
        )
        on, off = min(got["on"]), min(got["off"])
        rows.append({"spec": method, "validated_ms": on, "unvalidated_ms": off, "ratio": on / off, "rounds": got})
        print(f"{method}: ms/step validated {on:.3f}, unvalidated {off:.3f}, ratio {on / off:.3f}")
    print(f"wrote {write_json(result_name('validation_cost', args), {'steps': args.steps, 'rows': rows}, args.out)}")


if __name__ == "__main__":
    main()
