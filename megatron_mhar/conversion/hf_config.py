"""Hugging Face ``config.json`` <-> :class:`GPTModelConfig` (and :class:`MHARConfig`), for
Llama and Qwen3 and their MHAR forms.

Reads the raw ``config.json`` dict (no ``transformers`` import), in both the
transformers 4.x spelling (``rope_theta`` + ``rope_scaling``) and the 5.x one
(``rope_parameters``). Anything the Megatron model would compute differently
(biases, sliding windows, other RoPE scalings, a non-SiLU MLP) raises a
``ValueError`` that names the field, instead of converting into a model that is
silently not the same function.

An MHAR export (``MHARLlamaForCausalLM`` / ``MHARQwen3ForCausalLM``, the models of
:mod:`megatron_mhar.hf`) is its family's config plus the ``mhar_*`` routing fields and an
``auto_map`` naming the modeling files copied beside it (``AutoConfig``, ``AutoModel`` for
the decoder, ``AutoModelForCausalLM``) and, as ``transformers_version``, the oldest
transformers those files run on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from megatron_mhar.conversion.hf_io import min_transformers_version
from megatron_mhar.models.gpt_config import GPTModelConfig
from megatron_mhar.models.mhar_config import MHARConfig, function_fields

# architecture class -> (model_type, per-head q/k RMSNorm, default head_dim or None for d/heads)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, None),
    "Qwen3ForCausalLM": ("qwen3", True, 128),
    "Qwen3MoeForCausalLM": ("qwen3_moe", True, 128),
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
"""Architectures whose MLPs are mixtures of experts (:func:`_moe_fields`)."""
_BY_MODEL_TYPE = {model_type: arch for arch, (model_type, _, _) in ARCHITECTURES.items()}

# MHAR architecture (megatron_mhar/hf/modeling_mhar.py) -> (model_type, config class, base architecture)
MHAR_ARCHITECTURES = {
    "MHARLlamaForCausalLM": ("mhar_llama", "MHARLlamaConfig", "LlamaForCausalLM"),
    "MHARQwen3ForCausalLM": ("mhar_qwen3", "MHARQwen3Config", "Qwen3ForCausalLM"),
    "MHARQwen3MoeForCausalLM": ("mhar_qwen3_moe", "MHARQwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
_MHAR_BY_BASE = {base: arch for arch, (_, _, base) in MHAR_ARCHITECTURES.items()}
_MHAR_BY_MODEL_TYPE = {model_type: arch for arch, (model_type, _, _) in MHAR_ARCHITECTURES.items()}
CONFIGURATION_FILE = "configuration_mhar.py"
MODELING_FILE = "modeling_mhar.py"

# MHARConfig field -> config.json field of an MHAR export (the fields defining the function).
MHAR_FIELDS = {name: f"mhar_{name}" for name in
               ("variant", "num_heads", "block_size", "delta_block_layers", "eps", "logit_scale")}

# Megatron's Llama-3.1 RoPE scaling hard-codes these (RotaryEmbedding._apply_scaling).
_MEGATRON_LLAMA3_SCALING = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def architecture(hf: Dict[str, Any]) -> str:
    """The supported architecture class of an HF config (the base class for an MHAR export),
    or a ``ValueError``."""
    archs = hf.get("architectures") or []
    if len(archs) > 1:
        raise ValueError(f"config.json lists several architectures {archs}; expected exactly one")
    arch = archs[0] if archs else (_BY_MODEL_TYPE.get(hf.get("model_type"))
                                   or _MHAR_BY_MODEL_TYPE.get(hf.get("model_type")))
    if arch in MHAR_ARCHITECTURES:
        expected_type, _, base = MHAR_ARCHITECTURES[arch]
        if hf.get("model_type", expected_type) != expected_type:
            raise ValueError(
                f"config.json: architectures={archs} but model_type={hf.get('model_type')!r}; "
                f"expected model_type={expected_type!r}"
            )
        return base
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch or hf.get('model_type')!r}: the converter handles "
            f"{', '.join(list(ARCHITECTURES) + list(MHAR_ARCHITECTURES))}"
        )
    expected_type = ARCHITECTURES[arch][0]
    if hf.get("model_type", expected_type) != expected_type:
        raise ValueError(
            f"config.json: architectures={archs} but model_type={hf.get('model_type')!r}; "
            f"expected model_type={expected_type!r}"
        )
    return arch


def _rope(hf: Dict[str, Any]):
    """(theta, llama3 scaling factor or None) from either transformers spelling."""
    params = hf.get("rope_parameters")
    if params is not None:
        theta = params.get("rope_theta", hf.get("rope_theta"))
        scaling = params
    else:
        theta = hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling") or {}
    if theta is None:
        raise ValueError("config.json has no rope_theta")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise ValueError(
            f"config.json: RoPE scaling {kind!r} is not supported (Megatron's RoPE implements "
            f"only 'llama3'); supported: default, llama3"
        )
    for key, megatron_value in _MEGATRON_LLAMA3_SCALING.items():
        if key in scaling and float(scaling[key]) != float(megatron_value):
            raise ValueError(
                f"config.json: llama3 RoPE scaling with {key}={scaling[key]}; Megatron's RoPE "
                f"hard-codes {key}={megatron_value}"
            )
    if "factor" not in scaling:
        raise ValueError("config.json: llama3 RoPE scaling without 'factor'")
    return float(theta), float(scaling["factor"])


def _refuse(hf: Dict[str, Any], key: str, ok, why: str) -> None:
    value = hf.get(key, ok)
    if value != ok:
        raise ValueError(f"config.json: {key}={value!r} is not supported ({why})")


def model_config_from_hf(
    hf: Dict[str, Any],
    seq_length: Optional[int] = None,
    make_vocab_size_divisible_by: int = 128,
    **overrides,
) -> GPTModelConfig:
    """The :class:`GPTModelConfig` computing the same function as an HF Llama/Qwen3 config.

    Args:
        hf: the parsed ``config.json``.
        seq_length: training sequence length; ``None`` takes ``max_position_embeddings``.
        make_vocab_size_divisible_by: Megatron pads the embedding to a multiple of this
            (times TP); the padded rows are zero and never predicted.
        overrides: other GPTModelConfig fields that do not change the weights
            (``attention_backend``, ``spec``, dropouts).
    """
    arch = architecture(hf)
    _, qk_norm, default_head_dim = ARCHITECTURES[arch]
    _refuse(hf, "hidden_act", "silu", "the Megatron model is a SwiGLU MLP")
    _refuse(hf, "attention_bias", False, "Megatron's add_qkv_bias has no output-projection bias")
    _refuse(hf, "mlp_bias", False, "MLP biases are not mapped")
    _refuse(hf, "use_sliding_window", False, "sliding-window attention is not supported")
    _refuse(hf, "pretraining_tp", 1, "set it to 1; it only changes how HF splits the matmuls")
    _refuse(hf, "partial_rotary_factor", 1.0, "partial RoPE is not mapped")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size", "rms_norm_eps"):
        if key not in hf:
            raise ValueError(f"config.json has no {key!r}")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or default_head_dim or hf["hidden_size"] // heads
    theta, scaling = _rope(hf)
    if theta != int(theta):
        raise ValueError(f"config.json: rope_theta={theta} is not an integer (Megatron takes an int)")
    fields = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"],
        # None when it is the default, as recipes write it (the driver compares fields)
        kv_channels=None if head_dim * heads == hf["hidden_size"] else head_dim,
        vocab_size=hf["vocab_size"],
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        seq_length=seq_length if seq_length is not None else hf.get("max_position_embeddings") or 4096,
        normalization="RMSNorm",
        norm_epsilon=float(hf["rms_norm_eps"]),
        swiglu=True,
        qk_layernorm=qk_norm,
        add_bias_linear=False,
        add_qkv_bias=False,
        rotary_base=theta,
        rotary_percent=1.0,
        rope_scaling=scaling is not None,
        rope_scaling_factor=scaling if scaling is not None else 8.0,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
    )
    if arch in MOE_ARCHITECTURES:
        fields.update(_moe_fields(hf))
    fields.update(overrides)
    return GPTModelConfig(**fields)


def _moe_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """The MoE fields of a Qwen3-MoE config: every MoE layer Megatron's ``MoELayer`` (top-k
    router, experts of ``moe_intermediate_size``), the others dense MLPs of
    ``intermediate_size`` (``mlp_only_layers``, ``decoder_sparse_step``)."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    for key, value in (("num_experts", experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                       ("moe_intermediate_size", hf.get("moe_intermediate_size"))):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"config.json: {key}={value!r}; a Qwen3-MoE model needs a positive integer")
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    pattern = [int(layer not in dense and (layer + 1) % step == 0) for layer in range(hf["num_hidden_layers"])]
    if not any(pattern):
        raise ValueError(
            f"config.json: mlp_only_layers={sorted(dense)} and decoder_sparse_step={step} leave no MoE "
            f"layer; convert it as a dense Qwen3 (architectures: Qwen3ForCausalLM)"
        )
    _refuse(hf, "shared_expert_intermediate_size", None, "Qwen3-MoE has no shared expert")
    return dict(
        num_moe_experts=experts,
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_layer_freq=1 if all(pattern) else pattern,
        # renormalised top-k (norm_topk_prob) is Megatron's softmax over the top-k logits
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
    )


def hf_config_from_model(model: GPTModelConfig, dtype: str = "float32") -> Dict[str, Any]:
    """A ``config.json`` for a checkpoint that has no source HF config (trained from scratch).

    Qwen3MoeForCausalLM for an MoE model, Qwen3ForCausalLM when the model has q/k norms,
    LlamaForCausalLM otherwise.
    """
    problems = []
    if model.normalization != "RMSNorm":
        problems.append("normalization must be RMSNorm")
    if not model.swiglu:
        problems.append("swiglu must be true")
    if model.add_bias_linear or model.add_qkv_bias:
        problems.append("add_bias_linear and add_qkv_bias must be false")
    if model.rotary_percent != 1.0:
        problems.append("rotary_percent must be 1.0")
    if model.is_moe and not model.qk_layernorm:
        problems.append("an MoE model needs qk_layernorm (Qwen3-MoE's q/k norms)")
    if model.moe_shared_expert_intermediate_size is not None:
        problems.append("moe_shared_expert_intermediate_size must be null (Qwen3-MoE has no shared expert)")
    if problems:
        raise ValueError(f"model config has no Llama/Qwen3 equivalent: {'; '.join(problems)}")
    arch = "Qwen3MoeForCausalLM" if model.is_moe else "Qwen3ForCausalLM" if model.qk_layernorm else "LlamaForCausalLM"
    heads = model.num_attention_heads
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": float(model.rotary_base)}
    if model.rope_scaling:
        rope = {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                **_MEGATRON_LLAMA3_SCALING, "rope_theta": float(model.rotary_base)}
    config = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch][0],
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": model.num_query_groups or heads,
        "head_dim": model.kv_channels or model.hidden_size // heads,
        "intermediate_size": model.ffn_hidden_size or 4 * model.hidden_size,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.seq_length,
        "rms_norm_eps": model.norm_epsilon,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": model.attention_dropout,
        "tie_word_embeddings": model.tie_embeddings,
        "initializer_range": model.init_method_std,
        "rope_theta": float(model.rotary_base),
        "rope_scaling": None if rope["rope_type"] == "default" else
        {k: v for k, v in rope.items() if k != "rope_theta"},
        "rope_parameters": rope,
        "torch_dtype": dtype,
        "dtype": dtype,
        # Unknown without the tokenizer (not the Llama class defaults 1 and 2); the export
        # sets eos_token_id from the tokenizer it is given.
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if arch == "LlamaForCausalLM":
        config["mlp_bias"] = False
    if model.is_moe:
        pattern = model.moe_layer_pattern()
        config.update(
            num_experts=model.num_moe_experts,
            num_experts_per_tok=model.moe_router_topk,
            moe_intermediate_size=model.moe_ffn_hidden_size or config["intermediate_size"],
            norm_topk_prob=not model.moe_router_pre_softmax,
            decoder_sparse_step=1,
            mlp_only_layers=[layer for layer, moe in enumerate(pattern) if not moe],
            router_aux_loss_coef=model.moe_aux_loss_coeff,
        )
    return config


def is_mhar_export(hf: Dict[str, Any]) -> bool:
    """Whether a config.json is an MHAR export's (the routing is in its own tensors)."""
    archs = hf.get("architectures") or []
    return bool(set(archs) & set(MHAR_ARCHITECTURES)) or hf.get("model_type") in _MHAR_BY_MODEL_TYPE


def mhar_config_from_hf(hf: Dict[str, Any]) -> MHARConfig:
    """The :class:`MHARConfig` of an MHAR export's config.json (``ValueError`` naming a bad field)."""
    fields = {}
    for name, key in MHAR_FIELDS.items():
        if key not in hf and key != "mhar_eps":
            raise ValueError(f"config.json of an MHAR export has no {key!r}")
        fields[name] = hf.get(key)
    if fields["variant"] not in ("full", "block", "delta"):
        raise ValueError(
            f"config.json: mhar_variant={fields['variant']!r}; an MHAR export is full, block or delta "
            f"(a model without routing is exported as a plain Llama / Qwen3)"
        )
    try:
        mhar = MHARConfig(**fields)
    except ValueError as err:  # its fields are named mhar.<field>; the export spells them mhar_<field>
        raise ValueError(f"config.json: {err}".replace("mhar.", "mhar_")) from None
    try:
        mhar.validate_for_model(hf["hidden_size"], hf["num_hidden_layers"])
    except ValueError as err:
        raise ValueError(f"config.json: {err}".replace("mhar.", "mhar_")) from None
    return mhar


def plain_hf_config(config: Dict[str, Any]) -> Dict[str, Any]:
    """A config.json in its plain Llama / Qwen3 form (an MHAR export's without its routing)."""
    if not is_mhar_export(config):
        return config
    base = architecture(config)
    out = {k: v for k, v in config.items() if k != "auto_map" and k not in MHAR_FIELDS.values()}
    out.update(architectures=[base], model_type=ARCHITECTURES[base][0])
    return out


def mhar_hf_config(config: Dict[str, Any], mhar: MHARConfig) -> Dict[str, Any]:
    """The config.json of an MHAR export: a Llama / Qwen3 ``config`` turned into its MHAR form."""
    base = architecture(config)
    arch = _MHAR_BY_BASE[base]
    model_type, config_class, _ = MHAR_ARCHITECTURES[arch]
    fields = function_fields(dataclasses.asdict(mhar))
    # The MHAR models need transformers 5, which reads RoPE from rope_parameters alone.
    legacy = ("rope_theta", "rope_scaling") if "rope_parameters" in config else ()
    out = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "auto_map", *legacy)}
    out.update({MHAR_FIELDS[name]: value for name, value in fields.items()})
    out.update(
        architectures=[arch],
        model_type=model_type,
        auto_map={
            "AutoConfig": f"{CONFIGURATION_FILE[:-3]}.{config_class}",
            "AutoModel": f"{MODELING_FILE[:-3]}.{arch.removesuffix('ForCausalLM')}Model",
            "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.{arch}",
        },
        # the oldest transformers the shipped modeling code runs on (it checks on import)
        transformers_version=min_transformers_version(),
    )
    return dict(sorted(out.items()))


def _function_fields(model: GPTModelConfig) -> Dict[str, Any]:
    """The fields that define the weights and the function they compute, defaults resolved.

    The rest (seq_length, spec, attention_backend, dropout, init, vocab padding) may
    differ between a checkpoint and the config that exports or loads it.
    """
    heads = model.num_attention_heads
    return dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=heads,
        num_query_groups=model.num_query_groups or heads,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        kv_channels=model.kv_channels or model.hidden_size // heads,
        vocab_size=model.vocab_size,
        normalization=model.normalization,
        norm_epsilon=model.norm_epsilon,
        swiglu=model.swiglu,
        qk_layernorm=model.qk_layernorm,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        rotary_base=model.rotary_base,
        rotary_percent=model.rotary_percent,
        rope_scaling_factor=model.rope_scaling_factor if model.rope_scaling else None,
        tie_embeddings=model.tie_embeddings,
        num_moe_experts=model.num_moe_experts,
        moe_router_topk=model.moe_router_topk if model.is_moe else None,
        moe_ffn_hidden_size=(model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size)
        if model.is_moe else None,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_layer_pattern=model.moe_layer_pattern(),
        moe_router_pre_softmax=model.moe_router_pre_softmax if model.is_moe else None,
    )


def check_same_function(a: GPTModelConfig, b: GPTModelConfig, what: str) -> None:
    """Raise unless two model configs describe the same weights and the same function."""
    fa, fb = _function_fields(a), _function_fields(b)
    diffs = [f"{name}: {fa[name]!r} vs {fb[name]!r}" for name in fa if fa[name] != fb[name]]
    if diffs:
        raise ValueError(f"{what} differ in: " + "; ".join(diffs))
