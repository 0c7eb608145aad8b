"""Model chunks for the driver: the TransformerConfig, the GPT chunks and their DDP wrappers."""

from __future__ import annotations

from typing import List

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mhar.models.builder import build_gpt_model, fused_kernel_fields, make_transformer_config
from megatron_mhar.training.schema import TrainConfig

FP8_FORMAT = "hybrid"
"""``training.precision: fp8``'s formats: E4M3 for activations and weights in the forward
pass, E5M2 (more range) for the gradients of the backward pass."""

FP8_RECIPE = "tensorwise"
"""``training.precision: fp8``'s scaling: per-tensor current scaling (TE's
``Float8CurrentScaling``, Hopper and Ada), each tensor scaled by its own amax when it is
cast. Unlike delayed scaling it keeps no amax history: no state to checkpoint (a resume
continues exactly), no lag behind a sudden change of scale, and the autocast is entered per
layer. It applies to the linear layers of Transformer Engine's spec only; attention, norms,
the output layer and the MHAR routing run in bf16."""


def transformer_config(cfg: TrainConfig, on_cpu: bool) -> TransformerConfig:
    """The TransformerConfig of this run: architecture + parallel layout + numerics."""
    par, tr = cfg.parallel, cfg.training
    bf16 = tr.bf16_params
    fp8 = dict(fp8=FP8_FORMAT, fp8_recipe=FP8_RECIPE) if tr.precision == "fp8" else {}
    interleaved = par.virtual_pipeline_model_parallel_size is not None
    return make_transformer_config(
        cfg.model,
        cfg.mhar,
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
        sequence_parallel=par.sequence_parallel,
        expert_model_parallel_size=par.expert_model_parallel_size,
        expert_tensor_parallel_size=par.expert_tensor_parallel_size,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        # Loss is a sum over tokens; finalize_model_grads divides by the global token count.
        calculate_per_token_loss=True,
        # gloo has no batched isend/irecv (runtime.cpu). On NCCL the interleaved schedule
        # overlaps its p2p (Megatron-LM's default): batched, at PP=2 the tensors for the
        # previous and the next stage go to the same rank in one batch and arrive swapped
        # (the H200 showed a wrong loss from step 1). Non-interleaved 1F1B runs batched.
        overlap_p2p_comm=interleaved and not on_cpu,
        batch_p2p_comm=not on_cpu and not interleaved,
        recompute_granularity=tr.recompute_granularity,
        recompute_method=tr.recompute_method,
        recompute_num_layers=tr.recompute_num_layers,
        **fused_kernel_fields(cfg.model),
        **fp8,
    )


def build_model_chunks(cfg: TrainConfig, config: TransformerConfig, on_cpu: bool) -> List[DistributedDataParallel]:
    """One DDP-wrapped GPT chunk per virtual pipeline stage held by this rank."""
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = build_gpt_model(
            cfg.model,
            cfg.mhar,
            config,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
        )
        if config.bf16:
            _norms_to(chunk, config.params_dtype)
        if not on_cpu:
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)

    par = cfg.parallel
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.training.bf16_params,
        overlap_grad_reduce=par.overlap_grad_reduce,
        overlap_param_gather=par.overlap_param_gather,
        use_distributed_optimizer=par.use_distributed_optimizer,
        # The training loop checks the loss and gradients of each step before the update
        # (Trainer.train_step): a non-finite step is skipped or stops the run with a message,
        # where Megatron's per-bucket check raises from inside the schedule.
        check_for_nan_in_grad=False,
    )
    return [
        DistributedDataParallel(
            config=config,
            ddp_config=ddp_config,
            module=chunk,
            # Megatron's convention: only the first chunk buckets (the rest overlap anyway).
            disable_bucketing=i > 0,
        )
        for i, chunk in enumerate(chunks)
    ]


def _norms_to(chunk: torch.nn.Module, dtype: torch.dtype) -> None:
    """torch's norms (the local spec without apex) are built in fp32 whatever
    ``params_dtype`` says. One dtype for every parameter, as under Transformer Engine's
    norms or Megatron-LM's Float16Module: Megatron's mixed-precision optimizer numbers a
    group's bf16 parameters apart from its fp32 ones, and its checkpoint of a mixed group
    pairs the optimizer state with the wrong parameters (the save asserts on a shape)."""
    for module in chunk.modules():
        if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            module.to(dtype)


def unwrap(chunk) -> torch.nn.Module:
    """The GPTModel inside a DDP wrapper."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
