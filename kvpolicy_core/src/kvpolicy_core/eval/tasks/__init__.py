"""Evaluation tasks beyond perplexity (retrieval: :mod:`.needle`; haystack texts: :mod:`.haystack`).

This module imports no mlx, so the command line can build its parser first.
"""

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def add_needle_arguments(parser) -> None:
    """The retrieval options of ``kvpolicy eval`` (used with ``--task needle|needle-multikey``)."""
    g = parser.add_argument_group("retrieval (--task needle, needle-multikey)")
    g.add_argument(
        "--depths",
        default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS),
        help="needle depths in [0, 1], comma-separated (default 0,0.25,0.5,0.75,1)",
    )
    g.add_argument(
        "--lengths",
        help="haystack lengths in tokens, comma-separated (default 1000; --task ruler: prompt lengths, default 4096)",
    )
    g.add_argument("--seeds", type=int, default=1, help="haystacks (and needles) per length (default 1)")
    g.add_argument(
        "--haystack",
        action="append",
        help="haystack text, repeatable: pydoc (default), stdlib, license, or a file path",
    )
    g.add_argument(
        "--prefill-step",
        action="append",
        type=int,
        help="prefill chunk size, repeatable (default: the whole prompt in one chunk)",
    )
    g.add_argument("--keys", type=int, default=4, help="statements in needle-multikey (default 4)")
