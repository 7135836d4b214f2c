"""The benchmark harness every program under benchmarks/ uses: BLAS first, common arguments, result
names, a timed step, interleaved rounds, and JSON results with the command, versions and BLAS.

A new benchmark script::

    from _common import Stopwatch, interleave, parser, result_name, summarize, write_json  # BLAS loads here
    import mlx.core as mx  # noqa: E402  (after the BLAS, via _common)

    def main(argv=None):
        p = parser(__doc__, rounds=3, seed=0)          # --smoke --out --tag [--rounds] [--seed]
        p.add_argument("--budget", type=int, default=64)  # the script's own options
        args = p.parse_args(argv)
        if args.smoke:                                 # tiny sizes: tests/test_benchmarks.py runs this
            args.budget, args.rounds = 8, 1
        samples = interleave({"h2o": step_h2o, "cam": step_cam}, args.rounds)  # A,B,A,B,...: seconds per call
        rows = summarize(samples, baseline="h2o")      # medians and ratios to the baseline, side by side
        print(f"wrote {write_json(result_name('mybench', args), {'rows': rows}, args.out)}")

``result_name("mybench", args)`` is ``mybench[_<tag>][_smoke]``; ``write_json`` writes
``<out>/<name>.json`` atomically with ``command`` and ``versions`` (mlx, mlx-lm, kvpolicy, Python,
BLAS) added. :class:`Stopwatch` times one step on the wall and CPU clocks; :func:`timed` is the
median of repeated calls of one function. Tiny random-weight models come from
:mod:`kvpolicy_core.testing.tiny_models`. The BLAS-free pieces live in ``_harness.py`` (re-exported here; it
never imports this module).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvpolicy_core.runtime.blas import load_optimized_blas

BLAS = load_optimized_blas(quiet=True)

import mlx.core as mx  # noqa: E402,F401  (after the BLAS; scripts import mx from here)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402,F401  (the harness, re-exported; _harness never imports this module)
    RESULTS,
    Stopwatch,
    interleave,
    median,
    parser,
    plot_time_memory,
    result_name,
    summarize,
    timed,
    timed_step,
    versions,
    with_budget,
    write_json,
)
