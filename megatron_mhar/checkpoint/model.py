"""A GPT chunk to load a checkpoint into: built uninitialised (or on the meta device) for
this rank's tensor- and pipeline-parallel layout, and the TP slicing of full tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

from megatron_mhar.models.gpt_config import GPTModelConfig
from megatron_mhar.models.mhar_config import MHARConfig


def build_model(
    model: GPTModelConfig,
    mhar: MHARConfig,
    dtype: torch.dtype,
    device: str = "cpu",
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
):
    """This rank's GPT chunk (no VPP), uninitialised: every tensor is loaded afterwards.

    Routing parameters are exceptions: they are created with their identity values
    (the paper's initialisation) regardless of ``perform_initialization``. On
    ``device="meta"`` every other weight is a meta tensor, which holds no memory: the
    structure that :func:`~megatron_mhar.checkpoint.streaming.save_streamed` and
    :func:`~megatron_mhar.checkpoint.streaming.read_streamed` fill one tensor at a time.
    """
    from megatron.core import parallel_state

    from megatron_mhar.models.builder import build_gpt_model, make_transformer_config

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    check_layout(model, tp, pp)
    # The distributed checkpoint keys are the same for the local and the TE spec.
    local = dataclasses.replace(model, spec="local")
    config = make_transformer_config(
        local,
        mhar,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=device in ("cpu", "meta"),
        perform_initialization=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
    )
    first = parallel_state.is_pipeline_first_stage() if pre_process is None else pre_process
    last = parallel_state.is_pipeline_last_stage() if post_process is None else post_process
    # The routers place their parameters on the CPU themselves (use_cpu_initialization).
    with torch.device("meta") if device == "meta" else contextlib.nullcontext():
        chunk = build_gpt_model(local, mhar, config, pre_process=first, post_process=last)
    return chunk if device == "meta" else chunk.to(device)


def check_layout(model: GPTModelConfig, tp: int, pp: int) -> None:
    """Clear errors for layouts the model cannot be split into."""
    for flag, size in (("--tp", tp), ("--pp", pp)):
        if size < 1:
            raise ValueError(f"{flag} must be at least 1, got {size}")
    groups = model.num_query_groups or model.num_attention_heads
    if model.num_attention_heads % tp or groups % tp:
        raise ValueError(
            f"--tp {tp} must divide the attention heads ({model.num_attention_heads}) and the "
            f"KV heads ({groups})"
        )
    if model.num_layers % pp:
        raise ValueError(f"--pp {pp} must divide the number of layers ({model.num_layers})")
    expert_width = model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
    if model.is_moe and expert_width % tp:
        raise ValueError(f"--tp {tp} must divide the experts' width (moe_intermediate_size {expert_width})")


def tp_slice(name: str, full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of a full (TP=1 layout) tensor.

    The split dimension is the one where the full tensor is ``tp_size`` times the
    parameter (Megatron sets ``partition_dim`` only when it initialises weights,
    and conversion builds models without initialising them). SwiGLU's
    ``linear_fc1`` is the one split that is not a contiguous chunk: each rank
    holds ``[gate shard; up shard]``.
    """
    if tuple(full.shape) == tuple(param.shape):
        return full
    split = [d for d in range(full.dim()) if full.shape[d] != param.shape[d]]
    if (
        full.dim() != param.dim()
        or len(split) != 1
        or full.shape[split[0]] != tp_size * param.shape[split[0]]
    ):
        raise ValueError(
            f"{name}: converted shape {tuple(full.shape)} does not fit the model's "
            f"{tuple(param.shape)} (TP rank {tp_rank} of {tp_size})"
        )
    dim = split[0]
    if name.endswith("linear_fc1.weight"):  # dense MLPs and experts alike
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp_size, dim)[tp_rank], up.chunk(tp_size, dim)[tp_rank]], dim)
    return full.chunk(tp_size, dim=dim)[tp_rank]
