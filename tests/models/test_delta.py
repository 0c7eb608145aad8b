"""The delta variant (the paper's variants): identity at init, its sources and gates."""

import pytest
import torch

from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.ops import depth_route_reference
from tests.helpers import build_gpt, capture_sublayers, gpt_batch, randomize_routers, tiny_gpt_config


def test_delta_at_init_computes_the_base_model_exactly(megatron_world1):
    """Zero gates: a converted model's logits equal the base GPT's, bitwise in fp32."""
    model_cfg = tiny_gpt_config(num_layers=5, attention_backend="megatron")
    base = build_gpt(model_cfg, MHARConfig(variant="none"))
    delta = build_gpt(model_cfg, MHARConfig(variant="delta", delta_block_layers=2), seed=99)
    missing, unexpected = delta.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all("router." in k for k in missing)
    randomize_routers(delta)
    with torch.no_grad():  # only the gates must be zero; queries, norms and nulls may be anything
        for name, param in delta.named_parameters():
            if name.endswith("router.gate"):
                param.zero_()
    tokens, positions = gpt_batch()
    with torch.no_grad():
        assert torch.equal(delta(tokens, positions, None), base(tokens, positions, None))


def test_delta_parameters(megatron_world1):
    """Per sublayer: query, norm weight and null source (d each) and one gate; no final site."""
    model_cfg = tiny_gpt_config()
    base = build_gpt(model_cfg, MHARConfig(variant="none"))
    delta = build_gpt(model_cfg, MHARConfig(variant="delta", delta_block_layers=model_cfg.num_layers))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    d, layers = model_cfg.hidden_size, model_cfg.num_layers
    assert count(delta) - count(base) == 2 * layers * (3 * d + 1)
    assert delta.decoder.final_router is None
    for name, param in delta.named_parameters():
        if name.endswith(("router.query", "router.gate", "router.null_source")):
            assert torch.equal(param, torch.zeros_like(param)), name


@pytest.mark.parametrize("block_layers", [1, 2, 4], ids=["every-layer", "two-layer-blocks", "no-block-read"])
def test_delta_sites_read_embedding_and_completed_block_deltas(megatron_world1, block_layers):
    model_cfg = tiny_gpt_config(num_layers=5)
    mhar = MHARConfig(variant="delta", delta_block_layers=block_layers, num_heads=8)
    model = build_gpt(model_cfg, mhar)
    randomize_routers(model)
    inputs, outputs = capture_sublayers(model)

    routers = [r for layer in model.decoder.layers for r in (layer.input_router, layer.pre_mlp_router)]
    hidden = block_start = outputs[0]
    rows = [outputs[0]]
    for site, (x, router) in enumerate(zip(inputs, routers), start=1):
        sources = torch.stack(rows + [router.null_source.expand_as(hidden)])
        routed = depth_route_reference(sources, router.query, router.norm_weight, 8, eps=1e-6)
        torch.testing.assert_close(x, hidden + router.gate * routed, rtol=1e-5, atol=1e-5,
                                   msg=f"site {site}")
        hidden = hidden + outputs[site]
        layer = (site + 1) // 2
        if site % 2 == 0 and layer % block_layers == 0:
            rows.append(hidden - block_start)  # the true block delta h_end - h_start
            block_start = hidden


def test_delta_gates_leave_zero_and_then_routing_learns(megatron_world1):
    model_cfg = tiny_gpt_config()
    model = build_gpt(model_cfg, MHARConfig(variant="delta", delta_block_layers=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):
        optimizer.zero_grad()
        tokens, positions = gpt_batch(step)
        model(tokens, positions, None, labels=tokens).float().mean().backward()
        query_grads = [p.grad for n, p in model.named_parameters() if n.endswith("router.query")]
        if step == 0:  # zero gates block every gradient but the gates' own
            assert all(g is None or not g.any() for g in query_grads)
        else:
            assert any(g is not None and g.any() for g in query_grads)
        optimizer.step()
    gates = [p for n, p in model.named_parameters() if n.endswith("router.gate")]
    assert all(g.abs().item() > 0 for g in gates)
