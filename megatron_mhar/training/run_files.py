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

from megatron_mhar.checkpoint.format import published_checkpoints
from megatron_mhar.errors import ConfigError
from megatron_mhar.files import write_atomic
from megatron_mhar.runtime.distributed import on_rank0
from megatron_mhar.runtime.lock import DirectoryLock
from megatron_mhar.training.checkpointing import saved_run
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
    elsewhere) for the life of the run and claims the checkpoint directory
    (:func:`claim_checkpoint_dir`); where another run holds or owns them, every rank raises
    (:class:`~megatron_mhar.runtime.lock.DirectoryInUse` on rank 0) before anything is
    written, and the directories this start created are removed again."""
    directories = [cfg.run.dir.absolute()]
    checkpoints = cfg.checkpoint_dir.absolute()
    if directories[0] not in (checkpoints, *checkpoints.parents):
        directories.append(checkpoints)
    created = [d for directory in directories for d in (directory, *directory.parents) if not d.exists()]
    with contextlib.ExitStack() as held:
        def take() -> None:
            for directory in directories:
                what = "run directory" if directory == directories[0] else "checkpoint directory"
                other = "give this run another run.name" + (" or checkpoint.dir" if what != "run directory" else "")
                held.enter_context(DirectoryLock(directory / LOCK_FILE, f"{what} {directory}", other))
            claim_checkpoint_dir(cfg, outside=len(directories) > 1)

        try:
            on_rank0(take)
        except BaseException:
            held.close()  # the lock files go first
            if torch.distributed.get_rank() == 0:
                for directory in sorted(set(created), key=lambda d: len(d.parts), reverse=True):
                    with contextlib.suppress(OSError):  # only where still empty
                        directory.rmdir()
            raise
        yield


OWNER_FILE = "owner.json"
"""The record, in a checkpoint directory, of the run it belongs to (:func:`claim_checkpoint_dir`)."""


def claim_checkpoint_dir(cfg: TrainConfig, outside: bool) -> None:
    """Record this run as the owner of its ``checkpoint.dir`` where that lies ``outside`` the
    run directory; raise a ``ConfigError`` where it belongs to another run.

    A run resumes from its checkpoint directory and prunes it: another run's would be adopted
    and deleted. The owner is the run directory that first used it (recorded in
    ``OWNER_FILE``, else read from the newest checkpoint's run config); the default
    ``{run dir}/checkpoints`` is its run directory's, wherever that is moved.
    """
    if not outside:
        return
    directory, run_dir = cfg.checkpoint_dir.absolute(), str(cfg.run.dir.absolute())
    record = directory / OWNER_FILE
    owner = _recorded_owner(record) or _owner_of_checkpoints(directory)
    if owner is not None and owner["run_dir"] != run_dir:
        raise ConfigError(
            f"checkpoint directory {directory} belongs to run {owner['name']!r} ({owner['run_dir']}); this run "
            f"({run_dir}) would resume from its checkpoints and prune them. Give this run its own "
            f"checkpoint.dir (or leave it unset: {run_dir}/checkpoints); to start from that run's checkpoint "
            f"on purpose (a warm start), set checkpoint.load={directory} (or .../iter_N), and "
            f"checkpoint.load_model_only=true for its weights alone. If this is that run moved elsewhere, "
            f"delete {record}"
        )
    if owner is None or not record.is_file():
        write_atomic(record, json.dumps({"name": cfg.run.name, "run_dir": run_dir}, indent=1) + "\n")


def _recorded_owner(record: Path) -> Optional[Dict[str, str]]:
    try:
        owner = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return {"name": str(owner.get("name")), "run_dir": str(owner.get("run_dir"))} if isinstance(owner, dict) \
        else None


def _owner_of_checkpoints(directory: Path) -> Optional[Dict[str, str]]:
    """The run that wrote the newest checkpoint of ``directory`` (one saved before owners were
    recorded), from its run config; ``None`` where none says (a converted checkpoint)."""
    for checkpoint in published_checkpoints(directory):
        run = saved_run(checkpoint)
        if run is not None:
            return {"name": run["name"], "run_dir": str((Path(run["output_dir"]) / run["name"]).absolute())}
    return None


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
