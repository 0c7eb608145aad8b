"""Architecture of the GPT model, mapped one-to-one onto Megatron's TransformerConfig."""

import dataclasses
import math
from typing import List, Optional, Union

import torch

NORMS = ("RMSNorm", "LayerNorm")
SPECS = ("local", "transformer_engine", "auto")
ATTENTION_BACKENDS = ("sdpa", "megatron")
MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
MOE_DISPATCHERS = ("allgather", "alltoall")
MOE_ROUTER_DTYPES = ("fp32", "fp64")


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

    num_moe_experts: Optional[int] = None
    """Routed experts of each MoE layer (Megatron-Core's ``MoELayer``: router, token
    dispatcher, experts); ``None``: every MLP is dense."""

    moe_router_topk: int = 2
    """Experts each token is routed to."""

    moe_ffn_hidden_size: Optional[int] = None
    """Width of each routed expert's MLP; ``None`` means ffn_hidden_size."""

    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared expert every token also passes through (Qwen2-MoE, DeepSeek);
    ``None``: no shared expert."""

    moe_layer_freq: Union[int, List[int]] = 1
    """Which decoder layers have an MoE MLP: every N-th layer from the first (an int; 1 is
    all), or a list of num_layers flags, 1 for MoE and 0 for dense (Megatron's)."""

    moe_router_pre_softmax: bool = False
    """Softmax over all experts, then the top-k (weights not renormalised); False: softmax
    over the top-k logits, which is Qwen3-MoE's renormalised top-k (``norm_topk_prob``)."""

    moe_router_dtype: Optional[str] = None
    """``fp32`` or ``fp64``: the router's logits and softmax in that precision (Megatron-LM
    trains bf16 MoE with fp32); ``None``: the activations' dtype."""

    moe_router_load_balancing_type: str = "aux_loss"
    """Megatron's load-balancing loss: ``aux_loss`` (per micro-batch), ``seq_aux_loss`` (per
    sequence), ``global_aux_loss`` (over the global batch) or ``none``."""

    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (Qwen3-MoE: 0.001); 0 adds none."""

    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss (1e-3 is Megatron's suggested start); ``None`` adds none."""

    moe_token_dispatcher_type: str = "allgather"
    """How tokens reach their experts' ranks: ``allgather`` or ``alltoall`` (Megatron-LM's
    choice with expert parallelism on GPUs; on CPU only ``allgather`` runs)."""

    mtp_num_layers: Optional[int] = None
    """Multi-token prediction depths (Megatron-Core's MTP block, DeepSeek-V3): depth k predicts
    the token k + 1 positions further from depth k - 1's output and the next token's
    embedding, on the last pipeline stage (``megatron_mhar.models.mtp``); ``None``: none."""

    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP losses (their mean over depths) beside the language-model loss
    (Megatron's default); used with mtp_num_layers."""

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
        self._check_moe()
        if self.mtp_num_layers is not None:
            _require_int("mtp_num_layers", self.mtp_num_layers, "must be positive, or null for no MTP")
        elif self.mtp_loss_scaling_factor != 0.1:
            raise ValueError(
                "model.mtp_loss_scaling_factor is set but model.mtp_num_layers is null (no MTP); set "
                "model.mtp_num_layers or remove model.mtp_loss_scaling_factor"
            )
        _require_number("mtp_loss_scaling_factor", self.mtp_loss_scaling_factor, lambda v: v >= 0,
                        "must be non-negative")

    @property
    def is_moe(self) -> bool:
        """Whether any decoder layer has an MoE MLP."""
        return self.num_moe_experts is not None

    def moe_layer_pattern(self) -> List[bool]:
        """For each decoder layer (0-based, global), whether its MLP is an MoE layer."""
        if not self.is_moe:
            return [False] * self.num_layers
        if isinstance(self.moe_layer_freq, int):
            return [layer % self.moe_layer_freq == 0 for layer in range(self.num_layers)]
        return [bool(flag) for flag in self.moe_layer_freq]

    def _check_moe(self) -> None:
        """The MoE fields: valid values, and none set on a dense model (where they would do nothing)."""
        if not self.is_moe:
            defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name.startswith("moe_")}
            set_ = [name for name, default in defaults.items() if getattr(self, name) != default]
            if set_:
                raise ValueError(
                    f"model.{set_[0]} is set but model.num_moe_experts is null (a dense model); set "
                    f"model.num_moe_experts or remove model.{set_[0]}"
                )
            return
        _require_int("num_moe_experts", self.num_moe_experts, "must be positive, or null for dense MLPs")
        _require_int("moe_router_topk", self.moe_router_topk, "must be positive")
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_moe_experts="
                f"{self.num_moe_experts}; route each token to at most that many experts"
            )
        if self.moe_router_topk == 1 and not self.moe_router_pre_softmax:
            raise ValueError(
                "model.moe_router_topk=1 needs model.moe_router_pre_softmax=true (a softmax over one "
                "top-k logit is 1 and passes no gradient to the router)"
            )
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), "must be positive, or null")
        freq = self.moe_layer_freq
        if isinstance(freq, int) and not isinstance(freq, bool):
            _require_int("moe_layer_freq", freq, "must be a positive integer or a list of 0/1 flags")
        elif (not isinstance(freq, list) or len(freq) != self.num_layers
              or any(flag not in (0, 1) or isinstance(flag, bool) for flag in freq) or not any(freq)):
            raise ValueError(
                f"model.moe_layer_freq must be a positive integer or a list of num_layers={self.num_layers} "
                f"flags (1: MoE, 0: dense) with at least one 1, got {freq!r}"
            )
        _require_choice("moe_router_load_balancing_type", self.moe_router_load_balancing_type, MOE_LOAD_BALANCING)
        _require_choice("moe_token_dispatcher_type", self.moe_token_dispatcher_type, MOE_DISPATCHERS)
        if self.moe_router_dtype is not None:
            _require_choice("moe_router_dtype", self.moe_router_dtype, MOE_ROUTER_DTYPES)
        _require_number("moe_aux_loss_coeff", self.moe_aux_loss_coeff, lambda v: v >= 0, "must be non-negative")
        if self.moe_aux_loss_coeff > 0 and self.moe_router_load_balancing_type == "none":
            raise ValueError(
                f"model.moe_aux_loss_coeff={self.moe_aux_loss_coeff} with moe_router_load_balancing_type="
                f"none adds no loss; set a load-balancing type (aux_loss) or the coefficient to 0"
            )
        if self.moe_z_loss_coeff is not None:
            _require_number("moe_z_loss_coeff", self.moe_z_loss_coeff, lambda v: v >= 0,
                            "must be non-negative, or null for no z-loss")

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
        if self.mtp_num_layers is not None:
            kwargs.update(mtp_num_layers=self.mtp_num_layers, mtp_loss_scaling_factor=self.mtp_loss_scaling_factor)
        if self.is_moe:
            kwargs.update(
                num_moe_experts=self.num_moe_experts,
                moe_router_topk=self.moe_router_topk,
                moe_ffn_hidden_size=self.moe_ffn_hidden_size or kwargs["ffn_hidden_size"],
                moe_shared_expert_intermediate_size=self.moe_shared_expert_intermediate_size,
                moe_layer_freq=self.moe_layer_freq,
                moe_router_pre_softmax=self.moe_router_pre_softmax,
                moe_router_dtype=self.moe_router_dtype,
                moe_router_load_balancing_type=self.moe_router_load_balancing_type,
                moe_aux_loss_coeff=self.moe_aux_loss_coeff,
                moe_z_loss_coeff=self.moe_z_loss_coeff,
                moe_token_dispatcher_type=self.moe_token_dispatcher_type,
            )
        return kwargs


def _require_int(field: str, value, rule: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"model.{field} must be an integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"model.{field} {rule}, got {value!r}")


def _require_choice(field: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"model.{field} must be one of {choices}, got {value!r}")


def _require_number(field: str, value, ok, rule: str) -> None:
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or not ok(value)):
        raise ValueError(f"model.{field} {rule}, got {value!r}")
