"""MHAR forms of Llama and Qwen3 as transformers models: ``from_pretrained``, ``generate``, KV cache.

The attention, MLP, norms and rotary embedding are transformers' own Llama / Qwen3
modules; only the decoder loop differs. Each sublayer reads a routed mixture of earlier
sources (the MHAR paper) instead of the residual stream:

* ``full`` / ``block``: sources are the embedding and every sublayer output (``full``), or
  sums of blocks of ``mhar_block_size`` sublayers plus the running partial of the current
  block (``block``); a final routing site feeds the final norm.
* ``delta``: the additive stream is kept and each sublayer input gets the gated correction
  ``gate * route([sources, null])`` over the embedding and the delta of every completed
  block of ``mhar_delta_block_layers`` decoder layers; no final site.

Routing is per token: a token's sources are its own earlier sublayer outputs, so a
forward pass keeps the depth history of its own tokens only, and a decoding step with a
KV cache routes over the new tokens' sources alone (earlier tokens reach it through the
cached keys and values of attention, as in any transformer). Padding tokens therefore
influence nothing but their own position, which the attention mask hides.

The routing itself is the package's ``depth_route`` (the fused Triton kernels on CUDA
when ``megatron_mhar`` is installed, its torch reference otherwise); an export ships a
verbatim copy of ``megatron_mhar/ops/depth_route.py`` beside this file. This file and
``configuration_mhar.py`` import only torch and transformers otherwise.
"""

import dataclasses
import functools
from typing import List, Optional, Union

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from .configuration_mhar import MHARLlamaConfig, MHARQwen3Config

try:
    from megatron_mhar.ops.depth_route import depth_route
except ImportError:  # an exported directory, loaded where megatron_mhar is not installed
    from .depth_route import depth_route


# ---------------------------------------------------------------- layouts over depth


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Sources of the full (``block_size`` 1) and block variants.

    Sublayers are numbered globally and 1-based (layer ``l`` owns sublayers ``2l - 1`` and
    ``2l``; the final site is ``2L + 1``). Sublayer ``j`` lies in block
    ``n = (j - 1) // S + 1`` at position ``i = (j - 1) % S + 1``; it reads rows ``0 .. n-1``
    (row 0 the embedding, row k the sum of block k) plus, for ``i >= 2``, the running
    partial of block n, which is kept in row n until the block completes it.
    """

    num_layers: int
    block_size: int
    has_final_site = True

    @property
    def capacity(self) -> int:
        """Rows the routing ever reads at once (completed rows, or rows and the partial)."""
        return 1 + -(-2 * self.num_layers // self.block_size)

    @property
    def final_site(self) -> int:
        return 2 * self.num_layers + 1

    def position(self, site: int):
        return (site - 1) // self.block_size + 1, (site - 1) % self.block_size + 1

    def rows_read(self, site: int) -> int:
        """Sources read by ``site``: completed rows, plus the partial's row when it has one."""
        block, position = self.position(site)
        return block + int(position >= 2)


@dataclasses.dataclass(frozen=True)
class DeltaLayout:
    """Sources of the delta variant: row 0 the embedding, row k the delta of block k."""

    num_layers: int
    block_layers: int
    has_final_site = False

    @property
    def capacity(self) -> int:
        """Rows ever read: the embedding, the completed blocks and the site's null source."""
        return 2 + (self.num_layers - 1) // self.block_layers

    @staticmethod
    def layer_of(site: int) -> int:
        return (site + 1) // 2

    def rows_read(self, site: int) -> int:
        """Rows before the null source: the embedding and the blocks completed before ``site``."""
        return 1 + (self.layer_of(site) - 1) // self.block_layers

    def completes_block(self, site: int) -> bool:
        """Whether sublayer ``site`` ends a block whose delta a later layer reads."""
        layer = self.layer_of(site)
        return site % 2 == 0 and layer % self.block_layers == 0 and layer < self.num_layers


def depth_layout(config) -> Union[BlockLayout, DeltaLayout]:
    layers = config.num_hidden_layers
    if config.mhar_variant == "delta":
        return DeltaLayout(layers, config.mhar_delta_block_layers)
    return BlockLayout(layers, config.mhar_block_size if config.mhar_variant == "block" else 1)


# ---------------------------------------------------------------- one forward's sources


class SourceRows:
    """The sources of one forward pass, ``[N, B, T, D]``, read as prefixes ``[:n]``.

    Without autograd the rows live in one buffer allocated per forward and every routing
    site reads a prefix view of it (no copies). With autograd they are kept as a list and
    stacked per read: in-place writes into a buffer would change tensors that earlier
    reads saved for the backward pass.
    """

    def __init__(self, capacity: int, like: torch.Tensor):
        self.stacked = torch.is_grad_enabled()
        if self.stacked:
            self.rows: List[Optional[torch.Tensor]] = [None] * capacity
        else:
            self.buffer = like.new_empty((capacity, *like.shape))

    def set(self, row: int, value: torch.Tensor) -> None:
        if self.stacked:
            self.rows[row] = value
        else:
            self.buffer[row].copy_(value)

    def add(self, row: int, value: torch.Tensor) -> None:
        if self.stacked:
            self.rows[row] = self.rows[row] + value
        else:
            self.buffer[row].add_(value)

    def prefix(self, n: int) -> torch.Tensor:
        return torch.stack(self.rows[:n]) if self.stacked else self.buffer[:n]


class RoutingSite(nn.Module):
    """One routing site: pseudo-query (zero init) and key RMSNorm weight (ones); the delta
    variant adds a null source (zeros) and a scalar gate (zero)."""

    def __init__(self, config):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(config.hidden_size))
        self.norm_weight = nn.Parameter(torch.ones(config.hidden_size))
        if config.mhar_variant == "delta":
            self.null_source = nn.Parameter(torch.zeros(config.hidden_size))
            self.gate = nn.Parameter(torch.zeros(1))

    def reset_parameters(self) -> None:
        init.zeros_(self.query)
        init.ones_(self.norm_weight)
        if hasattr(self, "gate"):
            init.zeros_(self.null_source)
            init.zeros_(self.gate)


class DepthStream:
    """The full and block variants' state of one forward: the rows of sources."""

    def __init__(self, layout: BlockLayout, route, embedding: torch.Tensor):
        self.layout, self.route = layout, route
        self.rows = SourceRows(layout.capacity, embedding)
        self.rows.set(0, embedding)

    def read(self, site: int, router: RoutingSite) -> torch.Tensor:
        """The routed input of ``site`` [B, T, D]."""
        return self.route(self.rows.prefix(self.layout.rows_read(site)), router.query, router.norm_weight)

    def write(self, site: int, output: torch.Tensor) -> None:
        """Add sublayer ``site``'s output to its block's row (the first output sets it)."""
        block, position = self.layout.position(site)
        if position == 1:
            self.rows.set(block, output)
        else:
            self.rows.add(block, output)

    def output(self, final_router: RoutingSite) -> torch.Tensor:
        return self.read(self.layout.final_site, final_router)


class DeltaStream:
    """The delta variant's state of one forward: stream ``h``, block start, rows of sources."""

    def __init__(self, layout: DeltaLayout, route, embedding: torch.Tensor):
        self.layout, self.route = layout, route
        self.rows = SourceRows(layout.capacity, embedding)
        self.rows.set(0, embedding)
        self.hidden = self.block_start = embedding

    def read(self, site: int, router: RoutingSite) -> torch.Tensor:
        """``h + gate * route([rows, null])`` [B, T, D]; the null source joins last."""
        rows = self.layout.rows_read(site)
        self.rows.set(rows, router.null_source.to(self.hidden.dtype).expand_as(self.hidden))
        routed = self.route(self.rows.prefix(rows + 1), router.query, router.norm_weight)
        return self.hidden + router.gate.to(routed.dtype) * routed

    def write(self, site: int, output: torch.Tensor) -> None:
        self.hidden = self.hidden + output
        if self.layout.completes_block(site):
            block = self.layout.layer_of(site) // self.layout.block_layers
            self.rows.set(block, self.hidden - self.block_start)
            self.block_start = self.hidden

    def output(self, final_router: Optional[RoutingSite]) -> torch.Tensor:
        return self.hidden


# ---------------------------------------------------------------- decoder


class RoutedDecoderLayer:
    """A family's decoder layer whose two sublayers read routed inputs from the stream.

    Mixed in before ``LlamaDecoderLayer`` / ``Qwen3DecoderLayer``, whose submodules
    (``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``) it runs
    unchanged. Adds ``attention_router`` and ``mlp_router``.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_router = RoutingSite(config)
        self.mlp_router = RoutingSite(config)
        self.attention_site = 2 * layer_idx + 1

    def forward(self, stream, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs) -> torch.Tensor:
        """Run both sublayers on ``stream``; returns the MLP output [B, T, D] (the stream holds it)."""
        site = self.attention_site
        routed = stream.read(site, self.attention_router)
        attention_out, _ = self.self_attn(
            hidden_states=self.input_layernorm(routed),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        stream.write(site, attention_out)
        routed = stream.read(site + 1, self.mlp_router)
        mlp_out = self.mlp(self.post_attention_layernorm(routed))
        stream.write(site + 1, mlp_out)
        return mlp_out


class MHARLlamaDecoderLayer(RoutedDecoderLayer, LlamaDecoderLayer):
    pass


class MHARQwen3DecoderLayer(RoutedDecoderLayer, Qwen3DecoderLayer):
    pass


class MHARPreTrainedModel(PreTrainedModel):
    """Weight init and loading rules shared by the MHAR families."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = False  # the depth stream is state across layers
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, RoutingSite):
            module.reset_parameters()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' ``from_pretrained``, refusing checkpoints that miss, add or reshape tensors.

        A missing routing tensor would otherwise be initialised silently and the model would
        compute another function; the ``ValueError`` names every such tensor.
        ``ignore_mismatched_sizes=True`` lets reshaped tensors be initialised, as usual.
        """
        wants_info = kwargs.pop("output_loading_info", False)
        ignore_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
        model, info = super().from_pretrained(
            *args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
        problems = [f"{kind.replace('_', ' ')}: {_listed(sorted(info.get(kind) or ()))}"
                    for kind in ("missing_keys", "unexpected_keys") if info.get(kind)]
        if info.get("mismatched_keys") and not ignore_mismatched:
            shapes = [f"{name} (checkpoint {tuple(saved)}, config {tuple(wanted)})"
                      for name, saved, wanted in sorted(info["mismatched_keys"])]
            problems.append(f"mismatched shapes: {_listed(shapes)}")
        if problems:
            config = model.config
            raise ValueError(
                f"the checkpoint does not match the {type(model).__name__} config "
                f"(mhar_variant={config.mhar_variant!r}, num_hidden_layers={config.num_hidden_layers}, "
                f"hidden_size={config.hidden_size}, tie_word_embeddings={config.tie_word_embeddings}); "
                + "; ".join(problems)
                + ". Export MHAR checkpoints with mcore_to_hf_mhar.py, which writes every routing tensor"
            )
        return (model, info) if wants_info else model


def _listed(names, shown: int = 8) -> str:
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(str(name) for name in names[:shown]) + more


class MHARModel:
    """The decoder: embedding, routed layers, final site (full / block) and final norm."""

    layer_class: type
    norm_class: type
    rotary_class: type

    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [self.layer_class(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = self.norm_class(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = self.rotary_class(config=config)
        self.layout = depth_layout(config)
        self.final_router = RoutingSite(config) if self.layout.has_final_site else None
        self.gradient_checkpointing = False
        self.post_init()

    def _route(self):
        config = self.config
        return functools.partial(
            depth_route, num_heads=config.mhar_num_heads, eps=config.routing_eps,
            logit_scale=config.mhar_logit_scale,
        )

    def _layer_masks(self, attention_mask, **mask_kwargs) -> list:
        """The attention mask of each layer (full, or sliding-window for Qwen3's sliding layers)."""
        types = getattr(self.config, "layer_types", None) or ["full_attention"] * len(self.layers)
        if isinstance(attention_mask, dict):  # already built by generate
            return [attention_mask[kind] for kind in types]
        masks = {"full_attention": create_causal_mask(attention_mask=attention_mask, **mask_kwargs)}
        if "sliding_attention" in types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(attention_mask=attention_mask, **mask_kwargs)
        return [masks[kind] for kind in types]

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        for flag in ("output_hidden_states", "output_attentions"):
            if kwargs.pop(flag, None):
                raise ValueError(
                    f"{flag}=True is not supported by MHAR models: there is no single residual stream "
                    f"between layers (each sublayer reads its own mixture of earlier outputs)"
                )
        if use_cache is None:
            use_cache = self.config.use_cache
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        masks = self._layer_masks(
            attention_mask, config=self.config, inputs_embeds=inputs_embeds, cache=cache,
            position_ids=position_ids,
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        stream_class = DeltaStream if isinstance(self.layout, DeltaLayout) else DepthStream
        stream = stream_class(self.layout, self._route(), inputs_embeds)
        for layer, mask in zip(self.layers, masks):
            layer(
                stream,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.norm(stream.output(self.final_router))
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)


class MHARForCausalLM:
    """``MHAR<Family>Model`` plus the output layer (tied to the embedding or not); mixed in
    before the family's pre-trained model class, which ``GenerationMixin`` follows."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    model_class: type

    def __init__(self, config):
        super().__init__(config)
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``input_ids`` [B, T] -> ``logits`` [B, T, vocab] (the last ``logits_to_keep`` if set)."""
        kwargs.pop("return_dict", None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)


# ---------------------------------------------------------------- the two families


class MHARLlamaPreTrainedModel(MHARPreTrainedModel):
    config_class = MHARLlamaConfig
    config: MHARLlamaConfig
    _no_split_modules = ["MHARLlamaDecoderLayer"]


class MHARLlamaModel(MHARModel, MHARLlamaPreTrainedModel):
    layer_class = MHARLlamaDecoderLayer
    norm_class = LlamaRMSNorm
    rotary_class = LlamaRotaryEmbedding


class MHARLlamaForCausalLM(MHARForCausalLM, MHARLlamaPreTrainedModel, GenerationMixin):
    model_class = MHARLlamaModel


class MHARQwen3PreTrainedModel(MHARPreTrainedModel):
    config_class = MHARQwen3Config
    config: MHARQwen3Config
    _no_split_modules = ["MHARQwen3DecoderLayer"]


class MHARQwen3Model(MHARModel, MHARQwen3PreTrainedModel):
    layer_class = MHARQwen3DecoderLayer
    norm_class = Qwen3RMSNorm
    rotary_class = Qwen3RotaryEmbedding


class MHARQwen3ForCausalLM(MHARForCausalLM, MHARQwen3PreTrainedModel, GenerationMixin):
    model_class = MHARQwen3Model


__all__ = [
    "MHARLlamaForCausalLM",
    "MHARLlamaModel",
    "MHARLlamaPreTrainedModel",
    "MHARQwen3ForCausalLM",
    "MHARQwen3Model",
    "MHARQwen3PreTrainedModel",
]
