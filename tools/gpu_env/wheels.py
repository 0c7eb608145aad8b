"""Rewrite a wheel with some files replaced.

The pruned library goes back into the ``transformer_engine_cu13`` wheel under the same
name and version (Transformer Engine checks at import that the core and meta packages'
versions are equal, so a local version label would fail it); its RECORD lists the new
file's sha256, and the bundle's manifest tells the pruned wheel from PyPI's.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile
from pathlib import Path


class WheelError(ValueError):
    """The wheel is not laid out as a wheel should be."""


def record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def dist_info_dir(names: list[str]) -> str:
    dirs = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
    if len(dirs) != 1:
        raise WheelError(f"expected one .dist-info folder, found {sorted(dirs)}")
    return dirs.pop()


def replace_in_wheel(source: Path, dest_dir: Path, replacements: dict[str, Path]) -> Path:
    """Write ``source`` into ``dest_dir`` under the same name with the files named in
    ``replacements`` (archive path -> file) replaced and RECORD rewritten."""
    source = Path(source)
    dest = Path(dest_dir) / source.name
    if dest.resolve() == source.resolve():
        raise WheelError(f"dest_dir {dest_dir} holds the source wheel: write elsewhere")
    with zipfile.ZipFile(source) as src:
        infos = src.infolist()
        names = [i.filename for i in infos]
        missing = sorted(set(replacements) - set(names))
        if missing:
            raise WheelError(f"{source.name} has no {', '.join(missing)}")
        record_name = f"{dist_info_dir(names)}/RECORD"
        dest.parent.mkdir(parents=True, exist_ok=True)
        records: list[tuple[str, str, str]] = []
        with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as out:
            for info in infos:
                if info.filename == record_name:
                    continue
                name = info.filename
                data = Path(replacements[name]).read_bytes() if name in replacements else src.read(info)
                new_info = zipfile.ZipInfo(name, date_time=info.date_time)
                new_info.external_attr = info.external_attr
                new_info.compress_type = zipfile.ZIP_DEFLATED
                out.writestr(new_info, data)
                records.append((name, record_hash(data), str(len(data))))
            buffer = io.StringIO()
            writer = csv.writer(buffer, lineterminator="\n")
            writer.writerows(records)
            writer.writerow((record_name, "", ""))
            out.writestr(zipfile.ZipInfo(record_name, date_time=infos[0].date_time), buffer.getvalue())
    return dest


def read_member(wheel: Path, name: str) -> bytes:
    with zipfile.ZipFile(wheel) as z:
        return z.read(name)
