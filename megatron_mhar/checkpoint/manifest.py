"""A checkpoint's manifest: each of its files with its size and checksum.

Written into a checkpoint directory before the directory is published (renamed into
place), and checked whenever the checkpoint is read::

    iter_0000200/manifest.json
      {"format": "megatron_mhar.checkpoint.manifest.v1", "checksum": "xxh3_64",
       "files": {"common.pt": {"size": 4711, "xxh3_64": "9f0c..."}, ...},
       "digest": "..."}

``files`` lists every file under the directory (subdirectories included) but the manifest
itself; ``digest`` is the checksum of the ``files`` entry, so a damaged manifest names
itself instead of blaming a file. The checksum is xxHash's XXH3 (64 bits), the fastest of
the candidates measured on CPU (``benchmarks/bench_checksum.py``; ``docs/performance.md``).

A writer that checksums a file's bytes on their way to disk (:class:`ChecksummingFile`)
leaves the result beside it in ``<file>.xxh3_64``; :func:`describe` takes it from there
(and removes it) instead of reading the file back, which on a loaded machine costs as
much as a good part of the write.

Verification levels (``checkpoint.verify``): ``full`` reads every file and compares sizes
and checksums; ``size`` compares the set of files and their sizes (no file is read);
``off`` checks nothing. The training driver and the conversion tools write and check the
same manifest (:mod:`megatron_mhar.checkpoint.format`).

Imports no Megatron and no torch; xxhash is imported where a checksum is taken.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Sequence

from megatron_mhar.files import write_atomic

MANIFEST_FILE = "manifest.json"
FORMAT = "megatron_mhar.checkpoint.manifest.v1"
CHECKSUM = "xxh3_64"
VERIFY_LEVELS = ("full", "size", "off")
"""Values of ``checkpoint.verify``: checksums and sizes, sizes only, nothing."""

READ_BYTES = 1 << 24  # 16 MiB reads: past this, larger reads hash no faster


class ManifestError(ValueError):
    """A directory does not match its manifest (or has none that can be read)."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = Path(path)
        """The file at fault (the manifest itself when it is missing or damaged)."""


def new_digest():
    """A fresh XXH3-64 digest (``update(bytes)``, ``hexdigest()``): the project's checksum."""
    import xxhash

    return xxhash.xxh3_64()


def read_pieces(path) -> Iterator[memoryview]:
    """A file's bytes in pieces of :data:`READ_BYTES`, read into one buffer: each piece is
    valid until the next is asked for."""
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                return
            yield view[:n]


def file_checksum(path: Path) -> str:
    """The hex XXH3-64 checksum of a file's bytes."""
    digest = new_digest()
    for piece in read_pieces(path):
        digest.update(piece)
    return digest.hexdigest()


HASH_CHUNK_BYTES = 1 << 18
""":class:`ChecksummingFile` writes and hashes in chunks of this size (256 KiB: fits a core's
L2 cache, and large enough that the per-call cost does not show)."""

WRITEBACK_BYTES = 1 << 26
"""Every 64 MiB written, :class:`ChecksummingFile` starts the disk writeback of what it
wrote so far on a thread, so that the disk works while the next bytes are hashed."""

SIDE_SUFFIX = f".{CHECKSUM}"
"""``<file>.xxh3_64``: the size and checksum a :class:`ChecksummingFile` took while writing."""


class ChecksummingFile:
    """A file opened for writing (``wb``) whose bytes are checksummed as they are written;
    on a clean close the size and checksum go to ``<file>.xxh3_64`` for :func:`describe`.

    Offers what a writer of serialized tensors uses: ``write``, ``tell``, ``flush``,
    ``fileno`` (for ``os.fsync``) and the context manager.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self._file = open(self.path, "wb")
        self._digest = new_digest()
        self._unflushed = 0
        self._flusher = None

    def write(self, data) -> int:
        # Chunk by chunk, each hashed right after it is written, while its bytes are still
        # in the CPU's cache: hashing a whole tensor apart from its write reads it from
        # memory twice (benchmarks/bench_checksum.py).
        view = memoryview(data).cast("B")
        for start in range(0, len(view), HASH_CHUNK_BYTES):
            chunk = view[start:start + HASH_CHUNK_BYTES]
            self._file.write(chunk)
            self._digest.update(chunk)
        self._unflushed += len(view)
        if self._unflushed >= WRITEBACK_BYTES and (self._flusher is None or not self._flusher.is_alive()):
            self._start_writeback()
        return len(view)

    def _start_writeback(self) -> None:
        import threading

        self._file.flush()
        self._unflushed = 0
        fd = self._file.fileno()

        def writeback():
            try:
                os.fdatasync(fd)
            except OSError:
                pass  # the writer's own fsync reports it

        self._flusher = threading.Thread(target=writeback, name="writeback", daemon=True)
        self._flusher.start()

    def _join_writeback(self) -> None:
        if self._flusher is not None:
            self._flusher.join()
            self._flusher = None

    def tell(self) -> int:
        return self._file.tell()

    def flush(self) -> None:
        self._file.flush()

    def fileno(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        self._join_writeback()
        if self._file.closed:
            return
        size = self._file.tell()
        self._file.close()
        with open(self.path + SIDE_SUFFIX, "w") as side:
            json.dump({"size": size, CHECKSUM: self._digest.hexdigest()}, side)

    def __enter__(self) -> "ChecksummingFile":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:  # a failed write leaves no checksum behind
            self._join_writeback()
            self._file.close()


def listed_files(directory: Path) -> List[str]:
    """Paths (relative, ``/``-separated) of every file under ``directory`` but the manifest
    and checksums left by :class:`ChecksummingFile`."""
    directory = Path(directory)
    names = []
    for root, _, files in os.walk(directory):
        for name in files:
            relative = Path(root, name).relative_to(directory).as_posix()
            if relative != MANIFEST_FILE and not relative.endswith(SIDE_SUFFIX):
                names.append(relative)
    return sorted(names)


def describe(directory: Path, names: Iterable[str]) -> Dict[str, Dict[str, object]]:
    """``{name: {"size", "xxh3_64"}}`` of the given files of ``directory``: from the
    checksum a :class:`ChecksummingFile` left (removed once taken) when its size still
    matches, else read here."""
    directory = Path(directory)
    described = {}
    for name in names:
        path, side = directory / name, directory / (name + SIDE_SUFFIX)
        size = path.stat().st_size
        taken = json.loads(side.read_text()) if side.is_file() else None
        checksum = taken[CHECKSUM] if taken and taken.get("size") == size else file_checksum(path)
        described[name] = {"size": size, CHECKSUM: checksum}
        side.unlink(missing_ok=True)
    return described


def _entries_digest(files: Dict[str, Dict[str, object]]) -> str:
    digest = new_digest()
    digest.update(json.dumps(files, sort_keys=True).encode())
    return digest.hexdigest()


def write_manifest(directory: Path, files: Optional[Dict[str, Dict[str, object]]] = None) -> None:
    """Write ``directory/manifest.json`` (whole or not at all).

    ``files``: the entries of :func:`describe`, when computed elsewhere (each rank of a
    save describes its own files); they must cover every file of the directory.
    Default: every file, read here.
    """
    directory = Path(directory)
    present = listed_files(directory)
    if files is None:
        files = describe(directory, present)
    if sorted(files) != present:
        missing, extra = sorted(set(present) - set(files)), sorted(set(files) - set(present))
        raise RuntimeError(f"manifest of {directory} does not match its files: undescribed {missing}, "
                           f"described but absent {extra}")
    files = dict(sorted(files.items()))
    manifest = {"format": FORMAT, "checksum": CHECKSUM, "files": files, "digest": _entries_digest(files)}
    write_atomic(directory / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")


def read_manifest(directory: Path) -> Dict[str, Dict[str, object]]:
    """The ``files`` entry of ``directory``'s manifest; a :class:`ManifestError` if it is
    missing, unreadable or damaged."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"{path} is missing", path)
    try:
        manifest = json.loads(path.read_bytes())
        files = manifest["files"]
        intact = manifest.get("format") == FORMAT and manifest["digest"] == _entries_digest(files)
    except (ValueError, KeyError, TypeError):  # not JSON, not UTF-8, or not a manifest's fields
        intact = False
    if not intact:
        raise ManifestError(f"{path} is damaged (not a {FORMAT} manifest whose digest matches)", path)
    return files


def verify(directory: Path, level: str = "full", share: Optional[Sequence[int]] = None) -> None:
    """Raise a :class:`ManifestError` naming the first file of ``directory`` that does not
    match its manifest (at ``level``); return if all do.

    ``share=(rank, ranks)``: read only every ``ranks``-th file from the ``rank``-th for the
    checksums (the ranks of a job divide the reading); the file set and sizes are always
    checked whole.
    """
    if level not in VERIFY_LEVELS:
        raise ValueError(f"verification level must be one of {VERIFY_LEVELS}, got {level!r}")
    if level == "off":
        return
    directory = Path(directory)
    files = read_manifest(directory)
    present = set(listed_files(directory))
    bad = []
    for name, entry in files.items():
        path = directory / name
        if name not in present:
            bad.append((path, "is missing"))
        elif path.stat().st_size != entry["size"]:
            bad.append((path, f"has {path.stat().st_size} bytes, the manifest says {entry['size']}"))
    bad += [(directory / name, "is not in the manifest") for name in sorted(present - set(files))]
    if level == "full" and not bad:
        names = sorted(files)
        if share is not None:
            rank, ranks = share
            names = names[rank::ranks]
        for name in names:
            if file_checksum(directory / name) != files[name][CHECKSUM]:
                bad.append((directory / name, "does not match its checksum (its bytes changed)"))
    if bad:
        path, what = bad[0]
        more = f" (and {len(bad) - 1} more files)" if len(bad) > 1 else ""
        raise ManifestError(f"{path} {what}{more}", path)


def total_bytes(directory: Path) -> Optional[int]:
    """The bytes of the files a manifest lists (None where there is no intact manifest)."""
    try:
        return sum(int(entry["size"]) for entry in read_manifest(directory).values())
    except ManifestError:
        return None
