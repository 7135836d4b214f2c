"""Files the user names: what a path is, checked before any work (no mlx imported).

kvpolicy writes only regular files. Every writer of a user-named file (``save_caches``, prompt-cache files,
``--json`` results, JSONL exports) calls :func:`check_output_target` before it starts and again just before its
rename: a path that exists and is not a regular file (a directory, a FIFO, a device such as ``/dev/full``, a
socket), or a symlink to one, is refused with one line naming the option, never replaced. Readers name what a path
is when it is not a readable file (:func:`not_a_file`): missing, a directory, a symlink loop, a device.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from typing import Optional, Type

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def not_a_file(path) -> Optional[str]:
    """Why ``path`` cannot be read as a file (``"no such file"``, ``"is a directory"``, ``"is a symlink loop"``,
    ...), or None when it is a regular file or a symlink to one."""
    try:
        st = os.stat(path)  # follows symlinks
    except FileNotFoundError:
        return "is a symlink to a missing file" if os.path.islink(path) else "no such file"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a symlink loop"
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(st.st_mode):
        return None
    return f"is {_kind(st.st_mode)}, not a file"


def check_output_target(path, what: str, error: Type[Exception] = ValueError) -> None:
    """Refuse to write ``path`` unless it is missing or a regular file (a symlink is followed to its target).

    ``error(f"{what}: ...")`` for a directory, FIFO, device, socket, a symlink to one, or a symlink loop: kvpolicy
    replaces files by renaming a new one over them, which would replace the device or pipe itself.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # a new file (or a dangling symlink's target, created)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(f"{what}: is a symlink loop; give a file name") from None
        raise error(f"{what}: cannot write there ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        link = " (through a symlink)" if os.path.islink(path) else ""
        raise error(
            f"{what}: is {_kind(st.st_mode)}{link}, not a regular file; kvpolicy writes only regular files: "
            "give a file name"
        )


def check_writable(path, what: str, error: Type[Exception] = ValueError, *, make_parent: bool = False) -> None:
    """Before a run: ``path`` can be written (:func:`check_output_target`), its directory exists (``make_parent``:
    is made) and a file can be created in it (a read-only or missing directory fails now, not after the work)."""
    check_output_target(path, what, error)
    parent = os.path.dirname(os.path.realpath(path)) or "."
    try:
        if make_parent:
            os.makedirs(parent, exist_ok=True)
        elif not os.path.isdir(parent):
            raise error(f"{what}: directory {parent} does not exist; create it first")
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".kvpolicy-", suffix=".check"):
            pass
    except OSError as exc:
        raise error(f"{what}: cannot write in {parent} ({exc.strerror or exc})") from None
