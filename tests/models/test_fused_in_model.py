"""The fused routing inside the model, exact: fp32 Triton kernels (on the GPU where there is
one, else in the interpreter) against the torch routing in fp64, logits and every gradient.

The bf16 comparisons on a GPU (tests/models/test_model_gpu.py, test_te_spec.py) judge the
fused path against the bf16 noise of the torch path, which for a delta gate's gradient (one
sum over every token and channel whose terms nearly cancel) is as large as the gradient
itself. Here every gradient, the gates' included, must be the fp64 model's to fp32 accuracy.
"""

import dataclasses

import pytest
import torch

from tests.helpers import build_gpt, gpt_batch, randomize_routers, tiny_gpt_config, use_interpreter_without_cuda

use_interpreter_without_cuda()  # before anything imports the kernels (tests/kernels/conftest.py)

from megatron_mhar.models.mhar_config import MHARConfig  # noqa: E402

VARIANTS = [
    pytest.param(MHARConfig(variant="delta", num_heads=4, delta_block_layers=1), id="delta1"),
    pytest.param(MHARConfig(variant="delta", num_heads=4, delta_block_layers=1, routing_schedule="lookahead"),
                 id="delta1-lookahead"),
    pytest.param(MHARConfig(variant="block", num_heads=4, block_size=3), id="block3"),
    # The blocks as lookahead groups: merges of the running partial, the partial's gradient
    # from its merge's factors, the blocks' gradients from phase 1.
    pytest.param(MHARConfig(variant="block", num_heads=4, block_size=3, routing_schedule="lookahead"),
                 id="block3-lookahead"),
    pytest.param(MHARConfig(variant="full", num_heads=4), id="full"),
    pytest.param(MHARConfig(variant="full", num_heads=4, routing_schedule="lookahead", lookahead_group=3),
                 id="full-lookahead3"),
]


def _logits_and_grads(model, dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run on the GPU where there is one
    tokens, positions = (t.to(device) for t in gpt_batch())
    labels = gpt_batch(seed=1)[0].to(device)
    model.to(device=device, dtype=dtype)
    logits = model(tokens, positions, None)
    loss = torch.nn.functional.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return logits.detach().double(), {name: p.grad.double() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mhar", VARIANTS)
def test_fused_routing_in_fp32_is_the_fp64_model(request, mhar):
    # Megatron's CUDA runtime where the kernels run on the GPU (the CPU one keeps the model there).
    request.getfixturevalue("megatron_cuda_world1" if torch.cuda.is_available() else "megatron_world1")
    cfg = tiny_gpt_config(spec="local")
    reference = build_gpt(cfg, dataclasses.replace(mhar, kernel_impl="torch"))
    randomize_routers(reference)
    fused = build_gpt(cfg, dataclasses.replace(mhar, kernel_impl="triton"))
    fused.load_state_dict(reference.state_dict())
    logits_ref, grads_ref = _logits_and_grads(reference, torch.float64)
    logits, grads = _logits_and_grads(fused, torch.float32)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5 * logits_ref.abs().max().item())
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads_ref.items():
        # 1e-5 of the tensor's scale: fp32's accumulated rounding, three orders below what a
        # wrong term of any gradient (a gate's sum without one source, say) moves it by.
        # A router's scale is the largest of its kind: a site reading one source has a
        # constant softmax, so its query and norm gradients are zero by cancellation of terms
        # as large as the other sites' (the lookahead merges take delta from the output and
        # leave rounding there; the per-site kernels renormalise it to an exact zero).
        kind = name.rsplit(".", 1)[-1] if "router." in name else None
        scale = max(g.abs().max().item() for n, g in grads_ref.items() if n == name or (kind and "router." in n
                                                                                        and n.endswith("." + kind)))
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
