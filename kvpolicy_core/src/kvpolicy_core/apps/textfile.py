"""Reading a text file the user named on the command line, with one clear error line per problem."""

from __future__ import annotations

from ..errors import InputFileError


def read_text_file(path: str, option: str) -> str:
    """The UTF-8 text of ``path`` (a leading BOM dropped), named by the option that gave it.

    Anything readable works, pipes included (``--file <(...)``). Every failure is an
    :class:`InputFileError` whose message starts ``"{option} {path}: "``: no such file, a
    directory, permission denied, not UTF-8 text (the offset of the first bad byte), or empty
    (nothing but whitespace).
    """
    where = f"{option} {path}"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise InputFileError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise InputFileError(f"{where}: is a directory, not a file") from None
    except PermissionError:
        raise InputFileError(f"{where}: permission denied") from None
    except OSError as exc:
        raise InputFileError(f"{where}: cannot be read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        offset = exc.start + len(raw) - len(exc.object)  # exc.object is the text after a BOM
        raise InputFileError(f"{where}: not UTF-8 text (byte 0x{raw[offset]:02x} at offset {offset})") from None
    if not text.strip():
        raise InputFileError(f"{where}: the file is empty")
    return text
