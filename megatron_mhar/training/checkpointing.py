"""Checkpoints of a training run: saved aside and published atomically, resumed, pruned.

The directory layout, the stored run config and how a checkpoint is read are
:mod:`megatron_mhar.checkpoint_format`'s. A save writes into the staging directory
``.tmp.<name>``, then rank 0 renames it to ``<name>`` (a new name, never over an
existing checkpoint) and replaces ``latest`` with ``os.replace``. A save interrupted at
any point leaves ``latest`` naming the last good checkpoint, which no step of a save
ever touches; the next save clears the leftovers.

A checkpoint holds the model chunks, the optimizer (Megatron's sharded optimizer
state), the LR scheduler, per-rank RNG states, the iteration and consumed samples
(the data position), the evaluation history, and the resolved run config. Loading
compares the checkpoint's ``model``/``mhar`` config with the current one first and
names every differing field.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy
import torch
import yaml
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_mhar.checkpoint_format import (
    CHECKPOINT_VERSION,
    LATEST,
    TMP_PREFIX,
    TOKENIZER_DIR,
    TRAIN_CONFIG_FILE,
    check_config,
    checkpoint_name,
    find_checkpoint,  # the driver's resume: the run's checkpoint, or checkpoint.load's
    reading,
    staging_dir,
)
from megatron_mhar.errors import ConfigError
from megatron_mhar.files import fsync_dir, write_atomic
from megatron_mhar.training.model import unwrap
from megatron_mhar.training.signals import SIGNALS as STOP_SIGNALS

# How Megatron's distributed optimizer writes its state: per parameter, in the parameter's
# own shape (gathered over the data-parallel ranks at a save), so that dist_checkpointing
# reshards it to any TP/PP/DP layout like the weights and the plain optimizer's state.
# megatron-core 0.16's default ('fully_sharded_model_space') cannot be saved at all (its
# flattened shards are refused), and 'dp_reshardable' would reshard over DP only.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _is_rank0() -> bool:
    return torch.distributed.get_rank() == 0


def _rng_state() -> Dict[str, Any]:
    state = {
        "random": random.getstate(),
        "numpy": numpy.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["random"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state_dict(model, optimizer, is_loading: bool, with_optimizer: bool, with_rng: bool):
    state: Dict[str, Any] = {}
    if len(model) == 1:
        state["model"] = unwrap(model[0]).sharded_state_dict()
    else:
        for i, chunk in enumerate(model):
            state[f"model{i}"] = unwrap(chunk).sharded_state_dict()
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=OPTIMIZER_METADATA
        )
    if with_rng:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        state["rng_state"] = ShardedObject("rng_state", _rng_state(), (world,), (rank,), replica_id=0)
    return state


def start_checkpoint_writer() -> None:
    """Start Megatron's checkpoint-writer helper process now, deaf to the stop signals.

    Megatron's filesystem writer keeps a multiprocessing Manager that it spawns at the
    first save. Slurm delivers a job step's signals to every process of the step, so a
    helper that can hear SIGTERM/SIGUSR1 dies of the very signal that asks for a save,
    and that save fails. Blocked (and ignored) signals are inherited by the spawned
    helper; in this process they stay pending and are delivered when unblocked.
    """
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if multiprocessing.current_process().daemon:
        # A daemonic process (a test harness's rank) may not start children; Megatron
        # then creates the helper at the first save, as it would without this call.
        return
    # megatron-core 0.19 made the helper's getter public; 0.16 has it private.
    create_helper = getattr(filesystem_async, "get_write_results_queue", None) or getattr(
        filesystem_async, "_get_write_results_queue"
    )
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
    try:
        create_helper()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)


def save_checkpoint(
    ckpt_dir: Path,
    iteration: int,
    model: List[torch.nn.Module],
    optimizer,
    scheduler,
    train_state: Dict[str, Any],
    config: Dict[str, Any],
    keep_last: int = 0,
    tokenizer=None,
) -> Path:
    """Save on every rank (a collective); returns the published checkpoint directory.

    ``tokenizer`` (a :class:`megatron_mhar.data.tokenizer.Tokenizer`) is saved beside the
    weights, in ``TOKENIZER_DIR``."""
    if iteration > 0:
        check_optimizer_checkpointable(optimizer)
    ckpt_dir = Path(ckpt_dir)
    name = checkpoint_name(iteration)
    tmp = staging_dir(ckpt_dir / name)
    if _is_rank0():
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob(f"{TMP_PREFIX}*"):  # leftovers of interrupted saves
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        tmp.mkdir()
    torch.distributed.barrier()

    # Before the first step the optimizer holds no state (Megatron's distributed optimizer
    # refuses to describe itself then): a step-0 checkpoint is its weights, like a
    # converted one, and resuming from it is a fresh start from them.
    state = _sharded_state_dict(
        model, optimizer, is_loading=False, with_optimizer=iteration > 0, with_rng=True
    )
    state.update(
        checkpoint_version=CHECKPOINT_VERSION,
        iteration=iteration,
        opt_param_scheduler=scheduler.state_dict(),
        train_state=train_state,
        config=config,
        world_size=torch.distributed.get_world_size(),
    )
    dist_checkpointing.save(state, str(tmp))  # ends with a barrier once all ranks wrote

    final = ckpt_dir / name
    if _is_rank0():
        (tmp / TRAIN_CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_DIR)
        suffix = 1
        while final.exists():  # never rename over a checkpoint `latest` may name
            suffix += 1
            final = ckpt_dir / f"{name}.{suffix}"
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(ckpt_dir)
        write_atomic(ckpt_dir / LATEST, final.name + "\n")
        if keep_last:
            _prune(ckpt_dir, keep_last, keep=final)
    torch.distributed.barrier()
    return ckpt_dir / (ckpt_dir / LATEST).read_text().strip()


def _prune(ckpt_dir: Path, keep_last: int, keep: Path) -> None:
    published = sorted(
        (p for p in ckpt_dir.glob("iter_*") if p.is_dir()), key=lambda p: p.stat().st_mtime
    )
    for old in published[:-keep_last]:
        if old != keep:
            shutil.rmtree(old)


def _layout(config: Dict[str, Any], world_size: Optional[int]) -> Tuple:
    """(world size, TP, PP, VPP) of a run config: which rank holds which RNG streams."""
    par = config.get("parallel", {})
    return (
        world_size,
        par.get("tensor_model_parallel_size", 1),
        par.get("pipeline_model_parallel_size", 1),
        par.get("virtual_pipeline_model_parallel_size"),
    )


def check_optimizer_checkpointable(optimizer) -> None:
    """Raise if ``optimizer``'s state cannot go through a checkpoint and back.

    Megatron's distributed optimizer over torch's own Adam (no Transformer Engine or apex)
    cannot: megatron-core reads the Adam step from torch's per-parameter state, which a
    new optimizer lacks (loading asserts), and copies that step as if it were a tensor of
    the saved state (``KeyError: 'step'``).
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:  # their fused Adams keep the step per group
        return
    if any(
        isinstance(opt, distrib_optimizer.DistributedOptimizer)
        for opt in getattr(optimizer, "chained_optimizers", [optimizer])
    ):
        raise ValueError(
            "parallel.use_distributed_optimizer=true with torch's Adam (neither Transformer Engine "
            "nor apex is installed): megatron-core cannot save and resume this optimizer's state. "
            "Set parallel.use_distributed_optimizer=false, or install Transformer Engine "
            "(pip install -e '.[te]'), or write no checkpoints (checkpoint.interval=0 "
            "checkpoint.save_at_end=false)"
        )


def load_checkpoint(
    checkpoint: Path,
    model: List[torch.nn.Module],
    optimizer,
    scheduler,
    config: Dict[str, Any],
    model_only: bool = False,
) -> Dict[str, Any]:
    """Load into ``model`` (and optimizer, scheduler, RNG unless ``model_only`` or the
    checkpoint is of step 0, which holds weights only: saved before the first step, or
    converted).

    Returns ``{"iteration", "train_state"}`` (iteration 0 and an empty train state
    with ``model_only``).
    """
    common = check_config(checkpoint, config)
    model_only = model_only or common.get("iteration") == 0
    saved_config = common["config"]
    if not model_only:
        saved = saved_config.get("parallel", {}).get("use_distributed_optimizer", False)
        current = config.get("parallel", {}).get("use_distributed_optimizer", False)
        if saved != current:
            raise ConfigError(
                f"checkpoint {checkpoint} holds the optimizer state of "
                f"parallel.use_distributed_optimizer={str(saved).lower()}, which this run "
                f"(={str(current).lower()}) cannot load; resume with "
                f"parallel.use_distributed_optimizer={str(saved).lower()}, or start a new run from "
                f"its weights with checkpoint.load={checkpoint} checkpoint.load_model_only=true"
            )
        check_optimizer_checkpointable(optimizer)
    # The RNG states are per rank; under another layout a rank's position (and so its
    # streams: per pipeline stage, per tensor-parallel rank) differs, and the run keeps
    # the fresh seeding of its own layout instead (as Megatron-LM does).
    same_layout = _layout(saved_config, common.get("world_size")) == _layout(
        config, torch.distributed.get_world_size()
    )
    sharded = _sharded_state_dict(
        model, optimizer, is_loading=True, with_optimizer=not model_only, with_rng=not model_only and same_layout
    )
    with reading(checkpoint):
        state = dist_checkpointing.load(sharded, str(checkpoint))
    if len(model) == 1:
        unwrap(model[0]).load_state_dict(state["model"], strict=True)
    else:
        for i, chunk in enumerate(model):
            unwrap(chunk).load_state_dict(state[f"model{i}"], strict=True)
    if model_only:
        # Mixed-precision optimizers hold fp32 main copies taken from the parameters at
        # construction (this run's own initialisation); without a refresh the first step
        # would write that initialisation back over the loaded weights.
        optimizer.reload_model_params()
        return {"iteration": 0, "train_state": {}}
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if same_layout:
        _set_rng_state(state["rng_state"])
    elif _is_rank0():
        print(
            f"{checkpoint} was saved under another parallel layout (world, TP, PP, VPP = "
            f"{_layout(saved_config, common.get('world_size'))}); optimizer state and data position "
            f"are resharded, the RNG streams are this layout's own",
            flush=True,
        )
    return {"iteration": state["iteration"], "train_state": state["train_state"]}
