"""What an OpenBLAS shared library was built for, read from its ELF file: nothing in it runs.

Loading a library runs its constructors, and calling ``openblas_get_config()`` runs its code:
the ``cmeel-openblas`` SKYLAKEX wheel already dies with SIGILL while being loaded on a CPU
without AVX (its constructors are compiled for AVX-512 CPUs). So the build target is read
from the bytes instead:

- ``DYNAMIC_ARCH``: the library defines ``gotoblas_dynamic_init`` and one ``gotoblas_<CORE>``
  kernel table per core it carries (it picks one at run time; zero-filled tables are placeholders);
- a single-target build's ``openblas_get_corename()`` is ``lea <name>(%rip), %rax; ret``
  (x86-64): the name it returns (``"SKYLAKEX"``) is read where that instruction points.

The config string itself cannot be read whole: compilers split it into vector constants and
immediates inside ``openblas_get_config``'s code.

This module must not import mlx or numpy.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Tuple

_EM_X86_64 = 62
_SHT_DYNSYM = 11
_SHT_NOBITS = 8
_PT_LOAD = 1
_NAME = re.compile(rb"[A-Za-z0-9_]{1,32}")


@dataclass(frozen=True)
class StaticBuild:
    """An ELF library's BLAS build, as far as its bytes tell.

    ``openblas``: it exports ``openblas_get_config``. ``dynamic``: a DYNAMIC_ARCH build.
    ``target``: a single-target build's core name, upper-case (None if not read).
    ``cores``: the cores a DYNAMIC_ARCH build carries, upper-case. ``note``: why ``target``
    is None for a single-target OpenBLAS (empty otherwise).
    """

    openblas: bool
    dynamic: bool = False
    target: Optional[str] = None
    cores: FrozenSet[str] = frozenset()
    note: str = ""


class _Elf:
    """The few parts of a little-endian ELF64 file this module reads."""

    def __init__(self, data):
        self.data = data
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ValueError("not a little-endian 64-bit ELF file")
        self.machine = struct.unpack_from("<H", data, 18)[0]
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        self.loads: List[Tuple[int, int, int]] = []  # (vaddr, file offset, file size) of PT_LOAD segments
        for i in range(phnum):
            p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
            if p_type == _PT_LOAD:
                self.loads.append((p_vaddr, p_offset, p_filesz))
        self.sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]

    def dynamic_symbols(self, prefixes: Tuple[bytes, ...]) -> Optional[Dict[str, int]]:
        """``{name: value}`` of the dynamic symbols defined with contents whose names start with one of
        ``prefixes``; None if the file has no dynamic symbol table section."""
        out: Optional[Dict[str, int]] = None
        for sec in self.sections:
            if sec[1] != _SHT_DYNSYM:
                continue
            strtab = self.sections[sec[6]]
            names = self.data[strtab[4] : strtab[4] + strtab[5]]
            entsize, out = max(sec[9], 24), out or {}
            for off in range(sec[4], sec[4] + sec[5] - entsize + 1, entsize):
                st_name, _, _, st_shndx, st_value = struct.unpack_from("<IBBHQ", self.data, off)
                if self._holds_bytes(st_shndx) and names.startswith(prefixes, st_name):
                    out[names[st_name : names.index(b"\0", st_name)].decode(errors="replace")] = st_value
        return out

    def _holds_bytes(self, index: int) -> bool:
        """Is section ``index`` one with contents in the file (not undefined, absolute or zero-filled)?"""
        return 0 < index < len(self.sections) and self.sections[index][1] != _SHT_NOBITS

    def read(self, vaddr: int, size: int) -> bytes:
        """Up to ``size`` bytes of the file mapped at ``vaddr`` (empty where nothing is)."""
        for start, offset, filesz in self.loads:
            if start <= vaddr < start + filesz:
                return bytes(self.data[offset + vaddr - start : offset + min(vaddr - start + size, filesz)])
        return b""


def _returned_string(elf: _Elf, func: int) -> Optional[str]:
    """The string a function of the form ``return "LITERAL";`` returns (x86-64), or None."""
    code = elf.read(func, 24)
    i = 4 if code.startswith(b"\xf3\x0f\x1e\xfa") else 0  # endbr64
    frame = code.startswith(b"\x55\x48\x89\xe5", i)  # push %rbp; mov %rsp,%rbp (-O0)
    i += 4 if frame else 0
    if code[i : i + 3] != b"\x48\x8d\x05":  # lea disp32(%rip),%rax
        return None
    end = i + 7
    if not (code.startswith(b"\xc3", end) or (frame and code.startswith(b"\x5d\xc3", end))):
        return None
    disp = struct.unpack_from("<i", code, i + 3)[0]
    raw = elf.read(func + end + disp, 33)
    name = _NAME.match(raw)
    if name is None or raw[name.end() : name.end() + 1] != b"\0":
        return None
    return name.group().decode()


def read_build(path: str) -> StaticBuild:
    """The build of the library at ``path``, read from its bytes (raises OSError if unreadable)."""
    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            return StaticBuild(openblas=False)
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with data:
        try:
            elf = _Elf(data)
            syms = elf.dynamic_symbols((b"openblas_get_co", b"gotoblas_"))
        except (ValueError, struct.error, IndexError):
            syms = None
        if syms is None:  # not a readable ELF library: an OpenBLAS among those cannot be judged
            if data.find(b"openblas_get_config\0") >= 0:
                return StaticBuild(openblas=True, note="its dynamic symbol table cannot be read")
            return StaticBuild(openblas=False)
        if "openblas_get_config" not in syms:
            return StaticBuild(openblas=False)
        if "gotoblas_dynamic_init" in syms:
            cores = frozenset(n[len("gotoblas_") :] for n in syms if n[len("gotoblas_") :].isupper())
            return StaticBuild(openblas=True, dynamic=True, cores=cores)
        if elf.machine != _EM_X86_64:
            return StaticBuild(openblas=True, note="its target is read on x86-64 only")
        corename = syms.get("openblas_get_corename")
        if corename is None:
            return StaticBuild(openblas=True, note="it has no openblas_get_corename()")
        target = _returned_string(elf, corename)
        if target is None:
            return StaticBuild(openblas=True, note="openblas_get_corename() is not a plain string return")
        return StaticBuild(openblas=True, target=target.upper())
