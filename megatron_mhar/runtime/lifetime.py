"""Helper processes die with the process that started them, however it dies.

A trainer killed by SIGKILL or the OOM killer runs no cleanup, so its helpers are told by
the kernel instead: each helper asks for ``PR_SET_PDEATHSIG`` (SIGKILL when its parent
exits) as it starts. The helpers are:

* Megatron's checkpoint-writer helper, a ``multiprocessing`` manager that megatron-core
  spawns at the first save and keeps (``filesystem_async``'s results queue):
  :func:`start_writer_helper` starts it first, with :func:`die_with_parent` as its
  initializer (the training driver and the conversion call it before they save).
* the writer processes Megatron forks from the trainer for each save, and any other
  child forked from the main thread: :func:`install` registers an after-fork hook.
* the ranks a conversion spawns (:mod:`megatron_mhar.conversion.convert`), which call
  :func:`die_with_parent` first.

Python's ``multiprocessing`` resource tracker needs nothing: it exits once every holder
of its pipe (the trainer and these helpers) is gone.
The parent-death signal follows the thread that started the child, so children forked
from another thread (which may end before the process) get no hook. Linux only; a no-op
elsewhere.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Optional, Sequence

_PR_SET_PDEATHSIG = 1
_installed = False
_forking_from_main = threading.local()
_prctl = None  # libc's prctl, looked up before any fork: a forked child loads no library


def _libc_prctl():
    global _prctl
    if _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _prctl


def die_with_parent(parent: Optional[int] = None) -> None:
    """Have the kernel kill this process (SIGKILL) when its parent exits; exit now if
    ``parent`` (the expected parent's pid) has already gone."""
    if not sys.platform.startswith("linux"):
        return
    if _libc_prctl()(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent is not None and os.getppid() != parent:  # it died before the request
        os._exit(1)


def _before_fork() -> None:
    _forking_from_main.pid = os.getpid()
    _forking_from_main.yes = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    if getattr(_forking_from_main, "yes", False):
        die_with_parent(_forking_from_main.pid)


def install() -> None:
    """From now on, a child forked from this process's main thread dies with it (idempotent)."""
    global _installed
    if not _installed and sys.platform.startswith("linux"):
        _libc_prctl()
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _installed = True


def start_writer_helper(deaf_to: Sequence[int] = ()) -> None:
    """Start megatron-core's checkpoint-writer helper now, so that it dies with this process
    and does not hear the signals ``deaf_to``.

    megatron-core (0.16 to 0.19) keeps the helper's queue in ``filesystem_async``'s
    ``_results_queue`` and creates it on first use as
    ``mp.get_context("spawn").Manager().Queue()``; the same manager is started here with
    :func:`die_with_parent` as its initializer, and its queue put where megatron-core
    looks. The signals ``deaf_to``, blocked in this thread while it starts the helper, stay
    blocked in the helper for good: Slurm delivers a job step's signals to every process
    of the step, and a helper that dies of the SIGTERM asking for a save fails that save.
    Here such a signal goes to another thread meanwhile, or waits until they are unblocked.
    (They are not set to be ignored meanwhile: a signal that arrives then would be lost.)
    """
    import multiprocessing
    from multiprocessing import resource_tracker
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if multiprocessing.current_process().daemon:
        # A daemonic process (a test harness's rank) may not start children; megatron-core
        # then creates the helper at the first save, without these safeguards.
        return
    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    # Started first: starting Python's resource tracker (which spawning needs) unblocks
    # SIGINT and SIGTERM in the calling thread, and the helper would hear them.
    resource_tracker.ensure_running()
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, deaf_to)
    try:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        filesystem_async._results_queue = manager.Queue()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
