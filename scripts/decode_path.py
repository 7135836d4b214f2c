"""Count what one steady-state decode eviction runs: ``python scripts/decode_path.py [config]`` (default H2O).

Feeds a prompt, then decode steps past the cut, the checked evictions and the first traces, and profiles the next
``update_and_fetch``: the kvpolicy files whose Python runs in it, and the deepest chain of named functions below it
(a comprehension or lambda counts as part of the function that holds it; what ``mx.compile`` traced once does not
run again). docs/architecture.md reports these numbers.
"""

import collections
import sys

import mlx.core as mx

from kvpolicy_core.cache.policy_cache import PolicyCache

config = sys.argv[1] if len(sys.argv) > 1 else "h2o:budget=16,n_sink=1"
mx.random.seed(0)
cache = PolicyCache(config)
k, v = mx.random.normal((1, 2, 40, 8)), mx.random.normal((1, 2, 40, 8))
cache.update_and_fetch(k[:, :, :30], v[:, :, :30])
cache._attended = cache._observed = True  # driven without a model: the attention hook's part is not measured
for i in range(30, 39):
    cache.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    cache._attended = cache._observed = True
    mx.eval(cache.scores)
frames, depth = [], [0]


def profile(frame, event, _arg):
    if event == "call":
        depth[0] += 1
        if "kvpolicy" in frame.f_code.co_filename:
            frames.append((depth[0], frame.f_code.co_filename.split("/src/")[-1], frame.f_code.co_name))
    elif event == "return":
        depth[0] -= 1


sys.setprofile(profile)
cache.update_and_fetch(k[:, :, 39:40], v[:, :, 39:40])
sys.setprofile(None)
stack, deepest, chain = [], 0, []
for d, f, name in frames:
    while stack and stack[-1][0] >= d:
        stack.pop()
    stack.append((d, name, f))
    named = [(n, f) for _, n, f in stack[1:] if not n.startswith("<")]
    if len(named) > deepest:
        deepest, chain = len(named), named
files = collections.Counter(f for _, f, _ in frames)
print(f"{config}: {len(files)} files, {deepest} named call levels below update_and_fetch")
print("deepest:", " -> ".join(f"{n} ({f.split('/')[-1]})" for n, f in chain))
for f, n in files.most_common():
    print(f"  {f}: {n} calls")
