"""The routers' parameter gradients straight into Megatron DDP's fp32 gradient buffer.

Megatron's DDP gives each parameter a ``main_grad`` view of its fp32 gradient buffer and, on
every backward, adds ``param.grad`` into it from a hook (two tiny kernels per routing site:
one add per query and one per norm weight, plus the casts to the parameters' dtype before).
Megatron's own layers skip that add with gradient-accumulation fusion: they accumulate the
weight gradient into ``main_grad`` themselves, set ``param.grad_added_to_main_grad`` so the
hook leaves it, and hand autograd an uninitialised placeholder so the hook still runs (and,
with overlapped gradient reduction, marks the bucket ready). The lookahead schedule's group
backward does the same with the fp32 sums it already holds (the per-site schedule does not yet), in one multi-tensor launch per list of gradients, not
one per parameter; the gradients are accumulated in fp32 without the round trip through
the parameters' dtype.
"""

from typing import List, Optional, Sequence

import torch


def fusable(params: Sequence[torch.Tensor]) -> bool:
    """Whether every parameter has Megatron DDP's fp32 ``main_grad`` and its
    ``grad_added_to_main_grad`` flag (a parameter outside DDP, or a cast or view of one, has
    neither and gets its gradient through autograd as usual)."""
    return bool(params) and all(
        getattr(p, "main_grad", None) is not None
        and hasattr(p, "grad_added_to_main_grad")
        and p.main_grad.dtype == torch.float32
        and p.main_grad.shape == p.shape
        for p in params
    )


def add_to_main_grads(
    params: Sequence[torch.Tensor], *grad_lists: Sequence[Optional[torch.Tensor]]
) -> List[torch.Tensor]:
    """Add each list's fp32 gradients (aligned with ``params``; None adds nothing) into the
    parameters' ``main_grad``, flag them added and return the placeholders to give autograd
    as their gradients. Call only where :func:`fusable` holds.

    As Megatron's layers do, a parameter with ``zero_out_wgrad`` set gets zeros (DDP's hook
    adds whatever it receives for those), every other one an uninitialised tensor, which the
    hook drops without reading."""
    targets = [p.main_grad for p in params]
    for grads in grad_lists:
        pairs = [(t, g) for t, g in zip(targets, grads, strict=True) if g is not None]
        if pairs:
            torch._foreach_add_([t for t, _ in pairs], [g for _, g in pairs])
    placeholders = []
    for p in params:
        p.grad_added_to_main_grad = True
        make = torch.zeros_like if getattr(p, "zero_out_wgrad", False) else torch.empty_like
        placeholders.append(make(p, memory_format=torch.contiguous_format))
    return placeholders
