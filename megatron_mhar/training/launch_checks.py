"""Launch-time checks: what needs the world size, the machine and the file system, before any
process group.

:func:`validate_launch` runs on every rank before the process groups start (all ranks reach
the same verdict): the parallel layout against the world size, the device and the installed
packages against the layer spec, precision, optimizer and kernels, the data files and
tokenizer against the model's vocabulary, and the output directories. A recipe's own
consistency is checked when it loads (:mod:`megatron_mhar.training.schema`).
:func:`with_resolved_spec` turns ``model.spec: auto`` into the spec this machine runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path
from typing import Callable, Tuple

from megatron_mhar.files import nearest_existing
from megatron_mhar.training.moe import check_moe_launch
from megatron_mhar.training.schema import TrainConfig

TE_INSTALL = "pip install 'megatron_mhar[te]'"
"""How Transformer Engine is installed (the package's te extra)."""


def validate_launch(cfg: TrainConfig, world_size: int, this_machine: bool = True) -> None:
    """Checks that need the launch: parallel layout vs world size, batch sizes, files.

    Runs before any process group starts, on every rank (all reach the same verdict).
    ``this_machine=False`` (``mhar-train --check``, the Slurm launchers' check before
    ``srun``, on a node that may have no GPU) leaves out what depends on the devices and
    packages of the machine the ranks run on.
    """
    _check_paths_expanded(cfg)
    par, tr = cfg.parallel, cfg.training
    if world_size % par.model_parallel_size:
        raise ValueError(
            f"world size {world_size} is not a multiple of tensor_model_parallel_size x "
            f"pipeline_model_parallel_size = {par.model_parallel_size}; change the parallel "
            f"sizes or the number of processes"
        )
    dp = world_size // par.model_parallel_size
    per_step = tr.micro_batch_size * dp
    if tr.global_batch_size % per_step:
        raise ValueError(
            f"training.global_batch_size={tr.global_batch_size} is not a multiple of "
            f"training.micro_batch_size x data-parallel size = {tr.micro_batch_size} x {dp}; "
            f"use a global batch of a multiple of {per_step}"
        )
    num_micro = tr.global_batch_size // per_step
    pp = par.pipeline_model_parallel_size
    if par.virtual_pipeline_model_parallel_size and num_micro % pp:
        raise ValueError(
            f"the interleaved pipeline schedule needs the micro-batches per step ({num_micro}) "
            f"to be a multiple of pipeline_model_parallel_size={pp}; raise "
            f"training.global_batch_size"
        )
    if par.sequence_parallel and cfg.model.seq_length % par.tensor_model_parallel_size:
        raise ValueError(
            f"model.seq_length={cfg.model.seq_length} must be a multiple of "
            f"tensor_model_parallel_size={par.tensor_model_parallel_size} with sequence parallelism"
        )

    if this_machine:
        _check_machine(cfg, world_size)

    # The tokenizer against the model first: data written by a tokenizer larger than the
    # model fails the data check too, whose message could only blame the data.
    tokenizer = check_tokenizer(cfg)
    check_data_prefixes(cfg.data.paths, "data.paths", cfg.model.vocab_size, tokenizer)
    check_heldout_data(cfg, tokenizer)
    if importlib.util.find_spec("psutil") is None:
        # Megatron's checkpoint writer processes need it and hang the save without it.
        raise ValueError("megatron.core.dist_checkpointing needs psutil: pip install psutil")
    _check_output_dir(cfg.run.dir, "run.output_dir/run.name")
    _check_output_dir(cfg.checkpoint_dir, "checkpoint.dir" if cfg.checkpoint.dir else "run.output_dir/run.name")
    if cfg.checkpoint.load is not None:
        if not os.path.isdir(cfg.checkpoint.load):
            raise ValueError(f"checkpoint.load={cfg.checkpoint.load!r}: no such directory")


def _check_machine(cfg: TrainConfig, world_size: int) -> None:
    """The devices and packages of this machine against the run's layer spec, precision,
    optimizer and kernels."""
    if cfg.run.device == "cuda" and not _cuda_available():
        raise ValueError("run.device=cuda but CUDA is not available; set run.device=cpu")
    on_cpu = runs_on_cpu(cfg)
    check_moe_launch(cfg, world_size, on_cpu)
    _check_spec_and_precision(cfg, on_cpu)
    _check_distributed_optimizer(cfg)
    if on_cpu and cfg.mhar.kernel_impl == "triton" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            "mhar.kernel_impl=triton runs on GPUs (or in Triton's interpreter with TRITON_INTERPRET=1); "
            "on CPU set mhar.kernel_impl=auto or torch"
        )
    if on_cpu and cfg.training.cuda_graph != "none":
        raise ValueError(
            f"training.cuda_graph={cfg.training.cuda_graph} needs a GPU; on CPU set training.cuda_graph=none"
        )


def _check_paths_expanded(cfg: TrainConfig) -> None:
    """No path keeps a ``${VAR}``: the configuration expanded every variable that was set
    when it was built, so one left names a variable that was not."""
    data, checkpoint = cfg.data, cfg.checkpoint
    paths = [("run.output_dir", cfg.run.output_dir)]
    for name in ("paths", "valid_paths", "test_paths"):
        paths += [(f"data.{name}[{i}]", p) for i, p in enumerate(getattr(data, name))]
    paths += [(f"data.{name}", getattr(data, name)) for name in ("tokenizer", "cache_dir", "embedded_dir")]
    paths += [(f"checkpoint.{name}", getattr(checkpoint, name)) for name in ("dir", "load")]
    unset = [(key, value) for key, value in paths if value is not None and "$" in value]
    if unset:  # all of them at once: a job finds them before its allocation, not one per submission
        names = sorted({m.group(1) or m.group(2) for _, v in unset for m in _VARIABLE.finditer(v)})
        raise ValueError(
            f"environment variables not set: {', '.join(names)} (used by "
            f"{', '.join(f'{key}={value!r}' for key, value in unset)}); export them or override those keys"
        )


_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
"""A ``${VAR}`` or ``$VAR`` left in a path: a variable that was not set."""


def runs_on_cpu(cfg: TrainConfig) -> bool:
    """Whether the run is on CPU: ``run.device=cpu``, or ``auto`` without CUDA."""
    return cfg.run.device == "cpu" or (cfg.run.device == "auto" and not _cuda_available())


def _device_is_cuda(cfg: TrainConfig):
    """``run.device`` as :func:`~megatron_mhar.models.specs.resolve_spec` takes it: True for
    cuda, False for cpu, None for auto (CUDA where available)."""
    return None if cfg.run.device == "auto" else cfg.run.device == "cuda"


def with_resolved_spec(cfg: TrainConfig, say: Callable[[str], None] = print) -> TrainConfig:
    """``cfg`` with ``model.spec: auto`` replaced by the spec this machine runs, said in one
    line on rank 0 (through ``say``), e.g. ``model.spec auto -> transformer_engine
    (Transformer Engine 2.12.0)``; ``--print-config`` shows it so.

    The run's ``config.yaml`` and checkpoints then record the spec that ran. A checkpoint
    does not depend on it: both specs store the same tensors under the same keys, and a
    resume may change it (:func:`megatron_mhar.checkpoint.format.check_config`).
    """
    from megatron_mhar.models.specs import resolve_spec

    if cfg.model.spec != "auto":
        return cfg
    choice = resolve_spec("auto", cuda=_device_is_cuda(cfg))
    if os.environ.get("RANK", "0") == "0":
        say(f"model.spec auto -> {choice.spec} ({choice.reason})")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, spec=choice.spec))


def _check_spec_and_precision(cfg: TrainConfig, on_cpu: bool) -> None:
    """Transformer Engine's layers, and FP8 (which only they run), need TE and a GPU."""
    from megatron_mhar.models.specs import resolve_spec, transformer_engine_version

    spec = cfg.model.spec
    if spec == "transformer_engine":
        if on_cpu:
            raise ValueError(
                "model.spec=transformer_engine runs Transformer Engine's layers, which need a GPU; "
                "on CPU set model.spec=local (or auto)"
            )
        try:
            transformer_engine_version()
        except ImportError as err:
            raise ValueError(
                f"model.spec=transformer_engine: {err}; install it ({TE_INSTALL}) or set "
                f"model.spec=local (or auto)"
            ) from None
    if cfg.training.precision != "fp8":
        return
    if on_cpu:
        raise ValueError(
            "training.precision=fp8 runs the linear layers in Transformer Engine's FP8 on a GPU; "
            "on CPU use training.precision=bf16 or fp32"
        )
    choice = resolve_spec(spec, cuda=True)  # not on CPU (above)
    if choice.spec != "transformer_engine":
        raise ValueError(
            f"training.precision=fp8 runs the linear layers in Transformer Engine's FP8, but "
            f"model.spec={spec} resolves to local here ({choice.reason}): install Transformer "
            f"Engine ({TE_INSTALL}) and set model.spec=auto or transformer_engine, or use "
            f"training.precision=bf16"
        )


def _check_distributed_optimizer(cfg: TrainConfig) -> None:
    """Megatron's distributed optimizer saves and resumes over a fused Adam only.

    megatron-core picks Transformer Engine's fused Adam where TE imports (apex's otherwise)
    for every run, whatever the layer spec; over torch's Adam it reads the Adam step from
    per-parameter state that a new optimizer lacks (loading asserts) and copies that step as
    if it were a tensor of the saved state (``KeyError: 'step'``).
    """
    if not cfg.parallel.use_distributed_optimizer:
        return
    if not (cfg.checkpoint.interval or cfg.checkpoint.save_at_end):
        return
    from megatron.core.optimizer import distrib_optimizer

    if not distrib_optimizer.HAVE_APEX_OR_TE:
        raise ValueError(
            "parallel.use_distributed_optimizer=true with torch's Adam (neither Transformer Engine "
            "nor apex is installed): megatron-core cannot save and resume this optimizer's state. "
            f"Install Transformer Engine ({TE_INSTALL}; model.spec=auto then also runs its "
            "layers), or set parallel.use_distributed_optimizer=false, or write no checkpoints "
            "(checkpoint.interval=0 checkpoint.save_at_end=false)"
        )


def check_tokenizer(cfg: TrainConfig) -> Tuple[str, int]:
    """``(data.tokenizer, its number of tokens)``, once the model's vocabulary holds every
    token: a model with fewer embedding rows than its tokenizer has tokens cannot take the
    data that tokenizer writes."""
    data, rows = cfg.data, cfg.model.vocab_size
    if data.tokenizer != "builtin":
        tok_dir = data.tokenizer
        if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
            raise ValueError(
                f"data.tokenizer={data.tokenizer!r}: no tokenizer.json in {tok_dir}; give a local "
                f"Hugging Face tokenizer directory (e.g. a download of Qwen/Qwen3-0.6B) or 'builtin'"
            )
        from megatron_mhar.data.tokenizer import Tokenizer

        vocab = Tokenizer.from_dir(tok_dir, data.eod_token).vocab_size
        source = f"data.tokenizer={tok_dir!r}"
    else:
        vocab, source = data.embedded_vocab_size, "the builtin tokenizer (data.embedded_vocab_size)"
    if vocab > rows:
        if cfg.checkpoint.load:  # a loaded model's embedding is what it is
            fix = ("The loaded model's vocabulary is fixed: set data.tokenizer to the tokenizer it was "
                   "converted with (mhar-convert hf-to-mcore checks the two) and write the data with it "
                   "(mhar-preprocess --tokenizer)")
        else:
            fix = (f"Set model.vocab_size>={vocab}, or use a tokenizer of at most {rows} tokens and write "
                   f"the data with it (mhar-preprocess --tokenizer)")
        raise ValueError(
            f"the model has {rows} embedding rows (model.vocab_size) but {source} has {vocab} tokens: "
            f"ids from {rows} up have no embedding. {fix}"
        )
    return data.tokenizer, vocab


def check_data_prefixes(prefixes, key: str, vocab_size: int, tokenizer: Tuple[str, int]) -> None:
    """Each prefix of the list ``key`` names one intact ``.bin/.idx`` pair whose token ids
    fit ``vocab_size``; ``tokenizer``: ``(data.tokenizer, its number of tokens)``, which
    the data should have been written with."""
    from megatron_mhar.data.datasets import open_indexed

    for i, prefix in enumerate(prefixes):
        try:  # both files there, and one intact pair: before any process group starts
            open_indexed(prefix)
        except ValueError as err:
            raise ValueError(f"{key}[{i}]={prefix!r}: {err}") from None
        # Ids past the vocabulary would train the padded embedding rows or fail deep in a
        # step (a device-side assert on GPUs): data written with another tokenizer. Read on
        # rank 0 only: a blend of many prefixes on every rank would be a storm of reads.
        if int(os.environ.get("RANK", "0")) == 0:
            _check_token_ids(prefix, f"{key}[{i}]={prefix!r}", vocab_size, tokenizer)


def check_heldout_data(cfg: TrainConfig, tokenizer: Tuple[str, int]) -> None:
    """``data.valid_paths`` and ``data.test_paths``: the training data's checks, and no
    prefix in two of the training, validation and test sets."""
    data = cfg.data
    check_data_prefixes(data.valid_paths, "data.valid_paths", cfg.model.vocab_size, tokenizer)
    check_data_prefixes(data.test_paths, "data.test_paths", cfg.model.vocab_size, tokenizer)
    first_use = {}  # real path -> (list key, index)
    for key in ("data.paths", "data.valid_paths", "data.test_paths"):
        for i, prefix in enumerate(getattr(data, key[len("data."):])):
            other_key, j = first_use.setdefault(
                os.path.realpath(prefix), (key, i)
            )
            if other_key != key:
                raise ValueError(
                    f"{key}[{i}]={prefix!r} is also {other_key}[{j}]: held-out data must be neither "
                    f"trained on nor shared by validation and test; give disjoint data sets"
                )


def _check_token_ids(path: str, what: str, vocab_size: int, tokenizer: Tuple[str, int]) -> None:
    """The largest token id of a pair against the model's vocabulary: from the pair's
    metadata (O(1)); from every id, read once, where the ``.bin`` changed since its metadata
    was written (the metadata is then rewritten); else from a sample of its first and last
    ids. Every id is checked again as training reads it
    (:class:`megatron_mhar.data.datasets.MicroBatches`). The tokenizer already fits the
    model (:func:`check_tokenizer`), so an id beyond it is data written otherwise."""
    from megatron_mhar.data.datasets import sampled_max_token
    from megatron_mhar.data.indexed_writer import read_metadata, rescan

    metadata, stale = read_metadata(path)
    if stale is not None:
        metadata = rescan(path, metadata, stale, say=lambda line: print(line, flush=True))
    largest = metadata["max_token_id"] if metadata else sampled_max_token(path)
    if largest >= vocab_size:
        name, size = tokenizer
        if stale is not None:
            cause = "its .bin changed after preprocessing (edited or regenerated)"
        elif metadata:
            cause = (f"it was written with a tokenizer of {metadata['vocab_size']} tokens, not data.tokenizer "
                     f"({name}, {size} tokens)")
        else:
            cause = f"it was written with another tokenizer than data.tokenizer ({name}, {size} tokens)"
        raise ValueError(
            f"{what} holds token id {largest}, beyond model.vocab_size={vocab_size} (the model's "
            f"embedding rows): {cause}; rewrite it with mhar-preprocess --tokenizer {name}, or fix the path"
        )


def _check_output_dir(path: Path, keys: str) -> None:
    """``path`` is a writable directory or can be made one (checked now, not at the first
    save after hours of training)."""
    path = path.absolute()
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise ValueError(
            f"{path} cannot be a directory: {existing} is a file; change {keys} or move the file"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{path} is not writable ({existing} is read-only to this user); change {keys}")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
