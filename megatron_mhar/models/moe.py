"""Mixture-of-experts decoders: Megatron-Core's own MoE layer in the MHAR layer spec.

Depth routing is indifferent to what a sublayer computes: an MoE MLP (Megatron's
``MoELayer``: ``TopKRouter``, a token dispatcher, the experts and an optional shared
expert) returns one vector per token like a dense MLP, so the MHAR layer, the source
history and the pipeline shapes are those of a dense model. What MoE changes is the
layer spec (Megatron's own MoE spec, per layer as ``model.moe_layer_freq`` says), the
parallel layout (expert parallelism through Megatron's process groups) and the losses:
Megatron's load-balancing and z-losses attach their gradients inside the router
(``MoEAuxLossAutoScaler``) and are scaled by Megatron's schedules, so they count once per
step as in Megatron; the routing over depth adds none.

* :func:`moe_layer_pattern`: which decoder layers of a pipeline chunk are MoE layers;
* :func:`store_pre_mlp_norm_unfused`: the local MoE spec's pre-MLP norm under its own
  distributed-checkpoint key, as Transformer Engine's MoE spec stores it;
* :func:`fused_moe_fields`: TE's fused token permutation, among the fused kernels of the
  Transformer Engine spec (whose MoE layers run the experts as TE's grouped GEMM);
* :func:`enable_router_gemm_fallback`: megatron-core 0.16.1 without Transformer Engine;
* :func:`reset_router_loss_tracker`: Megatron's process-global record of the router losses,
  emptied for each MoE model built.
"""

from __future__ import annotations

from typing import List, Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_mhar.models.gpt_config import GPTModelConfig

# The local spec's sharded_state_dict_keys_map entry that stores the pre-MLP norm as the
# norm fused into a dense MLP's first linear layer (Transformer Engine's dense layout).
_FUSED_PRE_MLP_NORM = "pre_mlp_layernorm."


def enable_router_gemm_fallback() -> None:
    """megatron-core 0.16.1's router reads ``moe_utils.te_general_gemm``, a name it binds only
    when Transformer Engine imports; without TE its ``None`` (torch's matmul, the fallback the
    router's code has for it) is bound here. Later versions bind it themselves."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def reset_router_loss_tracker() -> None:
    """Empty Megatron's router-loss tracker (``moe_utils``'s process-global dict, which each
    router adds its losses to, per layer, for logging). An MoE model built earlier in the
    process (another run, a test) leaves entries sized for its own layers, which a deeper
    model would index past."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.get_moe_layer_wise_logging_tracker().clear()


def moe_layer_pattern(model: GPTModelConfig, config, vp_stage: Optional[int] = None) -> List[bool]:
    """For each decoder layer this pipeline chunk builds, in order, whether it is an MoE layer
    (the chunk's global layers as Megatron's ``get_gpt_decoder_block_spec`` takes them)."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pattern = model.moe_layer_pattern()
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is not None:
        return [pattern[i] for i in layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = transformer_block.get_num_layers_to_build(config, vp_stage=vp_stage)
    return pattern[offset:offset + count]


def store_pre_mlp_norm_unfused(spec: ModuleSpec) -> ModuleSpec:
    """Megatron's local layer spec maps the pre-MLP norm onto the key of the norm Transformer
    Engine fuses into a dense MLP's ``linear_fc1``. An MoE layer has no such layer (TE's MoE
    spec keeps a separate ``pre_mlp_layernorm``), so here the norm keeps its own key and a
    checkpoint of an MoE model loads under either spec. Parameters and outputs are unchanged."""
    keys = dict(spec.submodules.sharded_state_dict_keys_map)
    keys.pop(_FUSED_PRE_MLP_NORM, None)
    spec.submodules.sharded_state_dict_keys_map = keys
    return spec


def fused_moe_fields(model: GPTModelConfig) -> dict:
    """TransformerConfig fields of an MoE model's fused kernels under Transformer Engine's
    spec: TE's fused token permutation and unpermutation, as Megatron-LM trains MoE. (The
    TE spec's experts are TE's grouped GEMM, ``TEGroupedMLP``, whose checkpoint is
    interchangeable with the local spec's ``SequentialMLP``.)"""
    if not model.is_moe:
        return {}
    return dict(moe_permute_fusion=True)
