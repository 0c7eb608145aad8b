"""The sections of a run configuration other than the model's: one dataclass per recipe
section (``run``, ``parallel``, ``training``, ``optimizer``, ``eval``, ``data``,
``checkpoint``, ``logging``), each checking its own values in ``__post_init__``, and the
expansion of the paths they hold (once, when the configuration is built).

:class:`~megatron_mhar.training.schema.TrainConfig` holds them with the ``model`` and
``mhar`` sections and checks what depends on several sections.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import List, Optional

from megatron_mhar.checkpoint.manifest import VERIFY_LEVELS

DEFAULT_SPLIT = "98,2,0"
"""``data.split`` when none is given and no held-out paths are."""

PRECISIONS = ("fp32", "bf16", "fp8")
"""Values of ``training.precision``."""

CUDA_GRAPH_MODES = ("none", "full_iteration")
"""Values of ``training.cuda_graph`` (see :mod:`megatron_mhar.training.cuda_graphs`)."""


def expand_path(text: str) -> str:
    """``~`` and every set ``${VAR}`` expanded. Every path of a configuration is expanded
    once, when the configuration is built; an unset variable stays as written, so that a
    recipe for another machine still loads, and the launch checks name it."""
    return os.path.expandvars(os.path.expanduser(text))


@dataclasses.dataclass
class RunConfig:
    """Where the run writes and how it is seeded."""

    name: str = "smoke_cpu"
    """Run name; the run directory is ``{output_dir}/{name}``."""

    output_dir: str = "runs"
    """Parent directory of run directories."""

    seed: int = 1234
    """Seed of parameter init, data order and every RNG (same seed, same losses)."""

    device: str = "auto"
    """``auto`` (CUDA when available), ``cuda`` or ``cpu`` (gloo; smoke runs and tests)."""

    def __post_init__(self):
        self.output_dir = expand_path(self.output_dir)
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"run.device must be auto, cuda or cpu, got {self.device!r}")
        if not self.name or "/" in self.name:
            raise ValueError(f"run.name must be a non-empty name without '/', got {self.name!r}")
        if not 0 <= self.seed < 2**32:  # numpy's seeding range
            raise ValueError(f"run.seed must be in [0, 2**32), got {self.seed}")

    @property
    def dir(self) -> Path:
        """The run directory."""
        return Path(self.output_dir) / self.name


@dataclasses.dataclass
class ParallelConfig:
    """Parallel layout; the data-parallel size is what the world size leaves over."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks (must divide attention heads and KV heads)."""

    pipeline_model_parallel_size: int = 1
    """Pipeline stages."""

    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank (interleaved 1F1B); ``None`` for none."""

    sequence_parallel: bool = False
    """Shard norms and dropout over the sequence across tensor-parallel ranks."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""

    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass."""

    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the forward pass."""

    expert_model_parallel_size: int = 1
    """Expert-parallel ranks (MoE): each holds num_moe_experts / this many experts of every
    MoE layer; carved out of the data-parallel (and tensor-parallel) ranks, as in Megatron."""

    expert_tensor_parallel_size: Optional[int] = None
    """Tensor-parallel ranks of each expert (MoE); ``None`` means tensor_model_parallel_size."""

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.expert_tensor_parallel_size is not None and self.expert_tensor_parallel_size < 1:
            raise ValueError(
                f"parallel.expert_tensor_parallel_size must be >= 1 (or null for the tensor-parallel "
                f"size), got {self.expert_tensor_parallel_size}"
            )
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and (vpp < 2 or self.pipeline_model_parallel_size < 2):
            raise ValueError(
                f"parallel.virtual_pipeline_model_parallel_size={vpp} needs a value >= 2 and "
                f"pipeline_model_parallel_size >= 2 (got {self.pipeline_model_parallel_size}); "
                f"set it to null for no interleaving"
            )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError(
                "parallel.sequence_parallel=true needs tensor_model_parallel_size > 1; "
                "set parallel.sequence_parallel=false"
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError(
                "parallel.overlap_param_gather=true needs parallel.use_distributed_optimizer=true"
            )

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one replica of the model."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size


@dataclasses.dataclass
class TrainingConfig:
    """Length, batch and numerics of training."""

    train_iters: int = 100
    """Optimizer steps."""

    global_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks and micro-batches."""

    micro_batch_size: int = 4
    """Sequences per forward pass on one rank."""

    precision: str = "fp32"
    """``bf16`` (bf16 parameters, fp32 master weights and gradient reduction: Megatron's
    mixed-precision optimizer, on GPUs and on CPU alike), ``fp8`` (bf16 as above, and the
    linear layers' GEMMs in FP8 through Transformer Engine: model.spec transformer_engine or
    auto, a GPU with FP8, every linear width and the tokens per micro-batch multiples of 16;
    the recipe is :data:`megatron_mhar.training.model.FP8_RECIPE`) or ``fp32``."""

    recompute_granularity: Optional[str] = None
    """Activation recomputation: ``full``, ``selective`` or ``None``."""

    recompute_method: Optional[str] = None
    """With ``full``: ``uniform`` or ``block``."""

    recompute_num_layers: Optional[int] = None
    """With ``full``: layers per recomputed chunk (uniform) or recomputed layers (block)."""

    cuda_graph: str = "none"
    """``full_iteration``: Megatron's full-iteration CUDA graph around the forward/backward
    of all micro-batches (one eager step, captured on the second, replayed after), which
    removes the host's launch cost (GPU, no pipeline parallelism); ``none``: eager."""

    skip_nonfinite_steps: int = 0
    """Steps whose loss or gradients are not finite (NaN, Inf) that are skipped, as Megatron
    skips the steps of an overflowing loss scale: no update, the step and its batch counted;
    one more stops the run (exit 2). 0: the first stops it, saving nothing after the step
    before it."""

    @property
    def bf16_params(self) -> bool:
        """Whether parameters (and activations) are bf16: ``bf16`` and ``fp8`` runs."""
        return self.precision in ("bf16", "fp8")

    def __post_init__(self):
        for name in ("train_iters", "global_batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"training.{name} must be >= 1, got {getattr(self, name)}")
        if self.skip_nonfinite_steps < 0:
            raise ValueError(f"training.skip_nonfinite_steps must be >= 0, got {self.skip_nonfinite_steps}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"training.global_batch_size={self.global_batch_size} is not a multiple of "
                f"training.micro_batch_size={self.micro_batch_size}"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"training.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.cuda_graph not in CUDA_GRAPH_MODES:
            raise ValueError(
                f"training.cuda_graph must be one of {list(CUDA_GRAPH_MODES)}, got {self.cuda_graph!r}"
            )
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(
                f"training.recompute_granularity must be full, selective or null, "
                f"got {self.recompute_granularity!r}"
            )
        if self.recompute_granularity == "full" and (
            self.recompute_method not in ("uniform", "block") or not self.recompute_num_layers
        ):
            raise ValueError(
                "training.recompute_granularity=full needs training.recompute_method "
                "(uniform or block) and training.recompute_num_layers >= 1"
            )


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW with warm-up and decay, as Megatron's optimizer and OptimizerParamScheduler run it."""

    lr: float = 5e-4
    """Peak learning rate."""

    min_lr: float = 5e-5
    """Learning rate at the end of the decay."""

    lr_warmup_iters: int = 10
    """Linear warm-up steps from 0 to ``lr``."""

    lr_decay_iters: Optional[int] = None
    """Steps of warm-up plus decay to ``min_lr``; not given: ``training.train_iters``, written
    into the configuration."""

    lr_decay_style: str = "cosine"
    """``cosine``, ``linear``, ``constant`` or ``inverse-square-root``."""

    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to biases and 1-D parameters)."""

    adam_beta1: float = 0.9
    """AdamW beta1."""

    adam_beta2: float = 0.95
    """AdamW beta2."""

    adam_eps: float = 1e-8
    """AdamW epsilon."""

    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""

    def __post_init__(self):
        if not self.lr > 0 or not 0 <= self.min_lr <= self.lr:
            raise ValueError(
                f"optimizer.lr must be positive and optimizer.min_lr in [0, lr], "
                f"got lr={self.lr}, min_lr={self.min_lr}"
            )
        if self.lr_warmup_iters < 0:
            raise ValueError(f"optimizer.lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        styles = ("cosine", "linear", "constant", "inverse-square-root")
        if self.lr_decay_style not in styles:
            raise ValueError(
                f"optimizer.lr_decay_style must be one of {styles}, got {self.lr_decay_style!r}"
            )
        if self.weight_decay < 0 or self.clip_grad < 0 or not self.adam_eps > 0:
            raise ValueError(
                "optimizer.weight_decay and optimizer.clip_grad must be >= 0 and "
                "optimizer.adam_eps > 0"
            )
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")


@dataclasses.dataclass
class EvalConfig:
    """Periodic validation on a fixed set of held-out batches (and a test after the last step)."""

    interval: int = 50
    """Evaluate every this many steps (and always after the last step); 0: only at the end.
    Test data (``data.test_paths`` or a test share of ``data.split``) is evaluated once,
    after the last step, on ``iters`` global batches too."""

    iters: int = 4
    """Global batches per evaluation; every evaluation reads the same batches."""

    tail: int = 3
    """The reported tail loss is the mean of the last this many evaluations."""

    def __post_init__(self):
        if self.interval < 0 or self.iters < 1 or self.tail < 1:
            raise ValueError(
                f"eval.interval must be >= 0 and eval.iters, eval.tail >= 1, got "
                f"interval={self.interval}, iters={self.iters}, tail={self.tail}"
            )


@dataclasses.dataclass
class DataConfig:
    """Token data (Megatron ``.bin/.idx`` prefixes) and the tokenizer that wrote it."""

    paths: List[str] = dataclasses.field(default_factory=list)
    """Dataset prefixes (``path/name`` for ``path/name.bin`` + ``.idx``); ``~`` and
    ``${VAR}`` are expanded, as in every path of the configuration, when it is built (an
    unset variable is an error at launch).
    Empty: the embedded corpus (the standard library's source)."""

    weights: Optional[List[float]] = None
    """Blend weights, one per path; ``None``: proportional to dataset size."""

    split: Optional[str] = None
    """Train, validation, test shares of the documents of ``paths`` (Megatron's ``--split``);
    not given: ``98,2,0``, written into the configuration (what ``--print-config`` shows is
    what runs); ``None`` with ``valid_paths``, where all of ``paths`` trains."""

    valid_paths: List[str] = dataclasses.field(default_factory=list)
    """Held-out validation prefixes (Megatron's ``--valid-data-path``), read by every
    evaluation; ``paths`` then trains whole. Empty: the validation share of ``split``."""

    valid_weights: Optional[List[float]] = None
    """Blend weights, one per ``valid_paths`` entry; ``None``: proportional to size."""

    test_paths: List[str] = dataclasses.field(default_factory=list)
    """Held-out test prefixes (Megatron's ``--test-data-path``), evaluated once after the
    last step; needs ``valid_paths``. Empty: the test share of ``split``, if any."""

    test_weights: Optional[List[float]] = None
    """Blend weights, one per ``test_paths`` entry; ``None``: proportional to size."""

    tokenizer: str = "builtin"
    """``builtin`` (byte-level BPE trained on the embedded corpus) or a local Hugging Face
    tokenizer directory holding ``tokenizer.json`` (e.g. Qwen3's)."""

    eod_token: Optional[str] = None
    """End-of-document token; ``None``: ``<|endoftext|>`` (builtin, Qwen) or the
    tokenizer's configured EOS token."""

    cache_dir: Optional[str] = None
    """Where the run's caches go: GPTDataset's sample indices, and the embedded corpus in
    ``{cache_dir}/embedded`` unless ``embedded_dir`` is set. ``None``: the indices beside
    each dataset, the embedded corpus in ``$XDG_CACHE_HOME/megatron_mhar/embedded``."""

    embedded_dir: Optional[str] = None
    """Where the embedded corpus, builtin tokenizer and their ``.bin/.idx`` are built (about
    7 MB); ``None``: see ``cache_dir`` (``~/.cache/megatron_mhar/embedded`` by default)."""

    embedded_vocab_size: int = 4096
    """Vocabulary of the builtin tokenizer."""

    embedded_max_bytes: Optional[int] = None
    """Use only this many bytes of the embedded corpus (tests); ``None``: all of it."""

    eod_mask_loss: bool = False
    """Do not train on predicting the token after an end-of-document token."""

    skip_batches: int = 0
    """Global batches to pass over where the run starts (from ``checkpoint.load`` or from
    scratch; a resume of its own checkpoints keeps their data position, which includes
    them): e.g. the batches a diverged run failed on."""

    def __post_init__(self):
        for prefix in ("", "valid_", "test_"):
            key = f"{prefix}paths"
            setattr(self, key, [expand_path(p) for p in getattr(self, key)])
        if self.tokenizer != "builtin":
            self.tokenizer = expand_path(self.tokenizer)
        for key in ("cache_dir", "embedded_dir"):
            if getattr(self, key) is not None:
                setattr(self, key, expand_path(getattr(self, key)))
        for prefix in ("", "valid_", "test_"):
            _check_blend_weights(getattr(self, f"{prefix}paths"), getattr(self, f"{prefix}weights"), prefix)
        if self.skip_batches < 0:
            raise ValueError(f"data.skip_batches must be >= 0, got {self.skip_batches}")
        if self.test_paths and not self.valid_paths:
            raise ValueError(
                "data.test_paths needs data.valid_paths (held-out sets replace data.split for "
                "validation and test together); give data.valid_paths too"
            )
        if self.valid_paths and self.split is not None:
            raise ValueError(
                f"data.split={self.split!r} carves validation data out of data.paths, but "
                f"data.valid_paths is set: set data.split=null to train on all of data.paths"
            )
        if self.split is None and not self.valid_paths:
            self.split = DEFAULT_SPLIT
        try:
            parts = [float(p) for p in self.train_split.replace("/", ",").split(",")]
        except ValueError:
            parts = []
        if len(parts) != 3 or min(parts) < 0 or parts[0] <= 0 or parts[1] <= 0:
            raise ValueError(
                f"data.split must be three comma-separated weights 'train,valid,test' with "
                f"positive train and valid parts, got {self.split!r}"
            )
        if self.embedded_vocab_size < 260:
            raise ValueError(
                f"data.embedded_vocab_size must be >= 260 (256 bytes + special tokens), "
                f"got {self.embedded_vocab_size}"
            )

    @property
    def embedded(self) -> bool:
        """Whether the run trains on the embedded corpus."""
        return not self.paths

    @property
    def heldout(self) -> bool:
        """Whether validation (and test) data come from their own paths, not from ``split``."""
        return bool(self.valid_paths)

    @property
    def train_split(self) -> str:
        """The ``split`` in force when held-out data is carved out of ``paths``."""
        return DEFAULT_SPLIT if self.split is None else self.split

    @property
    def has_test_data(self) -> bool:
        """Whether a test evaluation follows the last step (``test_paths`` or a test share)."""
        if self.heldout:
            return bool(self.test_paths)
        return float(self.train_split.replace("/", ",").split(",")[2]) > 0


def _check_blend_weights(paths: List[str], weights: Optional[List[float]], prefix: str) -> None:
    """One non-negative weight per path with a positive sum, or no weights."""
    if weights is None:
        return
    if len(weights) != len(paths):
        raise ValueError(
            f"data.{prefix}weights has {len(weights)} entries for {len(paths)} data.{prefix}paths; "
            f"give one weight per path or set data.{prefix}weights=null"
        )
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"data.{prefix}weights must be non-negative with a positive sum: {weights}")


@dataclasses.dataclass
class CheckpointConfig:
    """Megatron distributed checkpoints, written aside and published atomically."""

    dir: Optional[str] = None
    """Where checkpoints are saved and resumed from; ``None``: ``{run dir}/checkpoints``."""

    interval: int = 0
    """Save every this many steps; 0: only at the end and on SIGTERM/SIGUSR1."""

    save_at_end: bool = True
    """Save after the last step."""

    save_initial: bool = False
    """Also save before the first step of a run that starts from its own initialisation
    (not from a checkpoint): the starting weights, which other parallel layouts can load
    (``checkpoint.load``, ``load_model_only``) to train from exactly the same point (a
    layout's own initialisation draws differently). A step-0 checkpoint holds weights only;
    resuming from it starts the run afresh from them."""

    keep_last: int = 2
    """Checkpoints kept in ``dir``: older ones are deleted once a newer save is published and
    verified (the newest verified one never; one that fails verification is left for
    inspection); 0 keeps all."""

    verify: str = "full"
    """How a checkpoint is checked against its manifest before it is read or a save is taken
    as good: ``full`` (sizes and checksums of every file), ``size`` (the file set and
    sizes) or ``off``."""

    load: Optional[str] = None
    """Checkpoint to start from when ``dir`` holds none (a checkpoint directory or a
    directory with a ``latest`` file); resuming from ``dir`` always wins."""

    load_model_only: bool = False
    """From ``load``: take only the weights (start a new optimizer, schedule and data order)."""

    def __post_init__(self):
        for key in ("dir", "load"):
            if getattr(self, key) is not None:
                setattr(self, key, expand_path(getattr(self, key)))
        if self.interval < 0 or self.keep_last < 0:
            raise ValueError("checkpoint.interval and checkpoint.keep_last must be >= 0")
        if self.verify not in VERIFY_LEVELS:
            raise ValueError(f"checkpoint.verify must be one of {', '.join(VERIFY_LEVELS)}, got {self.verify!r}")


@dataclasses.dataclass
class LoggingConfig:
    """Console, ``metrics.jsonl`` and TensorBoard."""

    interval: int = 10
    """Log every this many steps (losses are averaged over the interval)."""

    tensorboard: bool = True
    """Write TensorBoard event files into ``{run dir}/tensorboard``."""

    routing_entropy: bool = True
    """Log per-site per-head routing entropy of MHAR models at every log step, and write
    the routing maps of the last step (``routing_maps.png`` / ``.json`` in the run
    directory, see :mod:`megatron_mhar.diagnostics.maps`)."""

    routing_interval: int = 0
    """Log the routing maps of MHAR models (mean weight of each site over each source, per
    head, and normalised entropy) to TensorBoard every this many steps; 0: never."""

    def __post_init__(self):
        if self.interval < 1:
            raise ValueError(f"logging.interval must be >= 1, got {self.interval}")
        if self.routing_interval < 0:
            raise ValueError(f"logging.routing_interval must be >= 0, got {self.routing_interval}")
