"""Process B of the resume tests: restore policy caches saved by another process and continue them.

Usage: ``python resume_driver.py ROUTE DIR``. DIR holds what process A wrote (``tests/test_resume.py``):
the model directory ``model/`` and, per method i of :data:`METHODS`, the caches saved by every route.
For each method this process loads the model from disk, restores the caches by ROUTE, runs the
:data:`CONTINUE` decode steps and writes their logits to ``DIR/<ROUTE>.npz`` (key: the method's index),
or the error that refused the restore to ``DIR/<ROUTE>.<i>.refused``. One process per route for every
method keeps the suite fast (each start imports mlx-lm).
"""

from __future__ import annotations

import copy
import gc
import json
import pickle
import sys
from pathlib import Path

#: every shipped method: H2O and CaM (observed signal: the hook), random, and CaM merging every loser
#: (min_sim=-1), so its slots carry nonzero log-weights when saved; on Gemma 3 (sliding-window layers)
METHODS = (
    "h2o:budget=16,n_sink=2",
    "cam:budget=16,n_sink=2",
    "random:budget=16,n_sink=2,salt=3",
    "cam:budget=16,n_sink=2,min_sim=-1,allocation=uniform",  # 16 in the global layers too: merges happen
)
PROMPT = (20, 13)  # chunk sizes of the prompt (the second chunk evicts)
DECODE = 5  # decode steps before saving (a pending eviction is saved)
CONTINUE = 6  # decode steps after restoring, compared exactly
ROUTES = ("load_caches", "pickle", "deepcopy", "prompt_cache", "from_state")
#: routes that save the settled state (mlx-lm's protocol): process A's reference continues after that save
SETTLED = ("prompt_cache", "from_state")


def tokens():
    import mlx.core as mx

    return mx.random.randint(3, 97, (1, sum(PROMPT) + DECODE + CONTINUE), key=mx.random.key(11))


def load_model(directory: Path):
    from mlx_lm.utils import load_model as load

    return load(Path(directory) / "model")[0]


def continuation(model, caches):
    """Logits [1, CONTINUE, V] of the decode steps after the save point, as a numpy array."""
    import mlx.core as mx
    import numpy as np

    toks, start = tokens(), sum(PROMPT) + DECODE
    out = mx.concatenate([model(toks[:, t : t + 1], cache=caches) for t in range(start, start + CONTINUE)], axis=1)
    mx.eval(out)
    return np.array(out)


def restore(route: str, directory: Path, i: int, model):
    """Method i's caches, restored by ``route`` from what process A saved."""
    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache

    from kvpolicy_core import PolicyCache, load_caches

    d = Path(directory)
    if route == "load_caches":
        return load_caches(d / f"{i}.caches.safetensors", model=model)
    if route == "pickle":
        return pickle.loads((d / f"{i}.pickle").read_bytes())
    if route == "deepcopy":
        loaded = load_caches(d / f"{i}.caches.safetensors")
        copies = copy.deepcopy(loaded)
        del loaded
        gc.collect()  # the copies alone hold the attention hook now
        return copies
    if route == "prompt_cache":
        return load_prompt_cache(str(d / f"{i}.prompt.safetensors"))
    if route == "from_state":
        arrays, meta = mx.load(str(d / f"{i}.states.safetensors"), return_metadata=True)
        layers = json.loads(meta["layers"])
        return [
            PolicyCache.from_state(
                tuple(arrays.get(f"{j}.{k}") for k in range(4))
                + (m,)
                + ((arrays[f"{j}.5"],) if f"{j}.5" in arrays else ())
            )
            for j, m in enumerate(layers)
        ]
    raise ValueError(f"unknown route {route!r}")


def save_states(path: Path, caches) -> None:
    """Every cache's ``state`` (settled) to one file that :func:`restore`'s ``from_state`` route reads."""
    import mlx.core as mx

    arrays, metas = {}, []
    for j, c in enumerate(caches):
        state = c.state
        metas.append(state[4])
        for k, x in enumerate(state):
            if isinstance(x, mx.array):
                arrays[f"{j}.{k}"] = x
    mx.save_safetensors(str(path), arrays, metadata={"layers": json.dumps(metas)})


def main() -> int:
    from kvpolicy_core.runtime.blas import load_optimized_blas

    load_optimized_blas(quiet=True)  # before mlx, as the test process (conftest.py): the same matmul results
    import numpy as np

    from kvpolicy_core import KVPolicyError

    route, directory = sys.argv[1], Path(sys.argv[2])
    model = load_model(directory)
    out = {}
    for i in range(len(METHODS)):
        try:
            caches = restore(route, directory, i, model)
            out[str(i)] = continuation(model, caches)
        except KVPolicyError as exc:
            (directory / f"{route}.{i}.refused").write_text(f"{type(exc).__name__}: {exc}")
    np.savez(directory / f"{route}.npz", **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
