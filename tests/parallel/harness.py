"""Train one tiny MHAR GPT under a parallel layout and under a single process, compare.

Workers live at module level so that ``tests.helpers.DistributedStream`` can pickle
them. One spawned process group runs many (layout, variant) jobs in a row: Megatron's
model-parallel state is rebuilt per job, torch.distributed is set up once.

Every job trains ``STEPS`` optimizer steps of the same global batch (``NUM_MICROBATCHES``
micro-batches of ``MBS`` sequences, split over data-parallel ranks) through
:func:`megatron_mhar.parallel.forward_backward`, Megatron DDP, ``finalize_model_grads``
and ``get_megatron_optimizer`` (SGD, gradient clipping on), starting from the weights
of the single-process reference model (TP slices and pipeline chunks cut from them).
It returns the global loss of every step and every parameter's gradient at step 1
(after Megatron's finalize), keyed by the parameter's single-process name.

A variant named ``moe-<variant>`` is the same routing over an MoE model (:data:`MOE`:
Megatron's MoE layer in every decoder layer, its load-balancing and z-losses on), which
layouts with expert parallelism (``Layout.ep``, ``Layout.etp``) split by experts;
``deep-<variant>`` the same routing over :data:`DEEP` (8 narrower layers), for layouts of
more than 4 chunks.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from tests.helpers import lm_batches

SEQ, MBS, NUM_MICROBATCHES, VOCAB, NUM_LAYERS = 8, 2, 4, 64, 4
STEPS = 3
LR = 0.2
QUERY_STD = 0.3  # routing logits of order 1: a well-conditioned reference
SEED = 1234

# Routing configurations under test. block: 3 sublayers per block (a block is 1.5
# decoder layers), so running partials cross stage boundaries (sites 3 and 5).
VARIANTS = {
    "none": dict(variant="none"),
    "full": dict(variant="full", num_heads=4),
    "block": dict(variant="block", block_size=3, num_heads=2),
    # delta: a block source after every decoder layer, so rows, the stream and the
    # block start all cross stage boundaries.
    "delta": dict(variant="delta", delta_block_layers=1, num_heads=2),
}

# The MoE model of the ``moe-*`` variants: 4 experts of width 16, top-2, the router losses
# on (their gradients must count once under every layout), the CPU's all-gather dispatcher.
# ``moe-halfloss-*``: the same model with half the router-loss coefficients.
AUX_LOSS, Z_LOSS = 1e-2, 1e-3
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_token_dispatcher_type="allgather")


# ``mtp-*``: the same model with two multi-token prediction depths (Megatron's MTP block on
# the last stage), their losses weighted 0.5 so they move the gradients visibly.
MTP = dict(mtp_num_layers=2, mtp_loss_scaling_factor=0.5)


# ``deep-*``: 8 layers of half the width, so that PP4 x VPP2 has a layer per chunk and its
# 4 ranks still run in seconds.
DEEP = dict(num_layers=8, hidden_size=16, num_attention_heads=2, num_query_groups=1, ffn_hidden_size=24)


def split_variant(variant: str) -> Tuple[dict, str]:
    """(the MoE, MTP and depth fields of the model, or none, and the routing variant) of a
    variant name such as ``full``, ``moe-full``, ``moe-halfloss-full``, ``mtp-full`` or
    ``deep-full``."""
    for prefix, extra in (("mtp-", MTP), ("deep-", DEEP)):
        if variant.startswith(prefix):
            fields, routing = split_variant(variant[len(prefix):])
            return dict(fields, **extra), routing
    for prefix, scale in (("moe-halfloss-", 0.5), ("moe-", 1.0)):
        if variant.startswith(prefix):
            return dict(MOE, moe_aux_loss_coeff=scale * AUX_LOSS, moe_z_loss_coeff=scale * Z_LOSS), variant[len(prefix):]
    return {}, variant


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parallel layout; the data-parallel size is what ``world`` leaves over."""

    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    dp: int = 1
    sp: bool = False
    first: Optional[int] = None
    """num_layers_in_first_pipeline_stage (uneven stages)."""
    last: Optional[int] = None
    """num_layers_in_last_pipeline_stage (uneven stages)."""
    overlap_p2p: bool = False
    """overlap_p2p_comm (interleaved schedule): receives are posted asynchronously."""
    unmark_routing_sp: bool = False
    """Drop the routing parameters' ``sequence_parallel`` marking (negative test)."""
    ep: int = 1
    """expert_model_parallel_size (carved out of the data- and tensor-parallel ranks)."""
    etp: Optional[int] = None
    """expert_tensor_parallel_size (``None``: tp)."""
    pipeline_cache: bool = True
    """mhar.pipeline_cache (cross-stage caching of the history; interleaved pipelines only)."""

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def model_config(variant: str = "none"):
    from megatron_mhar.models.gpt_config import GPTModelConfig

    fields = dict(num_layers=NUM_LAYERS, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48)
    fields.update(split_variant(variant)[0])
    return GPTModelConfig(vocab_size=VOCAB, make_vocab_size_divisible_by=32, seq_length=SEQ,
                          qk_layernorm=True, **fields)


LOOKAHEAD = "lookahead-"
"""Prefix of a routing variant on the lookahead schedule (``lookahead-full``: groups of the
auto size; ``lookahead-block`` / ``lookahead-delta``: the blocks as groups)."""


def mhar_config(variant: str, pipeline_cache: bool = True):
    from megatron_mhar.models.mhar_config import MHARConfig

    routing = split_variant(variant)[1]
    schedule = "lookahead" if routing.startswith(LOOKAHEAD) else "per_site"
    return MHARConfig(**VARIANTS[routing.removeprefix(LOOKAHEAD)], routing_schedule=schedule,
                      pipeline_cache=pipeline_cache)


def transformer_config(layout: Layout, variant: str):
    from megatron_mhar.models.builder import make_transformer_config

    return make_transformer_config(
        model_config(variant),
        mhar_config(variant, layout.pipeline_cache),
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        sequence_parallel=layout.sp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        num_layers_in_first_pipeline_stage=layout.first,
        num_layers_in_last_pipeline_stage=layout.last,
        pipeline_dtype=torch.float32,
        calculate_per_token_loss=True,
        batch_p2p_comm=False,  # gloo has no batch_isend_irecv
        overlap_p2p_comm=layout.overlap_p2p,
        use_cpu_initialization=True,
    )


def build_chunks(layout: Layout, variant: str, config) -> List[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage of this rank."""
    from megatron.core import parallel_state

    from megatron_mhar.models.builder import build_gpt_model
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        vp = vp_stage if layout.vpp else None
        chunks.append(
            build_gpt_model(
                model_config(variant), mhar_config(variant, layout.pipeline_cache), config,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                vp_stage=vp,  # with SP, the builder picks the sequence-parallel norm itself
            )
        )
    return chunks


def global_name(chunk: torch.nn.Module, name: str) -> str:
    """The single-process name of a chunk's parameter (layer and expert indices made global)."""
    prefix = "decoder.layers."
    if name.startswith(prefix):
        index, rest = name[len(prefix):].split(".", 1)
        layer = chunk.decoder.layers[int(index)]
        experts = "mlp.experts.local_experts."
        if rest.startswith(experts):
            local, rest = rest[len(experts):].split(".", 1)
            rest = f"{experts}{layer.mlp.local_expert_indices[int(local)]}.{rest}"
        return f"{prefix}{layer.layer_number - 1}.{rest}"
    return name


def is_expert(param: torch.nn.Parameter) -> bool:
    """Megatron marks the experts' parameters ``allreduce=False`` (reduced over the
    expert-data-parallel ranks, sharded over the expert-tensor-parallel ones)."""
    return not getattr(param, "allreduce", True)


def tp_rank_and_size(param: torch.nn.Parameter) -> Tuple[int, int]:
    """The tensor-parallel rank and size ``param`` is sharded over (expert TP for experts)."""
    from megatron.core import parallel_state

    if is_expert(param):
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _is_glu_fc1(name: str) -> bool:
    """SwiGLU fc1 weights (dense MLPs, experts, shared experts) are [gate; up]; each TP rank
    holds [gate shard; up shard]."""
    return name.endswith("linear_fc1.weight")


def tp_shard(name: str, value: torch.Tensor, tp_size: int, dim: int) -> List[torch.Tensor]:
    """The TP shards of a full tensor, in TP rank order."""
    if _is_glu_fc1(name):
        gate, up = value.chunk(2, dim=dim)
        return [torch.cat(pair, dim=dim) for pair in zip(gate.chunk(tp_size, dim), up.chunk(tp_size, dim))]
    return list(value.chunk(tp_size, dim=dim))


def tp_unshard(name: str, shards: List[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of :func:`tp_shard`."""
    if _is_glu_fc1(name):
        pairs = [shard.chunk(2, dim=dim) for shard in shards]
        return torch.cat([torch.cat([g for g, _ in pairs], dim), torch.cat([u for _, u in pairs], dim)], dim)
    return torch.cat(shards, dim=dim)


def load_full_weights(chunk: torch.nn.Module, full: Dict[str, torch.Tensor]) -> None:
    """Copy the reference weights into a chunk (TP slices along ``partition_dim``)."""
    for name, param in chunk.named_parameters():
        tp_rank, tp_size = tp_rank_and_size(param)
        key = global_name(chunk, name)
        if key == "output_layer.weight" and key not in full:  # tied: the last stage's copy
            key = "embedding.word_embeddings.weight"
        value = full[key]
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            value = tp_shard(key, value, tp_size, param.partition_dim)[tp_rank]
        assert value.shape == param.shape, (name, tuple(value.shape), tuple(param.shape))
        with torch.no_grad():
            param.copy_(value)


def global_batches() -> List[Dict[str, torch.Tensor]]:
    return lm_batches(NUM_MICROBATCHES, MBS, SEQ, VOCAB)


def _loss_func(loss_mask, output_tensor):
    """Sum of token losses and the token count (Megatron's per-token-loss convention)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask)
    return loss, mask.sum().to(torch.int), {"lm loss": torch.stack([loss.detach(), mask.sum()])}


def _forward_step(data_iterator, model):
    from functools import partial

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def train(config, chunks, batches, steps: int = STEPS, sent_bytes: Optional[dict] = None):
    """Megatron DDP + finalize_model_grads + get_megatron_optimizer.

    Returns (global loss of every step and of a final forward-only pass,
    {name: (grad at step 1, TP partition dim or None)}). ``sent_bytes`` receives the bytes
    this rank sent at step 1 under an interleaved schedule (``forward_backward``'s).
    """
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = [
        DistributedDataParallel(config, DistributedDataParallelConfig(), chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0, clip_grad=1.0),
        model,
        use_gloo_process_groups=False,
    )
    losses, grads = [], {}
    for step in range(steps):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        reports = _schedule(model, batches, sent_bytes=sent_bytes if step == 0 else None)
        if step == 0:
            for chunk in chunks:
                for name, param in chunk.named_parameters():
                    sharded = getattr(param, "tensor_model_parallel", False) and tp_rank_and_size(param)[1] > 1
                    dim = param.partition_dim if sharded else None
                    grads[global_name(chunk, name)] = (param.main_grad.detach().clone(), dim,
                                                       tp_rank_and_size(param)[0])
        update_ok, _, _ = optimizer.step()
        assert update_ok
        losses.append(_global_loss(reports))
    # An evaluation pass: the forward-only path of the same schedule.
    losses.append(_global_loss(_schedule(model, batches, forward_only=True)))
    return losses, grads


def _schedule(model, batches, forward_only=False, sent_bytes=None):
    """One pass of the layout's Megatron schedule over all micro-batches."""
    from megatron_mhar.parallel import forward_backward

    return forward_backward(
        forward_step_func=_forward_step,
        data_iterator=[iter(batches) for _ in model],
        model=model,
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=MBS,
        forward_only=forward_only,
        sent_bytes=sent_bytes,
    )


def _global_loss(reports) -> float:
    """Mean token loss over the global batch, on every rank."""
    from megatron.core import parallel_state

    total = torch.zeros(2, dtype=torch.float64)
    if parallel_state.get_tensor_model_parallel_rank() == 0:  # one copy per DP replica
        for report in reports:  # empty except on the last pipeline stage
            total += report["lm loss"].to(torch.float64)
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
    return (total[0] / total[1]).item()


def randomize_routers(model: torch.nn.Module, seed: int = 3) -> None:
    """Non-trivial routing (zero queries would route uniformly)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("router.query"):
                param.copy_(QUERY_STD * torch.randn(param.shape, generator=generator))
            elif name.endswith("router.norm_weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("router.gate", "router.null_source")):  # delta
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))


def reference(variant: str):
    """Single-process run (Megatron initialised with world size 1 by the caller).

    Returns (initial weights, losses, step-1 grads by name).
    """
    from megatron.core import tensor_parallel

    layout = Layout()
    config = transformer_config(layout, variant)
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED, force_reset_rng=True)
    (model,) = build_chunks(layout, variant, config)
    randomize_routers(model)
    full = {name: param.detach().clone() for name, param in model.named_parameters()}
    losses, grads = train(config, [model], global_batches())
    return full, losses, {name: grad for name, (grad, *_) in grads.items()}


def references(variants) -> Dict[str, tuple]:
    """:func:`reference` of each variant, in this process as a world of one (launcher
    variables of the environment set aside): {variant: (weights, losses, grads)}."""
    import os
    from unittest import mock

    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env
    from tests.helpers import LAUNCHER_ENV

    with mock.patch.dict(os.environ, {}):
        for name in LAUNCHER_ENV:
            os.environ.pop(name, None)
        initialize_model_parallel_from_env(tp=1, pp=1, seed=SEED, device="cpu")
        try:
            return {variant: reference(variant) for variant in variants}
        finally:
            destroy()


def _run_job(layout: Layout, variant: str, full: Dict[str, torch.Tensor]):
    from megatron.core import parallel_state

    config = transformer_config(layout, variant)
    chunks = build_chunks(layout, variant, config)
    for chunk in chunks:
        load_full_weights(chunk, full)
        if layout.unmark_routing_sp:
            for name, param in chunk.named_parameters():
                if "router." in name:
                    param.sequence_parallel = False
    dp_rank = parallel_state.get_data_parallel_rank()
    per_rank = NUM_MICROBATCHES // layout.dp
    batches = global_batches()[dp_rank * per_rank: (dp_rank + 1) * per_rank]
    sent_bytes = {}
    losses, grads = train(config, chunks, batches, sent_bytes=sent_bytes)
    return dict(
        losses=losses,
        grads=grads,
        sent_bytes=sent_bytes,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=dp_rank,
    )


def parallel_worker(jobs: List[Tuple[Layout, str]], weights: Dict[str, Dict[str, torch.Tensor]]):
    """Run every (layout, variant) job on this rank; yields one result dict per job, as it
    finishes (``tests.helpers.DistributedStream``)."""
    from megatron.core import parallel_state, tensor_parallel

    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    try:
        for index, (layout, variant) in enumerate(jobs):
            if index == 0:
                initialize_model_parallel_from_env(
                    tp=layout.tp, pp=layout.pp, vpp=layout.vpp, ep=layout.ep, etp=layout.etp, seed=SEED,
                    device="cpu", create_gloo_process_groups=False,
                )
            else:
                parallel_state.initialize_model_parallel(
                    tensor_model_parallel_size=layout.tp,
                    pipeline_model_parallel_size=layout.pp,
                    virtual_pipeline_model_parallel_size=layout.vpp,
                    expert_model_parallel_size=layout.ep,
                    expert_tensor_parallel_size=layout.etp,
                    create_gloo_process_groups=False,
                )
                tensor_parallel.model_parallel_cuda_manual_seed(SEED, force_reset_rng=True)
            result = _run_job(layout, variant, weights[variant])
            parallel_state.destroy_model_parallel()
            yield result
    finally:
        destroy()


def gather_grads(rank_results: List[dict]) -> Dict[str, torch.Tensor]:
    """Full-shape step-1 gradients from every rank of one job.

    TP shards are concatenated along their partition dim; replicated parameters are
    taken from TP rank 0 (:func:`replicated_grad_spread` compares the TP ranks).
    Data-parallel replicas must hold bitwise the same reduced gradient.
    The last stage's tied ``output_layer.weight`` is returned under its own name.
    """
    shards: Dict[str, Dict[int, Tuple[torch.Tensor, Optional[int]]]] = {}
    for result in rank_results:
        for name, (grad, dim, tp_rank) in result["grads"].items():
            key = (tp_rank, result["dp_rank"])
            shards.setdefault(name, {})[key] = (grad, dim)
    full = {}
    for name, by_rank in shards.items():
        tp_ranks = sorted({tp for tp, _ in by_rank})
        first = {tp: min(dp for t, dp in by_rank if t == tp) for tp in tp_ranks}
        dim = by_rank[(0, first[0])][1]
        for (tp, dp), (grad, _) in by_rank.items():  # DP replicas hold the same reduced grad
            torch.testing.assert_close(grad, by_rank[(tp, first[tp])][0], rtol=0, atol=0, msg=name)
        if dim is None:
            full[name] = by_rank[(0, first[0])][0]
        else:
            full[name] = tp_unshard(name, [by_rank[(tp, first[tp])][0] for tp in tp_ranks], dim)
    return full


def replicated_names(rank_results: List[dict]) -> List[str]:
    """Parameters that are not TP-sharded (norms, routing, replicated on every TP rank)."""
    return sorted({n for r in rank_results for n, (_, dim, _) in r["grads"].items() if dim is None})


def replicated_grad_spread(rank_results: List[dict], name: str) -> float:
    """Max difference of a replicated parameter's gradient between TP ranks."""
    holding = [r for r in rank_results if name in r["grads"]]
    first = min(r["dp_rank"] for r in holding)  # an expert is held by some DP ranks only
    grads = [r["grads"][name][0] for r in holding if r["dp_rank"] == first]
    return max((g - grads[0]).abs().max().item() for g in grads)
