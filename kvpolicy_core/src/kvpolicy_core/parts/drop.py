"""Drop disposition: the loser's slot is removed and nothing else changes."""

from __future__ import annotations

from .base import Disposition, Needs


class DropDisposition(Disposition):
    """Drop: survivors are untouched, ``x_j' = x_j`` for every survivor j (H2O)."""

    needs = Needs(batch_rows=True)
