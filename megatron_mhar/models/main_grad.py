"""The routers' parameter gradients straight into Megatron DDP's fp32 gradient buffer.

Megatron's DDP gives each parameter a ``main_grad`` view of its fp32 gradient buffer and, on
every backward, adds ``param.grad`` into it from a hook (two tiny kernels per routing site:
one add per query and one per norm weight, plus the casts to the parameters' dtype before).
Megatron's own layers skip that add with gradient-accumulation fusion: they accumulate the
weight gradient into ``main_grad`` themselves, set ``param.grad_added_to_main_grad`` so the
hook leaves it, and hand autograd an uninitialised placeholder so the hook still runs (and,
with overlapped gradient reduction, marks the bucket ready).

:func:`accumulate_into_main_grad` does the same for the lookahead schedule's routing
parameters: it is the ``param_grads_hook`` of :class:`~megatron_mhar.ops.lookahead.LookaheadHistory`,
which hands it the fp32 sums each group's backward already holds. They are added in one
multi-tensor launch per group, not one per parameter, and in fp32, without the round trip
through the parameters' dtype. The per-site schedule's parameters take DDP's own path.
"""

from typing import List, Optional, Sequence, Tuple

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


def add_to_main_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Add the fp32 gradients ``grads`` (aligned with ``params``) into the parameters'
    ``main_grad``, flag them added and return the placeholders to give autograd as their
    gradients. Call only where :func:`fusable` holds.

    As Megatron's layers do, a parameter with ``zero_out_wgrad`` set gets zeros (DDP's hook
    adds whatever it receives for those), every other one an uninitialised tensor, which the
    hook drops without reading."""
    torch._foreach_add_([p.main_grad for p in params], list(grads))
    placeholders = []
    for p in params:
        p.grad_added_to_main_grad = True
        make = torch.zeros_like if getattr(p, "zero_out_wgrad", False) else torch.empty_like
        placeholders.append(make(p, memory_format=torch.contiguous_format))
    return placeholders


def accumulate_into_main_grad(
    params: Sequence[torch.Tensor], grad_stacks: Tuple[torch.Tensor, ...]
) -> Optional[List[torch.Tensor]]:
    """A ``param_grads_hook``: the fp32 gradients ``grad_stacks`` (stacks whose rows, in
    order, are the gradients of ``params``) added into Megatron DDP's ``main_grad`` and the
    placeholders for autograd returned; None, touching nothing, where the parameters are not
    :func:`fusable`."""
    if not fusable(params):
        return None
    return add_to_main_grads(params, [grad for stack in grad_stacks for grad in stack.unbind()])
