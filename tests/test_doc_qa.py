"""benchmarks/doc_qa.py: its smoke size (tiny random model) runs every route (mlx-lm's own cache, the end-of-prompt
cut, streaming, compress-once) through generate_step and writes the rows and the --explain records. Benchmarks are
programs, not timed tests: no answer is checked here (a random model answers nothing)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SMOKE_METHODS = ["full", "cam8", "cam8-stream", "kvzip+cam8"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("doc_qa")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "doc_qa.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "doc_qa_tiny_smoke.json").read_text()), proc.stdout


@pytest.mark.slow
def test_smoke_asks_every_statement_under_every_method(smoke):
    data, stdout = smoke
    cfg = data["config"]
    assert data["versions"]["mlx"] and data["command"].startswith("python")
    assert cfg["haystack"] == "stdlib" and len(cfg["keys"]) == 4 and len(set(cfg["values"])) == 4
    assert list(cfg["methods"]) == SMOKE_METHODS
    assert cfg["methods"]["cam8"] == "cam:budget=128" and cfg["methods"]["full"] is None  # 1024 / 8
    spans = cfg["spans"]
    assert spans == sorted(spans, key=lambda s: s[0]) or len({s[0] for s in spans}) == 4  # four distinct places
    for (a, b), parts in zip(spans, cfg["statement_parts"]):
        assert parts["value"] and max(parts["value"]) < b - a  # the value's tokens lie inside the statement
    assert all(n <= cfg["length"] - cfg["max_new_tokens"] for n in cfg["prompt_tokens"])
    rows = {(r["method"], r["question"]) for r in data["rows"]}
    assert rows == {(m, q) for m in SMOKE_METHODS for q in range(4)}
    assert "| method | spec |" in stdout and "right |" in stdout


@pytest.mark.slow
def test_smoke_explains_what_each_cut_kept(smoke):
    data, _ = smoke
    ex = data["explain"]
    assert set(ex) == {f"{m}/{q}" for m in SMOKE_METHODS[1:] for q in range(4)}  # the full cache keeps everything
    layers = ex["cam8/0"]["layers"]
    assert len(layers) == 4  # the tiny gemma3's 4 layers, one entry per KV head in each
    for layer in layers:
        assert len(layer["statement"]) == len(layer["value_in_top"]) >= 1
    assert sum(layer["budget"] for layer in layers) == 4 * 128  # the mean budget (reach: window layers give theirs)
    budgets = [layer["budget"] for layer in ex["kvzip+cam8/0"]["layers"]]
    assert len(budgets) == 4 and all(b >= 1 for b in budgets)  # compress-once's per-layer budgets are recorded
    w = data["windows"][0]
    assert w["W"] == 32 and set(w["key_words_in_window"]) <= set(data["config"]["keys"][0].split("-"))
    assert set(data["template_share"]) == {"none", "chatml", "gemma"}
