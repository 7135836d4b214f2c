"""Files the user names: kvpolicy writes only regular files. A path that exists and is not one (a FIFO standing in
for a device such as ``/dev/full``, a directory), or a symlink to one, is refused with one line naming it, before any
work, and is left as it was; an output directory that is missing fails before the model loads. A prompt-cache file
whose header is not what safetensors writes is refused naming the file, by ``generate`` and ``serve`` alike."""

from __future__ import annotations

import json
import os
import stat
import struct

import pytest
from helpers import tiny_gemma3

from kvpolicy_core import KVCacheBuilder
from kvpolicy_core.apps import cli, serve
from kvpolicy_core.eval.tasks.cli_options import atomic_write_text, check_output, write_json
from kvpolicy_core.integration.persistence import CacheFileError, save_caches


@pytest.fixture(params=["fifo", "link-to-fifo", "directory", "link-to-directory"])
def target(request, tmp_path):
    """A path that is not a regular file (a FIFO stands in for a device node), and a check that it is unchanged."""
    fifo, folder = tmp_path / "pipe.safetensors", tmp_path / "folder.safetensors"
    os.mkfifo(fifo)
    folder.mkdir()
    real = fifo if "fifo" in request.param else folder
    path = real
    if request.param.startswith("link"):
        path = tmp_path / "link.safetensors"
        path.symlink_to(real)

    def unchanged():
        mode = os.stat(real).st_mode
        assert stat.S_ISFIFO(mode) if real is fifo else stat.S_ISDIR(mode), f"{real} was replaced"
        assert not list(folder.iterdir()), "something was written into the folder"
        if path is not real:
            assert os.path.islink(path) and os.readlink(path) == str(real)

    return path, unchanged


def test_save_caches_never_replaces_a_pipe_or_folder_nor_writes_through_a_link_to_one(target):
    path, unchanged = target
    model = tiny_gemma3()
    caches = KVCacheBuilder.for_model(model, "h2o:budget=8")
    with pytest.raises(CacheFileError, match="not a regular file"):
        save_caches(path, caches)
    unchanged()


def test_results_json_never_replaces_a_pipe_or_folder(target, capsys):
    path, unchanged = target
    with pytest.raises(ValueError, match="not a regular file"):
        check_output(str(path), "--json")
    with pytest.raises(ValueError, match="not a regular file"):
        write_json({"a": 1}, str(path))
    with pytest.raises(ValueError, match="not a regular file"):
        atomic_write_text(path, "{}", "--out")
    assert "wrote" not in capsys.readouterr().err
    unchanged()


def test_eval_json_to_a_pipe_is_refused_before_the_run(target, capsys):
    path, unchanged = target
    assert cli.main(["eval", "--model", "/nonexistent-model", "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--json {path}: is a" in err and "not a regular file" in err and "wrote" not in err
    unchanged()


def test_a_symlink_to_a_regular_file_is_written_through(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_json({"a": 1}, str(link))
    assert os.path.islink(link) and json.loads(real.read_text()) == {"a": 1}


@pytest.mark.parametrize("option", ["--save-caches", "--prompt-cache-file"])
def test_cache_files_to_a_missing_folder_or_a_pipe_fail_before_the_model_loads(tmp_path, capsys, option):
    os.mkfifo(tmp_path / "pipe.safetensors")
    command = ["generate", "hi"] if option == "--save-caches" else ["cache-prompt", "hi"]
    for dest, why in (
        (tmp_path / "missing" / "x.safetensors", "does not exist"),
        (tmp_path / "pipe.safetensors", "not a regular file"),
    ):
        # a model path that does not exist: reaching the model would be a different error
        assert cli.main([*command, option, str(dest), "--model", str(tmp_path / "no-model")]) == 2
        err = capsys.readouterr().err
        assert f"{option} {dest}" in err and why in err, err
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe.safetensors").st_mode)


def _file_with_header(path, header) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


@pytest.mark.parametrize("metadata", [["0.model", "x"], "a string", 7])
def test_a_prompt_file_whose_metadata_is_not_an_object_is_refused_naming_it(tmp_path, capsys, metadata):
    path = tmp_path / "doc.safetensors"
    _file_with_header(path, {"__metadata__": metadata})
    assert cli.main(["generate", "--prompt-cache", str(path), "question"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: not a safetensors prompt-cache file" in err and "__metadata__" in err
    assert "unexpected" not in err
    assert serve.main(["--prompt-cache", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: not a safetensors prompt-cache file" in err and "__metadata__" in err


def test_a_prompt_file_whose_header_is_not_an_object_is_refused(tmp_path, capsys):
    path = tmp_path / "doc.safetensors"
    _file_with_header(path, [1, 2])
    assert cli.main(["generate", "--prompt-cache", str(path), "question"]) == 2
    assert f"{path}: not a safetensors prompt-cache file" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["directory", "loop"])
def test_a_prompt_file_that_is_a_folder_or_a_symlink_loop_is_named_as_such(tmp_path, capsys, kind):
    path = tmp_path / "doc.safetensors"
    if kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(path)
    assert cli.main(["generate", "--prompt-cache", str(path), "question"]) == 2
    err = capsys.readouterr().err
    assert ("is a folder" if kind == "directory" else "symlink loop") in err and "no such file" not in err
