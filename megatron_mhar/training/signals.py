"""SIGTERM / SIGUSR1 / Ctrl-C: finish the current step, save a checkpoint, exit cleanly.

Slurm sends SIGTERM before killing a job (and SIGUSR1 ``--signal=USR1@90`` ahead
of the time limit); torchrun forwards SIGTERM to its workers; a user at a terminal
presses Ctrl-C (SIGINT). The handler only records the signal; the loop checks
:meth:`StopSignal.requested` between steps, where every rank agrees through one
all-reduce, so all ranks save together. A second Ctrl-C stops the process at once
(exit 130, as a shell reports SIGINT), losing the steps since the last checkpoint; the
driver resumes from that checkpoint and clears the unfinished save, as after SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Dict, Optional

import torch

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignal:
    """Installs the handlers on enter and restores the previous ones on exit."""

    def __init__(self):
        self.received: Optional[int] = None
        self._previous: Dict[int, object] = {}
        self.stop_message = "stopped at once"
        """Printed (rank 0) when a second Ctrl-C stops the process: how to resume."""

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
                # Not KeyboardInterrupt: raised from a handler it can land where exceptions
                # are ignored (a logging lock's release at fork) and the run goes on.
                if os.environ.get("RANK", "0") == "0":
                    print(f"\n{self.stop_message}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                # Megatron's checkpoint-writer helper ignores the stop signals: it goes
                # with this process instead of outliving it.
                import multiprocessing

                for child in multiprocessing.active_children():
                    child.kill()
                os._exit(130)
            if os.environ.get("RANK", "0") == "0":
                print("\nCtrl-C: finishing this step, then saving a checkpoint and exiting "
                      "(Ctrl-C again stops at once, losing the steps since the last checkpoint)",
                      file=sys.stderr, flush=True)
        self.received = signum

    @property
    def name(self) -> Optional[str]:
        """Name of the received signal."""
        return signal.Signals(self.received).name if self.received else None

    def requested(self, device: torch.device) -> bool:
        """Whether any rank received a signal (a collective when several ranks run)."""
        flag = 0 if self.received is None else int(self.received)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            tensor = torch.tensor([flag], dtype=torch.int64, device=device)
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
            flag = int(tensor.item())
            if flag and self.received is None:
                self.received = flag
        return flag != 0
