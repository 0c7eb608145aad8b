"""megatron_mhar.models.main_grad: the routers' gradients into Megatron DDP's fp32 buffer.

The whole path under Megatron DDP is tests/ops/test_lookahead.py's
``test_router_grads_accumulate_into_main_grad``; here the hook's protocol on bare tensors.
"""

import torch

from megatron_mhar.models.main_grad import accumulate_into_main_grad, fusable


def _ddp_param(values, main_grad, zero_out_wgrad=None):
    """A bf16 parameter as Megatron DDP leaves it: an fp32 ``main_grad`` and the flag."""
    param = torch.nn.Parameter(torch.tensor(values, dtype=torch.bfloat16))
    param.main_grad = torch.tensor(main_grad, dtype=torch.float32)
    param.grad_added_to_main_grad = False
    if zero_out_wgrad is not None:
        param.zero_out_wgrad = zero_out_wgrad
    return param


def test_gradients_added_in_fp32_and_placeholders_returned():
    """Each row of the stacks is added, unrounded, into its parameter's main_grad; the
    parameters are flagged, and autograd gets placeholders (zeros where the parameter asks
    DDP to zero its weight gradient)."""
    params = [_ddp_param([1.0, 2.0], [0.5, 0.5]), _ddp_param([3.0, 4.0], [1.0, -1.0], zero_out_wgrad=True)]
    grads = (torch.tensor([[1e-4, 3.0]]), torch.tensor([[1.0 + 2.0**-20, 0.0]]))
    placeholders = accumulate_into_main_grad(params, grads)
    assert torch.equal(params[0].main_grad, torch.tensor([0.5 + 1e-4, 3.5]))
    assert torch.equal(params[1].main_grad, torch.tensor([2.0 + 2.0**-20, -1.0]))
    assert all(p.grad_added_to_main_grad for p in params)
    assert [x.shape for x in placeholders] == [p.shape for p in params]
    assert [x.dtype for x in placeholders] == [torch.bfloat16] * 2
    assert torch.equal(placeholders[1], torch.zeros(2, dtype=torch.bfloat16))


def test_parameters_outside_ddp_are_left_to_autograd():
    """Without DDP's fp32 main_grad on every parameter the hook declines (None) and touches
    nothing: the history then casts the gradients for autograd itself."""
    with_ddp = _ddp_param([1.0], [0.0])
    plain = torch.nn.Parameter(torch.ones(1))
    half_buffer = _ddp_param([1.0], [0.0])
    half_buffer.main_grad = half_buffer.main_grad.bfloat16()
    assert fusable([with_ddp]) and not fusable([]) and not fusable([with_ddp, plain])
    assert not fusable([half_buffer])
    for params in ([with_ddp, plain], [half_buffer, with_ddp]):
        stacks = (torch.ones(len(params), 1),)
        assert accumulate_into_main_grad(params, stacks) is None
        assert torch.equal(with_ddp.main_grad, torch.zeros(1)) and not with_ddp.grad_added_to_main_grad
