"""``kvpolicy generate --prompt-cache`` refusing a file after the model has loaded exits with status 2 and its one
error line, every time: the command ends with ``os._exit`` after flushing (cli.entry), so MLX's threads torn down
during interpreter shutdown cannot turn the refusal into ``terminate called without an active exception``
(SIGABRT, exit 134)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpolicy_core.testing.tiny_models import write_model_dir

RUNS = 6


@pytest.fixture(scope="module")
def refused_file(tmp_path_factory):
    """A prompt file whose recorded model directory now holds other weights: refused after the model loads."""
    d = tmp_path_factory.mktemp("exit")
    model = write_model_dir(d / "model", "llama", layers=2)
    (d / "doc.txt").write_text("the secret number is 4821. the quick brown fox jumps over the lazy dog. " * 3)
    path = d / "doc.safetensors"
    args = ["cache-prompt", "--model", str(model), "--file", str(d / "doc.txt"), "--method", "h2o:budget=16,n_sink=2"]
    args += ["--compress-once", "stream", "--prompt-cache-file", str(path)]
    proc = subprocess.run([sys.executable, "-m", "kvpolicy_core.apps.cli", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    write_model_dir(d / "model", "llama", layers=2, seed=1)  # other weights at the recorded path
    return path


def test_a_refusal_after_the_model_loaded_exits_2_every_time(refused_file):
    cmd = [sys.executable, "-m", "kvpolicy_core.apps.cli", "generate", "--prompt-cache", str(refused_file), "q?"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(RUNS)]
    results = [(p.wait(timeout=600), p.communicate()[1]) for p in procs]
    for code, err in results:
        lines = err.strip().splitlines()
        assert code == 2, (code, err[-2000:])
        assert lines[-1].startswith("kvpolicy: error:") and "is not the one this file was made with" in lines[-1], err
        assert "terminate called" not in err
