"""Megatron's checkpoint-writer helper: started deaf to the stop signals, found by megatron-core."""

import signal

import pytest

from megatron_mhar.runtime import lifetime
from megatron_mhar.training.signals import SIGNALS as STOP_SIGNALS


def test_writer_helper_started_with_stop_signals_blocked(monkeypatch):
    """The helper megatron-core's writer uses is the one started here (the queue where
    megatron-core looks for it), created while the stop signals are blocked: Slurm signals
    every process of a job step, and a helper killed by the SIGTERM that asks for a save
    fails that save."""
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    seen = []
    start = SyncManager.start

    def recording_start(self, *args, **kwargs):
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        seen.append({sig: sig in blocked for sig in STOP_SIGNALS})
        return start(self, *args, **kwargs)

    monkeypatch.setattr(SyncManager, "start", recording_start)
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])

    lifetime.start_writer_helper(deaf_to=STOP_SIGNALS)
    queue = filesystem_async._results_queue
    try:
        assert seen == [{sig: True for sig in STOP_SIGNALS}]
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
        with open(f"/proc/{queue._manager._process.pid}/status") as f:  # the helper never hears them
            blocked = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
        assert all(blocked >> (sig - 1) & 1 for sig in STOP_SIGNALS)
        getter = getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue
        assert getter() is queue  # megatron-core uses it, and starts no helper of its own
        lifetime.start_writer_helper(deaf_to=STOP_SIGNALS)  # started once
        assert len(seen) == 1
    finally:
        queue._manager.shutdown()


@pytest.mark.parametrize("from_main", [True, False], ids=["main-thread", "other-thread"])
def test_children_forked_from_the_main_thread_die_with_it(tmp_path, from_main):
    """A child forked from the main thread after ``install`` is killed with its parent;
    one forked from another thread (whose end would signal it) is left alone."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    script = r"""
import os, sys, threading, time
from megatron_mhar.runtime import lifetime
lifetime.install()

def fork():
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)

fork() if sys.argv[1] == "main" else (lambda t: (t.start(), t.join()))(threading.Thread(target=fork))
print("forked", flush=True)
time.sleep(60)
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parent = subprocess.Popen([sys.executable, "-c", script, "main" if from_main else "thread"], cwd=root,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout.readline().strip() == "forked"
        child = psutil.Process(parent.pid).children()[0]
        parent.kill()
        parent.wait()
        time.sleep(1)
        alive = child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        assert alive != from_main
    finally:
        try:  # the child left alive on purpose (or by a failure)
            os.killpg(parent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
