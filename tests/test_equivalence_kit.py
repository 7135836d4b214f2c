"""The equivalence kit cannot pass vacuously: a phase in which nothing was evicted fails naming why; hostile
arguments are refused naming the argument; layers="unbounded" runs both phases in either order."""

import pytest
from helpers import tiny_gemma3

from kvpolicy_core.testing.equivalence import assert_equivalent


def test_a_budget_above_the_sequence_fails_naming_why():
    with pytest.raises(AssertionError, match=r"one sequence: nothing was evicted \(budgets \[64\], 35 tokens seen\)"):
        assert_equivalent("h2o:budget=64,n_sink=2", "h2o:budget=64,n_sink=2,recent=1")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(rows=0), "rows must be an int in"),
        (dict(rows=26), "rows must be an int in"),
        (dict(decode_steps=-3), "decode_steps must be an int >= 1"),
        (dict(decode_steps=0), "decode_steps must be an int >= 1"),
        (dict(prompt_chunks=()), "prompt_chunks must be a non-empty"),
        (dict(prompt_chunks=(7, 0, 5)), "prompt_chunks must be a non-empty"),
        (dict(prompt_chunks=(7, -2)), "prompt_chunks must be a non-empty"),
        (dict(seed=-1), "seed must be an int >= 0"),
        (dict(rows=1.5), "rows must be an int in"),
    ],
)
def test_hostile_arguments_are_refused_naming_the_argument(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        assert_equivalent("h2o:budget=12,n_sink=2", "h2o:budget=12,n_sink=2", **kwargs)


@pytest.mark.parametrize("order", ["unbounded first", "all first"])
def test_layers_unbounded_against_all_fails_naming_the_layer_in_either_order(order):
    """On a sliding-window model, "unbounded" keeps mlx-lm's RotatingKVCache where "all" keeps a policy cache."""
    pair = ["h2o:budget=12,n_sink=2,layers=unbounded", "h2o:budget=12,n_sink=2"]
    pair = pair if order == "unbounded first" else pair[::-1]
    with pytest.raises(AssertionError, match=r"layer 0: the first method keeps .*, the second "):
        assert_equivalent(*pair, model=tiny_gemma3())


def test_layers_unbounded_on_both_sides_runs_the_batched_phase():
    """Both keep mlx-lm's cache on the sliding layers: batched by mlx-lm's merge, compared through the logits; a
    different policy on the global layers is found in the batched phase too."""
    model = tiny_gemma3()
    assert_equivalent(
        "h2o:budget=12,n_sink=2,layers=unbounded", "cam:budget=12,n_sink=2,layers=unbounded,merge=drop", model=model
    )
    with pytest.raises(AssertionError, match="differ"):
        assert_equivalent(
            "h2o:budget=12,n_sink=2,layers=unbounded", "h2o:budget=12,n_sink=4,layers=unbounded", model=model
        )
