"""Layer specs for MHAR decoders, built from Megatron's own GPT layer specs."""

from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.models.attention import SDPACoreAttention
from megatron_mhar.models.gpt_config import GPTModelConfig
from megatron_mhar.models.layer import MHARTransformerLayer


def get_mhar_layer_local_spec(
    model: GPTModelConfig, mhar: MHARConfig, layer_norm: Optional[type] = None
) -> ModuleSpec:
    """Megatron's local (torch) GPT layer spec, with MHAR layers when routing is on.

    Args:
        model: architecture; ``attention_backend='sdpa'`` swaps in :class:`SDPACoreAttention`.
        mhar: ``variant='none'`` keeps Megatron's ``TransformerLayer``.
        layer_norm: optional norm class for every norm of the layer (e.g. one that accepts
            sequence parallelism without apex).
    """
    spec = get_gpt_layer_local_spec(
        qk_layernorm=model.qk_layernorm, normalization=model.normalization
    )
    attention = spec.submodules.self_attention.submodules
    if model.attention_backend == "sdpa":
        attention.core_attention = SDPACoreAttention
    if layer_norm is not None:
        spec.submodules.input_layernorm = layer_norm
        spec.submodules.pre_mlp_layernorm = layer_norm
        if model.qk_layernorm:
            attention.q_layernorm = layer_norm
            attention.k_layernorm = layer_norm
    return _with_mhar_layer(spec, mhar)


def get_mhar_layer_te_spec(model: GPTModelConfig, mhar: MHARConfig) -> ModuleSpec:
    """Megatron's Transformer Engine GPT layer spec, with MHAR layers when routing is on.

    The TE spec fuses the pre-norms into the following linear layers; the MHAR layer
    has no TE-specific logic, so TE users run exactly the layer code tested locally.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    try:
        import transformer_engine  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "model.spec='transformer_engine' needs Transformer Engine: pip install "
            "'megatron_mhar[te]', or use model.spec='local'"
        ) from err
    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm)
    return _with_mhar_layer(spec, mhar)


def get_mhar_layer_spec(
    model: GPTModelConfig, mhar: MHARConfig, layer_norm: Optional[type] = None
) -> ModuleSpec:
    """The layer spec ``model.spec`` names (``local`` or ``transformer_engine``)."""
    if model.spec == "transformer_engine":
        return get_mhar_layer_te_spec(model, mhar)
    return get_mhar_layer_local_spec(model, mhar, layer_norm)


def _with_mhar_layer(spec: ModuleSpec, mhar: MHARConfig) -> ModuleSpec:
    if mhar.enabled:
        spec.module = MHARTransformerLayer
    return spec
