"""Progress of long work (prefill, KVzip reconstruction, suite rows) on stderr, with the stage and tokens done.

One reporter per stage (:func:`reporter`), called with ``(done, total)`` after each step, the signature of
mlx-lm's ``prompt_progress_callback`` (so it is handed to ``generate_step`` as it is):

- on a terminal (the stream's ``isatty()``), one line rewritten in place (``\\r``), ended when the stage is done;
- anywhere else (a log, a pipe, a captured stream), one plain line per step, never a progress bar::

      kvpolicy: prefill 2048/4096 tokens (13.1 s)
      kvpolicy: niah_single-4096-s0 cam:budget=512: reconstruction 1024/4096 tokens (20.4 s)

Work of fewer than ``min_total`` tokens (:data:`MIN_TOKENS` by default) prints nothing. What is shown is set for
the current context (a :class:`contextvars.ContextVar`, so threads and tasks start from the defaults): :func:`quiet`
silences every reporter made inside it (a command's ``--no-progress``), :func:`labelled` names the work they belong
to (a suite row). No mlx import: the command line and the library share it.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from typing import Iterator, Optional, TextIO

#: work of fewer tokens than this prints nothing (it takes seconds at most)
MIN_TOKENS = 512
PREFIX = "kvpolicy: "

#: (enabled, label) for reporters made in the current context
_STATE: contextvars.ContextVar = contextvars.ContextVar("kvpolicy_progress", default=(True, ""))
#: the terminal stream whose progress line is not ended yet (None when none is open)
_open: Optional[TextIO] = None


@contextlib.contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """Inside, reporters print nothing (``on=False``: as outside; for ``with quiet(args.no_progress):``)."""
    enabled, label = _STATE.get()
    token = _STATE.set((enabled and not on, label))
    try:
        yield
    finally:
        _STATE.reset(token)


@contextlib.contextmanager
def labelled(label: str) -> Iterator[None]:
    """Inside, every line names ``label`` before the stage (nested labels are joined by a space)."""
    enabled, outer = _STATE.get()
    token = _STATE.set((enabled, f"{outer} {label}".strip()))
    try:
        yield
    finally:
        _STATE.reset(token)


def enabled() -> bool:
    """Whether reporters made here print (not inside :func:`quiet`)."""
    return _STATE.get()[0]


def end_line() -> None:
    """End a terminal progress line left open (a stage stopped by an error), so the next message starts clean."""
    global _open
    if _open is not None:
        with contextlib.suppress(Exception):
            _open.write("\n")
            _open.flush()
        _open = None


class Progress:
    """The reporter of one stage: ``progress(done, total)`` after each step (module docstring)."""

    def __init__(
        self,
        stage: str,
        *,
        stream: Optional[TextIO] = None,
        min_total: int = MIN_TOKENS,
        offset: int = 0,
        unit: str = "tokens",
    ) -> None:
        enabled, label = _STATE.get()
        self.stage = f"{label}: {stage}" if label else stage
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.min_total = min_total
        self.offset = offset  #: tokens done before this reporter's work (added to done and total)
        self.unit = unit
        try:
            self.tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):  # no isatty, or a closed stream
            self.tty = False
        self.start = time.perf_counter()
        self.last: Optional[int] = None
        self.width = 0  # of the terminal line written last (a shorter one is padded over it)

    def line(self, done: int, total: int) -> str:
        """``kvpolicy: STAGE DONE/TOTAL tokens (S s)``."""
        seconds = time.perf_counter() - self.start
        return f"{PREFIX}{self.stage} {done}/{total} {self.unit} ({seconds:.1f} s)"

    def __call__(self, done: int, total: int) -> None:
        global _open
        done, total = int(done) + self.offset, int(total) + self.offset
        if not self.enabled or total < self.min_total or done == self.last:
            return
        self.last = done
        text = self.line(done, total)
        try:
            if self.tty:
                pad = " " * max(0, self.width - len(text))
                self.width = len(text)
                finished = done >= total
                self.stream.write(f"\r{text}{pad}" + ("\n" if finished else ""))
                _open = None if finished else self.stream
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: progress is never worth failing the work for
            self.enabled = False


def reporter(stage: str, *, stream: Optional[TextIO] = None, min_total: int = MIN_TOKENS, offset: int = 0) -> Progress:
    """A :class:`Progress` for ``stage`` (``"prefill"``, ``"reconstruction"``) in the current context: quiet inside
    :func:`quiet`, named by :func:`labelled`; ``offset``: tokens already done before this work (a shared first
    chunk), added to what it reports."""
    return Progress(stage, stream=stream, min_total=min_total, offset=offset)
