"""Decode-step cost of validating part outputs (issue 13): the same cache with validation on and off, alternated; prints ms/step."""
import time, sys
import mlx.core as mx
from kvpolicy_core import PolicyCache
from kvpolicy_core.policy_step import PolicyStep
from kvpolicy_core.testing import random_kv

orig = PolicyStep._raise_broken
def unchecked(self, pending):  # the value checks are built but never evaluated (no host sync): every update applies
    return [[1]] * len(pending)

def run(method, steps=600):
    K, V = random_kv(B=1, H=8, S=256 + steps, D=64, seed=1)
    c = PolicyCache(method)
    k, v = c.update_and_fetch(K[:, :, :256], V[:, :, :256]); mx.eval(k, v, c.scores)
    t = time.perf_counter()
    for i in range(256, 256 + steps):
        k, v = c.update_and_fetch(K[:, :, i:i+1], V[:, :, i:i+1])
        mx.eval(k, v)
    return (time.perf_counter() - t) / steps * 1e3

for method in ("h2o:budget=256", "cam:budget=256"):
    res = {"on": [], "off": []}
    for rep in range(3):
        for mode in ("on", "off"):
            PolicyStep._raise_broken = orig if mode == "on" else unchecked
            res[mode].append(run(method))
    on, off = min(res["on"]), min(res["off"])
    print(f"{method}: ms/step validated {on:.3f}, unvalidated {off:.3f}, ratio {on/off:.3f}")
