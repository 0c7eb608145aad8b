"""The lookahead schedule in the model: same loss and gradients as per-site routing.

CPU, fp32, torch backend of the grouped algorithm (megatron_mhar.ops.lookahead); the
kernels themselves are compared with the per-site reference in tests/kernels.
"""

import pytest
import torch

from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.ops.history import TORCH_BACKEND, SourceHistory
from megatron_mhar.ops.lookahead import TORCH_LOOKAHEAD, GroupSite, LookaheadHistory
from megatron_mhar.ops.schedules import auto_group_size, block_ranges, group_ranges, lookahead_groups
from tests.helpers import build_gpt, gpt_batch, randomize_routers, tiny_gpt_config


def _models(group, variant="full", **mhar_fields):
    model_cfg = tiny_gpt_config(attention_backend="megatron")
    per_site = build_gpt(model_cfg, MHARConfig(variant=variant, num_heads=4, **mhar_fields))
    randomize_routers(per_site)
    lookahead = build_gpt(
        model_cfg,
        MHARConfig(variant=variant, num_heads=4, routing_schedule="lookahead", lookahead_group=group,
                   **mhar_fields),
    )  # fmt: skip
    lookahead.load_state_dict(per_site.state_dict())
    return per_site, lookahead


def _loss_and_grads(model, seeds):
    """Forward every micro-batch first (all in flight), then one backward over their sum."""
    model.zero_grad(set_to_none=True)
    losses = []
    for seed in seeds:
        tokens, positions = gpt_batch(seed)
        losses.append(model(tokens, positions, None, labels=tokens).float().mean())
    torch.stack(losses).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.stack(losses).detach(), grads


@pytest.mark.parametrize(
    "group,seeds,logit_scale,variant",
    [
        # Groups of one: every site is its own phase 1 (no merge rows).
        pytest.param(1, (0,), 1.0, {}, id="G1"),
        # Groups of 3 over 7 sites: a ragged first group (one site), merges of 0-2 rows.
        pytest.param(3, (0,), 4.0, {}, id="G3-tauH"),
        # Sites 1 | 2-7: a one-site group over the embedding, then one group of six.
        pytest.param(6, (0,), 1.0, {}, id="G6"),
        # Auto size; two micro-batches in flight before one backward.
        pytest.param(0, (0, 1), 1.0, {}, id="auto-two-microbatches"),
        # Block variant, the groups its blocks: sites 1-2 | 3-4 | 5-6 | 7 (the final site alone),
        # every site after a block's first merging the block's running partial.
        pytest.param(0, (0, 1), 4.0, dict(variant="block", block_size=2), id="block2"),
        # Blocks of 4: 1-4 | 5-7, the final site reading the second block's partial.
        pytest.param(0, (0,), 1.0, dict(variant="block", block_size=4), id="block4-final-partial"),
        # Delta blocks of one layer (sites 1-2 | 3-4 | 5-6), each site merging its null source.
        pytest.param(0, (0, 1), 4.0, dict(variant="delta", delta_block_layers=1), id="delta1"),
        pytest.param(0, (0,), 1.0, dict(variant="delta", delta_block_layers=2), id="delta2"),
    ],
)
def test_lookahead_model_matches_per_site(megatron_world1, nan_uninitialised, group, seeds, logit_scale, variant):
    """Under deterministic mode (``nan_uninitialised``) a row gradient read before anything
    stored it (the history's fp32 buffer is not zero-filled) is NaN and fails this."""
    per_site, lookahead = _models(group, logit_scale=logit_scale, **variant)
    loss, grads = _loss_and_grads(per_site, seeds)
    loss_l, grads_l = _loss_and_grads(lookahead, seeds)
    torch.testing.assert_close(loss_l, loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_l.keys() and len(grads) == len(list(per_site.parameters()))
    for name in grads:
        # fp32 rounding only: the schedules sum in other orders, and delta comes from the
        # output instead of a second pass (amplified by the sharp softmax at tau = H).
        atol = 2e-5 * grads[name].abs().max().item() + 1e-7
        torch.testing.assert_close(grads_l[name], grads[name], rtol=1e-4, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


def test_lookahead_history_is_freed(megatron_world1):
    """The groups hold no reference back into the graph: histories die after backward."""
    import gc
    import weakref

    from megatron_mhar.ops import lookahead as lookahead_module

    created = []
    original_init = lookahead_module.LookaheadHistory.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        created.append(weakref.ref(self))

    _, model = _models(3)
    lookahead_module.LookaheadHistory.__init__ = recording_init
    try:
        for seed in range(2):
            tokens, positions = gpt_batch(seed)
            model(tokens, positions, None, labels=tokens).float().mean().backward()
    finally:
        lookahead_module.LookaheadHistory.__init__ = original_init
    gc.collect()
    assert len(created) == 2 and all(ref() is None for ref in created)


def test_group_site_with_unused_output(megatron_world1, nan_uninitialised):
    """A group whose middle site's routed output is not used: the phase-1 backward still
    covers it (it lies between sites that are), with zero workspace slots. Under
    deterministic mode uninitialised memory is NaN, so a slot left unzeroed shows."""
    s, b, d, heads = 3, 2, 16, 4
    generator = torch.Generator().manual_seed(0)
    embedding = torch.randn(s, b, d, generator=generator, requires_grad=True)
    weights = [(0.3 * torch.randn(d, d, generator=generator)).requires_grad_(True) for _ in range(2)]
    routers = [((0.5 * torch.randn(d, generator=generator)).requires_grad_(True),
                (1 + 0.2 * torch.randn(d, generator=generator)).requires_grad_(True)) for _ in range(3)]  # fmt: skip
    grad_out = torch.randn(s, b, d, generator=generator)

    def run(lookahead):
        kw = dict(num_heads=heads, eps=1e-6, logit_scale=1.3)
        if lookahead:
            history = LookaheadHistory(3, embedding, TORCH_BACKEND, TORCH_LOOKAHEAD, **kw)
            sites = [GroupSite(j + 1, j + 1, q, g) for j, (q, g) in enumerate(routers)]

            def route(j):
                return history.route_group(sites, j)
        else:
            history = SourceHistory(3, embedding, TORCH_BACKEND, **kw)

            def route(j):
                return history.route(j + 1, *routers[j])
        history.write(0, embedding)
        row1 = torch.tanh(route(0) @ weights[0])
        history.write(1, row1)
        route(1)  # not used
        history.write(2, torch.tanh(row1 @ weights[1]))
        out = route(2)
        leaves = [embedding, *weights, *[x for r in routers for x in r]]
        grads = torch.autograd.grad((out * grad_out).sum(), leaves, allow_unused=True)
        return [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]

    expected, actual = run(False), run(True)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first_reads_partial", [True, False], ids=["chunk-starts-mid-block", "block-start"])
def test_block_group_merges_each_sites_partial(megatron_world1, nan_uninitialised, first_reads_partial):
    """A block's sites as one group over the completed rows, each folding in its running
    partial (an extra source outside the history): the per-site routing's outputs and every
    gradient, partials' included. A pipeline chunk that starts inside a block makes the
    group's first site read a partial too (phase 1 then finishes no site itself)."""
    s, b, d, heads, rows = 3, 2, 16, 4, 2
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randn(s, b, d, generator=generator, requires_grad=True) for _ in range(rows)]
    partials = [torch.randn(s, b, d, generator=generator, requires_grad=True) for _ in range(3)]
    routers = [((0.5 * torch.randn(d, generator=generator)).requires_grad_(True),
                (1 + 0.2 * torch.randn(d, generator=generator)).requires_grad_(True)) for _ in range(3)]  # fmt: skip
    grad_outs = [torch.randn(s, b, d, generator=generator) for _ in range(3)]
    extras = [first_reads_partial, True, True]

    def run(lookahead):
        kw = dict(num_heads=heads, eps=1e-6, logit_scale=1.3)
        if lookahead:
            history = LookaheadHistory(rows, sources[0], TORCH_BACKEND, TORCH_LOOKAHEAD, **kw)
            sites = [GroupSite(5 + j, rows, q, g, extra) for j, ((q, g), extra) in enumerate(zip(routers, extras))]
        else:
            history = SourceHistory(rows, sources[0], TORCH_BACKEND, **kw)
        for row, source in enumerate(sources):
            history.write(row, source)
        outs = []
        for j, ((q, g), extra) in enumerate(zip(routers, extras)):
            partial = partials[j] if extra else None
            outs.append(history.route_group(sites, j, partial) if lookahead else history.route(rows, q, g, partial))
        leaves = [*sources, *partials, *[x for r in routers for x in r]]
        loss = sum((out * grad).sum() for out, grad in zip(outs, grad_outs))
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        return [out.detach() for out in outs] + [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]

    expected, actual = run(False), run(True)
    for got, want in zip(actual, expected):  # fp32 sums in other orders (as in the model test above)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * want.abs().max().item() + 1e-7)


def test_block_group_refuses_a_missing_partial(megatron_world1):
    history = LookaheadHistory(1, torch.zeros(2, 1, 8), TORCH_BACKEND, TORCH_LOOKAHEAD, 2, 1e-6, 1.0)
    history.write(0, torch.zeros(2, 1, 8))
    sites = [GroupSite(1, 1, torch.zeros(8), torch.ones(8)), GroupSite(2, 1, torch.zeros(8), torch.ones(8), True)]
    history.route_group(sites, 0)
    with pytest.raises(ValueError, match="site 2 reads an extra source, but none was given"):
        history.route_group(sites, 1)


@pytest.mark.parametrize(
    "fields,message",
    [
        pytest.param(dict(routing_schedule="ahead"), "routing_schedule must be one of", id="unknown"),
        pytest.param(dict(variant="none", routing_schedule="lookahead"), "needs a routed variant",
                     id="baseline"),
        pytest.param(dict(variant="delta", routing_schedule="lookahead", lookahead_group=2),
                     "lookahead groups are its blocks \\(mhar.delta_block_layers\\)", id="delta-group"),
        pytest.param(dict(variant="block", routing_schedule="lookahead", lookahead_group=4),
                     "lookahead groups are its blocks", id="block-group"),
        pytest.param(dict(routing_schedule="lookahead", lookahead_group=-1), "non-negative",
                     id="negative-group"),
        pytest.param(dict(routing_schedule="lookahead", lookahead_kernels="tensor"),
                     "lookahead_kernels must be one of", id="unknown-kernels"),
    ],
)
def test_lookahead_config_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        MHARConfig(**fields)


@pytest.mark.parametrize("first,last,size", [(1, 73, 8), (1, 25, 4), (1, 16, 8), (5, 5, 8), (3, 9, 1), (1, 3, 8)])
def test_group_ranges_cover_the_sites_remainder_first(first, last, size):
    groups = group_ranges(first, last, size)
    assert [j for g in groups for j in g] == list(range(first, last + 1))
    sizes = [len(g) for g in groups]
    assert all(n == size for n in sizes[1:]) and 1 <= sizes[0] <= size
    assert sizes[0] == ((last - first + 1) % size or size)


@pytest.mark.parametrize("sites,size", [(25, 5), (49, 6), (73, 8), (1, 1), (2, 1), (7, 2)])
def test_auto_group_size_is_the_measured_choice(sites, size):
    """lookahead_group = 0 at the paper's 100M / 350M / 1B (25 / 49 / 73 sites) picks the
    group sizes the H200 measured fastest (auto_group_size's docstring), and at least 1."""
    assert auto_group_size(sites) == size


@pytest.mark.parametrize("first,last,size", [(1, 8, 0), (5, 4, 8)])
def test_group_ranges_errors(first, last, size):
    with pytest.raises(ValueError, match="no groups"):
        group_ranges(first, last, size)


@pytest.mark.parametrize("first,last,block,expected", [
    (1, 73, 8, [range(1 + 8 * k, 9 + 8 * k) for k in range(9)] + [range(73, 74)]),  # 1B: 9 blocks, the final site
    (1, 7, 4, [range(1, 5), range(5, 8)]),  # the final site inside the last block
    (6, 13, 4, [range(6, 9), range(9, 13), range(13, 14)]),  # a pipeline chunk starting mid-block
])
def test_block_groups_are_the_blocks_cut_at_the_chunk(first, last, block, expected):
    assert block_ranges(first, last, block) == expected
    assert lookahead_groups(first, last, 73, block) == expected
    assert lookahead_groups(first, last, 73, 1) == group_ranges(first, last, auto_group_size(73))


def _ddp_main_grads(model, fused, monkeypatch):
    """Routers' and all other main_grads after two micro-batches through Megatron DDP, with
    the routers' gradient-accumulation fusion on or off."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    import megatron_mhar.models.main_grad as main_grad

    if not fused:
        monkeypatch.setattr(main_grad, "fusable", lambda params: False)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    ddp.zero_grad_buffer()
    for seed in (0, 1):
        tokens, positions = gpt_batch(seed)
        ddp(tokens, positions, None, labels=tokens).float().mean().backward()
    monkeypatch.undo()
    return {n: p for n, p in model.named_parameters()}


def test_router_grads_accumulate_into_main_grad(megatron_world1, monkeypatch):
    """Under Megatron DDP the lookahead routers add their fp32 gradients into main_grad
    themselves (Megatron's grad_added_to_main_grad protocol): the buffer holds what DDP's
    own hook accumulates, once (a double or a missing add would show), and the placeholder
    autograd carried never reaches it."""
    _, fused_model = _models(3)
    _, plain_model = _models(3)
    fused = _ddp_main_grads(fused_model, True, monkeypatch)
    plain = _ddp_main_grads(plain_model, False, monkeypatch)
    routers = [n for n in fused if n.endswith(("router.query", "router.norm_weight"))]
    assert routers
    for name, param in fused.items():
        atol = 1e-6 * plain[name].main_grad.abs().max().item() + 1e-9
        torch.testing.assert_close(param.main_grad, plain[name].main_grad, rtol=1e-5, atol=atol,
                                   msg=lambda m: f"{name}: {m}")
        assert param.grad is None  # DDP's hook dropped the placeholder
        assert param.grad_added_to_main_grad == (name in routers), name
        assert not plain[name].grad_added_to_main_grad
    # Every router but the first site's (one source: its softmax is constant) has a gradient.
    assert sum(bool(fused[n].main_grad.abs().sum() > 0) for n in routers) == len(routers) - 2
