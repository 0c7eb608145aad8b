"""Multi-token prediction: Megatron-Core's MTP block (DeepSeek-V3) on MHAR decoders.

``model.mtp_num_layers`` MTP depths, all on the last pipeline stage (Megatron's placement
without a custom pipeline layout). Depth ``k`` predicts token ``t + k + 1`` from the
previous depth's output at ``t`` (depth 1: the main model's output) and the embedding of
token ``t + k``; the MTP losses reach the gradients only (``MTPLossAutoScaler``) with the
weight ``model.mtp_loss_scaling_factor / mtp_num_layers`` each.

* The MTP block reads the decoder's output: for an MHAR decoder the final routing site
  (or the delta variant's stream) after the final norm, the same tensor the output layer
  reads, as Megatron's MTP reads its decoder's final-normed output.
* The MTP layers are Megatron's own ``TransformerLayer`` with its additive residual, for
  every variant: each depth is one layer on a fresh input (``eh_proj`` of the two normed
  halves), so a depth stream inside it would have the projection and at most two
  sublayers to route over, and the layers and their parameters stay Megatron's whatever
  the decoder's variant. megatron-core 0.16 names each depth's layer ``transformer_layer``,
  0.19 ``mtp_model_layer`` (module and ``state_dict`` names); the distributed-checkpoint
  keys are ``mtp.layers.{k}.transformer_layer.*`` on both.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel

from megatron_mhar.models.gpt_config import GPTModelConfig
from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.models.specs import get_mhar_block_spec

MTP_PREFIX = "mtp."
"""The state-dict prefix of every MTP parameter (Megatron's ``GPTModel.mtp``)."""


def tracked_mtp_losses() -> Optional[torch.Tensor]:
    """Megatron's tracker of the MTP losses since it was last cleared: ``[depths]``, each the
    sum of the training micro-batches' mean token losses on this rank (``None``: nothing
    tracked here). megatron-core 0.16 keys it ``values``, later versions ``loss_values``
    (beside the acceptance counts)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    return tracker.get("loss_values", tracker.get("values"))


def clear_mtp_tracker() -> None:
    """Zero every tensor of Megatron's MTP tracker (the losses and, in later versions, the
    acceptance counts)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    for value in MTPLossLoggingHelper.tracker.values():
        if torch.is_tensor(value):
            value.zero_()


def without_mtp(model: GPTModelConfig) -> GPTModelConfig:
    """``model`` without its MTP block: the main model alone, as a Hugging Face export (which
    transformers does not run MTP in) holds it."""
    return dataclasses.replace(model, mtp_num_layers=None,
                               mtp_loss_scaling_factor=GPTModelConfig.mtp_loss_scaling_factor)


class MTPGPTModel(GPTModel):
    """Megatron's GPTModel whose forward without ``labels`` returns the main head's logits
    ``[b, s, vocab]`` and runs no MTP depth: those are the logits the MTP block's first
    chunk gives unchanged, and only a loss reads the depths.

    megatron-core 0.16's ``_postprocess`` reads ``labels`` whenever ``mtp_num_layers`` is
    set and fails without them; 0.19 skips the depths under its inference mode and
    otherwise trains them on labels rolled from ``input_ids``, which would add an MTP loss
    to the gradients of a ``load_model(..., grad=True)`` forward. Without MTP, or with
    labels, the forward is Megatron's."""

    def _postprocess(self, **kwargs):
        if kwargs.get("labels") is not None or not (kwargs.get("mtp_in_postprocess") and self.post_process):
            return super()._postprocess(**kwargs)
        # _postprocess splits its input into the MTP chunks wherever config.mtp_num_layers
        # is set; the model's own reference goes to a copy without it for this call (its
        # submodules hold the shared config, which stays as it is).
        config = self.config
        self.config = copy.copy(config)
        self.config.mtp_num_layers = None
        try:
            return super()._postprocess(**dict(kwargs, mtp_in_postprocess=False))
        finally:
            self.config = config


def get_mtp_block_spec(model: GPTModelConfig, config, vp_stage: Optional[int] = None,
                       layer_norm: Optional[type] = None):
    """The MTP block spec of one pipeline chunk: Megatron's ``get_gpt_mtp_block_spec`` over
    the plain (``variant: none``) decoder spec of the chunk, so each MTP layer is the last
    decoder layer's Megatron layer (MoE or dense as Megatron chooses); ``None`` without MTP
    or on a chunk that holds none (all but the last pipeline stage).

    Args:
        model: architecture, ``spec`` resolved.
        config: the model's TransformerConfig (``mtp_num_layers`` set from ``model``).
        vp_stage: virtual pipeline stage of the chunk.
        layer_norm: the local spec's norm override (sequence parallelism without apex), used
            for the MTP norms too.
    """
    if model.mtp_num_layers is None:
        return None
    plain = get_mhar_block_spec(model, MHARConfig(variant="none"), config, vp_stage, layer_norm)
    spec = get_gpt_mtp_block_spec(config, plain, use_transformer_engine=model.spec == "transformer_engine",
                                  vp_stage=vp_stage)
    if spec is not None and layer_norm is not None:
        for layer in spec.layer_specs:
            layer.submodules = dataclasses.replace(layer.submodules, enorm=layer_norm, hnorm=layer_norm,
                                                   layer_norm=layer_norm)
    return spec
