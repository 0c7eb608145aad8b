"""Layer and block specs for MHAR decoders, built from Megatron's own GPT layer specs.

The routers are spec slots: each MHAR layer's ``input_router`` and ``pre_mlp_router``
(:class:`~megatron_mhar.models.layer.MHARTransformerLayerSubmodules`) and the block's
``final_router`` (:class:`~megatron_mhar.models.block.MHARTransformerBlockSubmodules`) name
the router module, :func:`router_spec` of the variant here, so a user spec can swap or
wrap them as it swaps Megatron's own submodules.

``model.spec`` names the spec: ``local`` (Megatron's torch layers), ``transformer_engine``
(Megatron's Transformer Engine layers: fused norm + linear, TE attention, FP8) or ``auto``,
which :func:`resolve_spec` turns into one of the two on the machine that runs the model.
The two specs compute the same function from the same parameters, stored under the same
distributed-checkpoint keys, so the choice is one of execution, not of the model.
"""

import dataclasses
import importlib
from typing import Optional

import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import transformer_block
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_mhar.models.attention import SDPACoreAttention
from megatron_mhar.models.block import MHARTransformerBlockSubmodules
from megatron_mhar.models.gpt_config import GPTModelConfig
from megatron_mhar.models.layer import MHARTransformerLayer, MHARTransformerLayerSubmodules
from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.models.moe import moe_layer_pattern, store_pre_mlp_norm_unfused
from megatron_mhar.models.routing import DeltaRouter, DepthRouter


def get_mhar_layer_local_spec(
    model: GPTModelConfig, mhar: MHARConfig, layer_norm: Optional[type] = None, moe: bool = False
) -> ModuleSpec:
    """Megatron's local (torch) GPT layer spec, with MHAR layers when routing is on.

    Args:
        model: architecture; ``attention_backend='sdpa'`` swaps in :class:`SDPACoreAttention`.
        mhar: ``variant='none'`` keeps Megatron's ``TransformerLayer``.
        layer_norm: optional norm class for every norm of the layer (e.g. one that accepts
            sequence parallelism without apex).
        moe: the layer's MLP is Megatron's MoE layer of ``model.num_moe_experts`` experts
            (``SequentialMLP`` experts), its pre-MLP norm stored under its own key
            (:func:`~megatron_mhar.models.moe.store_pre_mlp_norm_unfused`).
    """
    spec = get_gpt_layer_local_spec(
        num_experts=model.num_moe_experts if moe else None,
        qk_layernorm=model.qk_layernorm, normalization=model.normalization,
    )
    if moe:
        store_pre_mlp_norm_unfused(spec)
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


def get_mhar_layer_te_spec(model: GPTModelConfig, mhar: MHARConfig, moe: bool = False) -> ModuleSpec:
    """Megatron's Transformer Engine GPT layer spec, with MHAR layers when routing is on.

    The TE spec fuses the pre-norms into the following linear layers (an MoE layer keeps a
    separate pre-MLP norm; its experts are TE's grouped GEMM); the MHAR layer has no
    TE-specific logic, so TE users run exactly the layer code tested locally.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    try:
        transformer_engine_version()
    except ImportError as err:
        raise ImportError(
            f"model.spec='transformer_engine' needs Transformer Engine ({err}): pip install "
            f"'megatron_mhar[te]', or use model.spec='local' (or 'auto')"
        ) from err
    spec = get_gpt_layer_with_transformer_engine_spec(
        num_experts=model.num_moe_experts if moe else None, moe_grouped_gemm=moe,
        qk_layernorm=model.qk_layernorm,
    )
    return _with_mhar_layer(spec, mhar)


def get_mhar_layer_spec(
    model: GPTModelConfig, mhar: MHARConfig, layer_norm: Optional[type] = None, moe: bool = False
) -> ModuleSpec:
    """The layer spec ``model.spec`` names (``auto`` resolved by :func:`resolve_spec`), with an
    MoE MLP when ``moe``."""
    if resolve_spec(model.spec).spec == "transformer_engine":
        return get_mhar_layer_te_spec(model, mhar, moe)
    return get_mhar_layer_local_spec(model, mhar, layer_norm, moe)


@dataclasses.dataclass(frozen=True)
class SpecChoice:
    """The layer spec a model runs with, and why."""

    spec: str
    """``local`` or ``transformer_engine``."""

    reason: str
    """Why: the Transformer Engine version, or what rules it out."""


def transformer_engine_version() -> str:
    """The version of the importable ``transformer_engine.pytorch``.

    Raises ImportError saying why it does not import: not installed, or installed but its
    libraries do not load (a CUDA or cuDNN mismatch raises OSError or RuntimeError inside
    Transformer Engine's own import).
    """
    try:
        importlib.import_module("transformer_engine.pytorch")
    except (ImportError, OSError, RuntimeError) as err:
        raise ImportError(f"Transformer Engine not importable: {err}") from err
    return importlib.import_module("transformer_engine").__version__


def resolve_spec(spec: str, cuda: Optional[bool] = None) -> SpecChoice:
    """What ``model.spec`` means here: ``auto`` is ``transformer_engine`` where
    ``transformer_engine.pytorch`` imports and the model runs on CUDA, else ``local``;
    ``local`` and ``transformer_engine`` stay as they are.

    Args:
        spec: ``model.spec``.
        cuda: whether the model runs on a GPU; ``None``: whether CUDA is available.
    """
    if spec != "auto":
        return SpecChoice(spec, "set in model.spec")
    if cuda is None and not torch.cuda.is_available():
        return SpecChoice("local", "no CUDA device; Transformer Engine layers run on GPUs")
    if cuda is False:
        return SpecChoice("local", "the model runs on CPU; Transformer Engine layers run on GPUs")
    try:
        version = transformer_engine_version()
    except ImportError as err:
        return SpecChoice("local", str(err))
    return SpecChoice("transformer_engine", f"Transformer Engine {version}")


def router_spec(mhar: MHARConfig) -> ModuleSpec:
    """The router of every routing site of ``mhar.variant``: :class:`DeltaRouter` (query, key
    norm, null source and gate) for ``delta``, :class:`DepthRouter` (query and key norm)
    otherwise."""
    return ModuleSpec(module=DeltaRouter if mhar.variant == "delta" else DepthRouter)


def get_mhar_block_spec(
    model: GPTModelConfig, mhar: MHARConfig, config, vp_stage: Optional[int] = None,
    layer_norm: Optional[type] = None,
) -> TransformerBlockSubmodules:
    """The decoder block spec of one pipeline chunk: its layers (:func:`get_mhar_layer_spec`;
    MoE or dense as ``model.moe_layer_freq`` says, Megatron's ``get_gpt_decoder_block_spec``
    rule), the final norm and, when routing is on, the final site's router
    (:class:`MHARTransformerBlockSubmodules`); for ``variant: none`` the block Megatron builds
    from its own layer spec.

    Args:
        model, mhar, layer_norm: as :func:`get_mhar_layer_spec`; ``layer_norm`` is also the
            final norm of the local spec (Megatron's default for it, ``WrappedTorchNorm``
            without apex or TE, refuses sequence parallelism).
        config: the model's TransformerConfig (how many layers this chunk builds).
        vp_stage: virtual pipeline stage of the chunk.
    """
    specs = {moe: get_mhar_layer_spec(model, mhar, layer_norm, moe) for moe in {False, model.is_moe}}
    if resolve_spec(model.spec).spec == "local":
        # The local layers' own norm, as Megatron's local decoder spec takes it: the block's
        # default (``LayerNormImpl``) is TE's norm wherever TE is installed, CPU runs included.
        final_norm = layer_norm or gpt_layer_specs.LNImpl
    else:
        final_norm = transformer_block.LayerNormImpl
    block = dict(
        layer_specs=[specs[moe] for moe in moe_layer_pattern(model, config, vp_stage)],
        layer_norm=final_norm,
    )
    if not mhar.enabled:
        return TransformerBlockSubmodules(**block)
    return MHARTransformerBlockSubmodules(**block, final_router=router_spec(mhar))


def _with_mhar_layer(spec: ModuleSpec, mhar: MHARConfig) -> ModuleSpec:
    """Megatron's layer ``spec`` as an MHAR layer with its routers in their slots (unchanged
    for ``variant: none``)."""
    if mhar.enabled:
        spec.module = MHARTransformerLayer
        megatron = {f.name: getattr(spec.submodules, f.name) for f in dataclasses.fields(spec.submodules)}
        router = router_spec(mhar)
        spec.submodules = MHARTransformerLayerSubmodules(**megatron, input_router=router, pre_mlp_router=router)
    return spec
