"""The long-context suite: contexts built as documented, RULER's scoring, JSONL, and both protocols."""

import json

import pytest

from kvpolicy_core.apps.cli import main
from kvpolicy_core.eval.tasks import ruler
from kvpolicy_core.eval.tasks.ruler import TaskParams, build_context, build_suite, score

SMALL = {  # parameters that fit the tiny model's character-level contexts of a few hundred tokens
    "niah_multikey": TaskParams(keys=3, questions=3, digits=4),
    "niah_multiquery": TaskParams(keys=4, queries=2, questions=2, digits=4),
    "vt": TaskParams(hops=2, digits=4, few_shot=False),
    "cwe": TaskParams(common=2, common_freq=6, uncommon_freq=1, few_shot=False),
}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from mlx_lm.tokenizer_utils import load

    return load(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tok):
    import mlx_lm

    return mlx_lm.load(str(tiny_model_dir))[0], tok


def test_contexts_are_deterministic_fit_the_length_and_hold_their_answers(tok):
    for task in ruler.TASKS:
        for hay in ("pydoc", ruler.NOISE):
            ctx = build_context(tok, task, 900, hay, seed=3, params=SMALL.get(task))
            again = build_context(tok, task, 900, hay, seed=3, params=SMALL.get(task))
            assert ruler.to_record(ctx) == ruler.to_record(again), task
            assert build_context(tok, task, 900, hay, seed=4, params=SMALL.get(task)).context_ids != ctx.context_ids
            assert all(ctx.total_tokens(i) <= 900 for i in range(len(ctx.questions)))
            assert min(ctx.total_tokens(i) for i in range(len(ctx.questions))) > 700, (task, hay)  # filled
            text = tok.decode(ctx.context_ids)
            for q in ctx.questions:
                assert all(a in text for a in q.answers), (task, q.answers)
                assert ctx.full_prompt_ids(0)[: len(ctx.context_ids)] == ctx.context_ids
            for a, b in ctx.spans:  # each span is one statement, whole
                assert tok.decode(ctx.context_ids[a:b]).strip().endswith(".")
            if hay == ruler.NOISE and task != "cwe":
                assert "The grass is green." in text
    mk = build_context(tok, "niah_multikey", 900, "pydoc", 0, params=SMALL["niah_multikey"])
    text = tok.decode(mk.context_ids)
    assert text.count("One of the special magic numbers for ") == 3 and len(mk.questions) == 3
    assert len({q.answers[0] for q in mk.questions}) == 3  # each question asks a different key
    assert tok.decode(mk.questions[0].question_ids).endswith("mentioned in the provided text is")
    vt = build_context(tok, "vt", 900, ruler.NOISE, 0, params=SMALL["vt"])
    chain = vt.questions[0].answers
    assert len(chain) == 3 and f"VAR {chain[1]} = VAR {chain[0]}." in tok.decode(vt.context_ids)


def test_common_words_are_the_most_frequent_words_of_the_list(tok):
    ctx = build_context(tok, "cwe", 900, "pydoc", 1, params=SMALL["cwe"])
    assert ctx.haystack == ruler.WORDLIST
    body = tok.decode(ctx.context_ids).split("most often.", 1)[1]
    words = [w for w in body.split() if w.isalpha()]
    counts = {w: words.count(w) for w in set(words)}
    assert sorted(ctx.questions[0].answers) == sorted(sorted(counts, key=counts.get)[-2:])
    assert (
        min(counts[w] for w in ctx.questions[0].answers)
        == 6
        > max(c for w, c in counts.items() if w not in ctx.questions[0].answers)
    )


def test_suite_has_cwe_once_per_seed_and_bad_inputs_are_clear(tok):
    suite = build_suite(tok, ["niah_single", "cwe"], [600], ["pydoc", "noise"], [0, 1], params=SMALL)
    assert sorted(c.id for c in suite) == sorted(
        [
            "niah_single-pydoc-600-0",
            "niah_single-pydoc-600-1",
            "niah_single-noise-600-0",
            "niah_single-noise-600-1",
            "cwe-wordlist-600-0",
            "cwe-wordlist-600-1",
        ]
    )
    with pytest.raises(ValueError, match="task must be one of"):
        build_context(tok, "qa", 600)
    with pytest.raises(ValueError, match="no room for a haystack"):
        build_context(tok, "niah_multikey", 200)
    with pytest.raises(ValueError, match="TaskParams.keys"):
        TaskParams(keys=0)


def test_depth_puts_the_needle_at_that_share_of_the_haystack(tok):
    for hay in ("pydoc", ruler.NOISE):
        spans = {}
        for d in (0.0, 0.3, 0.7, 1.0):
            ctx = build_context(tok, "niah_single", 900, hay, seed=2, params=TaskParams(answer="echo", depth=d))
            (a, b), n = ctx.spans[0], len(ctx.context_ids)
            assert "special magic numbers" in tok.decode(ctx.context_ids[a:b])
            spans[d] = (a, b, n)
        first, last = spans[0.0][0], spans[1.0][1]
        head = build_context(tok, "niah_single", 900, hay, seed=2, params=TaskParams(answer="echo", depth=0.0))
        assert "the numbers afterwards." in tok.decode(head.context_ids[:first])[-30:]  # right after the instruction
        assert last == spans[1.0][2] - len(tok.encode("\n", add_special_tokens=False))  # right before the end
        for d in (0.3, 0.7):
            assert abs((spans[d][0] - first) / (spans[d][2] - first) - d) < 0.08, (hay, d, spans[d])
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="TaskParams.depth"):
            TaskParams(depth=bad)


def test_scores_are_rulers_substring_matches():
    assert score("  The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert score("ABCDE fghij", ["abcde", "FGHIJ"]) == 1.0  # case-insensitive
    assert score("123", ["123", "456"], "part") == 1.0 and score("x", ["123"], "part") == 0.0
    assert score("12\x003", ["123"]) == 0.0  # control characters separate
    assert ruler.string_match_all(["123 456", "no"], [["123", "456"], ["7"]]) == 50.0
    assert ruler.string_match_part(["123", "456"], [["123", "9"], ["1"]]) == 50.0
    with pytest.raises(ValueError, match="at least one answer"):
        score("x", [])


def test_jsonl_round_trip_and_a_bad_line_names_its_field(tok, tmp_path):
    suite = build_suite(tok, ["niah_multikey", "vt"], [700], ["noise"], [0], params=SMALL)
    path = ruler.write_jsonl(tmp_path / "prompts.jsonl", suite)
    lines = path.read_text().splitlines()
    rec = json.loads(lines[0])
    assert set(rec) >= {"id", "task", "length", "haystack", "model", "context_ids", "questions"}
    q = rec["questions"][0]
    assert q["full_prompt_ids"] == rec["context_ids"] + q["question_ids"] and q["max_new_tokens"] > 0
    assert [ruler.to_record(c) for c in ruler.read_jsonl(path)] == [ruler.to_record(c) for c in suite]
    rec["questions"][0]["answers"] = []
    path.write_text(lines[0] + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: questions\[0\].answers"):
        ruler.read_jsonl(path)


SPECS = ("full", "rotating:budget=48", "h2o:budget=48,n_sink=2", "cam:budget=48,n_sink=2")


def _suite(tok, questions=2):
    params = {**SMALL, "niah_multikey": TaskParams(keys=3, questions=questions, digits=4)}
    return build_suite(tok, ["niah_multikey", "vt"], [640], ["noise"], [0], params=params)


def test_both_protocols_answer_every_question_for_every_method(tiny):
    from kvpolicy_core.eval.tasks.ruler_runner import format_table, run_suite, summarize

    model, tok = tiny
    suite = _suite(tok)
    rows = run_suite(model, tok, suite, SPECS, prefill_step=128)
    n_q = sum(len(c.questions) for c in suite)
    assert len(rows) == 2 * len(SPECS) * n_q
    for r in rows:
        assert 0.0 <= r["score"] <= 1.0 and r["new_tokens"] <= 40
        if r["method"] != "full":  # a bounded cache holds its budget on global layers
            assert r["kv_bytes_kept"] < r["kv_bytes_full"]
    summary = summarize(rows)
    assert {s["protocol"] for s in summary} == {"query-agnostic", "question-in-prompt"}
    assert all(s["full"] is not None and set(s["tasks"]) == {"niah_multikey", "vt"} for s in summary)
    assert "rotating:budget=48" in format_table(summary, ["niah_multikey", "vt"])


def test_each_question_sees_only_the_compressed_context(tiny):
    """Query-agnostic: the answer to a question does not depend on which questions were asked before it."""
    import dataclasses

    from kvpolicy_core.eval.tasks.ruler_runner import run_context

    model, tok = tiny
    ctx = _suite(tok, questions=3)[0]
    assert len(ctx.questions) == 3
    backwards = dataclasses.replace(ctx, questions=ctx.questions[::-1])
    for spec in SPECS:
        fwd = run_context(model, tok, ctx, spec, ["query-agnostic"], 128, early_stop=False)
        bwd = run_context(model, tok, backwards, spec, ["query-agnostic"], 128, early_stop=False)
        assert [r["output"] for r in fwd] == [r["output"] for r in bwd][::-1], spec
        alone = run_context(
            model,
            tok,
            dataclasses.replace(ctx, questions=ctx.questions[1:2]),
            spec,
            ["query-agnostic"],
            128,
            early_stop=False,
        )
        assert alone[0]["output"] == fwd[1]["output"], spec


def test_shared_first_chunk_is_each_methods_own_prefill(tiny):
    """Replaying the recorded first chunk gives the answers of prefilling each method through generate_step."""
    from kvpolicy_core.eval.tasks.ruler_runner import run_suite

    model, tok = tiny
    suite = _suite(tok)[1:]  # vt: one question
    shared = run_suite(model, tok, suite, SPECS, prefill_step=128, early_stop=False)
    own = run_suite(model, tok, suite, SPECS, prefill_step=128, share_first_chunk=False, early_stop=False)
    assert [(r["method"], r["protocol"], r["output"]) for r in shared] == [
        (r["method"], r["protocol"], r["output"]) for r in own
    ]


def test_question_in_prompt_is_generate_step_on_the_full_prompt(tiny):
    """The shared chunk is an optimisation only: the answer equals mlx-lm's greedy decode of the whole prompt."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from kvpolicy_core.eval.perplexity import make_caches
    from kvpolicy_core.eval.tasks.ruler_runner import run_context

    model, tok = tiny
    ctx = _suite(tok)[1]
    spec = "h2o:budget=48,n_sink=2"
    got = run_context(model, tok, ctx, spec, ["question-in-prompt"], 128, early_stop=False)[0]
    q = ctx.questions[0]
    out = []
    for t, _ in generate_step(
        mx.array(ctx.full_prompt_ids(0)),
        model,
        max_tokens=q.max_new_tokens,
        prompt_cache=make_caches(model, spec),
        prefill_step_size=128,
    ):
        if t in ctx.stop_ids:
            break
        out.append(t)
    assert got["output"] == tok.decode(out) and got["new_tokens"] == len(out)


def test_cli_ruler_table_json_and_jsonl(capsys, tiny_model_dir, tmp_path):
    out, prompts = tmp_path / "ruler.json", tmp_path / "prompts.jsonl"
    base = [
        "eval",
        "--task",
        "ruler",
        "--model",
        str(tiny_model_dir),
        "--lengths",
        "400",
        "--ruler-tasks",
        "niah_single",
        "--haystack",
        "noise",
        "--no-progress",
    ]
    assert main(base + ["--export-jsonl", str(prompts)]) == 0
    assert [c.task for c in ruler.read_jsonl(prompts)] == ["niah_single"]
    code = main(
        base
        + [
            "--method",
            "h2o",
            "--ratio",
            "4",
            "--prefill-step",
            "128",
            "--json",
            str(out),
            "--protocol",
            "query-agnostic",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "h2o:budget=100" in printed and "full" in printed
    data = json.loads(out.read_text())
    assert {r["method"] for r in data["rows"]} == {"full", "h2o:budget=100"}
    assert {r["protocol"] for r in data["rows"]} == {"query-agnostic"}
    code = main(base + ["--ruler-tasks", "niah_single,qa"])
    assert code == 2 and "--ruler-tasks" in capsys.readouterr().err


def test_calibrated_prompts_lead_into_the_statements_words(tok):
    """The calibrated answer prefix ends where the asked statement's value begins; vt's chain reads forward."""
    ctx = build_context(tok, "niah_multikey", 900, "noise", 0)  # the calibrated preset
    text = tok.decode(ctx.context_ids)
    for q in ctx.questions:
        prefix = tok.decode(q.question_ids).rsplit("\n", 1)[-1].split("<pad>")[-1]
        assert prefix.startswith("One of the special magic numbers for ") and f"{prefix} {q.answers[0]}." in text
    vt = build_context(tok, "vt", 900, "noise", 0)
    a, b, c = vt.questions[0].answers
    assert f"VAR {a} is assigned to VAR {b}. " in tok.decode(vt.context_ids)
    assert tok.decode(vt.questions[0].question_ids).endswith("is assigned to VAR")
    assert ruler.preset_params("calibrated", "niah_multivalue", "smollm2-135m-float32").values == 4
    assert ruler.preset_params("calibrated", "niah_multivalue", "gemma3-270m-float32").values == 2
    assert ruler.preset_params("ruler", "niah_multivalue", "smollm2-135m-float32").answer == "ruler"


@pytest.mark.parametrize("replayed", [False, True])
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_first_chunk_then_the_rest_is_the_whole_context_prefill(tiny, gemma_model, replayed, family):
    """The shared first chunk plus the rest, chunked as generate_step chunks it, leaves a policy cache holding
    exactly what prefilling the whole context through generate_step leaves (same tokens kept, same keys)."""
    import numpy as np

    from kvpolicy_core.eval.perplexity import make_caches
    from kvpolicy_core.eval.tasks.ruler_runner import first_chunk_caches, prefill, record_first_chunk, shared_prefix

    model, tok = tiny
    if family == "gemma":  # sliding-window layers (window 8) next to global ones
        model = gemma_model
    ctx = _suite(tok)[1]
    n = shared_prefix(ctx, 128)
    assert n == 128
    record = record_first_chunk(model, ctx, 128) if replayed else None
    for spec in ("h2o:budget=48,n_sink=2", "cam:budget=48,n_sink=2"):
        whole = make_caches(model, spec)
        prefill(model, whole, ctx.context_ids, 128)
        split = first_chunk_caches(model, spec, ctx, 128, record)
        prefill(model, split, ctx.context_ids[n:], 128)
        for a, b in zip(whole, split):
            (ka, _, pa, _), (kb, _, pb, _) = a.retained(), b.retained()
            assert np.array_equal(np.array(pa), np.array(pb)), spec
            np.testing.assert_allclose(np.array(ka), np.array(kb), atol=1e-5)


# ----------------------------------------------------------------------------- the suite's options
RULER = ["eval", "--task", "ruler", "--no-progress"]


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--lengths", "1000000000"], "--lengths: each must be at most 1048576"),  # grew memory by 9 GB, silently
        (["--lengths", "5000"], "--lengths: 5000 tokens is beyond the model's 4096 positions"),
        (["--ratio", "nan"], "--ratio: expected finite numbers"),
        (["--ratio", "inf"], "--ratio: expected finite numbers"),
        (["--ratio", "1e-9"], "--ratio: each must be at least 1"),
        (["--ruler-tasks", ","], "--ruler-tasks: no task given"),
        (["--protocol", ""], "--protocol: no protocol given"),
        (["--seeds", "1000000000"], "--seeds must be in [1, 65536]"),
        (["--prefill-step", "99999999999"], "--prefill-step must be in [1, 1048576]"),
        (["--from-jsonl", "."], "--from-jsonl .: not a file"),
        (["--from-jsonl", "/nonexistent.jsonl"], "--from-jsonl /nonexistent.jsonl: no such file"),
        (["--json", "."], "--json .: is a folder"),
        (["--export-jsonl", "/dev/null/x.jsonl"], "--export-jsonl /dev/null/x.jsonl: cannot write there"),
    ],
)
def test_suite_options_are_one_line_naming_the_option(capsys, tiny_model_dir, extra, needle):
    code = main(RULER + ["--model", str(tiny_model_dir), "--lengths", "400"] + extra)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvpolicy: error:") and needle in lines[0], lines


def test_suite_json_to_an_unwritable_path_fails_before_the_run(capsys, tiny_model_dir, tmp_path, monkeypatch):
    import kvpolicy_core.apps.cli as cli

    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: pytest.fail("the run started"))
    (tmp_path / "file").write_text("")
    code = main(RULER + ["--model", str(tiny_model_dir), "--json", str(tmp_path / "file" / "r.json")])
    assert code == 2 and "--json " in capsys.readouterr().err


def test_from_jsonl_ids_outside_the_vocabulary_are_refused_naming_the_line(capsys, tiny_model_dir, tmp_path):
    rec = {"id": "c", "task": "niah_single", "length": 64, "context_ids": [1, 2, 5000],
           "questions": [{"question_ids": [3], "answers": ["1"], "max_new_tokens": 2}]}  # fmt: skip
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    code = main(RULER + ["--model", str(tiny_model_dir), "--from-jsonl", str(path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"{path}:1.context_ids: token id 5000 at index 2" in lines[0], lines
    path.write_text("")
    code = main(RULER + ["--model", str(tiny_model_dir), "--from-jsonl", str(path)])
    assert code == 2 and "the file holds no context" in capsys.readouterr().err


def test_long_context_report_on_a_corrupt_file_is_one_line_naming_the_option(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "long_context.py"
    bad = tmp_path / "bad.json"
    cases = (('{"rows": [', "not a JSON file"), ('{"rows": [{"id": 1}]}', "row 0 lacks"), ("[]", "no 'rows'"))
    for text, needle in cases:
        bad.write_text(text)
        done = subprocess.run([sys.executable, str(script), "--report", str(bad)], capture_output=True, text=True)
        lines = [x for x in done.stderr.strip().splitlines() if "warning" not in x]
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith("long_context.py: error: --report ") and needle in lines[0], lines
