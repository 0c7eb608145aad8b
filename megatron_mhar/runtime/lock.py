"""One writer per directory: an exclusive lock held for the life of a run or a conversion.

A training run holds the lock of its run directory (rank 0, from start to exit), a
conversion the lock of its output while it writes. A second writer refuses at once with
:class:`DirectoryInUse`, which names the holder (host, pid, start time, command) and how
to proceed. The lock never outlives its holder, however the holder dies. The lock file
(``.lock`` in a run directory, ``.lock.<name>`` beside a conversion's output) is removed
when the holder releases it; one left by a killed holder is taken over.

Two kinds of lock, chosen per file system (:func:`lock_kind`; ``MHAR_LOCK=flock|file``
overrides):

* ``flock``: the kernel's lock on the lock file, released by the kernel when the holder
  dies (SIGKILL included). Local file systems; NFS, where Linux turns ``flock`` into
  NFS byte-range locks that every client sees (the lock of a holder whose node died
  goes with that node's NFS lease, 90 s by default); Lustre mounted with ``-o flock``;
  GPFS and CephFS, whose locks are cluster-wide.
* ``file``: the lock file is created with ``O_EXCL`` and names its holder; the holder
  refreshes its time stamp every :data:`HEARTBEAT_S` seconds. For file systems whose
  ``flock`` is not known to be cluster-wide: Lustre without ``-o flock`` (``localflock``
  locks one node only, ``noflock`` refuses), BeeGFS (global locks are a client setting
  not visible here), FUSE mounts, and wherever ``flock`` fails (``ENOLCK``). A lock file
  whose holder is gone is taken over: on the holder's own host (same boot) when its pid
  no longer runs the process that took the lock; from another host when its time stamp
  has not moved for :data:`STALE_S` seconds (a start beside a dead holder on another
  node waits that long once).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, Optional

from megatron_mhar.errors import UserError

LOCK_ENV = "MHAR_LOCK"
"""``flock`` or ``file``: the kind of lock, instead of the one chosen per file system."""
KINDS = ("flock", "file")
HEARTBEAT_S = 10.0
"""How often a ``file`` lock's holder refreshes its time stamp."""
STALE_S = 3 * HEARTBEAT_S
"""A ``file`` lock of another host whose time stamp has not moved for this long is stale."""

# File systems whose flock() is not cluster-wide, or not known to be (Lustre: unless
# mounted with -o flock).
_FILE_LOCK_FILESYSTEMS = ("lustre", "beegfs")
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class DirectoryInUse(UserError):
    """Another process holds the lock of a directory; the message names it."""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> Optional[float]:
    """When process ``pid`` started (seconds since the epoch), ``None`` if it does not run."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # another user's process: it runs, start time unknown
        return -1.0


def _holder_record() -> Dict[str, object]:
    """Who takes the lock: this process."""
    started = _process_start(os.getpid())
    return {
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "pid": os.getpid(),
        "process_start": started,
        "started": datetime.datetime.fromtimestamp(started or time.time()).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),  # whole: the message names the holder by it
        "token": uuid.uuid4().hex,
    }


def _mount_of(path: Path) -> tuple:
    """(file system type, mount and super options) of the mount holding ``path``, from
    ``/proc/self/mountinfo``; ("", "") where it cannot be read."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return "", ""
    return mount_of(str(path), lines)


def mount_of(path: str, mountinfo_lines) -> tuple:
    """(file system type, options) of the longest mount point holding ``path`` among
    ``mountinfo_lines`` (``/proc/self/mountinfo`` format)."""
    best, found = -1, ("", "")
    for line in mountinfo_lines:
        fields = line.split()
        if " - " not in line or len(fields) < 7:
            continue
        point = fields[4].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            head, tail = line.split(" - ", 1)
            tail_fields = tail.split()
            options = ",".join([head.split()[5]] + tail_fields[2:3])
            best, found = len(point), (tail_fields[0], options)
    return found


def lock_kind(directory: Path) -> str:
    """``flock`` or ``file`` for a lock in ``directory`` (see the module's docstring)."""
    chosen = os.environ.get(LOCK_ENV)
    if chosen:
        if chosen not in KINDS:
            raise ValueError(f"{LOCK_ENV}={chosen!r}: use one of {', '.join(KINDS)}, or unset it")
        return chosen
    return _kind_for(*_mount_of(Path(directory).resolve()))


def _kind_for(fstype: str, options: str) -> str:
    if fstype == "lustre":
        return "flock" if "flock" in options.split(",") else "file"
    if fstype in _FILE_LOCK_FILESYSTEMS or fstype.startswith("fuse"):
        return "file"
    return "flock"


def _read_record(path: Path) -> Optional[dict]:
    """The holder a lock file names (``None``: absent, empty, or being written)."""
    try:
        with open(path) as f:  # opened anew: NFS revalidates the file on open
            text = f.read()
    except (FileNotFoundError, IsADirectoryError):
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _stamp(path: Path) -> Optional[int]:
    """The lock file's modification time in ns, read through a fresh open (``None``: gone)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)


class DirectoryLock:
    """The lock of one directory, through the lock file ``path``.

    ``what`` names the directory in messages (``"run directory runs/x"``); ``other_way``
    says how to proceed besides waiting (``"give this run another run.name"``).
    """

    def __init__(self, path: Path, what: str, other_way: str, kind: Optional[str] = None):
        self.path = Path(path).absolute()
        self.what = what
        self.other_way = other_way
        self.kind = kind
        self._fd: Optional[int] = None
        self._record: Optional[dict] = None
        self._heartbeat: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # ------------------------------------------------------------ taking and leaving

    def acquire(self) -> "DirectoryLock":
        """Take the lock now, or raise :class:`DirectoryInUse` (never waits for a live holder)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kind = self.kind or lock_kind(self.path.parent)
        record = _holder_record()
        if kind == "flock" and self._acquire_flock(record):
            self.kind = "flock"
        else:
            self._acquire_file(record)
            self.kind = "file"
        self._record = record
        return self

    def release(self) -> None:
        """Leave the lock and remove the lock file (a no-op when not held)."""
        if self._record is None:
            return
        if self._heartbeat is not None:
            self._stop.set()
            self._heartbeat.join()
            self._heartbeat = None
        try:
            current = _read_record(self.path)
            if current is not None and current.get("token") == self._record["token"]:
                # flock: unlinked while held, so a process that opened it meanwhile sees
                # another file at the path once it gets the lock, and tries again.
                self.path.unlink(missing_ok=True)
        except OSError:  # a read-only or vanished file system: the file stays, the lock goes
            pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._record = None

    def __enter__(self) -> "DirectoryLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    # ------------------------------------------------------------ flock

    def _acquire_flock(self, record: dict) -> bool:
        """Take the kernel's lock; False where this file system refuses flock."""
        import fcntl

        # NFS turns flock into a byte-range lock, whose exclusive kind needs the file open
        # for writing; elsewhere it is held read-only (a file open for writing would keep
        # its file system from being remounted read-only) and the record written apart.
        mode = os.O_RDWR if _mount_of(self.path.parent.resolve())[0].startswith("nfs") else os.O_RDONLY
        while True:
            try:
                fd, created = os.open(self.path, mode | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), True
            except FileExistsError:
                try:
                    fd, created = os.open(self.path, mode | os.O_CLOEXEC), False
                except FileNotFoundError:  # released meanwhile
                    continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise self._in_use(_read_record(self.path)) from None
                if err.errno in _NO_FLOCK:
                    if created:  # the lock file kind creates its own
                        self.path.unlink(missing_ok=True)
                    return False
                raise
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder removed the file between our open and our lock
                os.close(fd)
                continue
            data = json.dumps(record).encode()
            # Closing another descriptor of the file would drop a byte-range lock: NFS writes through this one.
            out = fd if mode == os.O_RDWR else os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.ftruncate(out, 0)
                os.pwrite(out, data, 0)
                os.fsync(out)
            finally:
                if out != fd:
                    os.close(out)
            self._fd = fd
            return True

    # ------------------------------------------------------------ file

    def _acquire_file(self, record: dict) -> None:
        data = json.dumps(record).encode()
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _read_record(self.path)
                if holder is None:  # being written by its creator this instant, or left empty
                    time.sleep(1.0)
                    holder = _read_record(self.path)
                if holder is not None and self._alive(holder):
                    raise self._in_use(holder) from None
                self._take_over(holder or {})
                continue
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._stop.clear()
            self._heartbeat = threading.Thread(target=self._beat, name="mhar-lock-heartbeat", daemon=True)
            self._heartbeat.start()
            return
        raise self._in_use(_read_record(self.path))

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # gone or unreachable for now: the next beat tries again
                pass

    def _alive(self, holder: dict) -> bool:
        """Whether the holder a lock file names still runs."""
        if holder.get("host") == socket.gethostname() and holder.get("boot_id") == _boot_id():
            started = _process_start(int(holder.get("pid", -1)))
            recorded = holder.get("process_start")
            return started is not None and (started < 0 or recorded is None or abs(started - recorded) < 1.0)
        if holder.get("host") == socket.gethostname():
            return False  # written before this host's last boot
        # Another host: alive if its heartbeat moves. Clocks of hosts differ, so the time
        # stamp is watched rather than compared with this host's time.
        print(f"{self.path} names {holder.get('host')} pid {holder.get('pid')}; waiting up to {STALE_S:.0f} s "
              f"for its heartbeat to see whether it still runs", file=sys.stderr, flush=True)
        first = _stamp(self.path)
        deadline = time.monotonic() + STALE_S
        while time.monotonic() < deadline:
            time.sleep(min(1.0, STALE_S))
            now = _stamp(self.path)
            if now is None or now != first or _read_record(self.path) != holder:
                return True  # it beat (or the file changed hands): someone holds it
        return False

    def _take_over(self, stale: dict) -> None:
        """Remove the lock file of a holder found dead, unless it changed hands meanwhile."""
        aside = self.path.with_name(f"{self.path.name}.stale.{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # removed by another process that found it stale too
        moved = _read_record(aside)
        if moved is not None and moved.get("token") != stale.get("token"):
            # a live holder's file, created after ours was read: put it back unless another came
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            os.unlink(aside)
            raise self._in_use(moved)
        os.unlink(aside)
        holder = f"{stale.get('host')} pid {stale.get('pid')}, which no longer runs" if stale else "nobody (empty)"
        print(f"{self.path}: took over the lock of {holder}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------ messages

    def _in_use(self, holder: Optional[dict]) -> DirectoryInUse:
        if holder:
            who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
                   f" ({holder.get('command')})")
            stop = f"kill {holder.get('pid')} on {holder.get('host')}, or scancel its Slurm job"
        else:
            who, stop = "another process (its lock file is being written)", "stop it"
        return DirectoryInUse(
            f"{self.what} is in use by {who}; two writers would overwrite each other's files. Wait for it "
            f"to finish, or stop it ({stop}), or {self.other_way}. The lock is {self.path}: it goes when "
            f"its holder exits, however it ends"
        )
