"""ChecksummingFile: the checksum it leaves beside a file is the file's own."""

import json
import os

import pytest

from megatron_mhar.checkpoint import manifest


def _side(path):
    with open(str(path) + manifest.SIDE_SUFFIX) as f:
        return json.load(f)


def test_checksum_of_writes_with_a_reused_buffer(tmp_path):
    """The caller refilling its buffer right after ``write`` returns (as writers do) must
    not change the checksum."""
    path = tmp_path / "shard.distcp"
    buffer = bytearray((1 << 20) + 5)
    with manifest.ChecksummingFile(path) as f:
        for fill in range(4):
            buffer[:] = bytes([fill]) * len(buffer)
            f.write(buffer)
            f.write(memoryview(buffer)[:17])
        f.flush()
        os.fsync(f.fileno())
    side = _side(path)
    assert side["size"] == path.stat().st_size == 4 * (len(buffer) + 17)
    assert side[manifest.CHECKSUM] == manifest.file_checksum(path)


def test_failed_write_leaves_no_checksum(tmp_path):
    path = tmp_path / "shard.distcp"
    with pytest.raises(RuntimeError):
        with manifest.ChecksummingFile(path) as f:
            f.write(bytes(1 << 20))
            raise RuntimeError("disk gone")
    assert path.exists() and not os.path.exists(str(path) + manifest.SIDE_SUFFIX)


def test_early_writeback_leaves_the_checksum_and_no_thread(tmp_path, monkeypatch):
    """The disk writeback started on a thread every WRITEBACK_BYTES changes no byte and is
    joined before the file closes."""
    import threading

    monkeypatch.setattr(manifest, "WRITEBACK_BYTES", 1 << 20)
    path = tmp_path / "shard.distcp"
    with manifest.ChecksummingFile(path) as f:
        for _ in range(6):
            f.write(os.urandom(3 << 19))
        os.fsync(f.fileno())
    assert not [t for t in threading.enumerate() if t.name == "writeback"]
    side = _side(path)
    assert side["size"] == path.stat().st_size == 6 * (3 << 19)
    assert side[manifest.CHECKSUM] == manifest.file_checksum(path)
