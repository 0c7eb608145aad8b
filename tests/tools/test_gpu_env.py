"""tools/gpu_env: fatbin pruning on a synthetic ELF, parts and their sha256 checks,
the manifest, the wheel rewrite, and the installer's argument and check errors.
The real library is checked by build_bundle.py itself (cuobjdump), not here."""

from __future__ import annotations

import sys
import base64
import csv
import hashlib
import io
import json
import shutil
import struct
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from tools.gpu_env import cubins, fatbin, install, linkcheck, parts, wheels
from tools.gpu_env.manifest import Manifest, ManifestError

# (arch, flags, payload bytes, header size) of each entry, in two containers.
CONTAINERS = [
    [(75, 0x8011, 40, 64), (90, 0x8011, 48, 64), (100, 0x1108011, 24, 72)],
    [(90, 0x108011, 16, 64), (120, 0x1208011, 32, 64)],
]


def _entry(arch: int, flags: int, size: int, header_size: int, seed: int, kind: int = 2) -> bytes:
    header = fatbin.ENTRY_HEADER.pack(kind, 0x0101, header_size, size, size - 3, 0, 8, 1, arch, 0, 0, flags, 0, 10 * size)
    payload = bytes((seed * 31 + i * 7 + 1) % 251 + 1 for i in range(size))  # never zero
    return header + bytes(header_size - len(header)) + payload


def _fatbin_section() -> bytes:
    out = b""
    seed = 0
    for container in CONTAINERS:
        body = b""
        for arch, flags, size, header_size in container:
            body += _entry(arch, flags, size, header_size, seed)
            seed += 1
        out += fatbin.CONTAINER_HEADER.pack(fatbin.CONTAINER_MAGIC, 1, 16, len(body)) + body
        out += bytes(-len(out) % 8)
    return out


def make_elf(section: bytes | None = None, name: bytes = b".nv_fatbin") -> bytes:
    """A little-endian ELF64 with .text, a fatbin section and .shstrtab."""
    section = _fatbin_section() if section is None else section
    text = b"\x90" * 40
    shstrtab = b"\0.text\0" + name + b"\0.shstrtab\0"
    body = bytearray(64)
    offsets = []
    for blob in (text, section, shstrtab):
        body += bytes(-len(body) % 8)
        offsets.append(len(body))
        body += blob
    body += bytes(-len(body) % 8)
    shoff = len(body)
    headers = bytes(64)  # the null section
    names = [1, 7, 7 + len(name) + 1]
    for name_off, off, blob in zip(names, offsets, (text, section, shstrtab)):
        headers += struct.pack("<IIQQQQIIQQ", name_off, 1, 0, 0, off, len(blob), 0, 0, 8, 0)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    body[:64] = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, 4, 3)
    return bytes(body + headers)


# ---------------------------------------------------------------- fatbin


def test_entries_are_read_with_arch_names_and_offsets():
    data = make_elf()
    entries = fatbin.read_entries(data)
    assert [e.arch_name for e in entries] == ["sm_75", "sm_90", "sm_100a", "sm_90a", "sm_120"]
    assert [e.index for e in entries] == [1, 2, 3, 4, 5]
    assert [e.payload_size for e in entries] == [40, 48, 24, 16, 32]
    assert entries[2].header_size == 72 and entries[2].payload_offset == entries[2].header_offset + 72
    assert entries[1].cubin_name == "2.sm_90.cubin"


def test_cuobjdump_numbers_elf_and_ptx_entries_apart():
    body = b"".join(_entry(90, 0x8011, 16, 64, i, kind) for i, kind in enumerate([1, 2, 1, 2, 2]))
    section = fatbin.CONTAINER_HEADER.pack(fatbin.CONTAINER_MAGIC, 1, 16, len(body)) + body
    entries = fatbin.read_entries(make_elf(section))
    assert [e.cubin_name for e in entries] == [
        "1.sm_90.ptx", "1.sm_90.cubin", "2.sm_90.ptx", "2.sm_90.cubin", "3.sm_90.cubin"
    ]
    assert [e.index for e in entries] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "keep, kept_names",
    [
        pytest.param({90}, ["sm_90", "sm_90a"], id="sm90-keeps-both-variants"),
        pytest.param({75, 120}, ["sm_75", "sm_120"], id="first-and-last-entries"),
        pytest.param({100}, ["sm_100a"], id="entry-with-long-header"),
    ],
)
def test_prune_zeroes_only_other_payloads(keep, kept_names):
    original = make_elf()
    pruned = bytearray(original)
    report = fatbin.prune_bytes(pruned, keep)
    assert [e.arch_name for e in report.kept] == kept_names
    assert len(pruned) == len(original)
    entries = fatbin.read_entries(original)
    assert fatbin.read_entries(pruned) == entries  # every header and offset unchanged
    for e in entries:
        span = slice(e.payload_offset, e.payload_offset + e.payload_size)
        header = slice(e.header_offset, e.payload_offset)
        assert pruned[header] == original[header]
        if e.arch in keep:
            assert pruned[span] == original[span]
            assert fatbin.payload_sha256(pruned, e) == fatbin.payload_sha256(original, e)
        else:
            assert pruned[span] == bytes(e.payload_size)
    zeroed = {i for e in report.zeroed for i in range(e.payload_offset, e.payload_offset + e.payload_size)}
    assert all(pruned[i] == original[i] for i in range(len(original)) if i not in zeroed)
    assert fatbin.check_pruned(original, bytes(pruned), keep).zeroed == report.zeroed


def test_prune_file_writes_a_copy(tmp_path):
    src, dst = tmp_path / "lib.so", tmp_path / "out" / "lib.so"
    dst.parent.mkdir()
    src.write_bytes(make_elf())
    report = fatbin.prune_file(src, dst, {90})
    assert src.read_bytes() == make_elf()
    assert report.zeroed_bytes == 40 + 24 + 32 and report.kept_bytes == 48 + 16
    fatbin.check_pruned(src.read_bytes(), dst.read_bytes(), {90})


@pytest.mark.parametrize(
    "target, match",
    [
        pytest.param("kept_payload", "bytes .* differ", id="kept-payload-changed"),
        pytest.param("zeroed_payload", "should be zeroed", id="dropped-payload-left"),
        pytest.param("header", "headers or offsets", id="entry-header-changed"),
    ],
)
def test_check_pruned_catches_tampering(target, match):
    original = make_elf()
    pruned = bytearray(original)
    fatbin.prune_bytes(pruned, {90})
    entries = fatbin.read_entries(original)
    if target == "kept_payload":
        pruned[entries[1].payload_offset + 5] ^= 0xFF
    elif target == "zeroed_payload":
        pruned[entries[0].payload_offset + 3] = 1
    else:
        pruned[entries[1].header_offset + 28] = 89  # the arch field
    with pytest.raises(fatbin.FatbinError, match=match):
        fatbin.check_pruned(original, bytes(pruned), {90})


def test_bad_inputs_are_refused_with_the_reason():
    with pytest.raises(fatbin.FatbinError, match="not an ELF"):
        fatbin.read_entries(b"\0" * 128)
    with pytest.raises(fatbin.FatbinError, match="no .nv_fatbin section"):
        fatbin.read_entries(make_elf(name=b".rodata"))
    bad_magic = bytearray(_fatbin_section())
    bad_magic[0] ^= 1
    with pytest.raises(fatbin.FatbinError, match="bad fatbin container magic"):
        fatbin.read_entries(make_elf(bytes(bad_magic)))
    with pytest.raises(fatbin.FatbinError, match=r"no fatbin entry for architectures \[80\].*sm_90a"):
        fatbin.prune_bytes(bytearray(make_elf()), {80})
    with pytest.raises(ValueError, match="keep_arches is empty"):
        fatbin.prune_bytes(bytearray(make_elf()), set())
    with pytest.raises(fatbin.FatbinError, match="sizes differ"):
        fatbin.check_pruned(make_elf(), make_elf() + b"\0", {90})


def test_uncompressed_payload_is_returned_as_stored():
    data = make_elf()
    entry = fatbin.read_entries(data)[1]
    raw = fatbin.FatbinEntry(**{**entry.__dict__, "flags": entry.flags & ~fatbin.ZSTD_FLAG})
    assert cubins.decompress_payload(data, raw) == data[entry.payload_offset : entry.payload_offset + 48]
    lz4 = fatbin.FatbinEntry(**{**entry.__dict__, "flags": fatbin.LZ4_FLAG})
    with pytest.raises(fatbin.FatbinError, match="LZ4"):
        cubins.decompress_payload(data, lz4)


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd command")
def test_kept_cubins_decompress_zstd_payloads(tmp_path):
    cubin = bytes(range(256)) * 40
    frame = subprocess.run(["zstd", "-c", "-q"], input=cubin, capture_output=True, check=True).stdout
    padded = frame + bytes(-len(frame) % 8)
    header = fatbin.ENTRY_HEADER.pack(2, 0x0101, 64, len(padded), len(frame), 0, 8, 1, 90, 0, 0, 0x8011, 0, len(cubin))
    body = header + padded
    section = fatbin.CONTAINER_HEADER.pack(fatbin.CONTAINER_MAGIC, 1, 16, len(body)) + body
    lib = tmp_path / "libx.so"
    lib.write_bytes(make_elf(section))
    assert cubins.kept_cubins(lib, {90}) == {"libx.1.sm_90.cubin": hashlib.sha256(cubin).hexdigest()}
    assert cubins.kept_cubins(lib, {80}) == {}
    # A PTX entry is hashed as cuobjdump -xptx writes it: without the terminating NUL.
    ptx = b".version 8.0\n.target sm_90\n" * 20
    frame = subprocess.run(["zstd", "-c", "-q"], input=ptx + b"\0", capture_output=True, check=True).stdout
    padded = frame + bytes(-len(frame) % 8)
    header = fatbin.ENTRY_HEADER.pack(1, 0x0101, 64, len(padded), len(frame), 0, 8, 1, 90, 0, 0, 0x8011, 0, len(ptx) + 1)
    body = header + padded
    lib.write_bytes(make_elf(fatbin.CONTAINER_HEADER.pack(fatbin.CONTAINER_MAGIC, 1, 16, len(body)) + body))
    assert cubins.kept_cubins(lib, {90}) == {"libx.1.sm_90.ptx": hashlib.sha256(ptx).hexdigest()}


# ---------------------------------------------------------------- link check


def _shared_lib(tmp_path: Path, name: str, source: str, version_script: str | None, link: list[str]) -> Path:
    src = tmp_path / f"{name}.c"
    src.write_text(source)
    cmd = ["gcc", "-shared", "-fPIC", "-o", str(tmp_path / name), str(src), f"-Wl,-soname,{name}"]
    if version_script is not None:
        (tmp_path / f"{name}.map").write_text(version_script)
        cmd.append(f"-Wl,--version-script={tmp_path / f'{name}.map'}")
    subprocess.run(cmd + link, check=True)
    return tmp_path / name


@pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("nm") is None, reason="needs gcc and nm")
def test_unresolved_symbols_names_what_the_provider_lacks(tmp_path):
    new, old = tmp_path / "new", tmp_path / "old"
    new.mkdir(), old.mkdir()
    script = "libprov.so.1 { global: %s; local: *; };"
    _shared_lib(new, "libprov.so.1", "int foo(void){return 1;} int bar(void){return 2;}", script % "foo; bar", [])
    _shared_lib(old, "libprov.so.1", "int foo(void){return 1;}", script % "foo", [])
    user = _shared_lib(tmp_path, "libuser.so", "int foo(void); int bar(void); int use(void){return foo() + bar();}",
                       None, [str(new / "libprov.so.1")])
    assert linkcheck.undefined_versioned(user) == [("bar", "libprov.so.1"), ("foo", "libprov.so.1")]
    assert linkcheck.unresolved_symbols(user, [new]) == []
    assert linkcheck.unresolved_symbols(user, [old]) == ["libprov.so.1:bar"]
    assert linkcheck.unresolved_symbols(user, [tmp_path / "none"]) == ["libprov.so.1:(library not found)"] * 2


# ---------------------------------------------------------------- parts


def _blob(tmp_path: Path, size: int) -> Path:
    path = tmp_path / "archive.tar"
    path.write_bytes(bytes((i * 13 + 7) % 256 for i in range(size)))
    return path


@pytest.mark.parametrize(
    "size, part_size, n_parts",
    [
        pytest.param(1000, 300, 4, id="short-last-part"),
        pytest.param(900, 300, 3, id="exact-multiple"),
        pytest.param(10, 300, 1, id="one-part"),
    ],
)
def test_split_and_reassemble_round_trip(tmp_path, size, part_size, n_parts):
    archive = _blob(tmp_path, size)
    records = parts.split_file(archive, tmp_path / "parts", part_size)
    assert len(records) == n_parts
    assert [r.name for r in records] == [f"archive.tar.part{i:03d}" for i in range(n_parts)]
    assert all(r.size <= part_size for r in records) and sum(r.size for r in records) == size
    dest = parts.reassemble(records, tmp_path / "parts", parts.record_file(archive), tmp_path / "again.tar")
    assert dest.read_bytes() == archive.read_bytes()


def test_corrupted_or_missing_part_is_named(tmp_path):
    archive = _blob(tmp_path, 1000)
    records = parts.split_file(archive, tmp_path / "parts", 300)
    whole = parts.record_file(archive)
    part1 = tmp_path / "parts" / records[1].name
    data = bytearray(part1.read_bytes())
    data[10] ^= 1
    part1.write_bytes(bytes(data))
    with pytest.raises(parts.PartError, match=r"part archive.tar.part001 has the wrong sha256"):
        parts.reassemble(records, tmp_path / "parts", whole, tmp_path / "out.tar")
    part1.write_bytes(bytes(data[:-1]))
    with pytest.raises(parts.PartError, match=r"part archive.tar.part001 has 299 bytes, the manifest says 300"):
        parts.reassemble(records, tmp_path / "parts", whole, tmp_path / "out.tar")
    part1.unlink()
    with pytest.raises(parts.PartError, match=r"missing .*: archive.tar.part001$"):
        parts.reassemble(records, tmp_path / "parts", whole, tmp_path / "out.tar")
    assert not (tmp_path / "out.tar").exists()


def test_reassembled_file_must_match_the_whole(tmp_path):
    archive = _blob(tmp_path, 600)
    records = parts.split_file(archive, tmp_path / "parts", 300)
    wrong = parts.FileRecord(archive.name, 600, "0" * 64)
    with pytest.raises(parts.PartError, match="reassembled archive.tar does not match"):
        parts.reassemble(records, tmp_path / "parts", wrong, tmp_path / "out.tar")
    assert not (tmp_path / "out.tar").exists() and not (tmp_path / "out.tar.tmp").exists()


# ---------------------------------------------------------------- manifest


def _manifest(archive: parts.FileRecord, records: list[parts.FileRecord], wheels_: list[parts.FileRecord]) -> Manifest:
    return Manifest(
        archive=archive,
        parts=records,
        wheels=wheels_,
        install=["demo==1.0"],
        install_no_deps=[],
        build_sdists=[],
        packages={"demo": "1.0"},
        pruned_library={"pruned_sha256": "ab" * 32},
        import_check="import json",
    )


def test_manifest_round_trip_and_errors(tmp_path):
    record = parts.FileRecord("a.tar", 3, "cd" * 32)
    manifest = _manifest(record, [record], [record])
    manifest.write(tmp_path / "manifest.json")
    assert Manifest.read(tmp_path / "manifest.json") == manifest
    with pytest.raises(ManifestError, match="no manifest at"):
        Manifest.read(tmp_path / "none.json")
    obj = manifest.to_json()
    (tmp_path / "m.json").write_text(json.dumps({**obj, "format": 99}))
    with pytest.raises(ManifestError, match="format 99"):
        Manifest.read(tmp_path / "m.json")
    del obj["parts"]
    (tmp_path / "m.json").write_text(json.dumps(obj))
    with pytest.raises(ManifestError, match="malformed .*parts"):
        Manifest.read(tmp_path / "m.json")
    (tmp_path / "m.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.read(tmp_path / "m.json")


# ---------------------------------------------------------------- wheel rewrite


def test_replace_in_wheel_replaces_file_and_rewrites_record(tmp_path):
    src = tmp_path / "demo_pkg-1.2.3-py3-none-manylinux_2_28_x86_64.whl"
    metadata = "Metadata-Version: 2.1\nName: demo_pkg\nVersion: 1.2.3\n"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("demo_pkg/__init__.py", "x = 1\n")
        z.writestr("demo_pkg/lib/libdemo.so", b"original")
        z.writestr("demo_pkg-1.2.3.dist-info/METADATA", metadata)
        z.writestr("demo_pkg-1.2.3.dist-info/RECORD", "stale\n")
    new_lib = tmp_path / "libdemo.so"
    new_lib.write_bytes(b"pruned!")
    out = wheels.replace_in_wheel(src, tmp_path / "out", {"demo_pkg/lib/libdemo.so": new_lib})
    assert out.name == src.name
    with zipfile.ZipFile(out) as z:
        assert z.read("demo_pkg/lib/libdemo.so") == b"pruned!"
        assert z.read("demo_pkg/__init__.py") == b"x = 1\n"
        assert z.read("demo_pkg-1.2.3.dist-info/METADATA").decode() == metadata
        rows = list(csv.reader(io.StringIO(z.read("demo_pkg-1.2.3.dist-info/RECORD").decode())))
        assert sorted(r[0] for r in rows) == sorted(z.namelist())
        for name, digest, size in rows[:-1]:
            data = z.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expected}" and int(size) == len(data)
        assert rows[-1] == ["demo_pkg-1.2.3.dist-info/RECORD", "", ""]
    with pytest.raises(wheels.WheelError, match="has no demo_pkg/missing.so"):
        wheels.replace_in_wheel(src, tmp_path / "out2", {"demo_pkg/missing.so": new_lib})
    with pytest.raises(wheels.WheelError, match="holds the source wheel"):
        wheels.replace_in_wheel(src, tmp_path, {"demo_pkg/lib/libdemo.so": new_lib})


# ---------------------------------------------------------------- installer


def _bundle(tmp_path: Path, part_size: int = 700) -> tuple[Path, Manifest]:
    """A bundle of two small files split into parts, with its manifest."""
    staged = tmp_path / "stage" / "wheels"
    staged.mkdir(parents=True)
    for name, size in (("demo-1.0-py3-none-any.whl", 900), ("other-2.0-py3-none-any.whl", 500)):
        (staged / name).write_bytes(bytes((i * 17 + size) % 256 for i in range(size)))
    archive = tmp_path / "stage" / "bundle.tar"
    with tarfile.open(archive, "w") as tar:
        for path in sorted(staged.iterdir()):
            tar.add(path, arcname=f"wheels/{path.name}")
    bundle = tmp_path / "bundle"
    records = parts.split_file(archive, bundle, part_size)
    manifest = _manifest(parts.record_file(archive), records, [parts.record_file(p) for p in sorted(staged.iterdir())])
    manifest.write(bundle / "manifest.json")
    return bundle, manifest


def test_installer_argument_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        install.main(["--bundle", str(tmp_path / "nowhere")])
    assert exc.value.code == 2
    assert "is not a folder" in capsys.readouterr().err
    assert install.main(["--bundle", str(tmp_path), "--store", str(tmp_path / "store")]) == 1
    assert "no manifest at" in capsys.readouterr().err


def test_installer_gathers_parts_over_several_runs(tmp_path, capsys):
    bundle, manifest = _bundle(tmp_path)
    store = tmp_path / "store"
    names = [p.name for p in manifest.parts]
    assert len(names) >= 3
    held = tmp_path / "held"
    held.mkdir()
    for name in names[1:]:
        shutil.move(bundle / name, held / name)
    args = ["--bundle", str(bundle), "--store", str(store), "--stage-only"]
    assert install.main(args) == install.EXIT_MISSING
    assert f"still missing: {', '.join(names[1:])}" in capsys.readouterr().out
    (bundle / names[0]).unlink()
    for name in names[1:]:
        shutil.move(held / name, bundle / name)
    assert install.main(args) == 0
    assert f"all {len(names)} parts are in" in capsys.readouterr().out
    wheels_dir = install.unpack(manifest, store)
    assert sorted(p.name for p in wheels_dir.iterdir()) == [w.name for w in manifest.wheels]


def test_installer_refuses_a_corrupted_part_by_name(tmp_path, capsys):
    bundle, manifest = _bundle(tmp_path)
    victim = bundle / manifest.parts[1].name
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert install.main(["--bundle", str(bundle), "--store", str(tmp_path / "store")]) == 1
    assert f"part {manifest.parts[1].name} has the wrong sha256" in capsys.readouterr().err


def test_installer_refuses_a_store_of_another_bundle(tmp_path, capsys):
    first, _ = _bundle(tmp_path / "a")
    second, _ = _bundle(tmp_path / "b", part_size=500)
    store = tmp_path / "store"
    assert install.main(["--bundle", str(first), "--store", str(store), "--stage-only"]) == 0
    second_manifest = Manifest.read(second / "manifest.json")
    second_manifest.archive = parts.FileRecord("bundle.tar", 1, "ef" * 32)
    second_manifest.write(second / "manifest.json")
    assert install.main(["--bundle", str(second), "--store", str(store), "--stage-only"]) == 1
    assert "holds parts of another bundle" in capsys.readouterr().err


def test_unpack_refuses_a_wheel_unlike_the_manifest(tmp_path):
    bundle, manifest = _bundle(tmp_path)
    store = tmp_path / "store"
    assert install.main(["--bundle", str(bundle), "--store", str(store), "--stage-only"]) == 0
    manifest.wheels[0] = parts.FileRecord(manifest.wheels[0].name, manifest.wheels[0].size, "00" * 32)
    with pytest.raises(install.InstallError, match=f"{manifest.wheels[0].name} in the archive does not match"):
        install.unpack(manifest, store)


def test_prebuilt_extension_wheel_must_be_a_build_of_the_sdist(tmp_path):
    """--extension-wheel skips the build only for a wheel of the bundle's sdist, built for
    this Python; any other file is refused by name."""
    sdist = "transformer_engine_torch-2.12.0.tar.gz"
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    good = tmp_path / f"transformer_engine_torch-2.12.0-{tag}-{tag}-linux_x86_64.whl"
    good.write_bytes(b"")
    assert install.prebuilt_extension(sdist, good) == good
    for name in (f"transformer_engine_torch-2.13.0-{tag}-{tag}-linux_x86_64.whl",
                 "transformer_engine_torch-2.12.0-cp27-cp27-linux_x86_64.whl",
                 f"transformer_engine-2.12.0-{tag}-{tag}-linux_x86_64.whl"):
        other = tmp_path / name
        other.write_bytes(b"")
        with pytest.raises(install.InstallError, match=f"is not a transformer_engine_torch-2.12.0 wheel for {tag}"):
            install.prebuilt_extension(sdist, other)
    with pytest.raises(install.InstallError, match="is not a"):
        install.prebuilt_extension(sdist, tmp_path / "missing.whl")
