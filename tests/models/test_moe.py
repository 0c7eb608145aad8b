"""MoE decoders on CPU: Megatron-Core's MoE layer inside the MHAR layers.

* ``variant: none`` with MoE is Megatron's own MoE GPT (its block spec, its MoE layer):
  same parameters, bitwise logits and every gradient, with a shared expert, dense and MoE
  layers mixed, and the load-balancing and z-losses on;
* for every routing variant, Megatron's load-balancing and z-losses count exactly once:
  the gradients equal those of the model without them plus the two losses computed with
  Megatron's own functions from the routers' inputs (twice or none would differ), with
  and without full recomputation;
* the MoE fields are checked when the config is built, each error naming the field.
"""

from __future__ import annotations

import pytest
import torch

from megatron_mhar.models.mhar_config import MHARConfig
from tests.helpers import GPT_SEQ, GPT_VOCAB, build_gpt, gpt_batch, megatron_tiny_gpt_config, randomize_routers, tiny_gpt_config

EXPERTS, TOPK, EXPERT_FFN, SHARED_FFN = 4, 2, 24, 16
AUX, Z = 1e-2, 1e-3
MOE = dict(num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN,
           moe_shared_expert_intermediate_size=SHARED_FFN, moe_layer_freq=[1, 0, 1])


def moe_config(**overrides):
    """The tiny GPT (3 layers) with MoE layers 1 and 3 (4 experts, top-2, a shared expert)."""
    return tiny_gpt_config(**{**MOE, **overrides})


@pytest.fixture(autouse=True)
def aux_loss_scale():
    """Megatron's schedules set the aux losses' gradient scale as a class attribute; these
    tests call backward themselves, at scale 1 (the value outside a schedule)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    yield
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))


def _megatron_moe_gpt():
    """Megatron's own MoE GPTModel: its decoder block spec from its TransformerConfig (local
    spec), the architecture stated field by field (nothing from this package)."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = megatron_tiny_gpt_config(
        num_moe_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=EXPERT_FFN,
        moe_shared_expert_intermediate_size=SHARED_FFN, moe_layer_freq=[1, 0, 1], moe_aux_loss_coeff=AUX,
        moe_z_loss_coeff=Z, moe_token_dispatcher_type="allgather",
    )  # fmt: skip
    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm"),
        vocab_size=128, max_sequence_length=GPT_SEQ, share_embeddings_and_output_weights=True,
        position_embedding_type="rope", rotary_base=10000,
    )


def test_variant_none_is_megatron_moe_gpt(megatron_world1):
    """``none`` with MoE through the builder == Megatron's MoE GPT: parameters, logits and
    every gradient bitwise, the aux losses included (they reach the gradients)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.moe_layer import MoELayer

    ours = build_gpt(moe_config(attention_backend="megatron", moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z),
                     MHARConfig(variant="none"))
    theirs = _megatron_moe_gpt()
    assert type(ours) is GPTModel
    assert [isinstance(layer.mlp, MoELayer) for layer in ours.decoder.layers] == [True, False, True]
    assert ours.decoder.layers[0].mlp.shared_experts is not None
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert [k for k, v in ours_sd.items() if torch.is_tensor(v)] == [k for k, v in theirs_sd.items() if torch.is_tensor(v)]
    for key, value in theirs_sd.items():
        if torch.is_tensor(value):
            assert torch.equal(ours_sd[key], value), key
    tokens, positions = gpt_batch()
    outputs = [model(tokens, positions, None, labels=tokens) for model in (ours, theirs)]
    assert torch.equal(outputs[0], outputs[1])
    for output in outputs:
        output.float().mean().backward()
    grads = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        assert param.grad is not None and torch.equal(param.grad, grads[name].grad), name


def test_moe_pre_mlp_norm_keeps_its_checkpoint_key(megatron_world1):
    """The local spec stores a dense layer's pre-MLP norm as the norm Transformer Engine fuses
    into ``linear_fc1``; an MoE layer has no such layer, so its norm keeps its own key, the
    one of TE's MoE spec (a checkpoint loads under either spec). Dense and MoE layers mixed
    are stored per layer (Megatron's non-homogeneous layers)."""
    model = build_gpt(moe_config(), MHARConfig(variant="full", num_heads=4))
    keys = {name: tensor.key for name, tensor in model.sharded_state_dict().items() if "layernorm" in name}
    assert keys["decoder.layers.0.pre_mlp_layernorm.weight"] == "decoder.layers.0.pre_mlp_layernorm.weight"
    assert keys["decoder.layers.1.pre_mlp_layernorm.weight"] == "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"


def _router_losses(model, tokens, positions):
    """LM loss plus Megatron's load-balancing and z-losses of every MoE layer, computed with
    Megatron's own functions from the inputs the routers received in this forward."""
    from megatron.core.transformer.moe import moe_utils

    inputs = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, args, out: inputs.append((m, args[0])))
             for layer in model.decoder.layers if hasattr(layer.mlp, "router")]
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    for hook in hooks:
        hook.remove()
    assert len(inputs) == 2
    group = torch.distributed.group.WORLD
    for router, hidden in inputs:
        logits = moe_utils.router_gating_linear(hidden, router.weight, None, hidden.dtype).view(-1, EXPERTS)
        routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, TOPK, "softmax")
        per_expert, _, total = moe_utils.get_tokens_per_expert_and_token_count(routing_map, group, TOPK)
        loss = loss + moe_utils.switch_load_balancing_loss_func(scores, per_expert, total, TOPK, EXPERTS, AUX)
        loss = loss + moe_utils.z_loss_func(logits, Z)
    return loss


@pytest.mark.parametrize("variant,fields,recompute", [
    # the losses' gradients reach every earlier source
    pytest.param("full", dict(num_heads=4), None, id="full"),
    # through a block's running partial; full recomputation runs each router twice
    pytest.param("block", dict(num_heads=2, block_size=3), "full", id="block-full-recompute"),
    # through the gated corrections and the kept additive stream
    pytest.param("delta", dict(num_heads=2, delta_block_layers=1), "full", id="delta-full-recompute"),
])
def test_router_losses_count_once(megatron_world1, variant, fields, recompute):
    """The gradients of the model with the losses == those of the model without them plus the
    losses Megatron's functions compute from the routers' inputs."""
    mhar = MHARConfig(variant=variant, **fields)
    overrides = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    model = build_gpt(moe_config(moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z), mhar, **overrides)
    plain = build_gpt(moe_config(), mhar)
    randomize_routers(model)
    plain.load_state_dict(model.state_dict())
    tokens, positions = gpt_batch()
    model(tokens, positions, None, labels=tokens).float().mean().backward()
    _router_losses(plain, tokens, positions).backward()
    expected = dict(plain.named_parameters())
    largest = max(p.grad.abs().max().item() for p in expected.values())
    for name, param in model.named_parameters():
        ref = expected[name].grad
        # A delta gate's gradient is one sum with heavy cancellation: its rounding follows
        # the model's gradients, not the small result.
        scale = largest if ref.numel() == 1 else ref.abs().max().item()
        torch.testing.assert_close(param.grad, ref, rtol=1e-5, atol=1e-6 * scale, msg=name)
    # Without the losses, the router weights' gradients differ: the test can fail.
    plain.zero_grad()
    plain(tokens, positions, None, labels=tokens).float().mean().backward()
    router = "decoder.layers.0.mlp.router.weight"
    assert not torch.allclose(expected[router].grad, dict(model.named_parameters())[router].grad, rtol=1e-3)


@pytest.mark.parametrize("fields,message", [
    pytest.param(dict(num_moe_experts=0), "num_moe_experts must be positive", id="zero-experts"),
    pytest.param(dict(num_moe_experts=4, moe_router_topk=5), "moe_router_topk=5 exceeds", id="topk-over-experts"),
    pytest.param(dict(num_moe_experts=4, moe_router_topk=1), "moe_router_pre_softmax=true", id="topk1-post-softmax"),
    pytest.param(dict(num_moe_experts=4, moe_layer_freq=[1, 0]), "list of num_layers=3 flags", id="short-pattern"),
    pytest.param(dict(num_moe_experts=4, moe_layer_freq=[0, 0, 0]), "at least one 1", id="no-moe-layer"),
    pytest.param(dict(num_moe_experts=4, moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type must be",
                 id="dispatcher"),
    pytest.param(dict(num_moe_experts=4, moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="none"),
                 "adds no loss", id="coeff-without-type"),
    pytest.param(dict(moe_ffn_hidden_size=24), "num_moe_experts is null", id="moe-field-on-dense"),
])
def test_moe_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_gpt_config(**fields)
