"""The model on a GPU in bf16: every variant runs forward and backward; fused == reference."""

import pytest
import torch

from megatron_mhar.models.mhar_config import MHARConfig
from tests.helpers import gradient_tolerance, record_gate_gradient_scales

pytestmark = pytest.mark.gpu

SEQ, BATCH, VOCAB = 128, 2, 512


BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)


def _model_config(attention_backend):
    from megatron_mhar.models.gpt_config import GPTModelConfig

    return GPTModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8,
                          num_query_groups=4, ffn_hidden_size=512, vocab_size=VOCAB,
                          seq_length=SEQ, qk_layernorm=True, attention_backend=attention_backend)


def _build(mhar, attention_backend="sdpa", seed=5, dtype=torch.bfloat16):
    from megatron.core import tensor_parallel

    from megatron_mhar.models.builder import build_gpt_model, make_transformer_config

    model_cfg = _model_config(attention_backend)
    precision = BF16 if dtype == torch.bfloat16 else {}
    config = make_transformer_config(model_cfg, mhar, **precision)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return build_gpt_model(model_cfg, mhar, config).cuda()


def _batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).cuda()
    positions = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, SEQ)
    return tokens, positions


def _loss_and_grads(model):
    tokens, positions = _batch()
    labels = tokens.roll(1, dims=0)  # unrelated to the inputs: loss ~ ln(vocab) at init
    loss = model(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


VARIANTS = [
    pytest.param(MHARConfig(variant="none"), id="none"),
    pytest.param(MHARConfig(variant="full", num_heads=8), id="full-H8"),
    pytest.param(MHARConfig(variant="full", num_heads=1), id="full-H1"),
    pytest.param(MHARConfig(variant="block", num_heads=8, block_size=3), id="block3"),
    pytest.param(MHARConfig(variant="delta", num_heads=8, delta_block_layers=1), id="delta1"),
    # Two-phase routing in groups of 2 (5 groups over the 9 sites), phase 1 on each kernel
    # family: the tensor-core backward defers the old rows' gradients to their writes.
    pytest.param(MHARConfig(variant="full", num_heads=8, routing_schedule="lookahead", lookahead_group=2,
                            lookahead_kernels="tensor_cores"), id="full-lookahead-dots"),
    pytest.param(MHARConfig(variant="full", num_heads=8, routing_schedule="lookahead", lookahead_group=2,
                            lookahead_kernels="row_loop"), id="full-lookahead-row-loop"),
    # The block variant's blocks as lookahead groups, each phase-1 kernel family.
    pytest.param(MHARConfig(variant="block", num_heads=8, block_size=3, routing_schedule="lookahead",
                            lookahead_kernels="tensor_cores"), id="block3-lookahead-dots"),
    pytest.param(MHARConfig(variant="block", num_heads=8, block_size=3, routing_schedule="lookahead",
                            lookahead_kernels="row_loop"), id="block3-lookahead-row-loop"),
    pytest.param(MHARConfig(variant="delta", num_heads=8, delta_block_layers=1, routing_schedule="lookahead"),
                 id="delta1-lookahead"),
]


@pytest.mark.parametrize("mhar", VARIANTS)
def test_bf16_forward_backward(megatron_cuda_world1, nan_uninitialised, mhar):
    """Finite loss and gradients, under deterministic mode, where uninitialised memory is
    NaN: a read of a row gradient that nothing stored yet (the history's fp32 gradient
    buffer is not zero-filled) or of an unfilled workspace slot shows."""
    model = _build(mhar)
    loss, grads = _loss_and_grads(model)
    assert torch.isfinite(loss) and 5.5 < loss.item() < 7.0  # ln(512) = 6.24 at init
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("mhar", VARIANTS[1:])
def test_fused_kernels_match_reference_in_model(megatron_cuda_world1, mhar):
    """impl=triton vs impl=torch inside the bf16 model, judged against an fp32 model.

    Flash-attention rule: the fused model's error against the fp32 reference is at most
    twice the error of the bf16 reference path, plus a small atol, for the loss and
    every gradient; a delta gate's atol is set by its gradient's magnitude sum
    (``tests.helpers.GATE_NOISE``).
    """
    import dataclasses

    fp32 = _build(dataclasses.replace(mhar, kernel_impl="torch"), dtype=torch.float32)
    # Non-trivial routing: random queries, norm weights, gates. Scale 0.1 keeps the H=1
    # logits (a sum over all 256 channels) in the range trained queries reach; at 0.3
    # they saturate the softmax and bf16 noise elsewhere dominates both paths.
    with torch.no_grad():
        generator = torch.Generator(device="cuda").manual_seed(1)
        for name, param in fp32.named_parameters():
            if "router" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=generator, device="cuda"))
    results = {}
    for impl, dtype in (("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.bfloat16)):
        model = _build(dataclasses.replace(mhar, kernel_impl=impl), dtype=dtype)
        with torch.no_grad():
            for p_model, p_ref in zip(model.parameters(), fp32.parameters()):
                p_model.copy_(p_ref)
        if dtype == torch.float32:
            gate_scales = record_gate_gradient_scales(model)
        results[impl, dtype] = _loss_and_grads(model)
    (loss_ref, grads_ref) = results["torch", torch.float32]
    (loss_bf16, grads_bf16) = results["torch", torch.bfloat16]
    (loss_fused, grads_fused) = results["triton", torch.bfloat16]
    assert (loss_fused - loss_ref).abs() <= 2 * (loss_bf16 - loss_ref).abs() + 1e-2
    for name, grad in grads_ref.items():
        fused_error = (grads_fused[name] - grad).abs().max()
        bf16_error = (grads_bf16[name] - grad).abs().max()
        assert fused_error <= 2 * bf16_error + gradient_tolerance(name, grad, gate_scales), (
            f"{name}: fused error {fused_error:.3g} vs bf16 reference error {bf16_error:.3g}"
        )


def test_variant_none_bitwise_equals_megatron_gpt(megatron_cuda_world1):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ours = _build(MHARConfig(variant="none"), attention_backend="megatron")
    config = TransformerConfig(**_model_config("megatron").transformer_config_kwargs(), **BF16)
    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    theirs = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
        vocab_size=512, max_sequence_length=SEQ, share_embeddings_and_output_weights=True,
        position_embedding_type="rope", rotary_base=10000,
    ).cuda()
    for (key, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), key
    tokens, positions = _batch()
    with torch.no_grad():
        assert torch.equal(ours(tokens, positions, None), theirs(tokens, positions, None))
