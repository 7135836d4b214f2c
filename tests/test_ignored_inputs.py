"""An input the run would silently ignore is refused with one line naming it (exit 2 on the command line): a field
the method never reads (StreamingLLM's ``recent`` and ``signal``), an eval option of another task (``--preset`` with
perplexity), ``--parallel`` in a single process, an empty ``--depths``, per-layer ``budgets`` that are not ints."""

from __future__ import annotations

import pytest
from helpers import tiny_llama

from kvpolicy_core import KVCacheBuilder
from kvpolicy_core.apps import cli
from kvpolicy_core.config.parse import parse_config
from kvpolicy_core.errors import ConfigError


@pytest.mark.parametrize(
    "spec, field",
    [
        ("streamingllm:budget=16,signal=observed", "streamingllm_signal"),
        ("streamingllm:budget=16,recent=3", "streamingllm_recent"),
        ("streamingmerge:budget=16,recent=none", "streamingmerge_recent"),
        ({"method": "streamingllm", "budget": 16, "signal": "observed"}, "streamingllm_signal"),
        ("random:budget=16,signal=observed", "random_signal"),
    ],
)
def test_a_field_the_method_never_reads_is_refused(spec, field):
    with pytest.raises(ConfigError, match=f"{field}: method '.*' does not use"):
        parse_config(spec)


def test_an_unread_field_at_its_default_still_parses():
    assert parse_config("streamingllm:budget=16,recent=0,signal=proxy").to_string() == "streamingllm:budget=16"


def _refused(capsys, monkeypatch, argv):
    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: pytest.fail("the run started"))
    code = cli.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvpolicy: error:"), lines
    return lines[0]


@pytest.mark.parametrize(
    "argv, option",
    [
        (["eval", "--preset", "ruler"], "--preset"),
        (["eval", "--pres", "calibrated"], "--preset"),  # an abbreviation, at the default value: still given
        (["eval", "--task", "needle", "--chunk", "4"], "--chunk"),
        (["eval", "--task", "needle", "--keys", "3"], "--keys"),
        (["eval", "--task", "ruler", "--depths", "0.5"], "--depths"),
    ],
)
def test_an_option_of_another_task_is_refused(capsys, monkeypatch, argv, option):
    line = _refused(capsys, monkeypatch, argv)
    assert f"{option} is an option of --task" in line, line


@pytest.mark.parametrize("command", [["eval"], ["generate", "hi"]])
def test_parallel_in_one_process_is_refused(capsys, monkeypatch, command):
    line = _refused(capsys, monkeypatch, command + ["--parallel", "tensor"])
    assert "--parallel tensor" in line and "mlx.launch" in line, line


@pytest.mark.parametrize("depths", ["", ","])
def test_empty_depths_evaluate_nothing_and_are_refused(capsys, monkeypatch, depths):
    line = _refused(capsys, monkeypatch, ["eval", "--task", "needle", "--depths", depths])
    assert "--depths: no number given" in line, line


def test_empty_lengths_are_refused_not_replaced_by_the_default(capsys, monkeypatch):
    line = _refused(capsys, monkeypatch, ["eval", "--task", "needle", "--lengths", ""])
    assert "--lengths: no number given" in line, line


@pytest.mark.parametrize("budgets", [["8", "9"], [8.0, 9.0], [True, 8], "8,9"])
def test_per_layer_budgets_that_are_not_ints_are_refused(budgets):
    model = tiny_llama()
    assert len(model.layers) == 2
    with pytest.raises(ConfigError, match="^budgets: "):
        KVCacheBuilder.for_model(model, "h2o:budget=8,n_sink=1,recent=1", budgets=budgets)
