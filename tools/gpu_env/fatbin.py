"""Read the CUDA fatbin of an ELF shared library and prune it to a few architectures.

A library built by nvcc keeps its device code in the ``.nv_fatbin`` section: a run of
fatbin containers, each a 16-byte header followed by entries, each entry a header
(kind, architecture, flags, sizes) followed by its payload (a cubin or PTX, usually
compressed). Pruning zeroes the payloads of the entries for other architectures and
leaves every byte outside them alone: the ELF layout, every container and entry
header, and every offset stay as they were, so the CUDA runtime still finds the
entries it keeps where it expects them, and the zeroed runs compress to almost
nothing. Only little-endian ELF64 files (x86-64, aarch64) are read.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

FATBIN_SECTION = ".nv_fatbin"
CONTAINER_MAGIC = 0xBA55ED50
CONTAINER_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, entries size
ENTRY_HEADER = struct.Struct("<HHIQIIHHIIIQQQ")  # see FatbinEntry for the fields read
PTX_KIND, ELF_KIND = 1, 2
KIND_NAMES = {PTX_KIND: "ptx", ELF_KIND: "elf"}
# Entry flag bits: an architecture-specific target (sm_90a, sm_100a, ...), and a
# payload compressed with LZ4 (older nvcc) or zstd (nvcc 12.8 and later).
ARCH_SPECIFIC_FLAG = 0x100000
LZ4_FLAG = 0x2000
ZSTD_FLAG = 0x8000


class FatbinError(ValueError):
    """The file is not the ELF with a fatbin that this module reads."""


@dataclass(frozen=True)
class FatbinEntry:
    """One entry of a fatbin: where its header and payload lie in the file."""

    index: int
    """1-based position among all entries of the section."""
    kind_index: int
    """1-based position among the entries of the same kind (cuobjdump numbers its ELF
    and PTX files so)."""
    header_offset: int
    """File offset of the entry header."""
    header_size: int
    payload_offset: int
    """File offset of the payload, right after the header."""
    payload_size: int
    """Payload bytes, padding included."""
    compressed_size: int
    """Bytes of the compressed stream at the payload's start (the rest is padding)."""
    uncompressed_size: int
    """Size of the cubin or PTX once decompressed; 0 when the payload is not compressed."""
    kind: int
    """1 for PTX, 2 for a cubin (ELF)."""
    arch: int
    """Compute capability times ten: 90 for sm_90 and sm_90a."""
    flags: int

    @property
    def arch_name(self) -> str:
        """``sm_90`` or ``sm_90a``: the name cuobjdump gives the entry's architecture."""
        suffix = "a" if self.flags & ARCH_SPECIFIC_FLAG else ""
        return f"sm_{self.arch}{suffix}"

    @property
    def cubin_name(self) -> str:
        """The end of the name ``cuobjdump -xelf`` gives the entry's file: ``4.sm_90.cubin``
        for ``libfoo.4.sm_90.cubin`` (the library's stem comes first)."""
        return f"{self.kind_index}.{self.arch_name}.{'ptx' if self.kind == PTX_KIND else 'cubin'}"

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, f"kind{self.kind}")


def find_section(data: bytes | memoryview, name: str) -> tuple[int, int]:
    """File offset and size of the ELF64 section called ``name``."""
    if bytes(data[:4]) != b"\x7fELF":
        raise FatbinError("not an ELF file (no \\x7fELF magic)")
    if data[4] != 2 or data[5] != 1:
        raise FatbinError("only little-endian 64-bit ELF files are supported")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shentsize != 64 or shoff + shnum * shentsize > len(data):
        raise FatbinError("ELF section header table is truncated or malformed")

    def section(i: int) -> tuple[int, int, int]:
        name_off, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * 64)
        return name_off, offset, size

    _, strtab_off, strtab_size = section(shstrndx)
    wanted = name.encode()
    for i in range(shnum):
        name_off, offset, size = section(i)
        start = strtab_off + name_off
        end = bytes(data[start : strtab_off + strtab_size]).find(b"\0")
        if bytes(data[start : start + end]) == wanted:
            if offset + size > len(data):
                raise FatbinError(f"section {name} runs past the end of the file")
            return offset, size
    raise FatbinError(f"the ELF file has no {name} section (no CUDA device code)")


def parse_fatbin(data: bytes | memoryview, start: int, end: int) -> list[FatbinEntry]:
    """Every entry of the fatbin containers lying in ``data[start:end]``."""
    entries: list[FatbinEntry] = []
    per_kind: dict[int, int] = {}
    pos = start
    while pos < end:
        if pos + CONTAINER_HEADER.size > end:
            raise FatbinError(f"truncated fatbin container header at offset {pos:#x}")
        magic, _, header_size, entries_size = CONTAINER_HEADER.unpack_from(data, pos)
        if magic != CONTAINER_MAGIC:
            raise FatbinError(f"bad fatbin container magic {magic:#x} at offset {pos:#x}")
        entry_pos = pos + header_size
        container_end = entry_pos + entries_size
        if container_end > end:
            raise FatbinError(f"fatbin container at offset {pos:#x} runs past the section end")
        while entry_pos < container_end:
            if entry_pos + ENTRY_HEADER.size > container_end:
                raise FatbinError(f"truncated fatbin entry header at offset {entry_pos:#x}")
            fields = ENTRY_HEADER.unpack_from(data, entry_pos)
            kind, _, entry_header_size, payload_size = fields[:4]
            compressed_size, arch, flags, uncompressed_size = fields[4], fields[8], fields[11], fields[13]
            if entry_header_size < ENTRY_HEADER.size:
                raise FatbinError(f"fatbin entry header at {entry_pos:#x} is too short")
            payload_offset = entry_pos + entry_header_size
            if payload_offset + payload_size > container_end:
                raise FatbinError(f"fatbin entry at offset {entry_pos:#x} runs past its container")
            per_kind[kind] = per_kind.get(kind, 0) + 1
            entries.append(
                FatbinEntry(
                    index=len(entries) + 1,
                    kind_index=per_kind[kind],
                    header_offset=entry_pos,
                    header_size=entry_header_size,
                    payload_offset=payload_offset,
                    payload_size=payload_size,
                    compressed_size=compressed_size,
                    uncompressed_size=uncompressed_size,
                    kind=kind,
                    arch=arch,
                    flags=flags,
                )
            )
            entry_pos = payload_offset + payload_size
        pos = container_end
        # Containers are 8-byte aligned; the padding between them must be zero.
        while pos < end and pos % 8:
            if data[pos] != 0:
                raise FatbinError(f"non-zero byte between fatbin containers at offset {pos:#x}")
            pos += 1
    return entries


def read_entries(data: bytes | memoryview) -> list[FatbinEntry]:
    """Every fatbin entry of an ELF file's ``.nv_fatbin`` section."""
    offset, size = find_section(data, FATBIN_SECTION)
    return parse_fatbin(data, offset, offset + size)


@dataclass(frozen=True)
class PruneReport:
    """What pruning kept and zeroed."""

    kept: list[FatbinEntry]
    zeroed: list[FatbinEntry]

    @property
    def zeroed_bytes(self) -> int:
        return sum(e.payload_size for e in self.zeroed)

    @property
    def kept_bytes(self) -> int:
        return sum(e.payload_size for e in self.kept)


def prune_bytes(data: bytearray, keep_arches: set[int]) -> PruneReport:
    """Zero, in place, the payload of every entry whose architecture is not kept."""
    if not keep_arches:
        raise ValueError("keep_arches is empty: name at least one architecture, e.g. {90}")
    entries = read_entries(data)
    kept = [e for e in entries if e.arch in keep_arches]
    if not kept:
        present = sorted({e.arch_name for e in entries})
        raise FatbinError(f"no fatbin entry for architectures {sorted(keep_arches)}; the file has {present}")
    zeroed = [e for e in entries if e.arch not in keep_arches]
    for e in zeroed:
        data[e.payload_offset : e.payload_offset + e.payload_size] = bytes(e.payload_size)
    return PruneReport(kept=kept, zeroed=zeroed)


def prune_file(source: Path, dest: Path, keep_arches: set[int]) -> PruneReport:
    """Write ``source`` to ``dest`` with the payloads of other architectures zeroed."""
    data = bytearray(Path(source).read_bytes())
    report = prune_bytes(data, keep_arches)
    Path(dest).write_bytes(data)
    return report


def check_pruned(original: bytes | memoryview, pruned: bytes | memoryview, keep_arches: set[int]) -> PruneReport:
    """Raise FatbinError unless ``pruned`` is ``original`` with only the other
    architectures' payloads zeroed: same length, same entries, every byte outside
    those payloads equal, and the payloads all zero."""
    if len(original) != len(pruned):
        raise FatbinError(f"sizes differ: original {len(original)} bytes, pruned {len(pruned)}")
    entries = read_entries(original)
    if read_entries(pruned) != entries:
        raise FatbinError("the pruned file's fatbin entries (headers or offsets) differ from the original's")
    original, pruned = memoryview(original), memoryview(pruned)
    report = PruneReport(
        kept=[e for e in entries if e.arch in keep_arches],
        zeroed=[e for e in entries if e.arch not in keep_arches],
    )
    pos = 0
    for e in report.zeroed:
        if original[pos : e.payload_offset] != pruned[pos : e.payload_offset]:
            raise FatbinError(f"bytes before entry {e.index} ({e.arch_name}) differ from the original")
        payload = pruned[e.payload_offset : e.payload_offset + e.payload_size]
        if payload != bytes(e.payload_size):
            raise FatbinError(f"entry {e.index} ({e.arch_name}) should be zeroed but is not")
        pos = e.payload_offset + e.payload_size
    if original[pos:] != pruned[pos:]:
        raise FatbinError("bytes after the last zeroed entry differ from the original")
    return report


def payload_sha256(data: bytes | memoryview, entry: FatbinEntry) -> str:
    """sha256 of one entry's payload as stored (compressed, padding included)."""
    view = memoryview(data)[entry.payload_offset : entry.payload_offset + entry.payload_size]
    return hashlib.sha256(view).hexdigest()
