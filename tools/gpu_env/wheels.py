"""Rewrite a wheel with some files replaced and a local version label added.

The pruned library goes back into the ``transformer_engine_cu13`` wheel as version
``2.20.2+sm90``: pip installs it like the original (``==2.20.2`` pins accept a local
label), its RECORD lists the new file's sha256, and ``pip list`` shows which build it is.
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


def relabel_wheel(source: Path, dest_dir: Path, replacements: dict[str, Path], local_label: str) -> Path:
    """Write ``source`` into ``dest_dir`` with the files named in ``replacements``
    (archive path -> file) replaced and ``+local_label`` added to its version."""
    source = Path(source)
    with zipfile.ZipFile(source) as src:
        infos = src.infolist()
        names = [i.filename for i in infos]
        missing = sorted(set(replacements) - set(names))
        if missing:
            raise WheelError(f"{source.name} has no {', '.join(missing)}")
        old_dist_info = dist_info_dir(names)
        project, version = old_dist_info[: -len(".dist-info")].rsplit("-", 1)
        new_version = f"{version}+{local_label}"
        new_dist_info = f"{project}-{new_version}.dist-info"
        tags = source.name[: -len(".whl")].split("-", 2)[2]
        dest = Path(dest_dir) / f"{project}-{new_version}-{tags}.whl"
        dest.parent.mkdir(parents=True, exist_ok=True)
        records: list[tuple[str, str, str]] = []
        record_name = f"{new_dist_info}/RECORD"
        with zipfile.ZipFile(dest, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as out:
            for info in infos:
                name = info.filename
                if name == f"{old_dist_info}/RECORD":
                    continue
                data = Path(replacements[name]).read_bytes() if name in replacements else src.read(info)
                if name.startswith(old_dist_info + "/"):
                    name = new_dist_info + name[len(old_dist_info) :]
                if name == f"{new_dist_info}/METADATA":
                    data = _set_metadata_version(data, version, new_version)
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


def _set_metadata_version(metadata: bytes, version: str, new_version: str) -> bytes:
    old_line = f"Version: {version}\n".encode()
    if old_line not in metadata:
        raise WheelError(f"METADATA has no 'Version: {version}' line")
    return metadata.replace(old_line, f"Version: {new_version}\n".encode(), 1)


def read_member(wheel: Path, name: str) -> bytes:
    with zipfile.ZipFile(wheel) as z:
        return z.read(name)
