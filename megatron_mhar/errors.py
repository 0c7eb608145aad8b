"""Failures the user fixes (input, environment), not bugs, and how every command reports them.

Every command (``mhar-train``, ``mhar-convert``, ``mhar-preprocess``, ``python -m
megatron_mhar.evaluate`` / ``analyze``, the ``checkpoint_tools/`` scripts) runs inside
:func:`command_errors`: a failure caused by the user's input or environment ends with
its message alone and exit code 2 (``docs/operations.md`` lists every exit code); with
``MHAR_TRACEBACK=1`` the traceback comes first. Anything else is a bug and keeps
Python's traceback and exit code 1.

What counts as the user's (:func:`is_user_error`): the ``ValueError``s the package
raises for bad configs, data and checkpoints (their messages name the problem and the
fix), missing or existing paths, and the operating system refusing for space or
permission (a full disk, a read-only mount). Several ranks: the message is printed once,
by rank 0, unless the failure happened on another rank only (:func:`on_this_rank`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import traceback
from typing import Iterator

EXIT_USER_ERROR = 2
"""Exit code of a failure caused by input or environment."""
TRACEBACK_ENV = "MHAR_TRACEBACK"
"""``MHAR_TRACEBACK=1`` prints the traceback of a user error before its message."""

SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
PERMISSION_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)


class UserError(Exception):
    """A failure caused by input or environment whose message names the problem and the fix."""


class ConfigError(UserError, ValueError):
    """The configuration does not fit what is on disk (e.g. a checkpoint of another model);
    the message names what differs and how to fix it. A ``ValueError``, so library
    callers that catch those keep working."""


class PeerFailure(UserError):
    """Another rank's failure, raised on this rank so that every rank stops: the message
    is that rank's (rank 0 prints it, the others stay quiet)."""


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` was caused by input or environment (exit code 2) rather than a bug."""
    if isinstance(err, (UserError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
                        IsADirectoryError, PermissionError)):
        return True
    return isinstance(err, OSError) and err.errno in SPACE_ERRNOS + PERMISSION_ERRNOS


def on_this_rank(err: BaseException) -> BaseException:
    """Mark ``err`` as this rank's alone (e.g. a bad token in its share of the data): it is
    printed by this rank, which the other ranks cannot know of."""
    err.mhar_rank_local = True
    return err


def os_error_fix(err: OSError) -> str:
    """The OS error ``err`` in words, naming its file and what to do."""
    where = f"{err.filename}: " if err.filename else ""
    what = err.strerror or str(err)
    if err.errno in SPACE_ERRNOS:
        fix = "free space on that file system (df -h shows it) or write elsewhere"
    elif err.errno in PERMISSION_ERRNOS:
        fix = "make it writable by this user (or remount it read-write), or write elsewhere"
    else:
        return f"{where}{what}"
    return f"{where}{what}; {fix}"


def message_of(err: BaseException) -> str:
    """The text printed for a user error."""
    if isinstance(err, OSError) and err.errno is not None and err.strerror:
        # the OS's own (a file named) or one raised with a message: OSError(code, message)
        return os_error_fix(err) if err.filename is not None else err.strerror
    return str(err) or type(err).__name__


def _rank() -> int:
    """This process's rank (the process group's where one runs, else the launcher's)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def report(prog: str, err: BaseException) -> None:
    """Print a user error as every command does (on the rank that prints it)."""
    rank = _rank()
    if rank != 0 and not getattr(err, "mhar_rank_local", False):
        return
    if os.environ.get(TRACEBACK_ENV, "0") not in ("", "0"):
        traceback.print_exception(err, file=sys.stderr)
        hint = ""
    else:
        hint = f"\n({TRACEBACK_ENV}=1 shows where it was raised)"
    where = f"[rank {rank}] " if rank != 0 else ""
    sys.stdout.flush()
    print(f"{where}{prog}: error: {message_of(err)}{hint}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def command_errors(prog: str) -> Iterator[None]:
    """Inside, a user error is reported (:func:`report`) and exits with code 2; any other
    exception propagates (a traceback, exit code 1)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - sorted here: user errors exit 2, others re-raise
        if not is_user_error(err):
            raise
        report(prog, err)
        raise SystemExit(EXIT_USER_ERROR) from None

