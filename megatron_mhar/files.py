"""Files the project writes: whole or not at all, and only where they can go."""

import os
from pathlib import Path
from typing import Union

TMP_PREFIX = ".tmp."
"""Names a file or directory being written beside its final name, renamed into place once whole."""


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename into it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, content: Union[str, bytes]) -> None:
    """Write ``content`` (text or bytes) to ``path`` through a temporary file beside it,
    flushed to disk and renamed over it: ``path`` holds a whole file at every moment, the
    previous or this one, and a failed write leaves no temporary file."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    try:
        with open(tmp, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def nearest_existing(path) -> Path:
    """``path`` itself or its nearest ancestor that exists: where its missing directories
    would be made, so a file or a read-only directory there means they cannot be."""
    path = Path(path).absolute()
    return next(p for p in (path, *path.parents) if p.exists())
