"""Split a file into numbered parts and put it back together, checking sha256 at each step.

A part is the unit of one upload to the GPU machine; each carries its size and sha256
in the manifest, so a part that is corrupted or missing is named before anything is
reassembled.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20


class PartError(ValueError):
    """A part is missing, has the wrong size, or the wrong sha256."""


@dataclass(frozen=True)
class FileRecord:
    """A file's name (relative to where the manifest places it), size and sha256."""

    name: str
    size: int
    sha256: str

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, obj: dict) -> "FileRecord":
        return cls(name=str(obj["name"]), size=int(obj["size"]), sha256=str(obj["sha256"]))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def record_file(path: Path, name: str | None = None) -> FileRecord:
    path = Path(path)
    return FileRecord(name=name or path.name, size=path.stat().st_size, sha256=sha256_file(path))


def split_file(path: Path, out_dir: Path, part_size: int) -> list[FileRecord]:
    """Cut ``path`` into ``<name>.partNNN`` files of at most ``part_size`` bytes."""
    if part_size <= 0:
        raise ValueError(f"part_size must be positive, got {part_size}")
    path, out_dir = Path(path), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    with open(path, "rb") as src:
        index = 0
        while True:
            part = out_dir / f"{path.name}.part{index:03d}"
            written = 0
            with open(part, "wb") as dst:
                while written < part_size and (chunk := src.read(min(CHUNK, part_size - written))):
                    dst.write(chunk)
                    written += len(chunk)
            if written == 0 and index > 0:
                part.unlink()
                break
            records.append(record_file(part))
            index += 1
            if written < part_size:
                break
    return records


def check_part(path: Path, record: FileRecord) -> None:
    """Raise PartError naming the part unless ``path`` matches ``record``."""
    path = Path(path)
    if not path.is_file():
        raise PartError(f"part {record.name} is missing (looked for {path})")
    size = path.stat().st_size
    if size != record.size:
        raise PartError(f"part {record.name} has {size} bytes, the manifest says {record.size}: upload it again")
    if sha256_file(path) != record.sha256:
        raise PartError(f"part {record.name} has the wrong sha256 (corrupted): upload it again")


def missing_parts(parts: list[FileRecord], directory: Path) -> list[str]:
    """Names of the parts not yet present in ``directory``."""
    return [p.name for p in parts if not (Path(directory) / p.name).is_file()]


def reassemble(parts: list[FileRecord], directory: Path, whole: FileRecord, dest: Path) -> Path:
    """Check every part in ``directory``, concatenate them into ``dest`` and check the result."""
    missing = missing_parts(parts, directory)
    if missing:
        raise PartError(f"parts missing from {directory}: {', '.join(missing)}")
    for record in parts:
        check_part(Path(directory) / record.name, record)
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    with open(tmp, "wb") as out:
        for record in parts:
            with open(Path(directory) / record.name, "rb") as src:
                shutil.copyfileobj(src, out, CHUNK)
    got = record_file(tmp, whole.name)
    if got.size != whole.size or got.sha256 != whole.sha256:
        tmp.unlink()
        raise PartError(f"reassembled {whole.name} does not match the manifest's sha256 and size")
    tmp.replace(dest)
    return dest
