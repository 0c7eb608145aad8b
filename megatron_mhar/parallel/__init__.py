"""Parallelism support for MHAR decoders under Megatron's schedules (pipeline p2p shapes)."""

from megatron_mhar.parallel.pipeline import (
    LayoutP2PCommunicator,
    check_pipeline_config,
    chunk_widths,
    forward_backward,
    make_adjust_tensor_shapes_fn,
    receive_order,
    send_order,
)

__all__ = [
    "LayoutP2PCommunicator",
    "check_pipeline_config",
    "chunk_widths",
    "forward_backward",
    "make_adjust_tensor_shapes_fn",
    "receive_order",
    "send_order",
]
