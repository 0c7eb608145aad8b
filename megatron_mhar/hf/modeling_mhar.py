"""MHAR forms of Llama, Qwen3 and Qwen3-MoE as transformers models: ``from_pretrained``,
``generate``, KV cache.

The attention, MLP (Qwen3-MoE's experts and router), norms and rotary embedding are
transformers' own Llama / Qwen3 / Qwen3-MoE modules; only the decoder loop differs. Each sublayer reads a routed mixture of earlier
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

The forward arguments, outputs and flags are those of the stock Llama / Qwen3 of the same
transformers version: ``cache`` (``past_key_values`` through transformers' deprecation
helper), ``output_hidden_states`` and ``output_attentions`` (recorded by transformers'
output hooks), ``return_dict``, activation checkpointing, ``torch.compile``. There is no
single residual stream between layers, so ``hidden_states[i]`` is decoder layer ``i``'s
input as that layer sees it, its routed input before the attention norm, and the last
entry is the final routed output after the final norm (``last_hidden_state``): ``L + 1``
entries, as for Llama, whose ``hidden_states[0]`` is the embedding just as an MHAR
model's first routed input is (a softmax over one source).

The routing itself is ``depth_route`` and which sources each site reads is the routing
layout: in an export, the copies of ``megatron_mhar/ops/depth_route.py`` (which runs the
fused Triton kernels on CUDA when ``mhar_kernels`` is installed, its torch reference
otherwise) and ``megatron_mhar/ops/routing_layout.py`` shipped beside this file; in the
package, the package's own, which the Megatron model uses too. This file and ``configuration_mhar.py`` import only torch and
transformers otherwise.
"""

import inspect
import json
import shutil
from pathlib import Path
from typing import Optional, Tuple, Union

# First: it refuses a transformers older than these models support, before the imports
# below can fail on a name that version lacks.
from .configuration_mhar import MHARLlamaConfig, MHARQwen3Config, MHARQwen3MoeConfig  # isort: skip

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeAttention,
    Qwen3MoeDecoderLayer,
    Qwen3MoeRMSNorm,
    Qwen3MoeRotaryEmbedding,
)
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.hub import cached_file
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

try:  # an export: the routing op and layout shipped beside this file, whatever megatron_mhar is installed
    from .depth_route import depth_route
    from .routing_layout import DeltaLayout, DepthLayout, Layout, layout_for
except ModuleNotFoundError as missing:  # the package's own classes (megatron_mhar.hf) ship none
    if missing.name not in (f"{__package__}.depth_route", f"{__package__}.routing_layout"):
        raise
    from megatron_mhar.ops.depth_route import depth_route
    from megatron_mhar.ops.routing_layout import DeltaLayout, DepthLayout, Layout, layout_for


def depth_layout(config) -> Layout:
    """The routing layout of ``config`` (``routing_layout.py``, the Megatron model's own)."""
    return layout_for(config.mhar_variant, config.num_hidden_layers, config.mhar_block_size,
                      config.mhar_delta_block_layers)


# ---------------------------------------------------------------- one forward's sources


class RoutingSite(nn.Module):
    """One routing site: pseudo-query (zero init) and key RMSNorm weight (ones); the delta
    variant adds a null source (zeros) and a scalar gate (zero).

    Its output is the input of the sublayer it feeds, before that sublayer's norm, which is
    what ``output_hidden_states`` records for the attention sites.
    """

    def __init__(self, config):
        super().__init__()
        self.num_heads, self.eps, self.logit_scale = config.mhar_num_heads, config.routing_eps, config.mhar_logit_scale
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

    def forward(self, sources: torch.Tensor, hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``sources`` [N, B, T, D] -> the routed mixture [B, T, D], or (delta) ``hidden + gate * mixture``."""
        routed = depth_route(sources, self.query, self.norm_weight, self.num_heads, self.eps,
                             logit_scale=self.logit_scale)
        return routed if hidden is None else hidden + self.gate.to(routed.dtype) * routed


class DepthStream:
    """How the full and block variants keep one forward's sources.

    The sources are a state of tensors that each decoder layer takes and returns (so that
    activation checkpointing can run a layer again from its inputs). Without autograd the
    state is one buffer ``[N, B, T, D]`` allocated per forward, written in place, and every
    site reads a prefix view of it (no copies). With autograd it is the tuple of rows, and a
    read stacks the rows it needs: in-place writes would change tensors that earlier reads
    saved for the backward pass.
    """

    def __init__(self, layout: DepthLayout, buffered: bool):
        self.layout, self.buffered = layout, buffered

    def start(self, embedding: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if not self.buffered:
            return (embedding,)
        buffer = embedding.new_empty((self.layout.max_sources, *embedding.shape))
        buffer[0].copy_(embedding)
        return (buffer,)

    def read(self, state, site: int, router: RoutingSite) -> torch.Tensor:
        """The input of ``site`` [B, T, D]; a block's running partial is kept in its row."""
        rows = self.layout.sources_read(site)
        return router(state[0][:rows] if self.buffered else torch.stack(state[:rows]))

    def write(self, state, site: int, output: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Add sublayer ``site``'s output to its block's row (the block's first output sets it)."""
        block, position = self.layout.position(site)
        if self.buffered:
            if position == 1:
                state[0][block].copy_(output)
            else:
                state[0][block].add_(output)
            return state
        # Blocks complete in order: a block's first output opens the last row.
        return state + (output,) if position == 1 else state[:block] + (state[block] + output,)

    def output(self, state, final_router: RoutingSite) -> torch.Tensor:
        return self.read(state, self.layout.final_site, final_router)


class DeltaStream:
    """How the delta variant keeps one forward's state: the additive stream ``h``, the
    stream where the current block started, and the rows of sources (buffered or not, as
    :class:`DepthStream`'s)."""

    def __init__(self, layout: DeltaLayout, buffered: bool):
        self.layout, self.buffered = layout, buffered

    def start(self, embedding: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        if not self.buffered:
            return embedding, embedding, embedding
        buffer = embedding.new_empty((self.layout.max_sources, *embedding.shape))
        buffer[0].copy_(embedding)
        return embedding, embedding, buffer

    def read(self, state, site: int, router: RoutingSite) -> torch.Tensor:
        """``h + gate * route([rows, null])`` [B, T, D]; the null source joins last."""
        hidden, rows = state[0], self.layout.rows_read(site)
        null = router.null_source.to(hidden.dtype).expand_as(hidden)
        if self.buffered:
            buffer = state[2]
            buffer[rows].copy_(null)
            return router(buffer[: rows + 1], hidden)
        return router(torch.stack([*state[2 : 2 + rows], null]), hidden)

    def write(self, state, site: int, output: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        hidden, block_start, rows = state[0] + output, state[1], state[2:]
        if self.layout.completes_block(site):
            if self.buffered:
                rows[0][self.layout.layer_of(site) // self.layout.block_layers].copy_(hidden - block_start)
            else:
                rows = rows + (hidden - block_start,)
            block_start = hidden
        return (hidden, block_start, *rows)

    def output(self, state, final_router: Optional[RoutingSite]) -> torch.Tensor:
        return state[0]


def depth_stream(layout: Layout, buffered: bool) -> Union[DepthStream, DeltaStream]:
    return (DeltaStream if isinstance(layout, DeltaLayout) else DepthStream)(layout, buffered)


# ---------------------------------------------------------------- decoder


class RoutedDecoderLayer:
    """A family's decoder layer whose two sublayers read routed inputs from the sources.

    Mixed in before ``LlamaDecoderLayer`` / ``Qwen3DecoderLayer``, whose submodules
    (``self_attn``, ``mlp``, ``input_layernorm``, ``post_attention_layernorm``) it runs
    unchanged, and whose ``GradientCheckpointingLayer`` base checkpoints it. Adds
    ``input_router`` and ``pre_mlp_router``.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.input_router = RoutingSite(config)
        self.pre_mlp_router = RoutingSite(config)
        self.attention_site = 2 * layer_idx + 1

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(self, *state: torch.Tensor, stream, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, position_embeddings=None, **kwargs) -> Tuple[torch.Tensor, ...]:
        """Run both sublayers on the sources ``state`` (positional, as activation checkpointing
        needs the tensors it recomputes from); returns the state after them."""
        site = self.attention_site
        routed = stream.read(state, site, self.input_router)
        attention_out, _ = self.self_attn(
            hidden_states=self.input_layernorm(routed),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        state = stream.write(state, site, attention_out)
        routed = stream.read(state, site + 1, self.pre_mlp_router)
        return stream.write(state, site + 1, self.mlp(self.post_attention_layernorm(routed)))


class MHARLlamaDecoderLayer(RoutedDecoderLayer, LlamaDecoderLayer):
    pass


class MHARQwen3DecoderLayer(RoutedDecoderLayer, Qwen3DecoderLayer):
    pass


class MHARQwen3MoeDecoderLayer(RoutedDecoderLayer, Qwen3MoeDecoderLayer):
    pass


# The files of an export's model code, and the running classes' source of each.
CODE_FILES = ("configuration_mhar.py", "modeling_mhar.py", "depth_route.py", "routing_layout.py")


def _running_code() -> dict:
    modules = (MHARLlamaConfig, RoutingSite, depth_route, layout_for)
    return {name: Path(inspect.getsourcefile(obj)) for name, obj in zip(CODE_FILES, modules)}


def recorded_outputs(attention_class: type, norm_class: type) -> dict:
    """What ``output_hidden_states`` and ``output_attentions`` record (``_can_record_outputs``):
    each layer's routed input (the output of its attention site), then the final norm's
    output, ``num_hidden_layers + 1`` entries as ``capture_outputs`` counts them; and the
    attention weights of each layer."""
    return {
        "hidden_states": [
            OutputRecorder(RoutingSite, layer_name="input_router", capture_initial_hidden_state=False),
            OutputRecorder(norm_class, layer_name="norm", capture_initial_hidden_state=False),
        ],
        "attentions": attention_class,
    }


class MHARPreTrainedModel(PreTrainedModel):
    """Weight init, loading rules and capabilities shared by the MHAR families.

    The flags are stock Llama's, with a ``base_model_pp_plan`` of ``None`` on the config: a
    pipeline stage of transformers' plan hands one hidden state to the next, where MHAR
    layers need every earlier source. The tensor-parallel plan is the family's: the routing
    parameters stay replicated and read the full hidden states that the row-parallel
    projections all-reduce.
    """

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, RoutingSite):
            module.reset_parameters()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained`` (and so ``push_to_hub``), with the model code
        these classes run beside the weights, as an export has it: the directory loads with
        ``trust_remote_code=True`` where megatron_mhar is not installed."""
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            for name, source in _running_code().items():
                shutil.copyfile(source, Path(save_directory) / name)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' ``from_pretrained``, refusing checkpoints that miss, add or reshape tensors.

        A missing routing tensor would otherwise be initialised silently and the model would
        compute another function; the ``ValueError`` names every such tensor.
        ``ignore_mismatched_sizes=True`` lets reshaped tensors be initialised, as usual.

        A directory shipping model files other than these classes' (exported by another
        version of megatron_mhar, whose registered classes transformers prefers to the
        directory's even with ``trust_remote_code=True``) loads with its own classes when
        ``trust_remote_code=True`` is passed, and is refused otherwise.
        """
        shipped = _shipped_class(cls, pretrained_model_name_or_path, kwargs)
        if shipped is not None:
            kwargs.pop("config", None)  # an instance of these classes' config: the shipped code reads its own
            return shipped.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        wants_info = kwargs.pop("output_loading_info", False)
        ignore_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
        model, info = super().from_pretrained(
            pretrained_model_name_or_path, *args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
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


def _shipped_class(cls, path, kwargs) -> Optional[type]:
    """``None`` where every model file the directory ships equals the one ``cls`` runs (or it
    ships none); else the directory's own class of ``cls``'s name, loaded as remote code if
    ``trust_remote_code=True`` was passed, or a ``ValueError`` saying to pass it.

    Loaded as remote code, the classes are the directory's own files and always match.
    """
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    hub = {key: kwargs[key] for key in ("cache_dir", "revision", "token", "local_files_only", "subfolder")
           if kwargs.get(key) is not None}
    differing = []
    for name, running in _running_code().items():
        shipped = cached_file(path, name, _raise_exceptions_for_missing_entries=False, **hub)
        if shipped is not None and Path(shipped).read_bytes() != running.read_bytes():
            differing.append(name)
    if not differing:
        return None
    if not kwargs.get("trust_remote_code"):
        raise ValueError(
            f"{path} ships {', '.join(differing)} unlike the classes running ({Path(__file__).parent}): "
            f"another version of megatron_mhar exported it, and its weights belong to its own code. Pass "
            f"trust_remote_code=True to run the code it ships, or export it again with the installed megatron_mhar"
        )
    auto_map = json.loads(Path(cached_file(path, "config.json", **hub)).read_text()).get("auto_map", {})
    auto_class, reference = next((key, ref) for key, ref in auto_map.items() if ref.endswith(f".{cls.__name__}"))
    shipped_class = get_class_from_dynamic_module(reference, path, **hub)
    shipped_class.register_for_auto_class(auto_class)  # save_pretrained copies the shipped code
    return shipped_class


def _listed(names, shown: int = 8) -> str:
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(str(name) for name in names[:shown]) + more


class MHARModel:
    """The decoder: embedding, routed layers, final site (full / block) and final norm."""

    layer_class: type
    norm_class: type
    rotary_class: type
    # A checkpoint of the causal LM holds the output layer too.
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]

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

    def _layer_masks(self, attention_mask, **mask_kwargs) -> list:
        """The attention mask of each layer (full, or sliding-window for Qwen3's sliding layers)."""
        types = getattr(self.config, "layer_types", None) or ["full_attention"] * len(self.layers)
        if isinstance(attention_mask, dict):  # already built by generate
            return [attention_mask[kind] for kind in types]
        masks = {"full_attention": create_causal_mask(attention_mask=attention_mask, **mask_kwargs)}
        if "sliding_attention" in types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(attention_mask=attention_mask, **mask_kwargs)
        return [masks[kind] for kind in types]

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
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
        stream = depth_stream(self.layout, buffered=not torch.is_grad_enabled())
        state = stream.start(inputs_embeds)
        for layer, mask in zip(self.layers, masks):
            state = layer(
                *state,
                stream=stream,
                attention_mask=mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **kwargs,
            )
        hidden_states = self.norm(stream.output(state, self.final_router))
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class MHARForCausalLM:
    """``MHAR<Family>Model`` plus the output layer (tied to the embedding or not); mixed in
    before the family's pre-trained model class, which ``GenerationMixin`` follows."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    model_class: type

    def __init__(self, config):
        super().__init__(config)
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
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
        outputs: BaseModelOutputWithPast = self.model(
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
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# ---------------------------------------------------------------- the families


class MHARLlamaPreTrainedModel(MHARPreTrainedModel):
    config_class = MHARLlamaConfig
    config: MHARLlamaConfig
    _no_split_modules = ["MHARLlamaDecoderLayer"]
    _can_record_outputs = recorded_outputs(LlamaAttention, LlamaRMSNorm)


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
    _can_record_outputs = recorded_outputs(Qwen3Attention, Qwen3RMSNorm)


class MHARQwen3Model(MHARModel, MHARQwen3PreTrainedModel):
    layer_class = MHARQwen3DecoderLayer
    norm_class = Qwen3RMSNorm
    rotary_class = Qwen3RotaryEmbedding


class MHARQwen3ForCausalLM(MHARForCausalLM, MHARQwen3PreTrainedModel, GenerationMixin):
    model_class = MHARQwen3Model


class MHARQwen3MoePreTrainedModel(MHARPreTrainedModel):
    config_class = MHARQwen3MoeConfig
    config: MHARQwen3MoeConfig
    _no_split_modules = ["MHARQwen3MoeDecoderLayer"]
    _can_record_outputs = recorded_outputs(Qwen3MoeAttention, Qwen3MoeRMSNorm)


class MHARQwen3MoeModel(MHARModel, MHARQwen3MoePreTrainedModel):
    layer_class = MHARQwen3MoeDecoderLayer
    norm_class = Qwen3MoeRMSNorm
    rotary_class = Qwen3MoeRotaryEmbedding


class MHARQwen3MoeForCausalLM(MHARForCausalLM, MHARQwen3MoePreTrainedModel, GenerationMixin):
    model_class = MHARQwen3MoeModel


# Qwen3-MoE checkpoints store each expert's projections apart (``mlp.experts.{e}.gate_proj``) while
# transformers holds a layer's experts fused, converting on load by model type: the MHAR form's as Qwen3-MoE's.
register_checkpoint_conversion_mapping(
    MHARQwen3MoeConfig.model_type, get_checkpoint_conversion_mapping("qwen3_moe"), overwrite=True
)


__all__ = [
    "MHARLlamaForCausalLM",
    "MHARLlamaModel",
    "MHARLlamaPreTrainedModel",
    "MHARQwen3ForCausalLM",
    "MHARQwen3Model",
    "MHARQwen3PreTrainedModel",
    "MHARQwen3MoeForCausalLM",
    "MHARQwen3MoeModel",
    "MHARQwen3MoePreTrainedModel",
]
