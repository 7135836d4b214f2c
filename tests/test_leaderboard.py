"""benchmarks/leaderboard.py: its smoke size runs (tiny random model) and writes every method x ratio, the full
cache's row, the per-model markdown table and plot; ``--report`` merges result files into a docs page without
running anything; the work it shares between methods is exact (a recorded one-chunk prefill replayed into every
installed method's caches gives the logits of the real forward; the batched perplexity the NLLs of
``perplexity``). Benchmarks are programs, not timed tests: no time is checked here."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
METHODS = ["full", "rotating", "h2o", "snapkv"]  # the smoke size's
RATIOS = [4.0, 8.0]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("leaderboard")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "leaderboard.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.slow
def test_smoke_writes_every_method_at_every_ratio_and_the_full_cache(smoke):
    out, stdout = smoke
    data = json.loads((out / "leaderboard_smoke.json").read_text())
    assert data["versions"]["mlx"] and data["command"].startswith("python")
    assert data["config"]["methods"] == METHODS and data["config"]["ratios"] == RATIOS
    assert "estimate:" in stdout  # printed at the start
    rows = {(r["method"], r["ratio"]): r for r in data["board"]["rows"]}
    assert ("full", 1.0) in rows and rows[("full", 1.0)]["score"] is not None
    for m in METHODS[1:]:
        for x in RATIOS:
            r = rows[(m, x)]
            assert r["score"] is not None  # both protocols ran
            assert set(r["suite"]) == {"question-in-prompt", "query-agnostic"}
            assert set(r["ppl_delta_pct"]) == {"pydoc", "stdlib"}  # two texts, one not the default corpus
    ppl = {(r["method"], r["ratio"], r["text"]) for r in data["ppl_rows"]}
    assert len(ppl) == (1 + 3 * 2) * 2
    budgets = {(r["method"], r["ratio"]): r["budget"] for r in data["ppl_rows"] if r["text"] == "pydoc"}
    assert budgets[("h2o", 4.0)] == 96 // 4 and budgets[("h2o", 8.0)] == 96 // 8  # budget = length / ratio
    suite_methods = {r["method"] for r in data["suite_rows"]}
    assert {"full", "h2o:budget=160", "h2o:budget=80", "rotating:budget=160"} <= suite_methods  # 640 / ratio
    ranks = data["rank_vs_h2o"]
    assert ranks["ratio"] == 8.0 and set(ranks["methods"]) == set(METHODS[1:])
    assert "score_minus_h2o" in ranks["methods"]["snapkv"] and "ppl_ratio_vs_h2o" in ranks["methods"]["snapkv"]
    assert {r["prefill"] for r in data["suite_rows"]} == {"one-chunk"}  # the default: shared forwards, replayed
    replayed = {r["name"]: r["replayed"] for r in data["suite_rows"]}
    assert replayed == {"full": True, "h2o": True, "snapkv": True, "rotating": False}  # rotating runs for real
    assert {r["batch"] for r in data["ppl_rows"]} == {2}  # both texts in one batch


@pytest.mark.slow
def test_resume_keeps_the_perplexity_rows_and_runs_none_again(smoke, tmp_path):
    out, _ = smoke
    proc = subprocess.run(
        [sys.executable, str(BENCH / "leaderboard.py"), "--smoke", "--no-suite", "--out", str(tmp_path)]
        + ["--resume", str(out / "leaderboard_smoke.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [x for x in proc.stdout.splitlines() if x.startswith("ppl ")]  # every spec was measured before
    before = json.loads((out / "leaderboard_smoke.json").read_text())
    after = json.loads((tmp_path / "leaderboard_smoke.json").read_text())
    assert after["ppl_rows"] == before["ppl_rows"] and after["errors"] == []


@pytest.fixture(scope="module")
def tiny():
    import tempfile

    import mlx_lm

    from kvpolicy_core.testing.tiny_models import write_model_dir

    # 4 layers: enough for squeeze's per-layer budgets to differ (a replay without the attention call, the old
    # one, gives them uniform: kept 49 in every layer against the real 50, 49, 48, 48 at budget 48)
    path = write_model_dir(Path(tempfile.mkdtemp(prefix="leaderboard-test-")), "llama", layers=4)
    model, tok = mlx_lm.load(str(path))
    return model, tok


def _installed():
    from kvpolicy_core import get_registry

    return sorted(get_registry().methods())


@pytest.mark.parametrize("name", ["full"] + _installed())
def test_a_replayed_one_chunk_prefill_gives_the_real_forwards_logits(tiny, name):
    """The leaderboard's suite replays one full-cache forward into every method (needle.replay_prefill): kept
    tokens and next logits must be the real one-chunk forward's, bit for bit (squeeze and pyramidkv, whose layer
    group measures the attention output, included)."""
    import mlx.core as mx

    from kvpolicy_core.eval.perplexity import make_caches
    from kvpolicy_core.eval.tasks.needle import record_prefill, replay_prefill

    model, _ = tiny
    ids = [(7 * i + 3) % 60 + 2 for i in range(200)]
    spec = "full" if name == "full" else f"{name}:budget=48"
    real = make_caches(model, spec)
    model(mx.array(ids[:-1], dtype=mx.uint32)[None], cache=real)
    got = replay_prefill(model, spec, record_prefill(model, ids))
    last = mx.array(ids[-1:], dtype=mx.uint32)[None]
    a, b = model(last, cache=real), model(last, cache=got)
    assert mx.array_equal(a, b).item()
    assert [getattr(c, "n", c.offset) for c in real] == [getattr(c, "n", c.offset) for c in got]


def test_batched_perplexity_gives_perplexitys_nlls(tiny):
    import numpy as np

    sys.path.insert(0, str(BENCH))
    from leaderboard import batched_perplexity

    from kvpolicy_core.eval.perplexity import perplexity

    model, _ = tiny
    rows = [[(5 * i + k) % 60 + 2 for i in range(48)] for k in (1, 2)]
    for spec in ("full", "h2o:budget=12", "tova:budget=12"):
        got = batched_perplexity(model, rows, spec)
        for r, g in zip(rows, got):
            want = perplexity(model, r, spec, chunk=1, progress=False)
            assert np.abs(g["nll"] - want["nll"]).max() < 1e-4


@pytest.mark.slow
def test_smoke_writes_the_markdown_table_and_the_plot(smoke):
    out, _ = smoke
    md = (out / "leaderboard_smoke_tiny.md").read_text()
    assert "| **full cache** | 1x |" in md
    for m in METHODS[1:]:
        assert f"| {m} | 4x |" in md and f"| {m} | 8x |" in md
    assert "question-in-prompt" in md and "query-agnostic" in md and "Δppl stdlib" in md
    png = out / "leaderboard_smoke_tiny.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_report_rewrites_a_models_section_of_the_docs_page(smoke, tmp_path):
    out, _ = smoke
    docs = tmp_path / "page.md"
    docs.write_text("# Leaderboard\n\nintro\n\n<!-- leaderboard:tiny -->\nold\n<!-- /leaderboard:tiny -->\n\nafter\n")
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH / "leaderboard.py"),
            "--report",
            str(out / "leaderboard_smoke.json"),
            "--docs",
            str(docs),
            "--plots",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = docs.read_text()
    assert "old" not in text and "intro" in text and text.rstrip().endswith("after")
    assert "| **full cache** | 1x |" in text and "| h2o | 8x |" in text
    assert (tmp_path / "leaderboard_tiny.png").is_file()
    assert "](leaderboard_tiny.png)" in text  # the plot embedded, its path relative to the page
    assert re.search(r"\| h2o \| \d+ \| \d+(\.\d)? \[\d+, \d+\] \|", text)  # questions, score [95% interval]


@pytest.mark.slow
def test_report_writes_a_page_per_model_where_docs_names_model(smoke, tmp_path):
    """The default ``--docs`` (docs/results/leaderboard-{model}.md): each model's section on a page of its own,
    a results page short enough for tests/test_docs_layout.py."""
    out, _ = smoke
    (tmp_path / "leaderboard.md").write_text("# Leaderboard\n")
    run = [sys.executable, str(BENCH / "leaderboard.py"), "--report", str(out / "leaderboard_smoke.json")]
    run += ["--docs", str(tmp_path / "leaderboard-{model}.md"), "--plots", str(tmp_path)]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "leaderboard-tiny.md").read_text()
    assert text.startswith("# Leaderboard: tiny random llama") and "](leaderboard.md)" in text
    assert "<!-- leaderboard:tiny -->" in text and "| h2o | 8x |" in text and "### " not in text
    assert len(text.splitlines()) <= 300


def test_report_default_pages_are_the_results_pages_per_model():
    lb = _lb()
    assert lb.DOCS == ROOT / "docs" / "results" / "leaderboard-{model}.md"
    for key in ("gemma3", "smollm2"):
        page = Path(str(lb.DOCS).replace("{model}", key))
        text = page.read_text()
        assert f"<!-- leaderboard:{key} -->" in text and f"<!-- /leaderboard:{key} -->" in text


def test_report_refuses_a_file_that_is_not_a_leaderboard_result(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": []}))
    proc = subprocess.run(
        [sys.executable, str(BENCH / "leaderboard.py"), "--report", str(bad), "--docs", str(tmp_path / "d.md")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "not a leaderboard result file" in proc.stderr


def _lb():
    sys.path.insert(0, str(BENCH))
    import leaderboard

    return leaderboard


def test_wilson_interval_matches_the_textbook_values():
    lb = _lb()
    low, high = lb.wilson(0.5, 10)  # 5 of 10: [23.7, 76.3]
    assert abs(low - 0.2366) < 1e-3 and abs(high - 0.7634) < 1e-3
    low, high = lb.wilson(1.0, 3)  # 3 of 3: the lower bound n / (n + z^2)
    assert abs(low - 3 / (3 + lb.Z95**2)) < 1e-9 and high == 1.0
    assert lb.wilson(0.0, 3)[0] == 0.0 and lb.wilson(0.5, 0) is None


def test_score_interval_weights_a_tasks_questions_as_the_score_does():
    lb = _lb()
    # niah_single's one question (weight 1/2) right, niah_multikey's two (1/4 each) wrong: score 50
    got = lb.score_interval([(1.0, 0.5), (0.0, 0.25), (0.0, 0.25)])
    assert got["n"] == 3 and abs(got["n_eff"] - 1 / 0.375) < 0.01
    low, high = lb.wilson(0.5, 1 / 0.375)
    assert got["low"] == round(100 * low, 1) and got["high"] == round(100 * high, 1)
    equal = lb.score_interval([(1.0, 1), (0.0, 1), (1.0, 1), (0.0, 1)])  # equal weights: plain Wilson on 2 of 4
    assert equal["n_eff"] == 4 and equal["low"] == round(100 * lb.wilson(0.5, 4)[0], 1)


def test_sign_test_needs_six_one_way_splits_for_five_percent():
    lb = _lb()
    assert lb.sign_test(0, 0) == 1.0 and lb.sign_test(3, 3) == 1.0
    assert lb.sign_test(5, 0) == 2 / 32 and lb.sign_test(6, 0) == 2 / 64 < 0.05
    assert abs(lb.sign_test(1, 5) - 2 * 7 / 64) < 1e-12


def test_smoke_without_out_writes_outside_the_results(monkeypatch, tmp_path):
    lb = _lb()
    seen = {}
    monkeypatch.setattr(lb, "run", lambda args: seen.setdefault("out", args.out))
    lb.main(["--smoke"])
    assert Path(seen["out"]).resolve() != (BENCH / "results").resolve()
    assert (BENCH / "results").resolve() not in Path(seen["out"]).resolve().parents
    seen.clear()
    lb.main([])
    assert Path(seen["out"]).resolve() == (BENCH / "results").resolve()


def test_kv_bits_plans_each_bounded_method_at_each_storage(capsys):
    """``--kv-bits none,8,4``: a row per bounded method per storage (config strings of their own), full and
    mlx-lm's rotating cache in full precision; the estimate counts the quantized rows' prefills as real forwards."""
    lb = _lb()
    assert lb.parse_kv_bits("none,8,4") == [None, 8, 4]
    with pytest.raises(ValueError, match="kv-bits"):
        lb.parse_kv_bits("16")
    got = lb.with_kv_bits(["full", "rotating", "h2o", "cam:merge=drop", "snapkv:kv_bits=8"], [None, 8, 4])
    assert got == [
        "full",
        "rotating",
        "h2o",
        "h2o:kv_bits=8",
        "h2o:kv_bits=4",
        "cam:merge=drop",
        "cam:merge=drop,kv_bits=8",
        "cam:merge=drop,kv_bits=4",
        "snapkv:kv_bits=8",
    ]
    assert lb.runs_for_real("h2o:kv_bits=4") and lb.runs_for_real("rotating") and not lb.runs_for_real("cam")
    lb.main(["--smoke", "--dry-run", "--methods", "full,rotating,h2o,cam", "--kv-bits", "none,8,4"])
    out = capsys.readouterr().out
    assert "8 methods x 2 ratios = 15 caches" in out  # full + rotating + (h2o, cam) x 3 storages, at 4x and 8x
    plan = dict(methods=["full", "h2o"], ratios=[8.0], texts=[], ppl_tokens=2, length=2048, tasks=["niah_single"])
    plan.update(haystacks=["noise"], protocols=["question-in-prompt"], seeds=1, prefill="one-chunk")
    costs = lb.ONE_CHUNK_COSTS["smollm2"]
    replayed = lb.estimate(plan, costs, {"niah_single": 1})["suite_s"]
    quantized = lb.estimate({**plan, "methods": ["full", "h2o:kv_bits=4"]}, costs, {"niah_single": 1})["suite_s"]
    assert quantized > replayed


def _bytes_result(tmp_path):
    """A small synthetic ``--kv-bits`` result: the full cache, h2o at 8x in full precision and at 4 bits."""
    import random

    rnd = random.Random(0)
    nll = [rnd.uniform(1, 3) for _ in range(95)]
    specs = [("full", 1.0, 8000, True), ("h2o", 8.0, 1000, True), ("h2o:kv_bits=4", 8.0, 160, False)]
    ppl_rows, suite_rows = [], []
    for name, ratio, kept, replayed in specs:
        bump = 0.0 if name == "full" else (0.2 if "kv_bits" in name else 0.1)
        row_nll = [x + bump for x in nll]
        ppl_rows.append(
            dict(text="pydoc", tokens=96, method=name, ratio=ratio, perplexity=math.exp(sum(row_nll) / 95))
            | dict(nll=row_nll, kv_bytes_kept=kept // 8, peak_memory_bytes=5 * kept, active_memory_bytes=2 * kept)
        )
        for i in range(4):
            suite_rows.append(
                dict(name=name, method=name, ratio=ratio, protocol="question-in-prompt", task="niah_single")
                | dict(id=f"niah_single-noise-640-{i}", question=0, model="tiny", replayed=replayed)
                | dict(score=1.0 if i < 3 else 0.0, kv_bytes_kept=kept, peak_memory_bytes=9 * kept)
                | dict(active_memory_bytes=3 * kept)
            )
    data = dict(config=dict(model="tiny", kv_bits=[None, 4], min_full=0.0), seconds=12.0)
    data.update(ppl_rows=ppl_rows, suite_rows=suite_rows)
    f = tmp_path / "leaderboard_qpb_tiny.json"
    f.write_text(json.dumps(data))
    return f


def test_report_builds_the_quality_per_byte_table_and_plot(tmp_path):
    lb = _lb()
    f = _bytes_result(tmp_path)
    page = tmp_path / "leaderboard-tiny.md"
    page.write_text("# Leaderboard: tiny\n\n<!-- leaderboard:tiny -->\nkept\n<!-- /leaderboard:tiny -->\n")
    lb.report([str(f)], tmp_path / "leaderboard-{model}.md", tmp_path)
    text = page.read_text()
    assert "<!-- leaderboard:tiny -->\nkept\n" in text  # the leaderboard's own section left as it is
    assert "## Quality per byte" in text and "<!-- leaderboard-bytes:tiny -->" in text
    assert "| **full cache** | 1x | full precision | 7.81 KiB | 23.4 KiB | 70.3 KiB (r) | 39.1 KiB | 75 [" in text
    assert re.search(r"\| h2o \| 8x \| full precision \| 1000 B \| 2\.93 KiB \| 8\.79 KiB \(r\) \| ", text)
    assert re.search(r"\| h2o \| 8x \| 4-bit \| 160 B \| 480 B \| 1\.41 KiB \| 800 B \| 75 \[\d+, \d+\] \| \+", text)
    png = tmp_path / "leaderboard_bytes_tiny.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](leaderboard_bytes_tiny.png)" in text
    assert "Result files: [`leaderboard_qpb_tiny.json`](leaderboard_qpb_tiny.json) (12 s)." in text  # linked
    lb.report([str(f)], tmp_path / "leaderboard-{model}.md", tmp_path)  # rewritten in place, not appended
    assert page.read_text() == text
