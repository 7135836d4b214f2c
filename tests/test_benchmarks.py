"""Every benchmark program runs in its smoke configuration, so the scripts cannot rot.

Benchmarks are programs, not timed tests: these only check that each one runs and writes its
results, not what the numbers are.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, result",
    [
        ("step_cost.py", "step_cost_smoke.json"),
        ("soak.py", "soak_smoke.json"),
        ("quality.py", "quality_token_smoke.json"),
        ("perturbation.py", "perturbation_smoke.json"),
        ("blas_speedup.py", "blas_speedup_smoke.json"),
        ("e2e_speed.py", "e2e_speed_smoke.json"),
        ("batch_speed.py", "batch_speed_smoke.json"),
        ("batch_policy_step.py", "batch_policy_step_smoke.json"),
        ("needle.py", "needle_smoke.json"),
        ("paired.py", "paired_smoke.json"),
        ("merge_batching.py", "merge_batching_smoke.json"),
        ("op_cost.py", "op_cost_smoke.json"),
        ("long_context.py", "long_context_smoke.json"),
        ("paper_merge_growth.py", "paper_merge_growth_smoke.json"),
        ("validation_cost.py", "validation_cost_smoke.json"),
        ("decode_layer.py", "decode_layer_tiny_64_smoke.json"),
        ("speculative.py", "speculative_smoke.json"),
    ],
)
def test_benchmark_smoke(tmp_path, script, result):
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / result).read_text())
    assert data["versions"]["mlx"] and data["command"].startswith("python")


@pytest.mark.slow
def test_end_to_end_speed_interleaved_smoke(tmp_path):
    """``--interleave``: every method timed at every step, alternately; one row per method with its medians."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "e2e_speed.py"), "--smoke", "--interleave", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "e2e_speed_smoke.json").read_text())["rows"]
    assert [r["spec"].split(":")[0] for r in rows] == ["full", "rotating", "h2o", "cam"]
    assert all(r["interleaved"]["decode_steps"] == 16 and r["decode_tps"] > 0 for r in rows)


@pytest.mark.slow
def test_step_cost_with_clustered_keys_times_steps_that_merge(tmp_path):
    """``--keys clustered``: keys close to each other, so CaM's default merges (random keys: never); the rows
    record the merges per decode eviction."""
    rates = {}
    for keys in ("random", "clustered"):
        proc = subprocess.run(
            [
                sys.executable,
                str(BENCH / "step_cost.py"),
                "--smoke",
                "--keys",
                keys,
                "--kinds",
                "KVCache;cam:cap=none",
                "--out",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        data = json.loads((tmp_path / "step_cost_smoke.json").read_text())
        assert data["keys"] == keys
        rates[keys] = data["rows"][0]["merges_per_eviction_cam:cap=none"]
    assert rates["random"] == 0 and rates["clustered"] > 0.9


def test_perplexity_reports_the_share_of_evictions_that_merged():
    """evaluation.perplexity: ``merges_per_eviction`` for caches that count merges (CaM), absent for H2O;
    0 where CaM never merges (cap=1), the share of (token, KV head) evictions otherwise."""
    from kvpolicy_core.eval.perplexity import perplexity
    from kvpolicy_core.testing.conformance import tiny_llama

    model, ids = tiny_llama(), list(range(3, 43))
    never = perplexity(model, ids, "cam:budget=16,cap=1", progress=False)
    some = perplexity(model, ids, "cam:budget=16,min_sim=-1,cap=none", progress=False)
    h2o = perplexity(model, ids, "h2o:budget=16", progress=False)
    assert never["merges_per_eviction"] == 0 and 0 < some["merges_per_eviction"] <= 1
    assert "merges_per_eviction" not in h2o and abs(never["perplexity"] - h2o["perplexity"]) < 1e-9


def test_paired_ratio_is_exp_of_the_mean_nll_difference_with_an_interval_that_can_exclude_one():
    import numpy as np

    from kvpolicy_core.eval.perplexity import paired_ratio

    rng = np.random.default_rng(0)
    b = rng.gamma(2.0, 1.5, 511)
    same = paired_ratio(b, b)
    assert same["ratio"] == same["low"] == same["high"] == 1.0 and same["p_worse"] == 0.0
    shifted = b + 0.05 + 0.3 * rng.normal(size=511)
    r = paired_ratio(shifted, b)
    assert abs(r["ratio"] - np.exp(np.mean(shifted - b))) < 1e-12
    assert 1.0 < r["low"] < r["ratio"] < r["high"] and r["p_worse"] == 1.0  # a real 5% loss: the CI excludes 1
    noise = paired_ratio(b + 0.3 * rng.normal(size=511), b)
    assert noise["low"] < 1.0 < noise["high"]  # zero-mean noise: the CI straddles 1
    with pytest.raises(ValueError, match="equal-length"):
        paired_ratio([], [])


def test_pooled_ratio_weighs_texts_by_tokens_and_narrows_with_more_of_them():
    import numpy as np

    from kvpolicy_core.eval.perplexity import paired_ratio, pooled_ratio

    rng = np.random.default_rng(1)
    texts = [rng.gamma(2.0, 1.5, n) for n in (511, 300, 511)]
    pairs = [(b + 0.02 + 0.3 * rng.normal(size=b.size), b) for b in texts]
    pooled = pooled_ratio(pairs)
    d = np.concatenate([a - b for a, b in pairs])
    assert abs(pooled["ratio"] - np.exp(d.mean())) < 1e-12 and pooled["texts"] == 3 and pooled["tokens"] == 1322
    one = paired_ratio(*pairs[0])
    assert pooled["high"] - pooled["low"] < one["high"] - one["low"]  # three texts: a narrower interval
    assert pooled_ratio([pairs[0]]) == {**one}


@pytest.mark.slow
def test_quality_rows_keep_per_token_nlls_and_compare_to_the_reference(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(BENCH / "quality.py"), "--smoke", "--methods", "h2o;cam", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "quality_token_smoke.json").read_text())
    assert all(len(r["nll"]) == data["tokens"] - 1 for r in data["rows"]) and len(data["ids_sha256"]) == 64
    pairs = {(c["method"], c["budget"]) for c in data["paired"]}
    assert pairs == {("cam", 16), ("cam", 32)} and all(c["reference"] == "h2o" for c in data["paired"])
    assert "nll" not in (tmp_path / "quality_token_smoke.csv").read_text().splitlines()[0]


@pytest.mark.parametrize(
    "a, b, needle",
    [
        (list(range(1, 100)), [1.0], "equal-length"),  # would broadcast
        (list(range(1, 100)), list(range(1, 99)), "equal-length"),
        ([1.0] * 50 + [float("nan")] * 49, [1.0] * 99, "finite"),
        ([1.0] * 20, [2.0] * 20, "two blocks"),  # one block: every resample the same, a point interval
    ],
)
def test_paired_ratio_refuses_what_would_give_a_meaningless_interval(a, b, needle):
    from kvpolicy_core.eval.perplexity import paired_ratio

    with pytest.raises(ValueError, match=needle):
        paired_ratio(a, b)


def test_paired_py_matches_rows_of_one_model_and_mode_only(tmp_path):
    """Same tokens, another model (or mode): not paired; two reference rows for one key: refused."""
    import numpy as np

    rng = np.random.default_rng(3)

    def result(name, model, mode, nll_cam, nll_h2o):
        rows = [
            {
                "method": m,
                "budget": 16,
                "seed": 0,
                "compression": 5.0,
                "perplexity": float(np.exp(np.mean(n))),
                "nll": list(n),
            }
            for m, n in (("cam", nll_cam), ("h2o", nll_h2o))
        ]
        path = tmp_path / f"{name}.json"
        path.write_text(
            json.dumps(
                {
                    "model": model,
                    "text": "pydoc",
                    "start": 0,
                    "mode": mode,
                    "chunk": 1,
                    "ids_sha256": "same",
                    "rows": rows,
                }
            )
        )
        return str(path)

    base = rng.gamma(2.0, 1.5, 100)
    small = result("small", "m1", "token", base + 0.1, base)
    big = result("big", "m2", "token", base - 1.0, base + 1.0)
    chunked = result("chunked", "m1", "chunked", base + 2.0, base)
    run = lambda *files: subprocess.run(
        [sys.executable, str(BENCH / "paired.py"), *files, "--out", str(tmp_path)],  # noqa: E731
        capture_output=True,
        text=True,
        timeout=300,
    )
    proc = run(small, big, chunked)
    assert proc.returncode == 0, proc.stderr
    ratios = sorted(round(c["ratio"], 4) for c in json.loads((tmp_path / "paired.json").read_text())["comparisons"])
    assert ratios == sorted(round(float(np.exp(x)), 4) for x in (0.1, -2.0, 2.0))  # each paired within itself
    dup = run(small, small)
    assert dup.returncode != 0 and "two 'h2o' rows" in dup.stderr


def test_the_harness_does_not_import_common():
    """_common (the BLAS, then mlx) imports _harness; _harness never imports _common (no import circle)."""
    tree = ast.parse((BENCH / "_harness.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "_common" not in names


def test_harness_interleaves_kinds_round_by_round_and_names_results(tmp_path):
    sys.path.insert(0, str(BENCH))
    from _harness import interleave, parser, result_name, summarize, write_json

    calls = []
    got = interleave({k: (lambda k=k: calls.append(k) or len(calls)) for k in "ABC"}, 2)
    assert calls == list("ABCABC") and got == {"A": [1, 4], "B": [2, 5], "C": [3, 6]}
    rows = summarize({"A": [1.0, 3.0], "B": [4.0, 8.0]}, baseline="A")
    assert rows["B"]["median"] == 6.0 and rows["B"]["ratio"] == 3.0 and rows["A"]["ratio"] == 1.0
    args = parser("x", rounds=3, seed=0).parse_args(["--smoke", "--tag", "t", "--out", str(tmp_path)])
    assert (args.rounds, args.seed, result_name("b", args), result_name("b")) == (3, 0, "b_t_smoke", "b")
    data = json.loads(write_json(result_name("b", args), {"x": 1}, args.out).read_text())
    assert data["x"] == 1 and data["versions"]["blas"] is not None and data["command"].startswith("python")


def test_a_smoke_run_without_out_writes_outside_the_results(tmp_path):
    """--smoke checks that a program runs: without --out its files go to a new temporary folder, never among
    benchmarks/results (issue 52); a real run's default is benchmarks/results; --out always wins."""
    sys.path.insert(0, str(BENCH))
    from _harness import RESULTS, parser

    smoke = Path(parser("x").parse_args(["--smoke"]).out).resolve()
    assert smoke.is_dir() and smoke != RESULTS.resolve() and RESULTS.resolve() not in smoke.parents
    smoke.rmdir()
    assert parser("x").parse_args([]).out == str(RESULTS)
    assert parser("x").parse_args(["--smoke", "--out", str(tmp_path)]).out == str(tmp_path)
    assert parser("x", out=None).parse_args(["--smoke"]).out is None  # the program chooses (leaderboard.py)


@pytest.mark.parametrize(
    "mode, result",
    [("--context", "real_shapes_context_smoke.json"), ("--layer-prefill", "real_shapes_layer_prefill_smoke.json")],
)
def test_real_shapes_modes_smoke_record_the_load(tmp_path, mode, result):
    """real_shapes.py's decode-at-context and per-layer prefill modes run and record the machine's load averages."""
    args = [mode, "128"] if mode == "--context" else [mode]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "real_shapes.py"), "--smoke", *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / result).read_text())
    assert data["versions"]["blas"] is not None and len(data["load_avg"]["start"]) == 3 and data["cpu_count"] >= 1


def test_real_shapes_markdown_prints_the_table_of_a_result_file(tmp_path):
    """The smoke run (as test_benchmark_smoke runs the others), then ``--markdown FILE``: the table of
    docs/results/speed.md from its result file, one row per method and budget."""
    run = [sys.executable, str(BENCH / "real_shapes.py")]
    proc = subprocess.run([*run, "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "real_shapes_smoke.json").read_text())
    assert data["versions"]["mlx"] and data["command"].startswith("python")
    proc = subprocess.run(
        [*run, "--markdown", str(tmp_path / "real_shapes_smoke.json")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| method | ratio | prefill tok/s")
    assert [r.split(" | ")[0] for r in rows[1:8]] == ["| full"] + [
        f"| {m} ({b})" for b in (16, 8) for m in ("rotating", "h2o", "cam")
    ]


def test_long_context_report_merges_files_and_compares_each_method_to_the_full_cache_on_its_questions(tmp_path):
    sys.path.insert(0, str(BENCH))
    import long_context

    def row(ctx, hay, method, score):
        return dict(id=ctx, task="niah_single", length=4096, haystack=hay, model="m", method=method, question=0,
                    protocol="query-agnostic", score=score)  # fmt: skip

    first = [row("a", "pydoc", "full", 1.0), row("b", "noise", "full", 0.0), row("a", "pydoc", "h2o:budget=1024", 1.0)]
    second = [row("a", "pydoc", "full", 1.0), row("a", "pydoc", "cam:budget=1024", 0.0)]
    second.append(row("b", "noise", "cam:budget=1024", 0.0))
    files = []
    for i, rows in enumerate((first, second)):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps({"rows": rows}))
    merged = long_context.merge_rows(files)
    assert len(merged) == 5  # the full cache's answer on context a is kept once
    table = {
        line.split(" | ")[2]: line.split(" | ")[3:] for line in long_context.markdown(merged, 40).splitlines()[2:5]
    }
    assert table["full"][:2] == ["50.0 (100 / 0)", "50.0"]
    assert table["h2o:budget=1024"][:3] == ["100.0 (100 / -)", "100.0", "+0.0"]  # full on context a: 100
    assert table["cam:budget=1024"][:3] == ["0.0 (0 / 0)", "0.0", "-50.0"]


def test_long_context_reuses_the_full_caches_answers_only_on_the_same_contexts(tmp_path):
    def run(out, *extra):
        cmd = [sys.executable, str(BENCH / "long_context.py"), "--smoke", "--protocols", "query-agnostic"]
        proc = subprocess.run(cmd + ["--out", str(out), *extra], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((out / "long_context_smoke.json").read_text())["rows"]

    first = run(tmp_path / "a", "--methods", "full", "--tasks", "niah_multikey")
    again = run(tmp_path / "b", "--methods", "full,h2o", "--tasks", "niah_multikey,vt", "--full-from",
                str(tmp_path / "a" / "long_context_smoke.json"))  # fmt: skip
    full = [r for r in again if r["method"] == "full"]
    assert [r["output"] for r in full if r["task"] == "niah_multikey"] == [r["output"] for r in first]
    assert all(r.get("reused") for r in full if r["task"] == "niah_multikey")
    assert not any(r.get("reused") for r in full if r["task"] == "vt")  # not in the earlier file: run
    assert any(r["method"].startswith("h2o") for r in again)


@pytest.mark.slow
def test_compress_once_cuts_oracle_keeps_every_statement(tmp_path):
    """``+spans``: the cut keeps every statement position in every layer and head; ``--full``: the full cache's
    answers ride along (smoke: both on)."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "compress_once_cuts.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "compress_once_cuts_smoke.json").read_text())
    assert data["versions"]["mlx"] and data["command"].startswith("python")
    rows = data["rows"]
    by = {}
    for r in rows:
        by.setdefault(r["allocation"], []).append(r)
    assert set(by) == {"full", "layer", "model", "model+spans"}
    assert all(r["spans_kept"] == [1.0] * len(r["spans_kept"]) and r["spans_kept"] for r in by["model+spans"])
    assert all(0.0 <= x <= 1.0 for r in by["model"] for x in r["spans_kept"])


def test_bytes_quality_reads_eval_and_retrieval_results_by_method_storage_and_ratio(tmp_path):
    """``bytes_quality.py`` joins ``kvpolicy eval --json`` perplexity (ratio = tokens / budget, over the full cache's)
    and hybrid_allocation retrieval rows under (method, storage, ratio)."""
    sys.path.insert(0, str(BENCH))
    import bytes_quality as bq

    ppl = tmp_path / "ppl.json"
    results = [
        {"spec": "full", "tokens": 1024, "perplexity": 20.0},
        {"spec": "cam:budget=128", "tokens": 1024, "perplexity": 22.0},
        {"spec": "cam:budget=128,kv_bits=4,kv_group_size=64", "tokens": 1024, "perplexity": 25.0},
    ]
    ppl.write_text(json.dumps({"model": "/m/gemma", "tokens": 1024, "results": results}))
    got = bq.perplexity_rows([ppl])["gemma"]
    assert got == {("cam", "full precision", 8): [1.1], ("cam", "4-bit", 8): [1.25]}
    ret = tmp_path / "ret.json"
    rows = [
        {"method_label": "cam:kv_bits=4,budget=192", "ratio": 8.0, "kind": "single", "score": 1.0, "kv_bytes_kept": 5},
        {"method_label": "cam:kv_bits=4,budget=192", "ratio": 8.0, "kind": "twokey", "score": 0.5, "kv_bytes_kept": 5},
    ]
    ret.write_text(json.dumps({"config": {"model": "/m/gemma"}, "rows": rows}))
    got = bq.retrieval_rows([ret])["gemma"][("cam", "4-bit", 8.0)]
    assert got["single"] == [1.0] and got["twokey"] == [0.5] and got["bytes"] == [5, 5]
