"""What a checkpoint directory is: its layout, the run config stored with it, and how it is read.

The training driver (:mod:`megatron_mhar.training.checkpointing`: save, resume, prune)
and the conversion and inference (:mod:`megatron_mhar.conversion.checkpoint`,
:mod:`megatron_mhar.inference`: convert, load) both write and read this layout::

    checkpoints/
      latest                 text: the name of the newest complete checkpoint
      iter_0000200/          one megatron.core.dist_checkpointing checkpoint
        common.pt, metadata.json, __*.distcp
        train_config.yaml    the run config (of a converted checkpoint: its model and mhar sections)
        tokenizer/           the run's tokenizer, a Hugging Face tokenizer directory
                             (tokenizer.json, tokenizer_config.json); trained checkpoints
      .tmp.iter_0000300/     a save in progress (or interrupted): never read

A checkpoint is complete once its ``metadata.json`` exists (dist_checkpointing writes it
last); a directory being written carries the staging prefix and is renamed into place
whole. The common state (``common.pt``) holds ``checkpoint_version``, ``iteration``,
``train_state`` and ``config``, the resolved run config as a dict whose ``model`` and
``mhar`` sections (:class:`GPTModelConfig`, :class:`MHARConfig`) define the network.

Importing this module does not import Megatron.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_mhar.errors import ConfigError
from megatron_mhar.models.mhar_config import MHARConfig, function_fields
from megatron_mhar.files import TMP_PREFIX
from megatron_mhar.models.gpt_config import GPTModelConfig

LATEST = "latest"
"""Text file naming the newest complete checkpoint of a checkpoint directory."""

CHECKPOINT_VERSION = 1
METADATA_FILE = "metadata.json"
TRAIN_CONFIG_FILE = "train_config.yaml"
TOKENIZER_DIR = "tokenizer"
"""The run's tokenizer inside a trained checkpoint (converted ones carry theirs in ``hf/``)."""
# Config sections that define the network; any difference makes a checkpoint unusable.
MODEL_SECTIONS = ("model", "mhar")
EMBEDDING_KEY = "embedding.word_embeddings.weight"

_SAVE_NAME = re.compile(r"iter_(\d+)(?:\.(\d+))?")  # checkpoint_name, and a repeated save's suffix


# ---------------------------------------------------------------- layout


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def staging_dir(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: beside it, never read."""
    path = Path(path).absolute()
    return path.parent / f"{TMP_PREFIX}{path.name}"


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a whole checkpoint (its metadata is written last)."""
    return (Path(path) / METADATA_FILE).is_file()


def find_checkpoint(path: Path) -> Optional[Path]:
    """The checkpoint ``path`` designates: via its ``latest`` file, or ``path`` itself, or,
    where no ``latest`` names one, its newest published ``iter_*`` checkpoint.

    A save publishes ``iter_*`` (a complete checkpoint, renamed into place) and then writes
    ``latest``; a job stopped in between, or a ``latest`` removed by hand, leaves checkpoints
    that nothing names. Starting afresh beside them would lose them (and ``keep_last``
    would prune them), so the newest is resumed instead, with a line saying so.
    """
    path = Path(path)
    latest = path / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        target = path / name
        if not is_complete(target):
            raise ValueError(f"{latest} names {name!r}, but {target} is not a complete checkpoint")
        return target
    if is_complete(path):
        return path
    published = {p: _SAVE_NAME.fullmatch(p.name) for p in path.glob("iter_*")} if path.is_dir() else {}
    published = {p: m for p, m in published.items() if m and is_complete(p)}
    if not published:
        return None
    # (iteration, save): iter_0000012, then iter_0000012.2 for a second save at the same
    # iteration (a save never renames over a published one).
    newest = max(published, key=lambda p: (int(published[p][1]), int(published[p][2] or 1)))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"{path} has no {LATEST!r} file; using its newest checkpoint, {newest.name}", flush=True)
    return newest


# ---------------------------------------------------------------- reading


@contextlib.contextmanager
def reading(checkpoint: Path) -> Iterator[None]:
    """Inside, a failure to read ``checkpoint``'s files (truncated, corrupt, half-copied)
    is raised as a ``ValueError`` that names the checkpoint and the way back, instead of
    the reader's own exception (torch's ``CheckpointException`` is a ``BaseException``
    wrapping each rank's)."""
    try:
        yield
    except (Exception, CheckpointException) as err:
        cause = err
        if isinstance(err, CheckpointException) and err.failures:
            cause = next(iter(err.failures.values()))[0]
        first = (str(cause).strip().splitlines() or [""])[0]
        raise ValueError(
            f"checkpoint {checkpoint} cannot be read ({type(cause).__name__}: {first}); it is truncated "
            f"or corrupt (an interrupted copy, a full disk?). Copy it again, or use an earlier one: "
            f"write its name into {Path(checkpoint).parent / LATEST} or give its iter_* directory"
        ) from err


def read_common_state(checkpoint: Path) -> Dict[str, Any]:
    """The non-tensor part of ``checkpoint`` (every rank reads the same file)."""
    from megatron.core import dist_checkpointing

    with reading(checkpoint):
        return dist_checkpointing.load_common_state_dict(str(checkpoint))


def read_configs(checkpoint: Path) -> Tuple[GPTModelConfig, MHARConfig, Dict[str, Any]]:
    """(model config, mhar config, common state) of a converted or trained checkpoint."""
    common = read_common_state(checkpoint)
    saved = common.get("config") if isinstance(common, dict) else None
    if not isinstance(saved, dict) or "model" not in saved:
        raise ValueError(
            f"{checkpoint} has no model config in its common state; it was written neither by "
            f"hf_to_mcore_mhar.py nor by megatron_mhar.train"
        )
    try:
        model = GPTModelConfig(**saved["model"])
        mhar = MHARConfig(**saved.get("mhar", {"variant": "none"}))
    except TypeError as err:
        raise ValueError(f"{checkpoint}: its model/mhar config does not fit this version: {err}") from None
    return model, mhar, common


def stored_dtype(checkpoint: Path) -> torch.dtype:
    """The dtype the checkpoint stores the word embeddings in."""
    from megatron.core import dist_checkpointing

    with reading(checkpoint):
        metadata = dist_checkpointing.load_tensors_metadata(str(checkpoint))
    if EMBEDDING_KEY not in metadata:
        raise ValueError(f"{checkpoint} holds no {EMBEDDING_KEY}; is it a GPT model checkpoint?")
    return metadata[EMBEDDING_KEY].dtype


# ---------------------------------------------------------------- the stored run config


def config_differences(saved: Dict[str, Any], current: Dict[str, Any], prefix: str = "") -> List[str]:
    """``key: saved -> current`` for every leaf that differs between two config dicts."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(config_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} (checkpoint) vs {b!r} (config)")
    return out


def check_config(checkpoint: Path, config: Dict[str, Any]) -> Dict[str, Any]:
    """The checkpoint's common state; raises if it was written for another model than the
    run config ``config`` (a dict) describes, naming every differing field."""
    common = read_common_state(checkpoint)
    saved = common.get("config")
    if saved is None:
        raise ValueError(f"{checkpoint} has no run config; was it written by megatron_mhar.train?")
    diffs = []
    for section in MODEL_SECTIONS:
        old, new = saved.get(section, {}), config.get(section, {})
        if section == "mhar":  # how routing runs may change between runs
            old, new = function_fields(old), function_fields(new)
        diffs += config_differences(old, new, f"{section}.")
    if diffs:
        raise ConfigError(
            f"checkpoint {checkpoint} was written for a different model; differing fields:\n  "
            + "\n  ".join(diffs)
            + f"\nuse the checkpoint's model/mhar settings (its {TRAIN_CONFIG_FILE}) or another "
            "checkpoint directory"
        )
    return common
