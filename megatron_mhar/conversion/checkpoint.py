"""Megatron distributed checkpoints of converted models: output checks, publishing, build and load.

A converted checkpoint has the layout and names of :mod:`megatron_mhar.checkpoint_format`
(the training driver's), so ``checkpoint.load`` of a recipe points at it directly::

    out/
      latest                  text: iter_0000000
      iter_0000000/           one megatron.core.dist_checkpointing checkpoint
        common.pt, metadata.json, __*.distcp
        train_config.yaml     the model and mhar sections a recipe must repeat
        conversion.json       source, architecture, dtype, layout of the conversion
        hf/                   the source config.json and tokenizer files (for the export)
        manifest.json         every other file's size and checksum (megatron_mhar.manifest)

The common state holds what the driver's ``load_checkpoint(..., model_only=True)``
reads: ``config`` (``{"model": ..., "mhar": ...}`` as dicts of
:class:`GPTModelConfig` and :class:`MHARConfig`), ``iteration`` 0, an empty
``train_state`` and ``checkpoint_version``. There is no optimizer state, so a run
starting from it sets ``checkpoint.load_model_only: true``.

The whole ``out/`` directory is written in its staging directory beside it and renamed
into place only once complete, its checkpoints' manifests written first (:func:`publish`).
Reading a checkpoint (:func:`find_checkpoint`) verifies it against its manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from megatron_mhar import checkpoint_format, manifest
from megatron_mhar.checkpoint_format import CHECKPOINT_VERSION, LATEST, TRAIN_CONFIG_FILE, reading, staging_dir

# convert.py reads a checkpoint's configs and dtype through this module.
from megatron_mhar.checkpoint_format import read_configs, stored_dtype  # noqa: F401
from megatron_mhar.files import fsync_dir, nearest_existing
from megatron_mhar.models.gpt_config import GPTModelConfig
from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.runtime.lock import DirectoryLock

ITERATION_DIR = checkpoint_format.checkpoint_name(0)
OLD_PREFIX = ".old."
HF_SUBDIR = "hf"
CONVERSION_FILE = "conversion.json"


# ---------------------------------------------------------------- layout and publishing


def find_checkpoint(path: Path, verify: str = "full") -> Path:
    """The checkpoint ``path`` designates (:func:`checkpoint_format.find_checkpoint`'s rule:
    its ``latest`` file, or itself, verified at ``verify``); raises where there is none."""
    found = checkpoint_format.find_checkpoint(Path(path), verify)
    if found is None:
        raise FileNotFoundError(
            f"{path} is not a Megatron distributed checkpoint (no {LATEST} file, no metadata.json)"
        )
    return found


def check_output(out: Path, overwrite: bool, inputs: Tuple[Path, ...] = ()) -> None:
    """Raise unless ``out`` may be (re)placed without touching anything it must not.

    ``--overwrite`` replaces an existing output directory, never a file, and never a
    directory that is or holds one of the conversion's ``inputs``.
    """
    out = Path(out).absolute()
    parent = nearest_existing(out.parent)
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, not a directory; choose another --out")
    if not out.exists():
        return
    for path in inputs:
        path = Path(path).resolve()
        if path == out.resolve() or out.resolve() in path.parents:
            raise ValueError(
                f"--out {out} is or contains the input {path}; writing it would delete the input. "
                f"Choose an --out outside it"
            )
    if not overwrite:
        raise FileExistsError(f"{out} exists; choose a new --out or pass --overwrite")
    if not out.is_dir():
        raise FileExistsError(f"{out} is a file; --overwrite replaces only a directory; choose another --out")


def output_lock(out: Path) -> DirectoryLock:
    """The lock a conversion holds on ``out`` while it writes (:mod:`megatron_mhar.runtime.lock`;
    its file ``.lock.<name>`` lies beside ``out``, which does not exist before the end): a
    second conversion into ``out`` refuses instead of deleting the first one's staging directory."""
    out = Path(out).absolute()
    return DirectoryLock(out.parent / f".lock.{out.name}", f"output {out}", "choose another --out")


def prepare_output(out: Path, overwrite: bool, inputs: Tuple[Path, ...] = ()) -> Tuple[Path, DirectoryLock]:
    """Take ``out``'s lock (:func:`output_lock`), check ``out`` may be written
    (:func:`check_output`) and make a fresh, empty staging directory; returns it and the
    lock, which the caller releases once the output is published or cleaned up."""
    out = Path(out).absolute()
    check_output(out, overwrite, inputs)  # before the lock file is made beside it
    lock = output_lock(out).acquire()
    try:
        check_output(out, overwrite, inputs)  # again: another conversion may have published it meanwhile
        tmp = staging_dir(out)
        if tmp.exists():  # an interrupted earlier conversion
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except BaseException:
        lock.release()
        raise
    return tmp, lock


def publish(tmp: Path, out: Path) -> Path:
    """Rename the complete staging directory to ``out`` (replacing an old ``out``), once
    each checkpoint in it has its manifest."""
    from megatron_mhar.conversion.hf_io import fsync_tree

    for iteration_dir in sorted(Path(tmp).glob("iter_*")):
        if checkpoint_format.is_complete(iteration_dir):
            manifest.write_manifest(iteration_dir)
    out = Path(out).absolute()
    fsync_tree(tmp)
    old = None
    if out.exists():
        old = out.parent / f"{OLD_PREFIX}{out.name}"
        if old.exists():
            shutil.rmtree(old)
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old)
    return out


# ---------------------------------------------------------------- models


def build_model(
    model: GPTModelConfig,
    mhar: MHARConfig,
    dtype: torch.dtype,
    device: str = "cpu",
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
):
    """This rank's GPT chunk (no VPP), uninitialised: every tensor is loaded afterwards.

    Routing parameters are exceptions: they are created with their identity values
    (the paper's initialisation) regardless of ``perform_initialization``. On
    ``device="meta"`` every other weight is a meta tensor, which holds no memory: the
    structure that :func:`save_streamed` and :func:`read_streamed` fill one tensor at a time.
    """
    from megatron.core import parallel_state

    from megatron_mhar.models.builder import build_gpt_model, make_transformer_config

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    check_layout(model, tp, pp)
    # The distributed checkpoint keys are the same for the local and the TE spec.
    local = dataclasses.replace(model, spec="local")
    config = make_transformer_config(
        local,
        mhar,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=device in ("cpu", "meta"),
        perform_initialization=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
    )
    first = parallel_state.is_pipeline_first_stage() if pre_process is None else pre_process
    last = parallel_state.is_pipeline_last_stage() if post_process is None else post_process
    # The routers place their parameters on the CPU themselves (use_cpu_initialization).
    with torch.device("meta") if device == "meta" else contextlib.nullcontext():
        chunk = build_gpt_model(local, mhar, config, pre_process=first, post_process=last)
    return chunk if device == "meta" else chunk.to(device)


def check_layout(model: GPTModelConfig, tp: int, pp: int) -> None:
    """Clear errors for layouts the model cannot be split into."""
    for flag, size in (("--tp", tp), ("--pp", pp)):
        if size < 1:
            raise ValueError(f"{flag} must be at least 1, got {size}")
    groups = model.num_query_groups or model.num_attention_heads
    if model.num_attention_heads % tp or groups % tp:
        raise ValueError(
            f"--tp {tp} must divide the attention heads ({model.num_attention_heads}) and the "
            f"KV heads ({groups})"
        )
    if model.num_layers % pp:
        raise ValueError(f"--pp {pp} must divide the number of layers ({model.num_layers})")
    expert_width = model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
    if model.is_moe and expert_width % tp:
        raise ValueError(f"--tp {tp} must divide the experts' width (moe_intermediate_size {expert_width})")


def global_name(chunk, name: str) -> str:
    """The TP=1/PP=1 name of a chunk's tensor (layer indices made global)."""
    prefix = "decoder.layers."
    if name.startswith(prefix):
        index, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{chunk.decoder.layers[int(index)].layer_number - 1}.{rest}"
    return name


def tp_slice(name: str, full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of a full (TP=1 layout) tensor.

    The split dimension is the one where the full tensor is ``tp_size`` times the
    parameter (Megatron sets ``partition_dim`` only when it initialises weights,
    and conversion builds models without initialising them). SwiGLU's
    ``linear_fc1`` is the one split that is not a contiguous chunk: each rank
    holds ``[gate shard; up shard]``.
    """
    if tuple(full.shape) == tuple(param.shape):
        return full
    split = [d for d in range(full.dim()) if full.shape[d] != param.shape[d]]
    if (
        full.dim() != param.dim()
        or len(split) != 1
        or full.shape[split[0]] != tp_size * param.shape[split[0]]
    ):
        raise ValueError(
            f"{name}: converted shape {tuple(full.shape)} does not fit the model's "
            f"{tuple(param.shape)} (TP rank {tp_rank} of {tp_size})"
        )
    dim = split[0]
    if name.endswith("linear_fc1.weight"):  # dense MLPs and experts alike
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp_size, dim)[tp_rank], up.chunk(tp_size, dim)[tp_rank]], dim)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def full_state_dict(chunk) -> Dict[str, torch.Tensor]:
    """Tensors of a TP=1/PP=1 model in memory by name (extra states and tied copies left out)."""
    return {
        name: tensor
        for name, tensor in chunk.state_dict().items()
        if torch.is_tensor(tensor) and not name.endswith("_extra_state")
    }


def sharded_state(chunk) -> Dict[str, Any]:
    """What ``dist_checkpointing`` saves and loads for one chunk: the driver's ``model`` key."""
    return {"model": chunk.sharded_state_dict()}


def save(chunk, checkpoint_dir: Path, common: Dict[str, Any]) -> None:
    """Collective: write this rank's shards and (rank 0) the common state."""
    from megatron.core import dist_checkpointing

    state = sharded_state(chunk)
    state.update(common)
    dist_checkpointing.save(state, str(checkpoint_dir))


def save_streamed(
    chunk, checkpoint_dir: Path, common: Dict[str, Any], value_of: Callable[[str, torch.Tensor], torch.Tensor]
) -> None:
    """Collective: write ``chunk``'s checkpoint with each tensor computed, one at a time, by
    ``value_of(name, param)`` (``name`` the TP=1/PP=1 name, ``param`` the chunk's
    parameter, a meta tensor on a meta chunk; it returns this rank's part).

    The checkpoint holds the tensors and nothing else: every tensor gets storage of its
    own, since Megatron's writer copies each tensor that is a view of a larger one (the
    two halves of a SwiGLU ``linear_fc1``), all of them at once.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    sharded = chunk.sharded_state_dict()
    for local, entry in sharded.items():
        if isinstance(entry, ShardedObject):
            continue
        name = global_name(chunk, local)
        value = value_of(name, entry.data)
        if tuple(value.shape) != tuple(entry.data.shape):
            raise ValueError(f"{name}: converted shape {tuple(value.shape)}, the model's {tuple(entry.data.shape)}")
        entry.data = _owned(value.to(entry.data.dtype))
        if isinstance(entry, ShardedTensorFactory):
            sharded[local] = entry.build()
            for part in _leaves(sharded[local]):
                part.data = _owned(part.data)
    state = {"model": sharded}
    state.update(common)
    dist_checkpointing.save(state, str(checkpoint_dir))


def _leaves(entry) -> list:
    """The tensors (or sharded tensors) of a state-dict entry: itself, or those it nests."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return list(nested_values(entry)) if isinstance(entry, (dict, list)) else [entry]


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it where it is a view of a larger storage."""
    whole = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole else tensor.clone()


def read_streamed(
    chunk, checkpoint: Path, before_load: Optional[Callable[[int], None]] = None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Collective: ``(TP=1/PP=1 name, tensor)`` for each of ``chunk``'s tensors in ``checkpoint``.

    One stored tensor (all its layers; for an MoE model whose layers are all MoE, every
    expert of every layer: Megatron's loads cover whole stored tensors) is loaded at a time,
    in place: into fresh tensors
    where ``chunk`` is a meta chunk (:func:`build_model`), else into the chunk's own
    parameters; ``before_load(nbytes)`` is told its size first. Megatron's own load of a
    whole model holds a second copy of each SwiGLU ``linear_fc1`` (the two halves it
    loads, then their concatenation); here the halves are loaded as views of the tensor
    they form.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    sharded = chunk.sharded_state_dict()
    groups: Dict[str, list] = {}  # stored key -> local names
    for local, entry in sharded.items():
        if not isinstance(entry, ShardedObject):
            groups.setdefault(entry.key, []).append(local)
    with reading(checkpoint):
        stored = dist_checkpointing.load_tensors_metadata(str(checkpoint))
    missing = sorted(set(groups) - set(stored))
    if missing:
        raise ValueError(
            f"checkpoint {checkpoint} has no {', '.join(missing[:4])}"
            f"{f' (and {len(missing) - 4} more)' if len(missing) > 4 else ''}: it was written for "
            f"another model than its config describes"
        )
    for key in _keys_of_all_ranks(groups):
        names = groups.get(key, [])
        if before_load is not None:
            before_load(sum(sharded[local].data.numel() * sharded[local].data.element_size() for local in names))
        targets, request = {}, {}
        for local in names:
            entry = sharded.pop(local)  # the only reference to its tensor is then the caller's
            targets[local] = torch.empty_like(entry.data, device="cpu") if entry.data.is_meta else entry.data
            entry.data = targets[local]
            request[local] = entry.build() if isinstance(entry, ShardedTensorFactory) else entry
            del entry
        views = {local: [part.data for part in _leaves(request[local])] for local in names}
        with reading(checkpoint):
            loaded = dist_checkpointing.load({"model": request}, str(checkpoint)).get("model", {})
        for local in names:
            for view, value in zip(views[local], _leaves(loaded[local]), strict=True):
                if value.data_ptr() != view.data_ptr():  # not loaded in place
                    view.copy_(value.view_as(view))
        del request, views, loaded
        for local in names:
            yield global_name(chunk, local), targets.pop(local)


def _keys_of_all_ranks(groups: Dict[str, list]) -> list:
    """The stored keys of every rank's chunk, in one order on every rank (each load is a
    collective: every rank takes part, with its part of the key or none)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return list(groups)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, list(groups))
    return list(dict.fromkeys(key for keys in gathered for key in keys))


def load_into(chunk, checkpoint: Path) -> None:
    """Collective: load the weights of ``checkpoint`` into ``chunk`` (any layout, strict),
    in place, one stored tensor at a time (:func:`read_streamed`)."""
    for _ in read_streamed(chunk, checkpoint):
        pass


def config_dicts(model: GPTModelConfig, mhar: MHARConfig) -> Dict[str, Any]:
    """The ``config`` entry of the common state (the driver compares these sections)."""
    return {"model": dataclasses.asdict(model), "mhar": dataclasses.asdict(mhar)}


def common_state(model: GPTModelConfig, mhar: MHARConfig, conversion: Dict[str, Any]) -> Dict[str, Any]:
    """The non-tensor part of a converted checkpoint (see the module docstring)."""
    return {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0,
        "config": config_dicts(model, mhar),
        "train_state": {},
        "conversion": conversion,
        "provenance": checkpoint_format.code_provenance(),
    }


def write_train_config(iteration_dir: Path, model: GPTModelConfig, mhar: MHARConfig) -> None:
    import yaml

    text = (
        "# The model and mhar sections a recipe continuing from this checkpoint must use\n"
        "# (megatron_mhar.train compares them field by field before loading).\n"
    )
    text += yaml.safe_dump(config_dicts(model, mhar), sort_keys=False)
    (iteration_dir / TRAIN_CONFIG_FILE).write_text(text)
