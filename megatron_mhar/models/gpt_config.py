"""Architecture of the GPT model, mapped one-to-one onto Megatron's TransformerConfig."""

import dataclasses
import math
from typing import Optional

import torch

NORMS = ("RMSNorm", "LayerNorm")
SPECS = ("local", "transformer_engine", "auto")
ATTENTION_BACKENDS = ("sdpa", "megatron")


@dataclasses.dataclass
class GPTModelConfig:
    """A Qwen3/Llama-style decoder (the paper's configurations); defaults are a tiny CPU model."""

    num_layers: int = 2
    """Decoder layers L (the model has 2L sublayers)."""

    hidden_size: int = 64
    """Model width d."""

    num_attention_heads: int = 4
    """Query heads."""

    num_query_groups: Optional[int] = None
    """KV heads for GQA; ``None`` means as many as query heads."""

    ffn_hidden_size: Optional[int] = None
    """MLP width; ``None`` means 4 * hidden_size."""

    kv_channels: Optional[int] = None
    """Per-head width of attention; ``None`` means hidden_size / num_attention_heads."""

    vocab_size: int = 256
    """Vocabulary size before padding (the tokenizer's)."""

    make_vocab_size_divisible_by: int = 128
    """Pad the embedding table to a multiple of this times the TP size."""

    seq_length: int = 64
    """Maximum sequence length (RoPE positions)."""

    normalization: str = "RMSNorm"
    """``RMSNorm`` or ``LayerNorm``."""

    norm_epsilon: float = 1e-6
    """Epsilon of every norm (and of the routing keys unless mhar.eps is set)."""

    swiglu: bool = True
    """Gated SiLU MLP (Llama/Qwen); False gives a GELU MLP."""

    qk_layernorm: bool = False
    """Per-head RMSNorm of queries and keys (Qwen3)."""

    add_bias_linear: bool = False
    """Biases in linear layers."""

    add_qkv_bias: bool = False
    """Bias in the QKV projection only (Qwen2)."""

    rotary_base: float = 10000.0
    """RoPE theta."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates."""

    rope_scaling: bool = False
    """Llama-3.1 RoPE frequency scaling."""

    rope_scaling_factor: float = 8.0
    """Llama-3.1 RoPE scaling factor (used when rope_scaling is true)."""

    tie_embeddings: bool = True
    """Share the input embedding and the output layer."""

    init_method_std: float = 0.02
    """Std of the normal init of every weight matrix."""

    hidden_dropout: float = 0.0
    """Dropout on sublayer outputs."""

    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""

    spec: str = "local"
    """``local`` (Megatron's torch layers), ``transformer_engine`` (Megatron's TE layers; needs
    the te extra and a GPU) or ``auto`` (TE where ``transformer_engine.pytorch`` imports and
    the model runs on a GPU, else local: ``megatron_mhar.models.specs.resolve_spec``)."""

    attention_backend: str = "sdpa"
    """Core attention of the local spec: ``sdpa`` (torch SDPA, flash on GPU) or ``megatron``."""

    fused_kernels: bool = True
    """With the Transformer Engine spec, build with the fused kernels Megatron-LM trains with
    (``models.builder.fused_kernel_fields``); false leaves them out, to measure what they
    bring (``benchmarks/bench_training.py --no-fusions``). How the model runs, not what it
    computes: a checkpoint loads under either value."""

    def __post_init__(self):
        positive = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                    "make_vocab_size_divisible_by", "seq_length")
        for name in positive:
            _require_int(name, getattr(self, name), "must be positive")
        for name in ("num_query_groups", "ffn_hidden_size", "kv_channels"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), "must be positive, or null to derive it (None in Python)")
        _require_number("norm_epsilon", self.norm_epsilon, lambda v: v > 0, "must be positive")
        _require_number("rotary_base", self.rotary_base, lambda v: v > 1,
                        "(RoPE theta) must be greater than 1, e.g. 10000 or 500000")
        _require_number("rotary_percent", self.rotary_percent, lambda v: 0 < v <= 1,
                        "must lie in (0, 1]")
        if self.rope_scaling:
            _require_number("rope_scaling_factor", self.rope_scaling_factor, lambda v: v > 0,
                            "must be positive when rope_scaling is on")
        for name in ("hidden_dropout", "attention_dropout"):
            _require_number(name, getattr(self, name), lambda v: 0 <= v < 1, "must lie in [0, 1)")
        _require_number("init_method_std", self.init_method_std, lambda v: v >= 0, "must be non-negative")
        if self.normalization not in NORMS:
            raise ValueError(f"model.normalization must be one of {NORMS}, got {self.normalization!r}")
        if self.spec not in SPECS:
            raise ValueError(f"model.spec must be one of {SPECS}, got {self.spec!r}")
        if not isinstance(self.fused_kernels, bool):
            raise ValueError(f"model.fused_kernels must be true or false, got {self.fused_kernels!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"model.attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.num_attention_heads={self.num_attention_heads} does not divide "
                f"hidden_size={self.hidden_size}; set model.kv_channels or change the head count"
            )
        groups = self.num_query_groups or self.num_attention_heads
        if self.num_attention_heads % groups:
            raise ValueError(
                f"model.num_query_groups={groups} must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        head_dim = self.kv_channels or self.hidden_size // self.num_attention_heads
        rotary_dim = int(head_dim * self.rotary_percent)  # as Megatron's RotaryEmbedding
        if rotary_dim % 2:
            raise ValueError(
                f"RoPE rotates {rotary_dim} channels per head (head width {head_dim} x "
                f"model.rotary_percent={self.rotary_percent}), an odd number; RoPE rotates pairs. "
                f"Change model.kv_channels (or hidden_size / num_attention_heads) or rotary_percent"
            )

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        """Vocab size padded as Megatron pads it, so every TP rank holds an equal slice."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    def transformer_config_kwargs(self) -> dict:
        """The TransformerConfig fields this architecture sets (parallel sizes excluded)."""
        kwargs = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size or 4 * self.hidden_size,
            kv_channels=self.kv_channels,
            normalization=self.normalization,
            layernorm_epsilon=self.norm_epsilon,
            gated_linear_unit=self.swiglu,
            activation_func=torch.nn.functional.silu if self.swiglu else torch.nn.functional.gelu,
            qk_layernorm=self.qk_layernorm,
            add_bias_linear=self.add_bias_linear,
            add_qkv_bias=self.add_qkv_bias,
            init_method_std=self.init_method_std,
            hidden_dropout=self.hidden_dropout,
            attention_dropout=self.attention_dropout,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
        )
        return kwargs


def _require_int(field: str, value, rule: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"model.{field} must be an integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"model.{field} {rule}, got {value!r}")


def _require_number(field: str, value, ok, rule: str) -> None:
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or not ok(value)):
        raise ValueError(f"model.{field} {rule}, got {value!r}")
