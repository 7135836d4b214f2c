"""The kvpolicy CLI on a tiny random-weight model directory, including every error path."""

import io
import json

import pytest

from kvpolicy_core.apps.cli import main


def run(capsys, *argv, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_methods_lists_packages_parts_and_fields(capsys):
    code, out, _ = run(capsys, "methods")
    assert code == 0
    from importlib.metadata import version  # the installed distributions' (0.3.0 once reinstalled)

    assert (
        f"cam  (kvpolicy-cam {version('kvpolicy-cam')})" in out
        and f"h2o  (kvpolicy-h2o {version('kvpolicy-h2o')})" in out
    )
    assert "disposition=mass_merge" in out and "disposition=drop" in out
    assert "budget = 512" in out and "merge = 'mass'" in out
    code, out, _ = run(capsys, "methods", "--json")
    data = {m["method"]: m for m in json.loads(out)["methods"]}
    assert (
        data["cam"]["fields"]["merge_gate"]["default"] is False and data["h2o"]["parts"]["selector"] == "lowest_score"
    )


def _section(out: str, method: str) -> str:
    """The lines of one method in `kvpolicy methods`: from its header to the next unindented line."""
    lines = out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.split()[:1] == [method] and not x.startswith(" "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
    return "\n".join(lines[start:end])


def test_methods_lists_the_common_fields_once_and_each_method_only_its_own(capsys):
    code, out, _ = run(capsys, "methods")
    assert code == 0 and out.count("common to every method") == 2  # KVCacheConfig's block, PolicyConfig's block
    for common in ("budget = 512", "n_sink = 4", "seed = 0", "kv_group_size = 64"):
        assert out.count(common) == 1, common  # once, above the methods
    cam = _section(out, "cam")
    assert "merge = 'mass'" in cam and "obs_window = None" not in cam  # the attention methods' fields: once
    assert out.count("obs_window = None") == 1 and "fields (besides AttentionPolicyConfig above):" in cam
    assert "AttentionPolicyConfig defaults changed: obs_window=32, pool=7" in _section(out, "snapkv")
    assert not any(f"    {f} " in cam for f in ("budget", "n_sink", "recent", "seed", "when", "allocation"))
    assert "common defaults changed: signal='observed', when='prompt_end'" in cam
    assert "rope_freqs" not in out and "rope_traditional" not in out  # the builder fills them from the model
    assert "common fields not used by this method: signal" in _section(out, "random")


def test_methods_json_is_complete_and_split_the_same_way(capsys):
    from kvpolicy_core.config.parse import parse_config
    from kvpolicy_core.config.policy_config import COMMON_FIELDS, PolicyConfig

    code, out, _ = run(capsys, "methods", "--json")
    assert code == 0
    doc = json.loads(out)
    common = doc["common_fields"]
    assert list(common["KVCacheConfig"]) == list(COMMON_FIELDS) and common["KVCacheConfig"]["method"]["required"]
    assert list(common["PolicyConfig"]) == list(PolicyConfig.model_fields)
    assert common["PolicyConfig"]["budget"]["default"] == 512
    for m in doc["methods"]:  # common defaults, the method's changes and its own fields give every default
        defaults = {k: v["default"] for k, v in common["PolicyConfig"].items()}
        defaults.update(m["common_defaults_changed"])
        defaults.update({k: v["default"] for k, v in m["fields"].items()})
        want = json.loads(json.dumps(parse_config(m["method"]).policy.model_dump(), default=str))
        assert defaults == want, m["method"]
        assert not set(m["fields"]) & set(PolicyConfig.model_fields)
    cam = {m["method"]: m for m in doc["methods"]}["cam"]
    assert cam["fields"]["rope_freqs"]["filled_by_builder"] and not cam["fields"]["merge"]["filled_by_builder"]
    assert cam["common_defaults_changed"] == {"signal": "observed", "when": "prompt_end"}


def test_generate_from_argument_file_and_stdin(capsys, tiny_model_dir, tmp_path, monkeypatch):
    code, out, err = run(
        capsys,
        "generate",
        "hello world, a long prompt",
        "--model",
        str(tiny_model_dir),
        "--method",
        "cam:budget=8,n_sink=2",
        "--max-tokens",
        "12",
    )
    assert code == 0 and out.strip()
    # the gate off is implied by the mass merge: not spelled out in the label
    assert "[cam:budget=8,n_sink=2]" in err and "tok/s" in err and "KV kept" in err and "peak memory" in err
    prompt = tmp_path / "p.txt"
    prompt.write_text("a prompt from a file that is long")
    code, out, err = run(
        capsys,
        "generate",
        "--file",
        str(prompt),
        "--model",
        str(tiny_model_dir),
        "--method",
        "h2o:budget=8,n_sink=2",
        "--max-tokens",
        "5",
        "--json",
    )
    summary = json.loads(err.strip().splitlines()[-1])
    assert code == 0 and summary["generation_tokens"] == 5 and summary["kv_bytes_kept"] <= summary["kv_bytes_full"]
    assert summary["compression_ratio"] > 1
    code, out, err = run(
        capsys,
        "generate",
        "--model",
        str(tiny_model_dir),
        "--max-tokens",
        "3",
        "--method",
        "full",
        stdin="from stdin",
        monkeypatch=monkeypatch,
    )
    assert code == 0 and "[full]" in err


def test_eval_table_and_json(capsys, tiny_model_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    out_json = tmp_path / "r.json"
    code, out, err = run(
        capsys,
        "eval",
        "--model",
        str(tiny_model_dir),
        "--file",
        str(text),
        "--tokens",
        "60",
        "--method",
        "full",
        "--method",
        "rotating",
        "--method",
        "cam:n_sink=2",
        "--budget",
        "12",
        "--budget",
        "24",
        "--json",
        str(out_json),
        "--no-progress",
    )
    assert code == 0
    for label in (
        "full",
        "rotating:budget=12",
        "rotating:budget=24",
        "cam:budget=12,n_sink=2",
        "cam:budget=24,n_sink=2",
    ):
        assert label in out
    data = json.loads(out_json.read_text())
    assert data["tokens"] == 60 and len(data["results"]) == 5
    full = data["results"][0]
    assert full["spec"] == "full" and len(full["nll"]) == 59 and full["kv_bytes_kept"] == full["kv_bytes_full"]
    assert all(r["kv_bytes_kept"] < full["kv_bytes_kept"] for r in data["results"][1:])


def test_eval_chunked_mode_and_config_files(capsys, tiny_model_dir, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('method = "cam"\nbudget = 16\nn_sink = 2\nmerge = "mean"\n')
    code, out, _ = run(
        capsys,
        "eval",
        "--model",
        str(tiny_model_dir),
        "--config",
        str(cfg),
        "--tokens",
        "40",
        "--chunk",
        "8",
        "--no-progress",
    )
    assert code == 0 and "cam:budget=16,n_sink=2,merge=mean" in out and "chunk: 8" in out
    cfg = tmp_path / "c.json"
    cfg.write_text('{"method": "h2o", "h2o_budget": 16, "h2o_n_sink": 2}')
    code, out, _ = run(
        capsys,
        "eval",
        "--model",
        str(tiny_model_dir),
        "--config",
        str(cfg),
        "--tokens",
        "30",
        "--no-progress",
        "--json",
        "-",
    )
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["results"][0]["spec"] == "h2o:budget=16,n_sink=2"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["eval", "--method", "nosuchkv"], "unknown method 'nosuchkv'; installed methods: cam, chunkkv, h2o"),
        (["eval", "--method", "cam:merge=avg"], "cam_merge: Input should be"),
        (["eval", "--method", "cam:budget"], "item 1 'budget' is not key=value"),
        (["eval", "--method", "rotating:budget=3"], "rotating_budget"),
        (["eval", "--method", "rotating:size=3"], "unknown field"),
        (["eval", "--method", "full:budget=3"], "'full' takes no options"),
        (["eval", "--file", "/nonexistent.txt"], "corpus file not found"),
        (["eval", "--tokens", "1"], "--tokens must be in [2, 1048576]"),
        (["eval", "--chunk", "0"], "--chunk must be >= 1"),
        (["eval", "--config", "/nonexistent.json"], "no such file"),
        (["generate", "x", "--method", "cam", "--config", "c.json"], "either --method or --config"),
        (["generate", "--file", "/nonexistent.txt"], "no such file"),
        (["generate", "x", "--model", "/tmp"], "not an mlx-lm model directory"),
        (["generate", "x", "--method", "h2o:budget=4,n_sink=4"], "budget must be greater than n_sink + recent"),
    ],
)
def test_errors_are_one_clear_line(capsys, argv, needle, tiny_model_dir):
    if "--model" not in argv and argv[0] in ("eval", "generate") and "--file" not in argv[:2]:
        argv = argv + ["--model", str(tiny_model_dir)]
    code, out, err = run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpolicy: error:") and needle in lines[0], err


def test_bad_config_files_are_clear(capsys, tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    code, _, err = run(capsys, "eval", "--config", str(bad), "--model", str(tiny_model_dir))
    assert code == 2 and "invalid JSON at line 1" in err
    bad = tmp_path / "bad.toml"
    bad.write_text("method = ")
    code, _, err = run(capsys, "eval", "--config", str(bad), "--model", str(tiny_model_dir))
    assert code == 2 and "invalid TOML" in err


def test_no_prompt_is_an_error(capsys, tiny_model_dir, monkeypatch):
    code, _, err = run(capsys, "generate", "--model", str(tiny_model_dir), stdin="", monkeypatch=monkeypatch)
    assert code == 2 and "no prompt" in err


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"\x00\x01\x9c\xffELF", "not UTF-8 text (byte 0x9c at offset 2)"),
        (b"", "the file is empty"),
        (b" \n\t\n", "the file is empty"),
        (None, "is a directory, not a file"),
    ],
)
def test_unreadable_text_files_are_one_line_naming_the_file(capsys, tmp_path, tiny_model_dir, content, needle):
    path = tmp_path / "in.toml"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    for argv, who in (
        (["generate", "--file", str(path)], "kvpolicy: error: --file"),
        (["eval", "--config", str(path)], "kvpolicy: error: --config"),
        (["serve", "--method", str(path)], "kvpolicy serve: error: --method"),
    ):
        code, _, err = run(capsys, *argv, "--model", str(tiny_model_dir))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0] == f"{who} {path}: {needle}", err


def test_prompt_file_with_a_bom_and_from_a_pipe(capsys, tmp_path, tiny_model_dir):
    import os
    import threading

    from kvpolicy_core.apps.textfile import read_text_file

    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbfhello")
    assert read_text_file(str(bom), "--file") == "hello"
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # as `--file <(...)` gives: readable, not a regular file
    writer = threading.Thread(target=lambda: fifo.write_text("hello world from a pipe"))
    writer.start()
    code, out, err = run(
        capsys, "generate", "--file", str(fifo), "--model", str(tiny_model_dir), "--max-tokens", "2", "--method", "full"
    )
    writer.join(timeout=10)
    assert code == 0 and "[full]" in err, err


# ----------------------------------------------------------------------------- numeric options and results files
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", "x", "--temp", "nan"], "--temp must be a finite number >= 0"),
        (["generate", "x", "--temp", "inf"], "--temp must be a finite number >= 0"),
        (["generate", "x", "--temp", "-1"], "--temp must be a finite number >= 0"),
        (["generate", "x", "--max-tokens", "0"], "--max-tokens must be in [1, 1048576]"),
        (["generate", "x", "--max-tokens", "-5"], "--max-tokens must be in [1, 1048576]"),
        (["eval", "--tokens", "1000000000"], "--tokens must be in [2, 1048576]"),
        (["eval", "--chunk", "10000000000"], "--chunk must be in [1, 1048576]"),
        (
            ["cache-prompt", "x", "--prompt-cache-file", "f.safetensors", "--prefill-step-size", "0"],
            "--prefill-step-size must be in [1, 1048576]",
        ),  # fmt: skip
        (["eval", "--budget", "99999999999"], "h2o_budget: Input should be less than or equal to 2147483647"),
    ],
)
def test_numeric_options_are_bounded_in_one_line_naming_the_option(capsys, argv, needle, tiny_model_dir):
    code, out, err = run(capsys, *argv, "--model", str(tiny_model_dir))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvpolicy: error:") and needle in lines[0], err


def test_eval_json_to_an_unwritable_path_fails_before_the_run(capsys, tiny_model_dir, tmp_path, monkeypatch):
    import kvpolicy_core.apps.cli as cli

    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: pytest.fail("the run started"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for dest in (str(blocker / "results.json"), str(tmp_path)):
        code, _, err = run(capsys, "eval", "--json", dest, "--model", str(tiny_model_dir))
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and f"--json {dest}:" in lines[0], err


def test_a_failed_results_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """The results are written to a temporary file and renamed: a full disk no longer leaves half a JSON file."""
    import errno
    import os

    from kvpolicy_core.eval.tasks.cli_options import write_json

    dest = tmp_path / "results.json"
    write_json({"run": 1}, str(dest))
    assert json.loads(dest.read_text()) == {"run": 1}

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(ValueError, match=r"--json .*results\.json: could not be written \(No space left on device\)"):
        write_json({"run": 2, "rows": list(range(1000))}, str(dest))
    assert json.loads(dest.read_text()) == {"run": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no temporary file left behind


DOCUMENT = "The code of the red door is 48213 and the blue door opens with 77. " * 3


def test_cache_prompt_refuses_stream_with_a_compress_once_method_in_one_line(capsys, tiny_model_dir, tmp_path):
    out = tmp_path / "doc.safetensors"
    code, _, err = run(
        capsys,
        *("cache-prompt", DOCUMENT, "--model", str(tiny_model_dir), "--method", "kvzip+cam:budget=32"),
        *("--compress-once", "stream", "--prompt-cache-file", str(out)),
    )
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvpolicy: error: --compress-once stream"), err
    assert not out.exists()
    # a compress-once method with --budget and no --compress-once: the method's own scorer, no contradiction
    code, out_text, err = run(
        capsys,
        *("cache-prompt", DOCUMENT, "--model", str(tiny_model_dir), "--method", "kvzip-layerwise+cam"),
        *("--budget", "32", "--prompt-cache-file", str(out), "--json"),
    )
    assert code == 0, err
    summary = json.loads(out_text)
    assert summary["compress_once"] == "kvzip-layerwise" and summary["budget"] == 32


def test_generate_from_a_prompt_cache_saves_the_caches_it_ends_with(capsys, tiny_model_dir, tmp_path):
    from kvpolicy_core.apps.prompt_file import file_metadata
    from kvpolicy_core.integration.persistence import load_caches

    doc = tmp_path / "doc.safetensors"
    code, _, err = run(
        capsys,
        *("cache-prompt", DOCUMENT, "--model", str(tiny_model_dir), "--method", "cam:budget=32"),
        *("--prompt-cache-file", str(doc)),
    )
    assert code == 0, err
    before = doc.read_bytes()
    saved = tmp_path / "after.safetensors"
    code, _, err = run(
        capsys,
        *("generate", "what opens the blue door?", "--prompt-cache", str(doc), "--max-tokens", "4"),
        *("--save-caches", str(saved), "--json"),
    )
    assert code == 0, err
    summary = json.loads(err.strip().splitlines()[-1])
    assert summary["caches_file"] == str(saved) and doc.read_bytes() == before
    caches = load_caches(saved)
    n_doc = int(file_metadata(doc)[0]["tokens_seen"])
    # the document, then the question's tokens and the answer's (mlx-lm feeds each token it yields)
    assert n_doc + summary["prompt_tokens"] < caches[0].offset <= n_doc + summary["prompt_tokens"] + 4
