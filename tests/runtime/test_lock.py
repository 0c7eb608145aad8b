"""The directory lock (``megatron_mhar.runtime.lock``): both kinds against real holder
processes, a killed holder's lock taken over, another host's heartbeat, the choice per file system."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_mhar.runtime import lock as lock_module
from megatron_mhar.runtime.lock import DirectoryInUse, DirectoryLock, lock_kind, mount_of

REPO = Path(__file__).resolve().parents[2]

HOLDER = r"""
import sys, time
from megatron_mhar.runtime.lock import DirectoryLock
DirectoryLock(sys.argv[1], "test directory", "use another", kind=sys.argv[2]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(path: Path, kind: str) -> subprocess.Popen:
    """A process holding the lock ``path`` (of ``kind``) until killed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), kind], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize("kind", ["flock", "file"])
def test_a_live_holder_is_named_and_a_killed_one_leaves_no_stale_lock(tmp_path, kind):
    path = tmp_path / "run" / ".lock"
    holder = _holder(path, kind)
    try:
        with pytest.raises(DirectoryInUse) as err:
            DirectoryLock(path, f"run directory {path.parent}", "give this run another run.name", kind=kind).acquire()
        message = str(err.value)
        assert message.startswith(f"run directory {path.parent} is in use by pid {holder.pid} on "
                                  f"{socket.gethostname()}, started 20"), message
        assert "give this run another run.name" in message and f"kill {holder.pid} on" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert path.exists()  # a killed holder removes nothing ...
    with DirectoryLock(path, "run directory", "other", kind=kind) as taken:  # ... yet its lock is gone
        assert taken.kind == kind
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists()  # released: removed


def test_flock_excludes_a_second_holder_in_the_same_process(tmp_path):
    path = tmp_path / ".lock"
    with DirectoryLock(path, "run directory", "other", kind="flock"):
        with pytest.raises(DirectoryInUse, match=f"in use by pid {os.getpid()} "):
            DirectoryLock(path, "run directory", "other", kind="flock").acquire()


def test_where_flock_is_refused_the_lock_file_is_used(tmp_path, monkeypatch):
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    path = tmp_path / ".lock"
    with DirectoryLock(path, "run directory", "other", kind="flock") as taken:
        assert taken.kind == "file"
        with pytest.raises(DirectoryInUse):
            DirectoryLock(path, "run directory", "other", kind="file").acquire()


def _other_host_lock(path: Path) -> dict:
    record = {"host": "node-b", "boot_id": "x", "pid": 4242, "process_start": 1.0, "started": "2026-01-01T00:00:00",
              "command": "mhar-train pretrain_1b_mhar", "token": "t"}
    path.write_text(json.dumps(record))
    return record


def test_another_hosts_lock_with_a_moving_heartbeat_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "STALE_S", 1.5)
    path = tmp_path / ".lock"
    _other_host_lock(path)
    beating = threading.Event()

    def beat():  # the holder on node-b, as seen through the shared file system
        while not beating.wait(0.2):
            os.utime(path)

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        with pytest.raises(DirectoryInUse, match="in use by pid 4242 on node-b, started 2026-01-01T00:00:00 "
                                                 r"\(mhar-train pretrain_1b_mhar\)"):
            DirectoryLock(path, "run directory", "other", kind="file").acquire()
    finally:
        beating.set()
        thread.join()
    assert json.loads(path.read_text())["token"] == "t"  # left to its holder


def test_another_hosts_lock_without_heartbeat_is_taken_over(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lock_module, "STALE_S", 1.0)
    path = tmp_path / ".lock"
    _other_host_lock(path)
    with DirectoryLock(path, "run directory", "other", kind="file"):
        assert json.loads(path.read_text())["pid"] == os.getpid()
        stamp = path.stat().st_mtime_ns
    assert "took over the lock of node-b pid 4242, which no longer runs" in capsys.readouterr().err
    assert stamp > 0 and not path.exists()


def test_the_file_lock_holder_keeps_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(lock_module, "HEARTBEAT_S", 0.1)
    path = tmp_path / ".lock"
    with DirectoryLock(path, "run directory", "other", kind="file"):
        first = path.stat().st_mtime_ns
        time.sleep(0.5)
        assert path.stat().st_mtime_ns > first


MOUNTINFO = [
    "22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw",
    "40 22 0:40 / /lustre rw,relatime shared:20 - lustre 10.0.0.1@o2ib:/fs rw,flock,lazystatfs",
    "41 22 0:41 / /scratch rw,relatime shared:21 - lustre 10.0.0.2@o2ib:/sc rw,localflock",
    "42 22 0:42 / /beegfs rw,relatime shared:22 - beegfs beegfs_nodev rw,cfgFile=/etc/beegfs/beegfs-client.conf",
    "43 22 0:43 / /home rw,relatime shared:23 - nfs4 srv:/home rw,vers=4.2,hard",
    "44 43 0:44 / /home/me/my\\040drive rw,relatime shared:24 - fuse.sshfs me@host:/ rw,user_id=0",
]


@pytest.mark.parametrize("path, fstype, kind", [
    ("/home/me/runs/x", "nfs4", "flock"),  # NFS: flock becomes NFS byte-range locks, seen by every client
    ("/lustre/runs/x", "lustre", "flock"),  # Lustre mounted with -o flock: cluster-wide locks
    ("/scratch/runs/x", "lustre", "file"),  # -o localflock: one node's locks only
    ("/beegfs/runs", "beegfs", "file"),  # global locks are a client setting not visible here
    ("/home/me/my drive/runs", "fuse.sshfs", "file"),  # FUSE: not known to lock across hosts
    ("/tmp/runs", "ext4", "flock"),  # local: the longest mount point holding the path wins
])  # fmt: skip
def test_the_kind_of_lock_follows_the_file_system(path, fstype, kind, monkeypatch):
    assert mount_of(path, MOUNTINFO)[0] == fstype
    monkeypatch.delenv(lock_module.LOCK_ENV, raising=False)
    monkeypatch.setattr(lock_module, "_mount_of", lambda p: mount_of(str(p), MOUNTINFO))
    assert lock_kind(Path(path)) == kind


def test_the_kind_of_lock_can_be_chosen(monkeypatch, tmp_path):
    monkeypatch.setenv(lock_module.LOCK_ENV, "file")
    assert lock_kind(tmp_path) == "file"
    monkeypatch.setenv(lock_module.LOCK_ENV, "fcntl")
    with pytest.raises(ValueError, match="MHAR_LOCK='fcntl': use one of flock, file, or unset it"):
        lock_kind(tmp_path)
