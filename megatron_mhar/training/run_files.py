"""What a run holds and leaves in its directory: the lock it holds for its life, the
outcome :func:`~megatron_mhar.training.loop.run` returns, the ``summary.json`` it writes
and the totals over ranks it reports (parameters, peak memory)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import resource
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import torch
from megatron.core import parallel_state

from megatron_mhar.files import write_atomic
from megatron_mhar.runtime.distributed import on_rank0
from megatron_mhar.runtime.lock import DirectoryLock
from megatron_mhar.training.model import unwrap
from megatron_mhar.training.schema import TrainConfig

SUMMARY_FILE = "summary.json"


@dataclasses.dataclass
class TrainResult:
    """What a run did, as rank 0 saw it."""

    run_dir: Path
    iteration: int
    """Steps done when the run ended."""
    losses: Dict[int, float]
    """Training loss of every step this process ran (step -> loss)."""
    val_losses: List[List[float]]
    """``[step, validation loss]`` of every evaluation, including those before a resume."""
    val_loss_tail: Optional[float]
    """Mean of the last ``eval.tail`` validation losses."""
    test_loss: Optional[float] = None
    """Loss on the test data after the last step, when the run has test data."""
    stopped_by: Optional[str] = None
    """Name of the signal that stopped the run early, if any."""
    checkpoint: Optional[Path] = None
    """The last checkpoint saved."""


LOCK_FILE = ".lock"
"""The lock file of a run directory (:mod:`megatron_mhar.runtime.lock`)."""


@contextlib.contextmanager
def run_lock(cfg: TrainConfig) -> Iterator[None]:
    """Rank 0 holds the lock of the run directory (and of ``checkpoint.dir`` where it lies
    elsewhere) for the life of the run; where another run holds it, every rank raises
    (:class:`~megatron_mhar.runtime.lock.DirectoryInUse` on rank 0) before anything is written."""
    directories = [cfg.run.dir.absolute()]
    checkpoints = cfg.checkpoint_dir.absolute()
    if directories[0] not in (checkpoints, *checkpoints.parents):
        directories.append(checkpoints)
    with contextlib.ExitStack() as held:
        def take() -> None:
            for directory in directories:
                what = "run directory" if directory == directories[0] else "checkpoint directory"
                other = "give this run another run.name" + (" or checkpoint.dir" if what != "run directory" else "")
                held.enter_context(DirectoryLock(directory / LOCK_FILE, f"{what} {directory}", other))

        on_rank0(take)
        yield


class RunReports:
    """The Trainer's ``summary.json`` and the totals it reports over ranks (a mixin of
    :class:`~megatron_mhar.training.loop.Trainer`; reads its ``cfg``, ``model``, ``device``,
    ``on_cpu``, ``val_losses``, ``checkpoint``, ``iteration`` and ``run_dir``)."""

    def _write_summary(self, result: TrainResult) -> None:
        """``summary.json``: the run's outcome (every rank calls: the parameter count is a collective)."""
        parameters = self._count_parameters()
        if self.is_logger:
            summary = {
                "name": self.cfg.run.name,
                "variant": self.cfg.mhar.variant,
                "parameters": parameters,
                "iteration": self.iteration,
                "val_loss": self.val_losses[-1][1] if self.val_losses else None,
                "val_loss_tail": result.val_loss_tail,
                "val_losses": self.val_losses,
                "test_loss": result.test_loss,
                "stopped_by": result.stopped_by,
                "checkpoint": str(self.checkpoint) if self.checkpoint else None,
            }
            write_atomic(self.run_dir / SUMMARY_FILE, json.dumps(summary, indent=1))

    def _count_parameters(self) -> int:
        """Parameters of the whole model (summed over tensor and pipeline ranks)."""
        local = sum(p.numel() for chunk in self.model for p in unwrap(chunk).parameters())
        total = torch.tensor([local], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
        return int(total.item())

    def _memory_gb(self) -> float:
        """Peak memory of the busiest rank (pipeline stages and ranks differ); every rank calls."""
        if self.on_cpu:
            local = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        else:
            local = torch.cuda.max_memory_allocated() / 2**30
        peak = torch.tensor([local], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        return float(peak.item())
