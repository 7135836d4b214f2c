"""Progress of long work on stderr (kvpolicy_core.runtime.progress): one line rewritten in place on a terminal, one
plain line per step elsewhere (never a bar flood in a log), silent inside quiet() and for short work; and the
command line's prefill and reconstruction lines on a non-terminal stderr."""

import io

import pytest

from kvpolicy_core.apps.cli import main
from kvpolicy_core.runtime import progress


class Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def feed(rep, steps, total):
    for done in steps:
        rep(done, total)


def test_off_a_terminal_one_plain_line_per_step_with_the_stage_and_tokens_done():
    s = Stream(tty=False)
    feed(progress.reporter("prefill", stream=s), [0, 2048, 2048, 4095, 4096], 4096)  # a repeated step: one line
    lines = s.getvalue().splitlines()
    assert "\r" not in s.getvalue() and s.getvalue().endswith("\n")
    assert [line.split(" (")[0] for line in lines] == [
        "kvpolicy: prefill 0/4096 tokens",
        "kvpolicy: prefill 2048/4096 tokens",
        "kvpolicy: prefill 4095/4096 tokens",
        "kvpolicy: prefill 4096/4096 tokens",
    ]
    assert all(line.endswith(" s)") for line in lines)


def test_on_a_terminal_one_line_rewritten_in_place_and_ended_when_done():
    s = Stream(tty=True)
    rep = progress.reporter("reconstruction", stream=s)
    feed(rep, [0, 1024], 100_000)
    assert "\n" not in s.getvalue() and s.getvalue().count("\r") == 2
    assert progress._open is s  # an unfinished line is open
    rep(100_000, 100_000)
    out = s.getvalue()
    assert out.count("\r") == 3 and out.endswith("\n") and out.count("\n") == 1 and progress._open is None
    frames = out.rstrip("\n").split("\r")[1:]
    assert [f.split(" (")[0] for f in frames] == [
        "kvpolicy: reconstruction 0/100000 tokens",
        "kvpolicy: reconstruction 1024/100000 tokens",
        "kvpolicy: reconstruction 100000/100000 tokens",
    ]
    s = Stream(tty=True)
    feed(progress.reporter("prefill", stream=s), [90_000, 5], 100_000)
    first, second = s.getvalue().split("\r")[1:]
    assert len(second) == len(first) and second.endswith(" ")  # a shorter frame is padded over the longer one


def test_a_line_left_open_is_ended_before_the_next_message():
    s = Stream(tty=True)
    progress.reporter("prefill", stream=s)(600, 1000)
    progress.end_line()
    assert s.getvalue().endswith("\n") and progress._open is None
    progress.end_line()  # nothing open: nothing written
    assert s.getvalue().count("\n") == 1


def test_quiet_short_work_labels_and_offsets():
    s = Stream(tty=False)
    with progress.quiet():
        progress.reporter("prefill", stream=s)(4096, 4096)
        assert not progress.enabled()
    with progress.quiet(False):
        assert progress.enabled()
    progress.reporter("prefill", stream=s)(100, progress.MIN_TOKENS - 1)  # short work: nothing
    assert s.getvalue() == ""
    with progress.labelled("niah_single-4096-s0"), progress.labelled("cam:budget=512"):
        progress.reporter("prefill", stream=s, offset=2048)(1024, 2048)
    assert s.getvalue().startswith("kvpolicy: niah_single-4096-s0 cam:budget=512: prefill 3072/4096 tokens (")


def test_a_broken_stream_never_fails_the_work():
    s = Stream(tty=False)
    s.close()
    rep = progress.reporter("prefill", stream=s)
    rep(0, 4096)
    rep(4096, 4096)  # no error


DOC = "The launch code of the red door is 48213. " * 16  # ~700 tokens of the tiny models' character tokenizer


@pytest.mark.parametrize(
    "mode, stages",
    [("kvzip", ["prefill", "reconstruction"]), ("stream", ["prefill"])],
)
def test_cache_prompt_reports_its_stages_on_a_non_terminal_stderr(capsys, tiny_model_dir, tmp_path, mode, stages):
    out_file = tmp_path / f"{mode}.safetensors"
    argv = ["cache-prompt", DOC, "--model", str(tiny_model_dir), "--method", "cam:budget=32", "--json"]
    argv += ["--prefill-step-size", "256", "--compress-once", mode, "--prompt-cache-file", str(out_file)]
    assert main(argv) == 0
    _, err = capsys.readouterr()
    assert "\r" not in err
    for stage in stages:
        lines = [line for line in err.splitlines() if line.startswith(f"kvpolicy: {stage} ")]
        total = int(lines[-1].split()[2].split("/")[1])
        assert total >= progress.MIN_TOKENS
        done = [int(line.split()[2].split("/")[0]) for line in lines]
        assert done[0] == 0 and done[-1] == total and done == sorted(done) and len(done) >= 2, err
    assert ("reconstruction" in err) == (mode == "kvzip")
