"""Run under ``mlx.launch``: several ``kvpolicy`` CLI commands (the CLI's ``main``) in one launch.

Usage: ``python distributed_driver.py RUNS.json OUT_DIR``; RUNS.json is a list of argv lists
(``["generate", "prompt", "--model", DIR, ...]``). For run i, rank 0 writes what the command
printed to ``OUT_DIR/<i>.out`` / ``<i>.err``; every rank writes ``OUT_DIR/report.rank<r>.json``
with each run's exit code and, for runs with ``--save-caches F``, whether its own rank file
loads back and how the other rank's file is refused. One launch for many commands keeps the
suite fast: every process start imports mlx-lm, which takes seconds on 2 cores.
"""

import contextlib
import io
import json
import sys
import time
from pathlib import Path


def main() -> int:
    start = time.perf_counter()
    runs, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    from kvpolicy_core.runtime.blas import load_optimized_blas

    load_optimized_blas(quiet=True)  # before mlx, as the CLI does: the same BLAS as the one-process run
    import mlx.core as mx

    from kvpolicy_core.apps.cli import main as cli
    from kvpolicy_core.integration.persistence import CacheFileError, load_caches
    from kvpolicy_core.runtime.distributed import rank_path, world

    rank, size = world()
    report = {"startup_seconds": round(time.perf_counter() - start, 2), "runs": []}
    for i, argv in enumerate(runs):
        stdout, stderr = io.StringIO(), io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = cli(argv)
        entry = {"argv": argv, "code": code, "seconds": round(time.perf_counter() - start, 2)}
        if code == 0 and "--save-caches" in argv:
            saved = argv[argv.index("--save-caches") + 1]
            mx.eval(mx.distributed.all_sum(mx.array(1.0)))  # barrier: the other rank's file is written
            entry["own_layers"] = [getattr(c, "layer", None) for c in load_caches(saved)]
            try:
                load_caches(rank_path(saved, ((rank + 1) % size, size)))
                entry["other_refused"] = None
            except CacheFileError as exc:
                entry["other_refused"] = str(exc)
        if rank == 0:
            (out / f"{i}.out").write_text(stdout.getvalue())
            (out / f"{i}.err").write_text(stderr.getvalue())
        report["runs"].append(entry)
    (out / f"report.rank{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
