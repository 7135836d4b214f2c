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
