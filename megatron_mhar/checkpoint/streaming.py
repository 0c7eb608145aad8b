"""Reading and writing a model's tensors in a distributed checkpoint, one stored tensor at a time.

The checkpoint's ``model`` key holds a GPT chunk's ``sharded_state_dict()`` (the training
driver's layout, :mod:`megatron_mhar.checkpoint.format`); stored tensors are named by
their TP=1/PP=1 names (:func:`global_name`), so any layout reads any other's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from megatron_mhar.checkpoint.format import reading


def global_name(chunk, name: str) -> str:
    """The TP=1/PP=1 name of a chunk's tensor (layer indices made global)."""
    prefix = "decoder.layers."
    if name.startswith(prefix):
        index, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{chunk.decoder.layers[int(index)].layer_number - 1}.{rest}"
    return name



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
