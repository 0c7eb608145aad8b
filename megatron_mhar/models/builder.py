"""Build Megatron GPT models with (or, for ``variant: none``, without) MHAR decoders."""

import contextlib
import dataclasses
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import gpt_model as megatron_gpt_model
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.models.block import MHARTransformerBlock
from megatron_mhar.models.gpt_config import GPTModelConfig
from megatron_mhar.models.mtp import MTPGPTModel, get_mtp_block_spec
from megatron_mhar.models.moe import enable_router_gemm_fallback, reset_router_loss_tracker, fused_moe_fields
from megatron_mhar.models.norms import SequenceParallelTorchNorm
from megatron_mhar.models.specs import get_mhar_block_spec, resolve_spec

# Megatron features the MHAR decoder does not implement, as (TransformerConfig field,
# value that is fine, what to do instead).
UNSUPPORTED = (
    ("context_parallel_size", 1, "set context_parallel_size=1"),
    ("cpu_offloading", False, "set cpu_offloading=False"),
    ("fine_grained_activation_offloading", False, "disable activation offloading"),
    ("cuda_graph_impl", "none", "CUDA graphs are not supported; set cuda_graph_impl='none'"),
    ("inference_fuse_tp_communication", False, "fused TP inference is not supported"),
    ("multi_latent_attention", False, "MLA is not supported; use standard attention"),
)


@dataclasses.dataclass
class MHARTransformerConfig(TransformerConfig):
    """Megatron's TransformerConfig plus the depth-routing configuration."""

    mhar: MHARConfig = dataclasses.field(default_factory=MHARConfig)
    """How the decoder routes over depth."""

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.mhar, MHARConfig):
            raise ValueError(f"mhar must be an MHARConfig, got {type(self.mhar).__name__}")
        self.mhar.validate_for_model(self.hidden_size, self.num_layers)
        for field, supported, fix in UNSUPPORTED:
            value = getattr(self, field, supported)
            if value != supported:
                raise ValueError(f"{field}={value!r} is not supported with MHAR decoders: {fix}")
        if self.fp8 and self.recompute_granularity == "full":
            raise ValueError(
                "fp8 with recompute_granularity='full' is not supported with MHAR decoders (their "
                "recomputed chunks do not go through Transformer Engine's FP8-aware checkpoint); "
                "use recompute_granularity='selective' or None"
            )
        if self.pipeline_model_parallel_size > 1 and self.variable_seq_lengths:
            raise ValueError(
                "variable_seq_lengths=True is not supported with MHAR pipeline parallelism (the "
                "p2p shapes follow from the depth layout at one sequence length); pad "
                "micro-batches to one length and set variable_seq_lengths=False"
            )


def fused_kernel_fields(model: GPTModelConfig) -> dict:
    """TransformerConfig fields of the fused kernels Megatron-LM trains with under
    Transformer Engine: Megatron's fused vocabulary-parallel cross-entropy, fused RoPE, the
    fused SwiGLU, for MoE TE's fused token permutation
    (:func:`~megatron_mhar.models.moe.fused_moe_fields`) and weight-gradient accumulation
    into ``main_grad`` inside TE's GEMMs. Empty for the local spec and with
    ``model.fused_kernels`` false. ``model.spec`` must be resolved (:func:`resolve_spec`).

    Gradient-accumulation fusion is TE's own (``fuse_wgrad_accumulation``) in every decoder
    linear; only the output layer, Megatron's ``ColumnParallelLinear``, would need apex's
    ``fused_weight_gradient_mlp_cuda``, and without it keeps the unfused accumulation
    (:func:`_linears_without_apex_wgrad`). The cross-entropy is Megatron's (``native``),
    not TE's: TE's backward creates a host tensor unless Megatron's config says the full
    iteration is captured, which the training loop's full-iteration graph does not set, so
    its capture fails."""
    if model.spec != "transformer_engine" or not model.fused_kernels:
        return {}
    return dict(gradient_accumulation_fusion=True, cross_entropy_loss_fusion=True,
                cross_entropy_fusion_impl="native", apply_rope_fusion=True, bias_activation_fusion=True,
                **fused_moe_fields(model))


def make_transformer_config(model: GPTModelConfig, mhar: MHARConfig, **overrides) -> TransformerConfig:
    """TransformerConfig for ``model``; an :class:`MHARTransformerConfig` when routing is on.

    ``overrides`` are TransformerConfig fields (parallel sizes, precision, recompute...).
    """
    if not isinstance(model, GPTModelConfig) or not isinstance(mhar, MHARConfig):
        raise ValueError(
            f"make_transformer_config(model, mhar) takes a GPTModelConfig and an MHARConfig, got "
            f"{type(model).__name__} and {type(mhar).__name__}; build them as GPTModelConfig(**fields)"
        )
    for name in ("params_dtype", "pipeline_dtype"):
        if name in overrides and overrides[name] is not None and not isinstance(overrides[name], torch.dtype):
            raise ValueError(f"{name} must be a torch.dtype such as torch.bfloat16, got {overrides[name]!r}")
    kwargs = model.transformer_config_kwargs()
    kwargs.update(overrides)
    if not mhar.enabled:
        return TransformerConfig(**kwargs)
    return MHARTransformerConfig(mhar=mhar, **kwargs)


@contextlib.contextmanager
def _decoder_class(block_class):
    # GPTModel.__init__ instantiates the module-level name TransformerBlock and offers no
    # hook for another block class; binding the name only while one model is built keeps
    # every other line of Megatron's GPTModel (embeddings, RoPE, output layer, sharded
    # state dict) in use unchanged.
    original = megatron_gpt_model.TransformerBlock
    megatron_gpt_model.TransformerBlock = block_class
    try:
        yield
    finally:
        megatron_gpt_model.TransformerBlock = original


@contextlib.contextmanager
def _linears_without_apex_wgrad(config: TransformerConfig):
    """Build a model whose TE linears fuse weight-gradient accumulation while Megatron's own
    linears (the output layer) do not, where apex's ``fused_weight_gradient_mlp_cuda`` is
    missing.

    ``ColumnParallelLinear`` refuses ``gradient_accumulation_fusion`` at construction without
    apex's extension, although TE's linears need no extension for it. Megatron reads the
    extension's presence from one module flag; it is set while the model is built and every
    Megatron linear built then takes the unfused path (its gradient reaches ``main_grad``
    through DDP's hook, as without the fusion)."""
    from megatron.core.tensor_parallel import layers

    if not config.gradient_accumulation_fusion or layers._grad_accum_fusion_available:
        yield lambda model: model
        return

    def unfuse_megatron_linears(model):
        for module in model.modules():
            if isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear)):
                module.gradient_accumulation_fusion = False
        return model

    layers._grad_accum_fusion_available = True
    try:
        yield unfuse_megatron_linears
    finally:
        layers._grad_accum_fusion_available = False


class MHARGPTModel(MTPGPTModel):
    """Megatron's GPTModel whose decoder is an :class:`MHARTransformerBlock` (with MTP, its
    forward without labels is :class:`MTPGPTModel`'s)."""

    def __init__(self, *args, **kwargs):
        with _decoder_class(MHARTransformerBlock):
            super().__init__(*args, **kwargs)


def _check_model_matches_config(model: GPTModelConfig, config: TransformerConfig) -> None:
    """Raise when ``config`` was not built from ``model`` or for this process's parallel layout."""
    expected = model.transformer_config_kwargs()
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size"):
        if getattr(config, name) != expected[name]:
            raise ValueError(
                f"config.{name}={getattr(config, name)} differs from the model's {expected[name]}; "
                f"build the config with make_transformer_config(model, mhar, ...)"
            )
    if not parallel_state.model_parallel_is_initialized():
        return
    for name, initialised in (
        ("tensor_model_parallel_size", parallel_state.get_tensor_model_parallel_world_size()),
        ("pipeline_model_parallel_size", parallel_state.get_pipeline_model_parallel_world_size()),
    ):
        if getattr(config, name) != initialised:
            raise ValueError(
                f"config.{name}={getattr(config, name)} but Megatron's parallel state is initialised "
                f"with {initialised}; pass the sizes given to initialize_model_parallel_from_env to "
                f"make_transformer_config"
            )


def build_gpt_model(
    model: GPTModelConfig,
    mhar: MHARConfig,
    config: TransformerConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    layer_norm: Optional[type] = None,
) -> GPTModel:
    """A GPTModel for one pipeline chunk; ``variant: none`` is Megatron's GPT unchanged
    (with MTP, :class:`~megatron_mhar.models.mtp.MTPGPTModel`: logits without labels).

    Args:
        model: architecture; ``spec: auto`` is resolved here (:func:`resolve_spec`).
        mhar: routing; must match ``config.mhar`` when routing is on.
        config: from :func:`make_transformer_config` (parallel sizes already set).
        pre_process / post_process: whether this chunk holds the embedding / output layer.
        vp_stage: virtual pipeline stage of this chunk.
        layer_norm: optional norm class for the local spec (see ``get_mhar_layer_local_spec``);
            with sequence parallelism it defaults to :class:`SequenceParallelTorchNorm`,
            because Megatron's local-spec torch norm refuses sequence parallelism without apex.
    """
    if mhar.enabled and getattr(config, "mhar", None) != mhar:
        raise ValueError(
            "config.mhar differs from the mhar argument; build the config with "
            "make_transformer_config(model, mhar, ...)"
        )
    _check_model_matches_config(model, config)
    model = dataclasses.replace(model, spec=resolve_spec(model.spec).spec)
    model_class = MHARGPTModel if mhar.enabled else MTPGPTModel if model.mtp_num_layers else GPTModel
    if layer_norm is None and config.sequence_parallel and model.spec == "local":
        layer_norm = SequenceParallelTorchNorm
    if model.is_moe:
        enable_router_gemm_fallback()
        reset_router_loss_tracker()
    with _linears_without_apex_wgrad(config) as finish:
        return finish(model_class(
            config=config,
            transformer_layer_spec=get_mhar_block_spec(model, mhar, config, vp_stage, layer_norm),
            vocab_size=model.padded_vocab_size(config.tensor_model_parallel_size),
            max_sequence_length=model.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=model.tie_embeddings,
            position_embedding_type="rope",
            rotary_percent=model.rotary_percent,
            rotary_base=int(model.rotary_base),
            rope_scaling=model.rope_scaling,
            rope_scaling_factor=model.rope_scaling_factor,
            vp_stage=vp_stage,
            mtp_block_spec=get_mtp_block_spec(model, config, vp_stage, layer_norm),
        ))
