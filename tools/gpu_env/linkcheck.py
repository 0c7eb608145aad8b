"""Check that a shared library's versioned symbols are defined by the libraries it will
load on the GPU machine.

Python loads Transformer Engine's core library with ctypes, which binds every symbol at
load time (RTLD_NOW): one symbol that the installed cuBLAS lacks fails the import. The
libraries searched are the ones torch's own ``nvidia-*`` wheels install, which the GPU
machine's torch brings too. Uses binutils' ``nm``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

# Versions that glibc and the GNU toolchain provide, not the CUDA wheels.
SYSTEM_VERSIONS = ("GLIBC", "GLIBCXX", "CXXABI", "GCC_")


def _nm(args: list[str]) -> list[str]:
    nm = shutil.which("nm")
    if nm is None:
        raise FileNotFoundError("the nm command is not installed: apt-get install binutils")
    return subprocess.run([nm, "-D", *args], capture_output=True, text=True, check=True).stdout.splitlines()


def undefined_versioned(library: Path) -> list[tuple[str, str]]:
    """(symbol, soname) of each undefined symbol bound to a library's version tag."""
    found = set()
    for line in _nm(["--undefined-only", str(library)]):
        name = line.split()[-1]
        if "@" not in name:
            continue
        symbol, version = name.split("@", 1)
        if not version.startswith(SYSTEM_VERSIONS):
            found.add((symbol, version.lstrip("@")))
    return sorted(found)


def defined(library: Path) -> set[str]:
    return {line.split()[-1].split("@")[0] for line in _nm(["--defined-only", str(library)]) if line.strip()}


def unresolved_symbols(library: Path, search_dirs: list[Path]) -> list[str]:
    """``soname:symbol`` for each versioned symbol that no library under ``search_dirs``
    of that soname defines (or whose library is not there at all)."""
    cache: dict[str, set[str] | None] = {}
    missing = []
    for symbol, soname in undefined_versioned(library):
        if soname not in cache:
            candidates = [p for d in search_dirs for p in Path(d).rglob(soname)]
            cache[soname] = defined(candidates[0]) if candidates else None
        symbols = cache[soname]
        if symbols is None:
            missing.append(f"{soname}:(library not found)")
        elif symbol not in symbols:
            missing.append(f"{soname}:{symbol}")
    return missing
