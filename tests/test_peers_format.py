"""The peer benchmark's library-free parts: its prompts format, RULER's score, kvpress's kept count, the table.

``benchmarks/peers.py`` runs kvpress, veloxquant-mlx and kvpolicy in separate environments; what they
share (and what makes their numbers comparable) must hold in every one of them.
"""

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"
_spec = importlib.util.spec_from_file_location("peers_benchmark", _PATH)
peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peers)


def _line(**over):
    row = {
        "id": "a",
        "task": "needle_single",
        "context_ids": [1, 2, 3],
        "questions": [{"question_ids": [4, 5], "answers": ["48213"], "max_new_tokens": 8}],
    }
    row.update(over)
    return json.dumps(row)


def test_string_match_all_is_rulers_fraction_of_answers_found_case_insensitive():
    assert peers.string_match_all(" The number is 48213.", ["48213"]) == 1.0
    assert peers.string_match_all("APPLE and pear", ["apple", "Pear", "plum"]) == pytest.approx(2 / 3)
    assert peers.string_match_all("4821 3", ["48213"]) == 0.0
    assert peers.string_match_all("48\n213", ["48213"]) == 1.0  # RULER drops control characters first


def test_kept_count_follows_kvpress_scorer_press_rounding():
    assert peers.compression_ratio(4) == 0.75 and peers.compression_ratio(8) == 0.875
    assert peers.keep_count(4060, 4) == int(4060 * 0.25) == 1015
    assert peers.keep_count(4060, 8) == 507  # int(507.5): kvpress truncates, never rounds up
    assert peers.keep_count(100, 3) == int(100 * (1 - (1 - 1 / 3)))


def test_prompts_file_round_trips_and_bad_lines_name_line_and_field(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text(_line() + "\n\n" + _line(id="b", stop_ids=[2]) + "\n")
    rows = peers.read_prompts(good)
    assert [r["id"] for r in rows] == ["a", "b"] and rows[1]["stop_ids"] == [2]
    cases = [
        (_line(context_ids=[]), "p.jsonl:2: context_ids"),
        (_line(context_ids=[1, "2"]), "p.jsonl:2: context_ids"),
        (_line(questions=[{"question_ids": [1], "answers": [], "max_new_tokens": 4}]), "questions[0].answers"),
        (_line(questions=[{"question_ids": [1], "answers": ["x"], "max_new_tokens": 0}]), "max_new_tokens"),
        (_line(model="llama-70b"), "model must be one of"),
        ("{not json", "p.jsonl:2: not JSON"),
        (json.dumps({"id": "x", "task": "t", "context_ids": [1]}), "missing field 'questions'"),
    ]
    for bad, message in cases:
        path = tmp_path / "p.jsonl"
        path.write_text(_line() + "\n" + bad + "\n")
        with pytest.raises(peers.PromptError, match=message.replace("[", r"\[").replace("]", r"\]")):
            peers.read_prompts(path)


def test_table_merges_libraries_into_one_row_per_method_ratio_and_task(tmp_path):
    def result(library, method, ratio, scores, seconds):
        rows = [
            {
                "library": library,
                "method": method,
                "ratio": ratio,
                "task": "needle_single",
                "score": s,
                "seconds": t,
                "prefill_s": t - 1,
                "cpu_s": t / 2,
                "prefill_cpu_s": t / 4,
                "answers": [{"seconds": 1.0}],
            }
            for s, t in zip(scores, seconds)
        ]
        path = tmp_path / f"{library}_{method}.json"
        path.write_text(json.dumps({"library": library, "threads": 1, "rows": rows}))
        return path

    text = peers.table(
        [result("kvpolicy", "h2o", 8.0, [1, 0, 0], [3, 4, 5]), result("kvpress", "no_press", 1.0, [1, 1], [2, 2])]
    )
    lines = text.splitlines()
    assert lines[2] == "| kvpress | no_press | 1x | needle_single | 100 | 2 | 2.0 | 1.0 | 0.5 |"
    assert lines[3] == "| kvpolicy | h2o | 8x | needle_single | 33 | 3 | 4.0 | 2.0 | 1.0 |"


def test_a_long_context_suite_file_is_read_and_filtered_by_task(tmp_path):
    path = tmp_path / "suite.jsonl"
    path.write_text(
        _line(id="a", task="niah_single", model="smollm2-135m-float32")
        + "\n"
        + _line(id="b", task="niah_multikey", model="smollm2-135m-float32")
        + "\n"
    )
    rows = peers.read_prompts(path)  # kvpolicy's suite JSONL names the converted directory
    assert [r["model"] for r in rows] == ["smollm2", "smollm2"]
    assert [r["id"] for r in peers.select_contexts(rows, "niah_multikey, vt", None)] == ["b"]
    assert [r["id"] for r in peers.select_contexts(rows, None, 1)] == ["a"]
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit, match="no context of --tasks 'vt'"):
        peers.main(["--library", "kvpolicy", "--prompts", str(path), "--tasks", "vt", "--out", str(out)])
    assert not out.exists()


def test_question_in_prompt_keeps_its_ratio_of_the_prompt_but_its_last_token():
    assert peers.kept_in_prompt(1990, 31, 8) == peers.keep_count(2020, 8) == 252
    assert peers.kept_in_prompt(1990, 31, 1) == 2020  # uncompressed: everything before the answer's first step


def test_grid_is_one_row_per_library_method_with_wilson_intervals_over_the_same_contexts(tmp_path):
    def result(library, method, ratio, per_context, protocol=None):
        rows = []
        for ctx, (task, scores) in per_context.items():
            row = {"library": library, "method": method, "ratio": ratio, "task": task, "id": ctx}
            row["answers"] = [{"score": s} for s in scores]
            if protocol:
                row["protocol"] = protocol
            rows.append(row)
        path = tmp_path / f"{library}_{method}_{ratio}_{protocol}.json"
        path.write_text(json.dumps({"library": library, "rows": rows}))
        return path

    both = {"a": ("niah_single", [1.0]), "b": ("niah_multikey", [1.0, 0.0])}
    files = [
        result("kvpress", "no_press", 1.0, both),
        result("kvpress", "snapkv", 8.0, both),
        result("kvpolicy", "full", 1.0, both),
        # h2o also ran a third context: left out, so that every cell is over the same questions
        result("kvpolicy", "h2o", 8.0, {**both, "c": ("niah_single", [1.0])}),
        result("kvpolicy", "h2o", 8.0, {"a": ("niah_single", [0.0])}, protocol="question-in-prompt"),
    ]
    lines = peers.grid(files, ratios=[8.0]).splitlines()
    assert lines[0] == "| library | method | niah_multikey 8x | niah_single 8x | all 8x |"
    # Wilson at n = 2, 1 and (all: weights 1/2, 1/4, 1/4) n_eff = 2.67
    assert lines[2] == "| kvpress | no_press (1x) | 50 [10, 90] | 100 [21, 100] | 75 [24, 97] |"
    assert [line.split(" | ")[:2] for line in lines[3:6]] == [
        ["| kvpress", "snapkv"],
        ["| kvpolicy", "full (1x)"],
        ["| kvpolicy", "h2o"],
    ]
    assert lines[-1].endswith("niah_multikey 2, niah_single 1 (2 contexts, the same in every cell).")
    qip = peers.grid(files, ratios=[8.0], protocol="question-in-prompt").splitlines()
    assert qip[2] == "| kvpolicy | h2o | 0 [0, 79] | 0 [0, 79] |"
