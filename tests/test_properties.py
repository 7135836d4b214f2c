"""Property-based tests (hypothesis) over every shipped method: the cache's invariants hold for
random budgets, sinks, recent windows, batch sizes, head counts, head dims and update sizes."""

import mlx.core as mx
import numpy as np
from helpers import SHIPPED_METHODS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpolicy_core import PolicyCache
from kvpolicy_core.testing.conformance import feed, random_kv

METHODS = SHIPPED_METHODS
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scenarios(draw):
    budget = draw(st.integers(4, 48))
    n_sink = draw(st.integers(0, min(4, budget - 2)))
    recent = draw(st.integers(0, budget - n_sink - 1))
    sizes = draw(st.lists(st.one_of(st.integers(1, 3), st.integers(1, 300)), min_size=1, max_size=12))
    return {
        "budget": budget,
        "n_sink": n_sink,
        "recent": recent,
        "sizes": sizes,
        "B": draw(st.integers(1, 3)),
        "H": draw(st.integers(1, 3)),
        "D": draw(st.sampled_from([4, 8, 16])),
        "seed": draw(st.integers(0, 2**16)),
    }


def config(method, s):
    sep = "," if ":" in method else ":"
    return f"{method}{sep}budget={s['budget']},n_sink={s['n_sink']},recent={s['recent']},seed={s['seed'] % 7}"


@SETTINGS
@given(scenarios(), st.sampled_from(METHODS))
def test_cache_invariants(s, method):
    total = sum(s["sizes"])
    keys, values = random_kv(B=s["B"], H=s["H"], S=total, D=s["D"], seed=s["seed"])
    cache = PolicyCache(config(method, s))
    seen = 0
    for S in s["sizes"]:
        kept_before = cache.tokens_kept
        (shape,) = feed(cache, keys[:, :, seen : seen + S], values[:, :, seen : seen + S], (S,), scale=0.5)
        seen += S
        assert shape == (s["B"], s["H"], kept_before + S, s["D"])  # retained + new
        assert cache.offset == seen  # offset = tokens seen
        # never above budget, but a prompt held for its cut (when="prompt_end", S > 1) is counted whole
        held = cache.holds_prompt and S > 1
        assert cache.tokens_kept == (kept_before + S if held else min(seen, s["budget"]))
        pos = np.array(cache.retained()[2])
        assert (np.diff(pos, axis=-1) > 0).all()  # positions strictly increase (temporal order)
        sinks = min(s["n_sink"], seen)
        assert (pos[..., :sinks] == np.arange(sinks)).all()  # sinks retained
        if s["recent"] > 0:
            assert (pos[..., -1] == seen - 1).all()  # the newest token is protected


@SETTINGS
@given(scenarios(), st.booleans())
def test_cam_drop_equals_h2o(s, gate):
    total = sum(s["sizes"])
    keys, values = random_kv(B=s["B"], H=s["H"], S=total, D=s["D"], seed=s["seed"])
    a, b = PolicyCache(config("h2o", s)), PolicyCache(config(f"cam:merge=drop,gate={gate}", s))
    for c in (a, b):
        feed(c, keys, values, s["sizes"])
    for x, y in zip(a.state[:4], b.state[:4]):
        assert mx.array_equal(x, y)


@SETTINGS
@given(scenarios())
def test_a_merge_conserves_total_score_mass(s):
    total = sum(s["sizes"])
    keys, values = random_kv(B=s["B"], H=s["H"], S=total, D=s["D"], seed=s["seed"])
    cache = PolicyCache(
        config("cam:min_sim=-1,prompt=true,cap=none", s)
    )  # every loser merges (no gate, threshold, cap)
    feed(cache, keys, values, s["sizes"])
    before = np.array(cache.scores).sum(axis=-1)
    cache.settle()  # budget > n_sink + recent leaves a non-sink survivor for every loser: all merge
    np.testing.assert_allclose(np.array(cache.scores).sum(axis=-1), before, rtol=1e-4, atol=1e-4)
