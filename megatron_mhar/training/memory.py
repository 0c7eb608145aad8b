"""Memory per GPU of a run's layout, estimated from the recipe before anything is built.

The driver prints it at start (rank 0), so a layout that cannot fit is seen before the
first step's ``memory_gb`` (the measurement) and before an out-of-memory error. Parameters
are counted exactly (the model's own shapes: tensor-parallel shards, the pipeline stage
holding the most, the experts of one expert-parallel rank); the bytes per parameter follow
Megatron's mixed-precision training (bf16 weights, fp32 gradients and Adam state, the
state sharded over the data-parallel ranks by the distributed optimizer: over the
expert-data-parallel ranks for the experts). Activations are an estimate per micro-batch
in flight (Korthikanti et al. 2022's per-layer terms, flash attention, the routed tokens
of MoE layers, the MHAR source history, the fp32 logits), times the micro-batches 1F1B
keeps in flight on the first stage, plus what cross-stage caching of the history keeps
under interleaving (:func:`pipeline_cache_bytes`).
"""

from __future__ import annotations

import dataclasses
import os

GB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU of the busiest rank (the first pipeline stage)."""

    dense_params: int
    """Parameters this rank holds outside the experts."""
    expert_params: int
    """Parameters of this rank's experts."""
    weights: float
    gradients: float
    optimizer: float
    activations: float
    """All micro-batches in flight."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def describe(self, layout: str) -> str:
        """One line for the console."""
        params = self.dense_params + self.expert_params
        experts = f" ({_count(self.expert_params)} in experts)" if self.expert_params else ""
        return (f"memory estimate per GPU ({layout}): {_count(params)} parameters{experts}; weights "
                f"{_size(self.weights)}, gradients {_size(self.gradients)}, optimizer "
                f"{_size(self.optimizer)}, activations ~{_size(self.activations)}; ~{_size(self.total)}")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if nbytes >= GB / 10 else f"{nbytes / 2**20:.1f} MB"


def layer_params(cfg, moe: bool) -> tuple:
    """(parameters outside the experts, parameters of the experts) of one decoder layer on one
    rank, MHAR routers included."""
    m, par = cfg.model, cfg.parallel
    tp = par.tensor_model_parallel_size
    etp = par.expert_tensor_parallel_size or tp
    h, heads = m.hidden_size, m.num_attention_heads
    head_dim = m.kv_channels or h // heads
    groups = m.num_query_groups or heads
    qkv_out = (heads + 2 * groups) * head_dim
    glu = 2 if m.swiglu else 1
    bias = m.add_bias_linear
    attention = (h * qkv_out + (qkv_out if (m.add_qkv_bias or bias) else 0)) // tp
    attention += heads * head_dim * h // tp + (h if bias else 0)
    norms = 2 * h + (2 * head_dim if m.qk_layernorm else 0)  # input, pre-MLP; q/k per head width
    dense = attention + norms + _routers_per_layer(cfg)
    if not moe:
        f = m.ffn_hidden_size or 4 * h
        return dense + (glu * f * h + f * h) // tp + ((glu * f) // tp + h if bias else 0), 0
    fe = m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * h
    experts = m.num_moe_experts // par.expert_model_parallel_size * (glu * fe * h + fe * h) // etp
    dense += m.num_moe_experts * h  # the router, replicated
    if m.moe_shared_expert_intermediate_size:
        fs = m.moe_shared_expert_intermediate_size
        dense += (glu * fs * h + fs * h) // tp
    return dense, experts


def _routers_per_layer(cfg) -> int:
    h, variant = cfg.model.hidden_size, cfg.mhar.variant
    if variant == "none":
        return 0
    if variant == "delta":
        return 2 * (3 * h + 1)  # query, key norm, null source, gate per site
    return 2 * 2 * h  # query and key norm per site


def model_params(cfg) -> tuple:
    """(dense, expert) parameters of the busiest rank: the first pipeline stage's layers
    (Megatron's even split) with the embedding, or the last's with the output layer."""
    m, par = cfg.model, cfg.parallel
    pp, tp = par.pipeline_model_parallel_size, par.tensor_model_parallel_size
    pattern = m.moe_layer_pattern()
    per_stage = m.num_layers // pp
    vocab = m.padded_vocab_size(tp) * m.hidden_size // tp
    final = m.hidden_size + (2 * m.hidden_size if cfg.mhar.variant in ("full", "block") else 0)
    stages = []
    for stage in range(pp):
        layers = [layer_params(cfg, pattern[i]) for i in range(stage * per_stage, (stage + 1) * per_stage)]
        dense = sum(d for d, _ in layers) + (vocab if stage == 0 else 0)
        if stage == pp - 1:
            dense += final + (vocab if not m.tie_embeddings or pp > 1 else 0)
        stages.append((dense, sum(e for _, e in layers)))
    return max(stages, key=sum)


def estimate_memory(cfg, world_size: int) -> MemoryEstimate:
    """The memory per GPU of ``cfg`` (a TrainConfig) launched on ``world_size`` ranks."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    expert_dp = max(1, world_size // ((par.expert_tensor_parallel_size or tp) * par.expert_model_parallel_size * pp))
    dense, experts = model_params(cfg)
    half = tr.precision in ("bf16", "fp8")
    weight_bytes, grad_bytes = (2 if half else 4), 4
    state = 12 if half else 8  # fp32 master copy (mixed precision), Adam's two moments
    if par.use_distributed_optimizer:
        optimizer = state * (dense / dp + experts / expert_dp)
    else:
        optimizer = state * (dense + experts)
    in_flight = pp if pp > 1 else 1
    activations = in_flight * _activations_per_micro_batch(cfg, half) + pipeline_cache_bytes(cfg)
    return MemoryEstimate(dense, experts, weight_bytes * (dense + experts), grad_bytes * (dense + experts),
                          optimizer, activations)


def pipeline_cache_bytes(cfg) -> float:
    """Bytes the cross-stage cache (``mhar.pipeline_cache``, interleaved pipelines) adds on the
    first stage: a later chunk's backward adds the cached rows' fp32 gradients into its
    earlier chunk's buffer, which then lives until that chunk's backward, up to P micro-batches
    later (the schedule's group). The histories themselves are held for backward anyway, and
    the smaller received tensors are not counted. Even chunks of ``L / (P V)`` layers."""
    from megatron_mhar.ops.routing_layout import layout_for

    m, par, mhar = cfg.model, cfg.parallel, cfg.mhar
    pp, vpp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size or 1
    if vpp == 1 or pp == 1 or mhar.variant == "none" or not mhar.pipeline_cache:
        return 0.0
    layout = layout_for(mhar.variant, m.num_layers, mhar.block_size, mhar.delta_block_layers)
    per_chunk = m.num_layers / (pp * vpp)
    # rank 0's chunk v takes the rows entering global chunk (v - 1) P + 1
    rows = sum(layout.rows_read(2 * int(((v - 1) * pp + 1) * per_chunk) + 1) for v in range(1, vpp))
    shard = par.tensor_model_parallel_size if par.sequence_parallel else 1
    return pp * rows * m.seq_length * cfg.training.micro_batch_size * m.hidden_size * 4 / shard


def _activations_per_micro_batch(cfg, half: bool) -> float:
    """Bytes one micro-batch keeps for backward on the first stage."""
    m, par, tr = cfg.model, cfg.parallel, cfg.training
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    s, b, h = m.seq_length, tr.micro_batch_size, m.hidden_size
    sbh = s * b * h * (2 if half else 4) / 2  # the paper's terms count 2-byte activations
    shard = tp if par.sequence_parallel else 1
    layers = m.num_layers // pp
    moe_layers = sum(m.moe_layer_pattern()[:layers])
    if tr.recompute_granularity == "full":
        per_layer = 2 * sbh / shard  # the layer inputs only
        total = layers * per_layer
    else:
        # Korthikanti et al.: 34 sbh per layer, 19 of them the MLP's (at width 4h), all sharded
        # with sequence parallelism, 10 replicated without it; flash attention keeps no s^2 term.
        sharded = par.sequence_parallel or tp == 1
        attention_norms = 15 * sbh / tp if sharded else 10 * sbh + 5 * sbh / tp
        dense_mlp = 19 * sbh / tp * (m.ffn_hidden_size or 4 * h) / (4 * h)
        moe_mlp = 0.0
        if m.is_moe:
            fe = m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * h
            etp = par.expert_tensor_parallel_size or tp
            # per routed token: its input and output copies (2 + 2) and the expert's SwiGLU
            # input and output (2 * fe + fe per channel, sharded over expert tensor parallelism);
            # plus the router's input
            moe_mlp = m.moe_router_topk * sbh * (4 + 6 * fe / (h * etp)) / shard + 2 * sbh / shard
        total = layers * attention_norms + (layers - moe_layers) * dense_mlp + moe_layers * moe_mlp
    # The MHAR source history (bf16 rows) and its fp32 gradient buffer during backward.
    sources = {"none": 0, "full": 1 + 2 * m.num_layers, "block": 1 + 2 * m.num_layers // max(cfg.mhar.block_size, 1),
               "delta": 3 + m.num_layers // cfg.mhar.delta_block_layers}[cfg.mhar.variant]
    total += sources * 6 * sbh / shard
    total += s * b * m.padded_vocab_size(tp) // tp * 4 if pp == 1 else 0  # fp32 logits (last stage)
    return total


def host_memory() -> int:
    """Bytes of this host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory() -> int:
    """Bytes of this rank's GPU."""
    import torch

    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def check_fits(estimate: MemoryEstimate, cfg, on_cpu: bool, ranks_on_host: int) -> None:
    """Raise a ``ValueError`` where the weights, gradients and optimizer state (counted
    exactly) of one rank exceed its GPU, or, on CPU, those of the host's ranks exceed the
    host's memory; the message names the fields to lower. Where only the activations (an
    estimate) take the total past it, say so on the console instead."""
    if on_cpu:
        where, have, ranks = "the host's memory", host_memory(), ranks_on_host
    else:
        where, have, ranks = "the GPU's memory", device_memory(), 1
    exact = ranks * (estimate.weights + estimate.gradients + estimate.optimizer)
    total = exact + ranks * estimate.activations
    of = f" for {ranks} ranks" if ranks > 1 else ""
    if exact > have:
        m, par = cfg.model, cfg.parallel
        tp = par.tensor_model_parallel_size
        tables = 1 if m.tie_embeddings and par.pipeline_model_parallel_size == 1 else 2  # input, output layer
        embedding = tables * m.padded_vocab_size(tp) * m.hidden_size // tp
        fields = (["model.vocab_size"] if embedding > (estimate.dense_params + estimate.expert_params) / 2 else
                  ["model.num_layers", "model.hidden_size", "model.ffn_hidden_size"])
        shard = ["parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size"]
        if not par.use_distributed_optimizer:
            shard.append("parallel.use_distributed_optimizer=true")
        raise ValueError(
            f"the model does not fit: its weights, gradients and optimizer state take {_size(exact)}{of} "
            f"(of ~{_size(total)} with activations), more than {where} ({_size(have)}). Lower "
            f"{', '.join(fields)}, or spread it over more GPUs ({', '.join(shard)})"
        )
    if total > have:
        print(f"warning: the memory estimate, ~{_size(total)}{of}, exceeds {where} ({_size(have)}) through "
              f"its activations (an estimate); lower training.micro_batch_size or model.seq_length, or set "
              f"training.recompute_granularity, should it run out of memory", flush=True)
