"""Checkpoints of a training run: saved aside, verified, published atomically, resumed, pruned.

The directory layout, the stored run config, the manifest and how a checkpoint is found
and read are :mod:`megatron_mhar.checkpoint.format`'s. A save writes into the staging
directory ``.tmp.<name>``; each rank then checksums the files it wrote and rank 0 writes
the manifest (:mod:`megatron_mhar.checkpoint.manifest`), renames the directory to ``<name>`` (a new
name, never over an existing checkpoint), checks the published files against the
manifest, and only then replaces ``latest`` with ``os.replace`` and prunes. A save
interrupted at any point leaves ``latest`` naming the last good checkpoint, which no step
of a save ever touches; leftovers are cleared at the next start or save. A save that
fails for lack of space or permission removes its staging directory and says what to free.

A checkpoint holds the model chunks, the optimizer (Megatron's sharded optimizer
state), the LR scheduler, per-rank RNG states, the iteration and consumed samples
(the data position), the evaluation history, and the resolved run config. Loading
compares the checkpoint's ``model``/``mhar`` config with the current one first and
names every differing field.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import numpy
import torch
import yaml
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling

from megatron_mhar.checkpoint import manifest
from megatron_mhar.checkpoint.format import (
    CHECKPOINT_VERSION,
    LATEST,
    TMP_PREFIX,
    TOKENIZER_DIR,
    TRAIN_CONFIG_FILE,
    check_config,
    checkpoint_name,
    checkpoint_problem,
    checksummed_writes,
    code_provenance,
    find_checkpoint,
    fresh_mtp_depths,
    published_checkpoints,
    reading,
    staging_dir,
)
from megatron_mhar.errors import PERMISSION_ERRNOS, SPACE_ERRNOS, ConfigError
from megatron_mhar.files import fsync_dir, write_atomic
from megatron_mhar.models.mtp import MTP_PREFIX
from megatron_mhar.runtime.distributed import on_all_ranks, on_rank0
from megatron_mhar.training.model import unwrap

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


def remove_leftovers(ckpt_dir: Path) -> None:
    """Delete what interrupted saves and prunes left in ``ckpt_dir`` (``.tmp.*``: never read)."""
    for stale in Path(ckpt_dir).glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()


def verified_problem(checkpoint: Path, verify: str) -> Optional[str]:
    """:func:`checkpoint_problem` with the checksum reading divided among the ranks (a
    collective); the same answer on every rank."""
    share = (torch.distributed.get_rank(), torch.distributed.get_world_size())
    problems = on_all_ranks(lambda: checkpoint_problem(checkpoint, verify, share))
    return next((p for p in problems if p), None)


def _owner(name: str, world: int) -> int:
    """The rank that checksums a file of a save: its writer's (``__<rank>_<i>.distcp``), else 0."""
    match = re.match(r"__(\d+)_", name)
    return int(match.group(1)) if match and int(match.group(1)) < world else 0


def _write_manifest(directory: Path) -> None:
    """Each rank checksums the files it wrote (reading them back), rank 0 writes the manifest."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    described = on_all_ranks(lambda: manifest.describe(
        directory, [n for n in manifest.listed_files(directory) if _owner(n, world) == rank]
    ))
    entries = {name: entry for part in described for name, entry in part.items()}
    on_rank0(lambda: manifest.write_manifest(directory, entries))


def save_checkpoint(
    ckpt_dir: Path,
    iteration: int,
    model: List[torch.nn.Module],
    optimizer,
    scheduler,
    train_state: Dict[str, Any],
    config: Dict[str, Any],
    keep_last: int = 0,
    verify: str = "full",
    failed: Iterable[Path] = (),
    tokenizer=None,
    conversion: Optional[Dict[str, Any]] = None,
) -> Path:
    """Save on every rank (a collective); returns the published checkpoint directory.

    ``failed``: checkpoints known to fail verification (found so at resume); pruning leaves
    them and does not count them among the ``keep_last`` kept. ``tokenizer`` (a
    :class:`megatron_mhar.data.tokenizer.Tokenizer`) is saved beside the weights, in
    ``TOKENIZER_DIR``, and covered by the manifest. ``conversion``: the conversion record of
    the converted checkpoint the run's weights come from (:func:`load_checkpoint` returns
    it), kept in the common state: an export restores the source model's config from it.
    """
    if iteration > 0:
        check_optimizer_checkpointable(optimizer)
    ckpt_dir = Path(ckpt_dir)
    name = checkpoint_name(iteration)
    tmp = staging_dir(ckpt_dir / name)
    try:
        on_rank0(lambda: _prepare_staging(ckpt_dir, tmp))
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
            provenance=code_provenance(),
        )
        if conversion is not None:
            state["conversion"] = conversion
        with checksummed_writes():
            dist_checkpointing.save(state, str(tmp))  # ends with a barrier once all ranks wrote
        on_rank0(lambda: _write_run_files(tmp, config, tokenizer))
        _write_manifest(tmp)
        final = on_rank0(lambda: _publish(ckpt_dir, tmp, name))
        # The checksums were taken from the files as written (read back after the writer's
        # fsync); the published directory must still hold exactly those files before
        # `latest` names it and anything older is pruned.
        problem = verified_problem(final, "size" if verify == "full" else verify)
        if problem is not None:
            raise ValueError(
                f"checkpoint {final} was written but fails verification: {problem}. {LATEST} still "
                f"names the previous checkpoint and nothing was pruned; check the filesystem of {ckpt_dir}"
            )
        on_rank0(lambda: write_atomic(ckpt_dir / LATEST, final.name + "\n"))
    except BaseException as err:
        code = _errno_of(err)
        if code is None and ckpt_dir.is_dir() and _space_left(ckpt_dir) < _checkpoint_bytes(ckpt_dir):
            # torch's zip writer reports a short write on a full disk as a position
            # mismatch ("unexpected pos"), without the OS error behind it.
            code = errno.ENOSPC
        if code not in SPACE_ERRNOS + PERMISSION_ERRNOS:
            raise
        if _is_rank0():  # free the space the partial save holds; the message says what remains
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(code, _save_failure(ckpt_dir, name, code, err)) from err
    if keep_last:
        on_rank0(lambda: _prune(ckpt_dir, keep_last, final, set(failed)))
    return final


def _errno_of(err: BaseException) -> Optional[int]:
    """The OS error code behind a failed save: Megatron's writer processes report theirs
    only as text (``RuntimeError: Worker failure: [Errno 28] ...``)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None:
            return err.errno
        match = re.search(r"\[Errno (\d+)\]", str(err))
        if match:
            return int(match.group(1))
        failures = getattr(err, "failures", None)  # torch's CheckpointException: one per rank
        nested = next(iter(failures.values()))[0] if isinstance(failures, dict) and failures else None
        err = nested or err.__cause__ or err.__context__
    return None


def _latest_name(ckpt_dir: Path) -> Optional[str]:
    """The checkpoint ``latest`` names, if it can be read."""
    try:
        return (ckpt_dir / LATEST).read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _space_left(ckpt_dir: Path) -> int:
    return shutil.disk_usage(ckpt_dir).free


def _checkpoint_bytes(ckpt_dir: Path) -> int:
    """The size of this run's last checkpoint (from its manifest), at least 1 MiB."""
    previous = _latest_name(ckpt_dir)
    return max((manifest.total_bytes(ckpt_dir / previous) if previous else None) or 0, 2**20)


def _save_failure(ckpt_dir: Path, name: str, code: int, err: BaseException) -> str:
    """What failed, that nothing was published, and what to do."""
    previous = _latest_name(ckpt_dir)
    kept = (f"{LATEST} still names {previous}, which the restarted run resumes from" if previous
            else "no checkpoint of this run existed before")
    detail = (str(err).strip().splitlines() or [type(err).__name__])[-1]
    head = (f"saving checkpoint {name} into {ckpt_dir} failed: {os.strerror(code)} ({detail}). Nothing was "
            f"published (the partial {TMP_PREFIX}{name} is removed); {kept}. ")
    if code in SPACE_ERRNOS:
        size = manifest.total_bytes(ckpt_dir / previous) if previous else None
        free = _space_left(ckpt_dir) if ckpt_dir.is_dir() else None
        need = f"about {size / 2**20:,.1f} MiB per checkpoint, " if size else ""
        left = f"{free / 2**20:,.1f} MiB free now" if free is not None else "free space unknown"
        return head + (f"Free space on the filesystem of {ckpt_dir} ({need}{left}): delete older "
                       f"iter_* checkpoints or other files, lower checkpoint.keep_last, or set "
                       f"checkpoint.dir to a larger filesystem; then restart the run")
    return head + (f"{ckpt_dir} is not writable by this user: fix its permissions (or the mount), "
                   f"or set checkpoint.dir to a writable directory; then restart the run")


def _write_run_files(tmp: Path, config: Dict[str, Any], tokenizer) -> None:
    """The run's config and tokenizer, beside the weights (before the manifest lists them)."""
    (tmp / TRAIN_CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
    if tokenizer is not None:
        tokenizer.save(tmp / TOKENIZER_DIR)


def _prepare_staging(ckpt_dir: Path, tmp: Path) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    remove_leftovers(ckpt_dir)
    tmp.mkdir()


def _publish(ckpt_dir: Path, tmp: Path, name: str) -> Path:
    """Rename the staging directory to a new ``iter_*`` name (never over a published one)."""
    final, suffix = ckpt_dir / name, 1
    while final.exists():  # never rename over a checkpoint `latest` may name
        suffix += 1
        final = ckpt_dir / f"{name}.{suffix}"
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(ckpt_dir)
    return final


def saved_run(checkpoint: Path) -> Optional[Dict[str, Any]]:
    """The ``run`` section of the run config ``checkpoint`` was saved with; ``None`` where it
    has none (a converted checkpoint) or it cannot be read."""
    try:
        run = (yaml.safe_load((Path(checkpoint) / TRAIN_CONFIG_FILE).read_text()) or {}).get("run")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return run if isinstance(run, dict) and run.get("output_dir") and run.get("name") else None


def _prune(ckpt_dir: Path, keep_last: int, newest: Path, failed: Set[Path]) -> None:
    """Keep ``newest`` (verified) and the ``keep_last - 1`` most recent other checkpoints
    whose files match their manifest's sizes; delete the older ones. Checkpoints that fail
    that check, or are in ``failed``, are neither counted nor deleted: they are named; those
    another run (another ``run.name``) saved, or none did, are never touched: another run's
    ``summary.json`` may name them."""
    kept, suspect = [newest], []
    name = (saved_run(newest) or {}).get("name")
    candidates = sorted(
        (p for p in published_checkpoints(ckpt_dir) if p != newest), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for checkpoint in candidates:
        if (saved_run(checkpoint) or {}).get("name") != name:
            continue
        if checkpoint in failed or checkpoint_problem(checkpoint, "size") is not None:
            suspect.append(checkpoint.name)
        elif len(kept) < keep_last:
            kept.append(checkpoint)
        else:
            # Renamed out of the published names first: a prune interrupted mid-way leaves a
            # leftover, never a half-deleted checkpoint that looks published.
            doomed = ckpt_dir / f"{TMP_PREFIX}pruned.{checkpoint.name}"
            os.rename(checkpoint, doomed)
            shutil.rmtree(doomed)
    if suspect:
        print(f"{ckpt_dir}: left {', '.join(suspect)} in place (failed verification); inspect, then delete",
              flush=True)


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


EXTRA_STATE_SUFFIX = "_extra_state"
"""State-dict suffix of a module's extra state (Transformer Engine's FP8 metadata)."""


def _check_absent_keys(checkpoint: Path, absent: Iterable[str]) -> None:
    """Raise unless what ``checkpoint`` lacks is Transformer Engine's extra state only.

    TE's norms (the final norm, q/k norms) carry an extra state, empty without FP8, that
    the local spec's torch norms do not have: a checkpoint of the local spec (a converted
    one, or a run on a machine without TE) lacks it, and those modules keep their own.
    """
    tensors = sorted(key for key in absent if not key.endswith(EXTRA_STATE_SUFFIX))
    if tensors:
        raise ConfigError(
            f"checkpoint {checkpoint} lacks {len(tensors)} tensors of this model, e.g. "
            f"{', '.join(tensors[:3])}; was it written by another version of the model code?"
        )


def _load_model_state(module: torch.nn.Module, loaded: Dict[str, Any], fresh_mtp: bool = False) -> None:
    """``module.load_state_dict(loaded, strict=True)``, where an extra state that the
    checkpoint lacks (:func:`_check_absent_keys`), and with ``fresh_mtp`` the MTP block,
    keep the module's own."""
    own = {key: value for key, value in module.state_dict().items()
           if key not in loaded and (key.endswith(EXTRA_STATE_SUFFIX) or (fresh_mtp and key.startswith(MTP_PREFIX)))}
    module.load_state_dict({**loaded, **own}, strict=True)


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

    Returns ``{"iteration", "train_state", "config", "conversion"}`` (and ``saved_iteration``,
    the checkpoint's step, and ``fresh_mtp``, with ``model_only``): iteration 0 and an
    empty train state with ``model_only``; ``config`` is the run config the checkpoint was
    saved with, ``conversion`` the conversion record it carries (``None`` for weights
    trained from scratch), which the run's saves carry on. ``fresh_mtp``: the run's MTP
    depths that a checkpoint without MTP leaves at their initialisation (``None``: none).
    """
    common = check_config(checkpoint, config, model_only)
    model_only = model_only or common.get("iteration") == 0
    saved_config = common["config"]
    fresh_mtp = fresh_mtp_depths(saved_config, config)  # check_config allows it only weights-only
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
    if fresh_mtp is not None:  # not asked of the checkpoint, which has none
        for name in [name for name in sharded if name.startswith("model")]:
            sharded[name] = {k: v for k, v in sharded[name].items() if not k.startswith(MTP_PREFIX)}
    with reading(checkpoint):
        state, _, absent = dist_checkpointing.load(
            sharded, str(checkpoint), strict=StrictHandling.RETURN_UNEXPECTED
        )
    _check_absent_keys(checkpoint, absent)
    if len(model) == 1:
        _load_model_state(unwrap(model[0]), state["model"], fresh_mtp is not None)
    else:
        for i, chunk in enumerate(model):
            _load_model_state(unwrap(chunk), state[f"model{i}"], fresh_mtp is not None)
    if model_only:
        # Mixed-precision optimizers hold fp32 main copies taken from the parameters at
        # construction (this run's own initialisation); without a refresh the first step
        # would write that initialisation back over the loaded weights.
        optimizer.reload_model_params()
        return {"iteration": 0, "train_state": {}, "config": saved_config, "conversion": common.get("conversion"),
                "saved_iteration": common.get("iteration"), "fresh_mtp": fresh_mtp}
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
    return {"iteration": state["iteration"], "train_state": state["train_state"], "config": saved_config,
            "conversion": common.get("conversion")}
