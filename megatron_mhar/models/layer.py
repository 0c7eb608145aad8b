"""MHARTransformerLayer: Megatron's TransformerLayer with routed sublayer inputs."""

import dataclasses
import functools
from typing import Any, Optional, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.utils import make_viewless_tensor

from megatron_mhar.models.routing import DepthStream


@dataclasses.dataclass
class MHARTransformerLayerSubmodules(TransformerLayerSubmodules):
    """Megatron's layer submodules plus the layer's two routing sites, as spec slots (as
    Megatron declares its hyper-connection modules), so a spec can swap or wrap a router.

    A router is built as ``router(config=config)`` and called as ``router(stream, site)``,
    returning the routed input ``[s, b, h]`` of sublayer ``site``
    (:class:`~megatron_mhar.models.routing.DepthRouter`, ``DeltaRouter``)."""

    input_router: Union[ModuleSpec, type, None] = None
    """The routing site before attention (sublayer ``2l - 1``)."""

    pre_mlp_router: Union[ModuleSpec, type, None] = None
    """The routing site before the MLP (sublayer ``2l``)."""


class MHARTransformerLayer(TransformerLayer):
    """A decoder layer whose two sublayers read routed mixtures of earlier sources.

    Submodule names (``input_layernorm``, ``self_attention``, ``pre_mlp_layernorm``,
    ``mlp``) are Megatron's, so its local and Transformer Engine specs, checkpoint keys
    and HF weight maps apply unchanged. Two routing sites are added, built from the spec's
    slots (:class:`MHARTransformerLayerSubmodules`): ``input_router`` before attention and
    ``pre_mlp_router`` before the MLP. Each sublayer's contribution
    to the stream is its output after bias and dropout, with no residual added: in the
    full and block variants the routed input replaces the residual stream (as in Attention Residuals);
    in the delta variant the stream object adds it to the kept additive stream.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MHARTransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: Optional[float] = None,
        pg_collection=None,
        vp_stage: Optional[int] = None,
    ):
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            hidden_dropout=hidden_dropout,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        missing = [name for name in ("input_router", "pre_mlp_router") if getattr(submodules, name, None) is None]
        if missing:
            raise ValueError(
                f"MHARTransformerLayer's spec names no {' and no '.join(missing)}: build the spec with "
                f"get_mhar_layer_local_spec / get_mhar_layer_te_spec, or set the MHARTransformerLayerSubmodules slots"
            )
        self.input_router = build_module(submodules.input_router, config=config)
        self.pre_mlp_router = build_module(submodules.pre_mlp_router, config=config)

    @property
    def attention_site(self) -> int:
        """Global 1-based index of this layer's attention sublayer (self.layer_number is global)."""
        return 2 * self.layer_number - 1

    def forward(
        self,
        hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        *,
        depth_stream: DepthStream,
        rotary_pos_emb: Optional[torch.Tensor] = None,
        rotary_pos_cos: Optional[torch.Tensor] = None,
        rotary_pos_sin: Optional[torch.Tensor] = None,
        attention_bias: Optional[torch.Tensor] = None,
        inference_context: Optional[Any] = None,
        packed_seq_params=None,
        sequence_len_offset: Optional[torch.Tensor] = None,
        padding_mask: Optional[torch.Tensor] = None,
        **unused_kwargs,
    ):
        """Run both sublayers on ``depth_stream``; ``hidden_states`` is not read.

        Returns the last sublayer output [s, b, h] (for hooks and inspection; the
        stream already holds it) and ``None`` for the cross-attention context.
        """
        site = self.attention_site
        routed = self.input_router(depth_stream, site)
        attention_out = self._attention_sublayer(
            routed,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            attention_bias=attention_bias,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        depth_stream.write(site, attention_out)

        routed = self.pre_mlp_router(depth_stream, site + 1)
        mlp_out = self._mlp_sublayer(routed, padding_mask=padding_mask)
        depth_stream.write(site + 1, mlp_out)
        return mlp_out, None

    def _bias_dropout(self, output_with_bias):
        """Bias and dropout of a sublayer output, without the residual add of Megatron's bda."""
        output, bias = output_with_bias
        if bias is not None:
            output = output + bias
        return torch.nn.functional.dropout(output, p=self.hidden_dropout, training=self.training)

    def _normed(self, norm, routed: torch.Tensor, recompute: bool):
        """Apply a pre-norm; under selective recompute keep no output (recomputed in backward).

        Returns (normed, checkpoint or None). ``CheckpointWithoutOutput`` takes the fp8
        recipe (``None`` when fp8 is off): its default argument wrongly enables the
        Transformer Engine fp8 path.
        """
        if not recompute:
            return norm(routed), None
        checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=self.config.fp8)
        return checkpoint.checkpoint(norm, routed), checkpoint

    def _attention_sublayer(self, routed: torch.Tensor, **attention_kwargs) -> torch.Tensor:
        normed, checkpoint = self._normed(
            self.input_layernorm, routed, self.recompute_input_layernorm
        )
        output_with_bias = self.self_attention(normed, **attention_kwargs)
        if checkpoint is not None:
            checkpoint.discard_output_and_register_recompute(output_with_bias[0])
        return self._bias_dropout(output_with_bias)

    def _mlp_sublayer(self, routed: torch.Tensor, padding_mask=None) -> torch.Tensor:
        normed, checkpoint = self._normed(
            self.pre_mlp_layernorm, routed, self.recompute_pre_mlp_layernorm
        )
        # padding_mask reaches an MoE router (tokens it leaves out of the load-balancing loss).
        if self.recompute_mlp:
            output_with_bias = tensor_parallel.checkpoint(
                functools.partial(self.mlp, padding_mask=padding_mask), False, normed
            )
        else:
            output_with_bias = self.mlp(normed, padding_mask=padding_mask)
        if checkpoint is not None:
            checkpoint.discard_output_and_register_recompute(output_with_bias[0])
        output = self._bias_dropout(output_with_bias)
        return make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)
