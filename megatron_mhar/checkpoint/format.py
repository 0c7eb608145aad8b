"""What a checkpoint directory is: its layout, the run config stored with it, and how it is read.

The training driver (:mod:`megatron_mhar.training.checkpointing`: save, resume, prune),
the conversion (:mod:`megatron_mhar.conversion`) and inference (:mod:`megatron_mhar.inference`)
all write and read this layout::

    checkpoints/
      latest                 text: the name of the newest verified checkpoint
      iter_0000200/          one megatron.core.dist_checkpointing checkpoint
        common.pt, metadata.json, __*.distcp
        train_config.yaml    the run config (of a converted checkpoint: its model and mhar sections)
        tokenizer/           the run's tokenizer, a Hugging Face tokenizer directory
                             (tokenizer.json, tokenizer_config.json); trained checkpoints
        hf/                  a converted checkpoint's source config.json and tokenizer files
        manifest.json        every other file's size and checksum (megatron_mhar.checkpoint.manifest)
      .tmp.iter_0000300/     a save in progress (or interrupted): never read

A checkpoint is complete once its ``metadata.json`` exists (dist_checkpointing writes it
last); a directory being written carries the staging prefix, gets its manifest, and is
renamed into place whole. The common state (``common.pt``) holds ``checkpoint_version``,
``iteration``, ``train_state`` and ``config``, the resolved run config as a dict whose
``model`` and ``mhar`` sections (:class:`GPTModelConfig`, :class:`MHARConfig`) define the
network, and ``provenance``, the code that wrote it (:func:`code_provenance`).

Every reader finds its checkpoint through :func:`find_checkpoint`, which verifies it
against its manifest first (``full``, ``size`` or ``off``: :mod:`megatron_mhar.checkpoint.manifest`);
one without a manifest (``checkpoint_version`` 1 had none) is read only with ``off``.

Importing this module does not import Megatron.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import subprocess
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_mhar.checkpoint import manifest
from megatron_mhar.errors import ConfigError
from megatron_mhar.files import TMP_PREFIX
from megatron_mhar.models.gpt_config import GPTModelConfig
from megatron_mhar.models.mhar_config import MHARConfig, function_fields

LATEST = "latest"
"""Text file naming the newest complete checkpoint of a checkpoint directory."""

CHECKPOINT_VERSION = 2
"""2: the checkpoint carries a manifest; 1: written before manifests (read unverified)."""
METADATA_FILE = "metadata.json"
TRAIN_CONFIG_FILE = "train_config.yaml"
TOKENIZER_DIR = "tokenizer"
"""The run's tokenizer inside a trained checkpoint (converted ones carry theirs in ``hf/``)."""
HF_SUBDIR = "hf"
"""A converted checkpoint's source ``config.json`` and tokenizer files, for its export."""
# Config sections that define the network; any difference makes a checkpoint unusable.
MODEL_SECTIONS = ("model", "mhar")
MODEL_EXECUTION_FIELDS = ("spec", "fused_kernels", "moe_token_dispatcher_type", "moe_router_dtype",
                          "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type",
                          "mtp_loss_scaling_factor")
"""``model`` fields a resume may change: the local and the Transformer Engine spec store the
same tensors under the same distributed-checkpoint keys (TE's fused pre-norms as the local
spec's norms, mapped by Megatron's ``sharded_state_dict_keys_map``), so a run saved with
one resumes with the other (``model.spec: auto`` on another machine); the fused kernels
of the TE spec change no tensor; an MoE model's token dispatcher, router precision and
router losses, and the MTP losses' weight, change how it runs and trains, not its weights."""
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


def published_checkpoints(path: Path) -> List[Path]:
    """The published ``iter_*`` checkpoints of a checkpoint directory, newest first.

    Newest by (iteration, save): ``iter_0000012``, then ``iter_0000012.2`` for a second
    save at the same iteration (a save never renames over a published one).
    """
    path = Path(path)
    if not path.is_dir():
        return []
    saves = {p: _SAVE_NAME.fullmatch(p.name) for p in path.iterdir() if p.is_dir()}
    saves = {p: m for p, m in saves.items() if m}
    return sorted(saves, key=lambda p: (int(saves[p][1]), int(saves[p][2] or 1)), reverse=True)


def checkpoint_problem(checkpoint: Path, verify: str = "full", share: Optional[Tuple[int, int]] = None) -> Optional[str]:
    """Why ``checkpoint`` is not to be read (incomplete, or not matching its manifest at
    the ``verify`` level), or ``None``. ``share``: see :func:`megatron_mhar.checkpoint.manifest.verify`."""
    checkpoint = Path(checkpoint)
    if not is_complete(checkpoint):
        return f"{checkpoint} is not a complete checkpoint (no {METADATA_FILE})"
    if verify == "off":
        return None
    try:
        manifest.verify(checkpoint, verify, share)
    except manifest.ManifestError as err:
        return str(err)
    return None


Problem = Callable[[Path], Optional[str]]
"""``checkpoint -> why it is not to be read, or None`` (:func:`checkpoint_problem` at a level)."""


def _say(line: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def find_checkpoint(path: Path, verify: str = "full", problem: Optional[Problem] = None) -> Optional[Path]:
    """The checkpoint ``path`` designates, verified: via its ``latest`` file, or ``path``
    itself, or, where no ``latest`` names an intact one, its newest verified ``iter_*``.

    A save publishes ``iter_*`` (a complete checkpoint, renamed into place) and then writes
    ``latest``; a job stopped in between, a ``latest`` removed or damaged by hand, or a
    checkpoint damaged since it was written, leaves checkpoints that ``latest`` does not
    name. Starting afresh beside them would lose them (and ``keep_last`` would prune them),
    so the newest verified one is used instead, with a line saying so. A checkpoint
    directory given itself must pass: its error names the file at fault and the next
    intact checkpoint beside it. ``None`` where ``path`` holds no checkpoint at all.

    ``problem``: how a checkpoint is checked (default :func:`checkpoint_problem` at
    ``verify``; the training driver divides the reading among its ranks).
    """
    path = Path(path)
    problem = problem or (lambda checkpoint: checkpoint_problem(checkpoint, verify))
    latest = path / LATEST
    if not latest.exists() and is_complete(path):
        reason = problem(path)
        if reason is not None:
            raise ValueError(f"checkpoint {path} fails verification: {reason}; {_instead(path.parent, problem, path)}")
        return path
    failures: List[str] = []  # why `latest` and each newer checkpoint were passed over
    skip = None
    if latest.exists():
        try:
            name = latest.read_text().strip()
        except (OSError, UnicodeDecodeError) as err:
            name, reason = "", f"cannot be read ({err})"
        else:
            reason = None if _SAVE_NAME.fullmatch(name) else f"holds {name[:80]!r}, not a checkpoint name"
        if reason is None:
            skip = path / name
            if not skip.is_dir():
                reason = f"names {name!r}, which does not exist"
            else:
                reason = problem(skip)
                if reason is None:
                    return skip
                reason = f"names {name!r}, which fails verification: {reason}"
        failures.append(f"{latest} {reason}")
    for candidate in published_checkpoints(path):
        if candidate == skip:
            continue
        reason = problem(candidate)
        if reason is None:
            why = failures if latest.exists() else [f"{path} has no {LATEST!r} file"] + failures
            _say(f"{'; '.join(why)}; using the newest verified checkpoint, {candidate.name}")
            return candidate
        failures.append(f"{candidate.name}: {reason}")
    if failures:
        raise ValueError(
            f"{path} holds no checkpoint that can be read:\n  " + "\n  ".join(failures)
            + f"\nrestore a checkpoint from a copy, or set checkpoint.verify=off to read one unverified, or "
            f"remove {path} to start afresh"
        )
    return None


def require_checkpoint(path: Path, verify: str = "full") -> Path:
    """The checkpoint ``path`` designates (:func:`find_checkpoint`'s rule:
    its ``latest`` file, or itself, verified at ``verify``); raises where there is none."""
    found = find_checkpoint(Path(path), verify)
    if found is None:
        raise FileNotFoundError(
            f"{path} is not a Megatron distributed checkpoint (no {LATEST} file, no metadata.json)"
        )
    return found


def _instead(directory: Path, problem: Problem, broken: Path) -> str:
    """The fix for a damaged checkpoint: the next intact one beside it, if any."""
    for candidate in published_checkpoints(directory):
        if candidate != broken and problem(candidate) is None:
            return f"use the intact {candidate} instead (or restore {broken.name} from a copy)"
    return (f"no intact checkpoint is beside it: restore it from a copy, or set checkpoint.verify=off "
            f"to read it unverified")


@contextlib.contextmanager
def checksummed_writes() -> Iterator[None]:
    """Inside, the files Megatron's checkpoint writer creates are checksummed as they are
    written (:class:`megatron_mhar.checkpoint.manifest.ChecksummingFile`), so that the manifest need
    not read them back.

    The writer (``FileSystemWriterAsync.write_preloaded_data``, run in processes forked
    from this one) opens each shard file with the ``open`` of its module's namespace; a
    module-level ``open`` there shadows the builtin for the duration. A writer that opens
    its files otherwise is not affected, and the manifest then reads those files back.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def open_for_writer(file, mode="r", *args, **kwargs):
        if mode == "wb" and not args and not kwargs:
            return manifest.ChecksummingFile(file)
        return open(file, mode, *args, **kwargs)

    missing = object()
    previous = filesystem_async.__dict__.get("open", missing)
    filesystem_async.open = open_for_writer
    try:
        yield
    finally:
        if previous is missing:
            del filesystem_async.open
        else:
            filesystem_async.open = previous


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


@functools.lru_cache(maxsize=1)
def code_provenance() -> Dict[str, Any]:
    """The code writing a checkpoint: ``{"megatron_mhar": version, "commit", "dirty"}``.

    ``commit`` is the git commit of the checkout this package runs from (``None`` for an
    installed wheel, or where git is missing) and ``dirty`` whether tracked files differ
    from it; an export's model card names them.
    """
    from megatron_mhar import __version__

    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"megatron_mhar": __version__, "commit": commit, "dirty": bool(changes) if commit else None}


# ---------------------------------------------------------------- the stored run config


def changed_fields(saved: Dict[str, Any], current: Dict[str, Any], prefix: str = "") -> List[Tuple[str, Any, Any]]:
    """``(dotted key, saved value, current value)`` of every leaf that differs between two
    config dicts (``"<absent>"`` for a key one of them lacks)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, "<absent>"), current.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(changed_fields(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append((f"{prefix}{key}", a, b))
    return out


def config_differences(saved: Dict[str, Any], current: Dict[str, Any], prefix: str = "") -> List[str]:
    """``key: saved (checkpoint) vs current (config)`` for every leaf that differs."""
    return [f"{key}: {a!r} (checkpoint) vs {b!r} (config)" for key, a, b in changed_fields(saved, current, prefix)]


def fresh_mtp_depths(saved: Dict[str, Any], config: Dict[str, Any]) -> Optional[int]:
    """``model.mtp_num_layers`` of the run config ``config`` where the checkpoint's run config
    ``saved`` has no MTP (a converted Hugging Face model, a run without MTP): the depths a
    weights-only load leaves at their initialisation. ``None`` otherwise."""
    old = (saved.get("model") or {}).get("mtp_num_layers")
    new = (config.get("model") or {}).get("mtp_num_layers")
    return new if old is None else None


def check_config(checkpoint: Path, config: Dict[str, Any], model_only: bool = False) -> Dict[str, Any]:
    """The checkpoint's common state; raises if it was written for another model than the
    run config ``config`` (a dict) describes, naming every differing field.

    A weights-only load (``model_only``, or a checkpoint of step 0) of a checkpoint without
    MTP may add MTP depths (:func:`fresh_mtp_depths`); a resume may not, nor may any load
    drop or change the checkpoint's."""
    common = read_common_state(checkpoint)
    saved = common.get("config")
    if saved is None:
        raise ValueError(f"{checkpoint} has no run config; was it written by megatron_mhar.train?")
    fresh_mtp = fresh_mtp_depths(saved, config)
    weights_only = model_only or common.get("iteration") == 0
    diffs, hints = [], []
    for section in MODEL_SECTIONS:
        old, new = saved.get(section, {}), config.get(section, {})
        if section == "mhar":  # how routing runs may change between runs
            old, new = function_fields(old), function_fields(new)
        else:  # and which layers run it; fields a checkpoint predates hold their defaults
            defaults = dataclasses.asdict(GPTModelConfig())
            old = {k: v for k, v in {**defaults, **old}.items() if k not in MODEL_EXECUTION_FIELDS}
            new = {k: v for k, v in {**defaults, **new}.items() if k not in MODEL_EXECUTION_FIELDS}
            if fresh_mtp is not None and weights_only:
                new["mtp_num_layers"] = None
            elif old["mtp_num_layers"] != new["mtp_num_layers"]:
                hints.append(_mtp_hint(checkpoint, old["mtp_num_layers"], fresh_mtp))
        diffs += config_differences(old, new, f"{section}.")
    if diffs:
        raise ConfigError(
            f"checkpoint {checkpoint} was written for a different model; differing fields:\n  "
            + "\n  ".join(diffs)
            + "".join(f"\n{hint}" for hint in hints)
            + f"\nuse the checkpoint's model/mhar settings (its {TRAIN_CONFIG_FILE}) or another "
            "checkpoint directory"
        )
    return common


def _mtp_hint(checkpoint: Path, saved_depths: Optional[int], fresh_mtp: Optional[int]) -> str:
    """What to do about a checkpoint whose MTP depths (``model.mtp_num_layers``) the run's differ from."""
    if fresh_mtp is not None:
        return (f"the checkpoint has no MTP weights: a new run (another run.name) starts its {fresh_mtp} MTP "
                f"depth(s) fresh on the checkpoint's other weights with checkpoint.load={checkpoint} "
                f"checkpoint.load_model_only=true")
    return f"the checkpoint holds {saved_depths} MTP depth(s): set model.mtp_num_layers={saved_depths}"


# ---------------------------------------------------------------- converted checkpoints


def config_dicts(model: GPTModelConfig, mhar: MHARConfig) -> Dict[str, Any]:
    """The ``config`` entry of the common state (the driver compares these sections)."""
    return {"model": dataclasses.asdict(model), "mhar": dataclasses.asdict(mhar)}


def common_state(model: GPTModelConfig, mhar: MHARConfig, conversion: Dict[str, Any]) -> Dict[str, Any]:
    """The non-tensor part of a converted checkpoint: iteration 0, no training state, the
    ``conversion`` record (:mod:`megatron_mhar.conversion.output`)."""
    return {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0,
        "config": config_dicts(model, mhar),
        "train_state": {},
        "conversion": conversion,
        "provenance": code_provenance(),
    }


def write_train_config(iteration_dir: Path, model: GPTModelConfig, mhar: MHARConfig) -> None:
    """``train_config.yaml`` of a converted checkpoint: the sections a recipe must repeat."""
    import yaml

    text = (
        "# The model and mhar sections a recipe continuing from this checkpoint must use\n"
        "# (megatron_mhar.train compares them field by field before loading).\n"
    )
    text += yaml.safe_dump(config_dicts(model, mhar), sort_keys=False)
    (iteration_dir / TRAIN_CONFIG_FILE).write_text(text)
