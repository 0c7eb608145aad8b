"""Megatron's full-iteration CUDA graph around the forward/backward schedule.

One training step launches tens of thousands of kernels; at the sizes this project
trains on one GPU the host, not the GPU, bounds an eager step (the 1B baseline's GPU is
busy about a fifth of the time on an H200 host). ``FullCudaGraphWrapper`` from
``megatron.core.full_cuda_graph`` runs the schedule eagerly for a warm-up call, captures
all micro-batches' forward and backward on the next one, and replays the graph after:
the step then costs one launch. The optimizer step stays outside the graph.

What capture needs, and this module provides:

* a graph state per schedule (:class:`FullIterationGraph`): the wrapper keeps its graph,
  result and call count in class attributes, one set per process, and the training
  benchmark runs several models in one process;
* everything on the capture stream from model construction on (:func:`capture_stream`):
  the gradient-accumulation nodes that Megatron's DDP creates at construction then belong
  to that stream, so the captured backward does not wait on the legacy default stream,
  which capture forbids (the torch release here lacks the override Megatron would set);
* graph-safe RNG streams: ``initialize_model_parallel_from_env(cuda_graph_rng=True)``.
"""

import contextlib
from typing import Callable

import torch

from megatron_mhar.training.schema import CUDA_GRAPH_MODES


class FullIterationGraph:
    """A forward/backward schedule under Megatron's ``FullCudaGraphWrapper``.

    Called as the schedule is (keyword arguments only): eager for ``warmup_steps`` calls,
    captured on the next, replayed after. ``forward_only`` calls are graphed apart from
    training calls, as the wrapper does.
    """

    def __init__(self, schedule: Callable, warmup_steps: int = 1):
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper

        if warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be >= 1 (an eager call first compiles the kernels and fills "
                f"the lazy caches, which capture cannot do), got {warmup_steps}"
            )
        self.wrapper = FullCudaGraphWrapper(schedule, cuda_graph_warmup_steps=warmup_steps)
        self.state = {
            "cuda_graph": {"training": None, "validation": None},
            "result": {"training": None, "validation": None},
            "curr_iteration": {"training": 0, "validation": 0},
        }

    def __call__(self, **kwargs):
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper

        shared = {name: getattr(FullCudaGraphWrapper, name) for name in self.state}
        for name, own in self.state.items():
            setattr(FullCudaGraphWrapper, name, own)
        try:
            return self.wrapper(**kwargs)
        finally:
            for name, value in shared.items():
                setattr(FullCudaGraphWrapper, name, value)


def capture_stream(mode: str):
    """Context that runs what follows on the graphs' capture stream (``mode`` other than
    ``"none"``), or does nothing."""
    if mode not in CUDA_GRAPH_MODES:
        raise ValueError(f"CUDA graph mode must be one of {CUDA_GRAPH_MODES}, got {mode!r}")
    if mode == "none":
        return contextlib.nullcontext()
    from megatron.core.full_cuda_graph import get_shared_capture_stream

    stream = get_shared_capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(stream)
