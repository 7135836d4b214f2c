"""Every private mlx-lm name kvpolicy's code touches, and the mlx-lm version they were checked against.

mlx-lm offers no public way to do these (docs/architecture.md, "What kvpolicy changes in mlx-lm", says why for
each). The list is the one place they are named: ``kvpolicy serve`` checks its own at start-up
(:func:`missing`), and ``tests/test_mlx_lm_inventory.py`` checks that the code touches exactly these names, that
the installed mlx-lm still has them, and that the architecture page lists them.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import List, Optional, Sequence, Tuple

#: the mlx-lm release the names below were read in (its installed package metadata when they were checked)
CHECKED_WITH = "0.32.2"

#: (mlx-lm class, private name): methods kvpolicy overrides or calls, attributes it reads or sets
PRIVATE: Tuple[Tuple[str, str], ...] = (
    ("mlx_lm.server.ResponseGenerator", "_run_generate"),  # overridden: the generation thread's target
    ("mlx_lm.server.ResponseGenerator", "_generate"),  # called: the loop the override restarts
    ("mlx_lm.server.ResponseGenerator", "_stop"),  # read: a stopping server is not restarted
    ("mlx_lm.server.ResponseGenerator", "_generation_failed"),  # set: what is_healthy reads
    ("mlx_lm.server.ResponseGenerator", "_next_request"),  # overridden: the requests the loop holds
    ("mlx_lm.server.ResponseGenerator", "_tokenize"),  # overridden and called: tokens checked in the HTTP thread
    ("mlx_lm.server.APIHandler", "_set_completion_headers"),  # called: status, JSON type and CORS headers
    ("mlx_lm.models.cache.RotatingKVCache", "_idx"),  # read and set: a native sliding-window layer's write slot
)


def installed_version() -> Optional[str]:
    """The installed mlx-lm's version (its package metadata), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx-lm")
    except PackageNotFoundError:
        return None


def _has(owner: type, name: str) -> bool:
    if hasattr(owner, name):
        return True
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(name)}\s*=", source) is not None  # an instance attribute


def missing(owners: Sequence[str] = ()) -> List[str]:
    """The names of :data:`PRIVATE` (of the classes ``owners`` only, if given) that the installed mlx-lm lacks."""
    out = []
    for owner, name in PRIVATE:
        if owners and owner not in owners:
            continue
        module, _, cls = owner.rpartition(".")
        try:
            found = _has(getattr(importlib.import_module(module), cls), name)
        except (ImportError, AttributeError):
            found = False
        if not found:
            out.append(f"{owner}.{name}")
    return out


def missing_message(owners: Sequence[str] = ()) -> Optional[str]:
    """One line naming what the installed mlx-lm lacks of :data:`PRIVATE`, or None when it has everything."""
    gone = missing(owners)
    if not gone:
        return None
    return (
        f"mlx-lm {installed_version()} lacks {', '.join(gone)}, which kvpolicy relies on "
        f"(checked against mlx-lm {CHECKED_WITH}); install mlx-lm=={CHECKED_WITH}"
    )
