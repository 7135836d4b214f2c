"""mlx-lm's own command line, run with kvpolicy's cache classes registered where mlx-lm's loader finds them.

``python -m kvpolicy_core.apps.with_mlx_lm generate --prompt-cache-file doc.safetensors --prompt "..."`` is
``mlx_lm.generate ...`` (the same code, options and output), in a process that can read kvpolicy's
prompt-cache files: mlx-lm's ``load_prompt_cache`` rebuilds cache classes by name from its own module,
and has no plugin hook, so a process that never imported kvpolicy cannot rebuild a ``PolicyCache``
(``KeyError: 'PolicyCache'``). The optimised BLAS is loaded first, as ``kvpolicy`` does, so the two
compute the same matmuls.
"""

from __future__ import annotations

import sys


def main() -> None:
    from ..runtime.blas import load_optimized_blas

    load_optimized_blas(quiet=True)
    from mlx_lm import cli

    from ..cache import batch, policy_cache  # noqa: F401  (register BatchPolicyCache and PolicyCache with mlx-lm)

    sys.argv = ["mlx_lm", *sys.argv[1:]]
    cli.main()


if __name__ == "__main__":
    main()
