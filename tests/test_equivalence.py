"""Cross-policy equivalence: CaM with merge="drop" is H2O bit for bit, whatever the gate."""

import mlx.core as mx
import pytest
from helpers import feed, random_kv

from kvpolicy_core import PolicyCache, attach, build_policy, detach
from kvpolicy_core.testing.equivalence import assert_equivalent

GATES = ["gate=true", "gate=false"]


@pytest.mark.parametrize("gate", GATES)
def test_primitive_level(gate):
    h2o = build_policy("h2o:budget=12,n_sink=2,signal=proxy")
    cam = build_policy(f"cam:budget=12,n_sink=2,merge=drop,{gate},signal=proxy")
    merged = build_policy(f"cam:budget=12,n_sink=2,merge=mean,{gate},signal=proxy")
    assert type(cam.disposition) is type(h2o.disposition)  # swapping one hook is the whole difference
    K, V = random_kv(B=2, H=3, S=20, D=8, seed=1)
    caches = [PolicyCache(p) for p in (h2o, cam, merged)]
    for c in caches:
        c.update_and_fetch(K, V)
    views = [c._view(0) for c in caches]
    losers = [c._step.choose(v, 8) for c, v in zip(caches, views)]
    assert mx.array_equal(losers[0], losers[1]) and mx.array_equal(losers[0], losers[2])
    for c in caches:
        c.settle()  # the 8 losers leave; drop leaves every survivor as it was
    for x, y in zip(caches[0].state[:4], caches[1].state[:4]):
        assert mx.array_equal(x, y)
    assert not mx.array_equal(caches[0].state[1], caches[2].state[1])  # a merge does change survivors


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("chunks", [[1] * 60, [25, 1, 1, 33], [7] * 8 + [1] * 4])
@pytest.mark.parametrize("signal", ["proxy", "observed"])
def test_cache_level(gate, chunks, signal):
    K, V = random_kv(B=2, H=2, S=60, D=8, seed=3)
    Q = mx.random.normal((2, 4, 60, 8), key=mx.random.key(5))
    caches = [
        PolicyCache(f"h2o:budget=16,n_sink=2,signal={signal}"),
        PolicyCache(f"cam:budget=16,n_sink=2,merge=drop,{gate},signal={signal},seed=9"),
    ]
    for c in caches:
        feed(c, K, V, chunks, Q, 0.35)
    a, b = (c.state[:4] for c in caches)
    for x, y in zip(a, b):
        assert mx.array_equal(x, y)


@pytest.mark.parametrize("gate", GATES)
def test_generated_tokens_are_identical(tiny_model_dir, gate):
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_model_dir))
    prompt = "a prompt that is quite a bit longer than the budget of sixteen tokens"
    outputs = []
    for method in ("h2o:budget=16,n_sink=2,signal=observed", f"cam:budget=16,n_sink=2,merge=drop,{gate}"):
        attach(model, method)
        outputs.append([r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=24)])
        detach(model)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 24
    attach(model, "cam:budget=16,n_sink=2,min_sim=-1,prompt=true,cap=none")  # a merge that merges every loser
    merged = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=24)]
    detach(model)
    assert merged != outputs[0]  # the comparison can tell policies apart


# ---------------------------------------------------------------- the public kit (kvpolicy_core.testing.equivalence)
@pytest.mark.parametrize("gate", GATES)
def test_the_kit_finds_cam_with_drop_to_be_h2o_over_chunks_decode_and_batched_rows(gate):
    assert_equivalent(f"cam:budget=12,n_sink=2,merge=drop,{gate}", "h2o:budget=12,n_sink=2")


def test_the_kit_tells_a_merging_cam_from_h2o_naming_where():
    with pytest.raises(AssertionError, match=r"(one sequence|batched rows).*(logits|layer \d+: kept)"):
        assert_equivalent("cam:budget=12,n_sink=2,min_sim=-1,prompt=true,cap=none", "h2o:budget=12,n_sink=2")
