"""scripts/demo.sh into a log (not a terminal): no progress-bar flood, one line per step, and the tree left clean.

Cheap: the script runs in a copy of the repository's layout where set-up is a no-op and ``.venv/bin/kvpolicy`` a
stand-in that draws a tqdm bar as ``kvpolicy eval`` does (300 updates) and writes the recorded results to the
``--json`` path it is given; the real ``benchmarks/demo_table.py`` prints the table from them.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # new processes (bash, Python): a second or two each

FAKE_KVPOLICY = """\
#!{python}
import shutil, sys
from pathlib import Path

from tqdm.auto import tqdm

args = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
bar = tqdm(total=300, desc="[1/1] full", unit="tok", leave=False)  # as kvpolicy_core.eval.perplexity draws it
for _ in range(300):
    bar.update(1)
bar.close()
print("[1/1] full: ppl 20.134, 5.2 tok/s", file=sys.stderr)
recorded = "demo_needle.json" if "--task" in args else "demo.json"
shutil.copy({root!r} + "/benchmarks/results/" + recorded, args[args.index("--json") + 1])
"""


def git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


@pytest.fixture
def demo_tree(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    t = tmp_path / "repo"
    (t / "scripts").mkdir(parents=True)
    (t / "benchmarks" / "results").mkdir(parents=True)
    (t / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "demo.sh", t / "scripts" / "demo.sh")
    (t / "scripts" / "setup.sh").write_text("echo 'setup: nothing to do'\n")
    for name in ("demo_table.py", "_harness.py"):
        shutil.copy(ROOT / "benchmarks" / name, t / "benchmarks" / name)
    for name in ("demo.json", "demo_needle.json"):  # the recorded results, tracked
        shutil.copy(ROOT / "benchmarks" / "results" / name, t / "benchmarks" / "results" / name)
    shutil.copy(ROOT / ".gitignore", t / ".gitignore")
    fake = t / ".venv" / "bin" / "kvpolicy"
    fake.write_text(FAKE_KVPOLICY.format(python=sys.executable, root=str(ROOT), calls=str(tmp_path / "calls.txt")))
    python = t / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for p in (fake, python):
        p.chmod(0o755)
    git(t, "init", "-q")
    git(t, "add", "-A")
    git(t, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "tree")
    return t


def test_demo_into_a_log_has_no_progress_bars_and_leaves_the_tree_clean(demo_tree):
    log = demo_tree.parent / "demo.log"
    with open(log, "w") as out:  # stdout and stderr to a file: no terminal
        proc = subprocess.run(
            ["bash", "scripts/demo.sh"], cwd=demo_tree, stdout=out, stderr=subprocess.STDOUT, timeout=120
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text and "%|" not in text, "progress bars in a log"
    lines = text.splitlines()
    assert len(lines) < 40, text
    assert [ln.split("]")[0] for ln in lines if ln.startswith("demo: [")] == [f"demo: [{i}/4" for i in range(1, 5)]
    assert any(ln.startswith("cam:budget=64") for ln in lines), text  # the table
    calls = (demo_tree.parent / "calls.txt").read_text().splitlines()
    assert len(calls) == 2 and all("--json benchmarks/results/local/" in c for c in calls), calls
    assert (demo_tree / "benchmarks" / "results" / "local" / "demo_needle.json").is_file()
    assert git(demo_tree, "status", "--porcelain") == "", "the demo changed the tree"


def test_demo_on_a_terminal_keeps_its_progress_bars(demo_tree):
    """With stderr on a pseudo-terminal the bars are drawn."""
    import fcntl
    import os
    import pty
    import struct
    import termios
    import threading

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty has 0 columns: no bar
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the other end closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc = subprocess.run(["bash", "scripts/demo.sh"], cwd=demo_tree, stdout=slave, stderr=slave, timeout=120)
    os.close(slave)
    reader.join(timeout=10)
    os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, out[-3000:]
    assert "%|" in out, textwrap.shorten(out, 2000)  # a bar: "[1/1] full:   0%|          | 0/300"
    assert git(demo_tree, "status", "--porcelain") == ""
