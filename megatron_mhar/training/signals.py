"""SIGTERM / SIGUSR1 / Ctrl-C: finish the current step, save a checkpoint, exit cleanly.

Slurm sends SIGTERM before killing a job (and SIGUSR1 ``--signal=USR1@90`` ahead
of the time limit); torchrun forwards SIGTERM to its workers; a user at a terminal
presses Ctrl-C (SIGINT). The handler only records the signal; the loop checks
:meth:`StopSignal.requested` between steps, where every rank agrees through one
all-reduce, so all ranks save together; a signal that comes while a checkpoint is
being written is answered by that checkpoint (the loop asks again after each save). A second Ctrl-C stops the process at once
(exit 130, as a shell reports SIGINT), losing the steps since the last checkpoint (or
the whole run, where none was saved yet: both messages say which); the driver resumes
from that checkpoint and clears the unfinished save, as after SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignal:
    """Installs the handlers on enter and restores the previous ones on exit."""

    def __init__(self):
        self.received: Optional[int] = None
        self.outputs_failed = False
        """Whether a rank could not write its outputs (metrics, TensorBoard): the run saves and stops."""
        self.saving: Optional[Path] = None
        """The checkpoint being written now, if any: a Ctrl-C meanwhile is answered by it."""
        self._previous: Dict[int, object] = {}
        self.resume_hint: Callable[[], str] = lambda: "the steps since the last checkpoint are lost"
        """What a stop at once loses and how the run goes on, said (rank 0) at the first
        Ctrl-C and when a second one stops the process; asked at that moment."""

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self.received == signal.SIGINT:
                self.exit_at_once(signum, frame)
            if os.environ.get("RANK", "0") == "0":
                then = (f"saving the checkpoint {self.saving}, then exiting" if self.saving is not None
                        else "finishing this step, then saving a checkpoint and exiting")
                print(f"\nCtrl-C: {then} (Ctrl-C again stops at once: {self.resume_hint()})",
                      file=sys.stderr, flush=True)
        self.received = signum

    def exit_at_once(self, signum=None, frame=None) -> None:
        """Stop the process now (exit 130, as a shell reports SIGINT), saying how the run
        goes on; the checkpoint writer's helpers die with it (:mod:`megatron_mhar.runtime.lifetime`).
        Not KeyboardInterrupt: raised from a handler it can land where exceptions are
        ignored (a logging lock's release at fork, an atexit callback)."""
        if os.environ.get("RANK", "0") == "0":
            print(f"\nstopped at once; {self.resume_hint()}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)

    @property
    def name(self) -> Optional[str]:
        """Name of the received signal."""
        return signal.Signals(self.received).name if self.received else None

    def requested(self, device: torch.device, outputs_failed: bool = False) -> bool:
        """Whether any rank received a signal or could not write its outputs
        (``outputs_failed``, :mod:`megatron_mhar.training.metrics`): a collective when several
        ranks run, after which :attr:`outputs_failed` says the latter on every rank."""
        flags = [0 if self.received is None else int(self.received), int(outputs_failed)]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            tensor = torch.tensor(flags, dtype=torch.int64, device=device)
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
            flags = tensor.tolist()
            if flags[0] and self.received is None:
                self.received = flags[0]
        self.outputs_failed = bool(flags[1])
        return flags[0] != 0 or self.outputs_failed
