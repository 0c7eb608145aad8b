"""MHARTransformerBlock: owns the depth stream of each forward call and the final site."""

import dataclasses
from contextlib import nullcontext
from typing import Optional, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.enums import Fp8Recipe
from megatron.core.fp8_utils import get_fp8_context
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import get_pg_rank, get_pg_size, make_viewless_tensor

from megatron_mhar.models.routing import make_layout, new_stream


@dataclasses.dataclass
class MHARTransformerBlockSubmodules(TransformerBlockSubmodules):
    """Megatron's block submodules (the layers' specs, the final norm) plus the final routing
    site's router, a spec slot like the layers' routers
    (:class:`~megatron_mhar.models.layer.MHARTransformerLayerSubmodules`)."""

    final_router: Union[ModuleSpec, type, None] = None
    """The routing site ``2L + 1`` that feeds the final norm (built on the last pipeline
    stage of the variants that have one: not ``delta``, whose output is its stream)."""


class MHARTransformerBlock(TransformerBlock):
    """A decoder block that routes over depth instead of adding a residual stream.

    For each forward call the block creates the variant's stream (``DepthStream`` or
    ``DeltaStream``: the source history of that micro-batch), seeds it with the embedding (first pipeline stage) or with the
    packed history received from the previous stage, runs its layers on it, and then
    either produces the decoder output (the final routing site, or the additive stream
    of the delta variant) and the final norm (last stage) or returns the
    packed history ``[s, b, width * h]`` for the next stage. The width per boundary
    follows from :mod:`~megatron_mhar.ops.routing_layout`.

    The final routing site ``final_router`` (the spec's slot,
    :class:`MHARTransformerBlockSubmodules`) is a child module, so distributed checkpoints
    keep its parameters (parameters set directly on a block are dropped).
    Full activation recomputation (uniform and block methods) checkpoints chunks of
    layers with the stream's state tensors as the chunk inputs and outputs.

    Under FP8 (``config.fp8``, Transformer Engine layers) the layers run in TE's FP8
    autocast as Megatron's ``TransformerBlock`` runs them. The autocast changes only what TE
    modules do (their GEMMs); the routing between the layers is plain torch and Triton, so
    the history, the routed inputs and the routing parameters stay in the parameters' dtype
    (bf16), as does the final site outside the layers.
    """

    def __init__(self, config, spec, post_layer_norm=True, pre_process=True, post_process=True,
                 pg_collection=None, vp_stage: Optional[int] = None):
        super().__init__(
            config=config,
            spec=spec,
            post_layer_norm=post_layer_norm,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        self.mhar = config.mhar
        self.layout = make_layout(self.mhar, config.num_layers)
        self.routing_eps = self.mhar.eps if self.mhar.eps is not None else config.layernorm_epsilon
        pp_rank, self.pp_size = get_pg_rank(self.pg_collection.pp), get_pg_size(self.pg_collection.pp)
        offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        # Global 1-based sublayer indices entering and leaving this chunk of layers.
        self.first_site = 2 * offset + 1
        self.next_site = self.first_site + 2 * len(self.layers)
        # Cross-stage caching (interleaved pipelines): this chunk takes the rows its rank's
        # previous chunk held from `history_cache` and receives only the others; it keeps its
        # own history there for its rank's next chunk, unless it is the rank's last.
        vpp = config.virtual_pipeline_model_parallel_size or 1
        self.local_chunk = vp_stage or 0
        self.caches_history = self.mhar.pipeline_cache and vpp > 1
        self.feeds_cache = self.caches_history and self.local_chunk < vpp - 1
        chunk = self.local_chunk * self.pp_size + pp_rank  # in pipeline order over all ranks
        self.cached_input_rows = 0 if self.pre_process else self._cached_rows(chunk)
        self.receiver_cached_rows = 0 if self.post_process else self._cached_rows(chunk + 1)
        self.history_cache = None
        """The rank's :class:`~megatron_mhar.ops.history.HistoryCache`, which
        ``megatron_mhar.parallel.forward_backward`` sets for its schedule's run."""
        self.routing_recorder = None
        """A :class:`~megatron_mhar.models.routing.RoutingRecorder` to which each forward adds
        its per-site routing weights and entropy (a diagnostic; ``None``: nothing recorded)."""
        self.final_router = None
        if self.post_process and self.layout.has_final_site:
            final_router = getattr(self.submodules, "final_router", None)
            if final_router is None:
                raise ValueError(
                    "MHARTransformerBlock's spec names no final_router: build it with "
                    "models.specs.get_mhar_block_spec, or set the MHARTransformerBlockSubmodules slot"
                )
            self.final_router = build_module(final_router, config=config)
        if config.recompute_granularity == "full" and config.distribute_saved_activations:
            raise ValueError(
                "distribute_saved_activations is not supported by MHAR decoders (the chunk "
                "inputs are the depth stream's state, not hidden states); set it to False"
            )

    def _cached_rows(self, chunk: int) -> int:
        """History rows that chunk ``chunk`` (pipeline order) finds in its rank's cache: those
        its rank's previous chunk held at its end, i.e. entering chunk ``chunk - P + 1``."""
        if not self.caches_history or chunk < self.pp_size:
            return 0
        vp_stage, rank = divmod(chunk - self.pp_size + 1, self.pp_size)
        site = 2 * get_transformer_layer_offset(self.config, vp_stage, rank) + 1
        return self.layout.rows_read(site)

    def input_width(self) -> int:
        """Hidden-size multiples of this chunk's pipeline input ``[s, b, width * h]``."""
        if self.pre_process:
            return 1
        return self.layout.boundary_width(self.first_site, self.cached_input_rows)

    def output_width(self) -> int:
        """Hidden-size multiples of this chunk's output (1 on the last stage)."""
        if self.post_process:
            return 1
        return self.layout.boundary_width(self.next_site, self.receiver_cached_rows)

    def site_routers(self) -> dict:
        """Global routing site -> router, for this chunk's sites (and the final site)."""
        routers = {}
        for layer in self.layers:
            routers[layer.attention_site] = layer.input_router
            routers[layer.attention_site + 1] = layer.pre_mlp_router
        if self.final_router is not None:
            routers[self.next_site] = self.final_router
        return routers

    def forward(self, hidden_states, attention_mask, context=None, context_mask=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                rotary_pos_cos_sin=None, attention_bias=None, inference_context=None,
                packed_seq_params=None, sequence_len_offset=None, padding_mask=None,
                *, inference_params=None, dynamic_inference_decode_only=None):
        """[s, b, h] embedding (or [s, b, width * h] from the previous stage) -> output.

        Returns the final-normed [s, b, h] on the last stage, else the packed history.
        """
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError(
                "MHAR decoders do not support Megatron's KV-cache inference path; run the full "
                "sequence without an inference context"
            )
        if context is not None:
            raise NotImplementedError("MHAR decoders have no cross-attention")
        if not self.pre_process:
            hidden_states = self.input_tensor
        hidden = self.config.hidden_size
        stream = new_stream(
            self.layout, self.mhar, self.routing_eps, hidden_states[..., :hidden], routers=self.site_routers()
        )
        stream.routing = self.routing_recorder
        if self.pre_process:
            stream.write_embedding(hidden_states)
        else:
            cached = self._cache().take(self.local_chunk) if self.caches_history and self.local_chunk else None
            stream.load(hidden_states, self.first_site, cached, self.cached_input_rows)

        layer_kwargs = dict(
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            padding_mask=padding_mask,
        )
        rng_context = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if self.config.sequence_parallel
            else nullcontext()
        )
        with rng_context, self._block_fp8_context():
            if self.config.recompute_granularity == "full" and self.training:
                self._checkpointed_layers(stream, layer_kwargs)
            else:
                for layer in self.layers:
                    with self._layer_fp8_context(layer):
                        layer(depth_stream=stream, **layer_kwargs)

        if self.feeds_cache:
            self._cache().put(self.local_chunk, stream.history)
        if not self.post_process:
            packed = stream.pack(self.next_site, self.receiver_cached_rows)
            stream.history.release()
            return packed
        output = stream.output(self.final_router)
        stream.history.release()
        if self.final_layernorm is not None:
            output = self.final_layernorm(output)
        return make_viewless_tensor(inp=output, requires_grad=True, keep_graph=True)

    def _cache(self):
        if self.history_cache is None:
            raise RuntimeError(
                "mhar.pipeline_cache under an interleaved pipeline needs the schedule of "
                "megatron_mhar.parallel.forward_backward (it sets the rank's history cache); "
                "call it, or set mhar.pipeline_cache=false"
            )
        return self.history_cache

    def _block_fp8_context(self):
        """TE's FP8 autocast around all layers for delayed scaling, whose amax reduction runs
        once, at the exit (Megatron's TransformerBlock does the same)."""
        if self.config.fp8 and self.config.fp8_recipe == Fp8Recipe.delayed:
            return get_fp8_context(self.config)
        return nullcontext()

    def _layer_fp8_context(self, layer):
        """TE's FP8 autocast around one layer for the other recipes (current scaling,
        blockwise), which keep no state between layers (Megatron's TransformerBlock does the
        same; it is where Megatron keeps chosen layers in bf16)."""
        if self.config.fp8 and self.config.fp8_recipe != Fp8Recipe.delayed:
            return get_fp8_context(self.config, layer.layer_number - 1)
        return nullcontext()

    def _checkpointed_layers(self, stream, layer_kwargs: dict) -> None:
        """Run the layers under Megatron's activation checkpointing (full recompute)."""
        mask, rotary = layer_kwargs["attention_mask"], layer_kwargs["rotary_pos_emb"]
        static_kwargs = {k: v for k, v in layer_kwargs.items()
                         if k not in ("attention_mask", "rotary_pos_emb")}

        def run_chunk(start: int, end: int):
            def chunk_forward(attention_mask, rotary_pos_emb, *state):
                stream.restore_state(*state)
                for layer in self.layers[start:end]:
                    layer(depth_stream=stream, attention_mask=attention_mask,
                          rotary_pos_emb=rotary_pos_emb, **static_kwargs)
                return stream.checkpoint_state(self.first_site + 2 * end)

            return chunk_forward

        def checkpointed(start: int, end: int) -> None:
            state = tensor_parallel.checkpoint(
                run_chunk(start, end), False, mask, rotary,
                *stream.checkpoint_state(self.first_site + 2 * start),
            )
            stream.restore_state(*((state,) if torch.is_tensor(state) else state))

        num_layers = len(self.layers)
        chunk = self.config.recompute_num_layers
        if self.config.recompute_method == "uniform":
            for start in range(0, num_layers, chunk):
                checkpointed(start, min(start + chunk, num_layers))
        elif self.config.recompute_method == "block":
            for index in range(num_layers):
                if index < chunk:
                    checkpointed(index, index + 1)
                else:
                    state = stream.checkpoint_state(self.first_site + 2 * index)
                    run_chunk(index, index + 1)(mask, rotary, *state)
        else:
            raise ValueError(
                f"recompute_method must be 'uniform' or 'block', got {self.config.recompute_method!r}"
            )
