"""Run configuration schema: the whole configuration and its typed loading.

:class:`TrainConfig` holds one dataclass per top-level section of a recipe (``run``,
``model``, ``mhar``, ``parallel``, ``training``, ``optimizer``, ``eval``, ``data``,
``checkpoint``, ``logging``; all but ``model`` and ``mhar`` are in
:mod:`megatron_mhar.training.sections`). Every section's ``__post_init__`` checks its own
values and :class:`TrainConfig` checks the values that depend on several sections.
:func:`from_dict` builds the dataclasses from a nested dict, strictly: an unknown key
names the closest valid key, a value of the wrong type names the expected type.

Reading YAML recipes and overrides is :mod:`megatron_mhar.training.recipes`; checks that
need the launch (world size, files on disk) are :mod:`megatron_mhar.training.launch_checks`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Dict, List, Tuple

from megatron_mhar.models.gpt_config import GPTModelConfig
from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.training.moe import check_moe_layout
from megatron_mhar.training.sections import (  # noqa: F401  (the sections, under their schema names)
    CUDA_GRAPH_MODES,
    DEFAULT_SPLIT,
    PRECISIONS,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    expand_path,
)


@dataclasses.dataclass
class TrainConfig:
    """Everything one training run needs; a recipe file is this, written in YAML."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    """Name, output directory, seed, device."""

    model: GPTModelConfig = dataclasses.field(default_factory=GPTModelConfig)
    """Architecture (megatron_mhar.models.gpt_config.GPTModelConfig)."""

    mhar: MHARConfig = dataclasses.field(default_factory=MHARConfig)
    """Depth routing (megatron_mhar.models.mhar_config.MHARConfig); ``variant: none`` is the baseline."""

    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Tensor / pipeline / data parallel layout."""

    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    """Steps, batch sizes, precision, recomputation."""

    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    """AdamW and the learning-rate schedule."""

    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Validation."""

    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Datasets and tokenizer."""

    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Saving and resuming."""

    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    """Metrics output."""

    def __post_init__(self):
        model, par = self.model, self.parallel
        self.mhar.validate_for_model(model.hidden_size, model.num_layers)
        tp = par.tensor_model_parallel_size
        groups = model.num_query_groups or model.num_attention_heads
        if model.num_attention_heads % tp or groups % tp:
            raise ValueError(
                f"parallel.tensor_model_parallel_size={tp} must divide model.num_attention_heads="
                f"{model.num_attention_heads} and the KV heads ({groups})"
            )
        check_moe_layout(model, par)
        chunks = par.pipeline_model_parallel_size * (par.virtual_pipeline_model_parallel_size or 1)
        if model.num_layers % chunks:
            raise ValueError(
                f"model.num_layers={model.num_layers} must be a multiple of the pipeline chunks "
                f"(pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {chunks})"
            )
        if self.training.cuda_graph != "none":
            self._check_cuda_graph()
        if self.training.precision == "fp8":
            self._check_fp8()
        warmup, decay = self.optimizer.lr_warmup_iters, self.lr_decay_iters
        if warmup >= decay:
            source = "optimizer.lr_decay_iters" if self.optimizer.lr_decay_iters else "training.train_iters"
            raise ValueError(
                f"optimizer.lr_warmup_iters={warmup} must be shorter than the decay "
                f"({source}={decay}); shorten the warm-up or lengthen the decay"
            )
        self.optimizer.lr_decay_iters = decay  # the default written out: the configuration is what runs

    def _check_cuda_graph(self) -> None:
        """What the captured schedule does not cover, each with its fix."""
        par, tr = self.parallel, self.training
        fix = "or set training.cuda_graph=none"
        if par.pipeline_model_parallel_size > 1:
            raise ValueError(
                f"training.cuda_graph={tr.cuda_graph} is not supported with pipeline parallelism "
                f"(pipeline_model_parallel_size={par.pipeline_model_parallel_size}); set "
                f"parallel.pipeline_model_parallel_size=1 {fix}"
            )
        if tr.recompute_granularity is not None:
            raise ValueError(
                f"training.cuda_graph={tr.cuda_graph} is not supported with activation "
                f"recomputation; set training.recompute_granularity=null {fix}"
            )
        if par.overlap_grad_reduce or par.overlap_param_gather:
            raise ValueError(
                f"training.cuda_graph={tr.cuda_graph} is not supported with overlapped gradient "
                f"reduction or parameter gathering; set parallel.overlap_grad_reduce=false and "
                f"parallel.overlap_param_gather=false {fix}"
            )
        if self.mhar.enabled and (self.logging.routing_entropy or self.logging.routing_interval):
            raise ValueError(
                f"training.cuda_graph={tr.cuda_graph}: the routing diagnostics are recorded by "
                f"Python on the steps they log, which a replayed graph does not run; set "
                f"logging.routing_entropy=false and logging.routing_interval=0 {fix}"
            )

    def _check_fp8(self) -> None:
        """FP8 GEMMs take operands whose dimensions are multiples of 16 (Transformer Engine
        asserts it inside the first step), and MHAR decoders do not recompute in FP8."""
        model, par, tr = self.model, self.parallel, self.training
        tp = par.tensor_model_parallel_size
        head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
        groups = model.num_query_groups or model.num_attention_heads
        tokens = tr.micro_batch_size * model.seq_length // (tp if par.sequence_parallel else 1)
        dims = [
            ("model.hidden_size", model.hidden_size),
            ("the MLP width per tensor-parallel rank (ffn_hidden_size / TP)",
             (model.ffn_hidden_size or 4 * model.hidden_size) // tp),
            ("the query width per tensor-parallel rank (num_attention_heads x head width / TP)",
             model.num_attention_heads * head_dim // tp),
            ("the QKV width per tensor-parallel rank ((num_attention_heads + 2 x num_query_groups) "
             "x head width / TP)", (model.num_attention_heads + 2 * groups) * head_dim // tp),
            ("the tokens per micro-batch and rank (micro_batch_size x seq_length"
             + (" / TP with sequence parallelism)" if par.sequence_parallel else ")"), tokens),
        ]
        for what, value in dims:
            if value % 16:
                raise ValueError(
                    f"training.precision=fp8: Transformer Engine's FP8 GEMMs need every linear "
                    f"layer's widths and the tokens per micro-batch to be multiples of 16, and "
                    f"{what} is {value}; change the model or batch shape, or use "
                    f"training.precision=bf16"
                )
        if self.mhar.enabled and tr.recompute_granularity == "full":
            raise ValueError(
                "training.precision=fp8 with training.recompute_granularity=full is not supported "
                "by MHAR decoders (their recomputed chunks do not go through Transformer Engine's "
                "FP8-aware checkpoint); use training.recompute_granularity=selective or null"
            )

    @property
    def lr_decay_iters(self) -> int:
        """Steps of warm-up plus decay."""
        return self.optimizer.lr_decay_iters or self.training.train_iters

    @property
    def checkpoint_dir(self) -> Path:
        """Where this run saves checkpoints."""
        if self.checkpoint.dir is not None:
            return Path(self.checkpoint.dir)
        return self.run.dir / "checkpoints"

    def to_dict(self) -> Dict[str, Any]:
        """Plain nested dict (YAML/JSON-serialisable) that :func:`from_dict` reads back."""
        return dataclasses.asdict(self)



# --------------------------------------------------------------------------------------
# Typed loading: nested dict -> dataclasses, strict keys and types
# --------------------------------------------------------------------------------------


def _field_types(cls) -> Dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _all_paths(cls, prefix: str = "") -> List[str]:
    paths = []
    for name, hint in _field_types(cls).items():
        path = f"{prefix}{name}"
        paths.append(path)
        if dataclasses.is_dataclass(hint):
            paths.extend(_all_paths(hint, path + "."))
    return paths


def _unknown_key(path: str) -> ValueError:
    """Error for an unknown dotted key, naming the closest valid key."""
    valid = _all_paths(TrainConfig)
    leaves = [p for p in valid if "." in p]
    section, _, leaf = path.rpartition(".")
    close: List[str] = []
    if section in valid:  # a typo inside a known section
        siblings = [p for p in leaves if p.rpartition(".")[0] == section]
        close = difflib.get_close_matches(path, siblings, n=1, cutoff=0.75)
    if not close and leaf:  # the right leaf in the wrong section: training.lr -> optimizer.lr
        by_leaf = {p.rpartition(".")[2]: p for p in leaves}
        names = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.8)
        close = [by_leaf[names[0]]] if names else []
    if not close:
        close = difflib.get_close_matches(path, leaves if section else valid, n=1, cutoff=0.6)
    if close:
        return ValueError(f"unknown config key {path!r}; did you mean {close[0]!r}?")
    options = [p for p in leaves if p.rpartition(".")[0] == section] if section in valid else [
        p for p in valid if "." not in p
    ]
    return ValueError(f"unknown config key {path!r}; valid keys here: {', '.join(options)}")



def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _coerce(value: Any, hint: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``hint``; convert only where lossless."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ValueError as err:
                errors.append(err)
        raise errors[0]
    if origin in (list, List, tuple, Tuple, typing.Sequence):
        if not isinstance(value, (list, tuple)):
            raise ValueError(
                f"{path}: expected a list, got {type(value).__name__} {value!r}; write a list as "
                f"[a, b] in YAML, {path}=[a,b] on the command line (one item: {path}=a)"
            )
        (arg, *_) = typing.get_args(hint) or (Any,)
        items = [_coerce(v, arg, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin in (tuple, Tuple) else items
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping of {hint.__name__} fields, got {value!r}")
        return _build(hint, value, path + ".")
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ValueError(f"{path}: expected a finite float, got {value}")
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 5e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
            else:
                if math.isfinite(number):
                    return number
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"{path}: unsupported annotation {hint!r}")
    raise ValueError(
        f"{path}: expected {_type_name(hint)}, got {type(value).__name__} {value!r}"
    )


def _build(cls, raw: Dict[str, Any], prefix: str):
    types_ = _field_types(cls)
    for key in raw:
        if key not in types_:
            raise _unknown_key(f"{prefix}{key}")
    kwargs = {key: _coerce(value, types_[key], f"{prefix}{key}") for key, value in raw.items()}
    return cls(**kwargs)



def field_hint(path: str):
    """The annotation of a dotted key, or an unknown-key error."""
    cls, hint = TrainConfig, None
    for part in path.split("."):
        if cls is None or part not in _field_types(cls):
            raise _unknown_key(path)
        hint = _field_types(cls)[part]
        cls = hint if dataclasses.is_dataclass(hint) else None
    return hint




def from_dict(raw: Dict[str, Any], source: str = "config") -> TrainConfig:
    """Typed, validated :class:`TrainConfig` from a nested dict."""
    try:
        return _build(TrainConfig, raw, "")
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None

