"""Extract the cubins of a library two independent ways and hash them.

``cuobjdump -xelf`` (NVIDIA's tool) reads the original library; it decompresses every
entry, so it refuses a pruned library whose other-architecture payloads are zeroed.
The kept entries of the pruned library are decompressed here with the ``zstd`` command
instead, from the payload bytes as stored. Equal hashes on both sides prove that the
pruned library holds, for the kept architectures, exactly the cubins of the original.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from tools.gpu_env.fatbin import LZ4_FLAG, PTX_KIND, ZSTD_FLAG, FatbinEntry, FatbinError, read_entries


def cuobjdump_cubins(cuobjdump: Path, library: Path, keep_arches: set[int]) -> dict[str, str]:
    """sha256 of each cubin and PTX file that ``cuobjdump -xelf``/``-xptx`` extracts for
    ``keep_arches``, by file name."""
    hashes: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="cuobjdump-") as tmp:
        for arch in sorted(keep_arches):
            # -xelf and -xptx match file names by substring: "sm_90" also takes sm_90a.
            for flag in ("-xelf", "-xptx"):
                subprocess.run(
                    [str(cuobjdump), flag, f"sm_{arch}", str(Path(library).resolve())],
                    cwd=tmp,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
        for path in sorted(Path(tmp).iterdir()):
            hashes[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return hashes


def decompress_payload(data: bytes | memoryview, entry: FatbinEntry, zstd: str = "zstd") -> bytes:
    """The cubin or PTX an entry holds, decompressed from its stored payload."""
    payload = bytes(memoryview(data)[entry.payload_offset : entry.payload_offset + entry.payload_size])
    if entry.flags & LZ4_FLAG:
        raise FatbinError(f"entry {entry.index} is LZ4-compressed; only zstd payloads are read here")
    if not entry.flags & ZSTD_FLAG:
        return payload
    out = subprocess.run(
        [zstd, "-d", "-c", "-q"], input=payload[: entry.compressed_size], capture_output=True, check=True
    ).stdout
    if len(out) != entry.uncompressed_size:
        raise FatbinError(
            f"entry {entry.index} decompressed to {len(out)} bytes, its header says {entry.uncompressed_size}"
        )
    return out


def kept_cubins(library: Path, keep_arches: set[int]) -> dict[str, str]:
    """sha256 of each kept entry's decompressed cubin or PTX, named as cuobjdump names it."""
    zstd = shutil.which("zstd")
    if zstd is None:
        raise FileNotFoundError("the zstd command is not installed: apt-get install zstd")
    data = Path(library).read_bytes()
    stem = Path(library).name.split(".so")[0]
    hashes = {}
    for e in read_entries(data):
        if e.arch in keep_arches:
            content = decompress_payload(data, e, zstd)
            if e.kind == PTX_KIND and content.endswith(b"\0"):
                content = content[:-1]  # cuobjdump -xptx writes the PTX without its terminating NUL
            hashes[f"{stem}.{e.cubin_name}"] = hashlib.sha256(content).hexdigest()
    return hashes
