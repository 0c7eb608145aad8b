"""The reference depth_route op against the method's definition (the MHAR paper)."""

import itertools

import pytest
import torch

from megatron_mhar.ops import depth_route, depth_route_reference

SHAPES = [
    # (N sources, token shape, D, H)
    pytest.param(1, (3,), 8, 1, id="one-source"),  # softmax over one source is the identity
    pytest.param(5, (2, 3), 16, 1, id="H1"),  # single head: Attention Residuals
    pytest.param(4, (7,), 12, 12, id="H=D"),  # every channel its own head
    pytest.param(6, (2, 5), 24, 8, id="H8-odd-tokens"),
    pytest.param(9, (1,), 40, 5, id="odd-head-width"),  # head width 8, five heads
]


def _inputs(n, tokens, d, dtype=torch.float32, scale=1.0):
    sources = torch.randn(n, *tokens, d, dtype=dtype) * torch.rand(n, *tokens, 1, dtype=dtype) * 3
    query = torch.randn(d, dtype=dtype) * scale
    norm_weight = 1 + 0.3 * torch.randn(d, dtype=dtype)
    return sources, query, norm_weight


@pytest.mark.parametrize("n,tokens,d,heads", SHAPES)
def test_zero_query_is_uniform_mean(n, tokens, d, heads):
    sources, _, norm_weight = _inputs(n, tokens, d)
    out = depth_route(sources, torch.zeros(d), norm_weight, heads, impl="torch")
    torch.testing.assert_close(out, sources.mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n,tokens,d,heads", SHAPES)
def test_single_head_matches_attnres_formula(n, tokens, d, heads):
    """H = 1 is AttnRes, written here independently from the library's reference."""
    sources, query, norm_weight = _inputs(n, tokens, d)
    eps = 1e-6
    expected = torch.zeros(*tokens, d)
    for index in itertools.product(*[range(t) for t in tokens]):
        values = [sources[(i, *index)] for i in range(n)]
        keys = [v / torch.sqrt((v * v).mean() + eps) * norm_weight for v in values]
        logits = torch.stack([torch.dot(query, k) for k in keys])
        alpha = torch.exp(logits - logits.max())
        alpha = alpha / alpha.sum()
        expected[index] = sum(a * v for a, v in zip(alpha, values))
    out = depth_route(sources, query, norm_weight, 1, eps=eps, impl="torch")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,tokens,d,heads", [p for p in SHAPES if p.values[3] > 1])
def test_heads_are_independent(n, tokens, d, heads):
    """Changing query head h changes only output slice h (the RMS still spans all of D)."""
    sources, query, norm_weight = _inputs(n, tokens, d)
    base = depth_route(sources, query, norm_weight, heads, impl="torch")
    width = d // heads
    for head in range(heads):
        changed = query.clone()
        changed[head * width:(head + 1) * width] += 5 * torch.randn(width)
        out = depth_route(sources, changed, norm_weight, heads, impl="torch")
        others = torch.ones(d, dtype=torch.bool)
        others[head * width:(head + 1) * width] = False
        torch.testing.assert_close(out[..., others], base[..., others], rtol=0, atol=0)
        if n > 1:
            assert not torch.allclose(out[..., ~others], base[..., ~others])


def test_logit_scale_multiplies_logits():
    sources, query, norm_weight = _inputs(5, (4,), 16)
    scaled = depth_route(sources, query, norm_weight, 4, impl="torch", logit_scale=4.0)
    manual = depth_route(sources, 4.0 * query, norm_weight, 4, impl="torch")
    torch.testing.assert_close(scaled, manual, rtol=1e-6, atol=1e-6)


def test_sequence_of_sources_equals_stacked_tensor():
    sources, query, norm_weight = _inputs(4, (2, 3), 16)
    torch.testing.assert_close(
        depth_route(list(sources), query, norm_weight, 4, impl="torch"),
        depth_route(sources, query, norm_weight, 4, impl="torch"),
    )


def test_output_dtype_follows_sources():
    sources, query, norm_weight = _inputs(3, (4,), 16, dtype=torch.bfloat16)
    out = depth_route(sources, query.float(), norm_weight.float(), 2, impl="torch")
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("n,tokens,d,heads", SHAPES)
def test_gradcheck_fp64(n, tokens, d, heads):
    sources, query, norm_weight = _inputs(n, tokens, d, dtype=torch.float64, scale=0.5)
    inputs = tuple(t.requires_grad_(True) for t in (sources, query, norm_weight))
    assert torch.autograd.gradcheck(
        lambda s, q, g: depth_route_reference(s, q, g, heads, logit_scale=1.7), inputs
    )


BAD_INPUTS = [
    pytest.param(dict(num_heads=3), "not divisible by num_heads", id="heads-not-dividing-D"),
    pytest.param(dict(num_heads=0), "positive int", id="zero-heads"),
    pytest.param(dict(query=torch.zeros(7)), "query must have shape", id="query-shape"),
    pytest.param(dict(norm_weight=torch.ones(4, 2)), "norm_weight must have shape", id="norm-shape"),
    pytest.param(dict(sources=torch.zeros(0, 3, 8)), "at least one source", id="no-sources"),
    pytest.param(dict(sources=[]), "at least one source", id="empty-list"),
    pytest.param(
        dict(sources=[torch.zeros(3, 8), torch.zeros(4, 8)]), "share one shape", id="ragged-list"
    ),
    pytest.param(
        dict(sources=[torch.zeros(3, 8), torch.zeros(3, 8, dtype=torch.float64)]),
        "share one shape and dtype",
        id="mixed-dtypes",
    ),
    pytest.param(dict(sources=torch.zeros(8)), "at least 2 dims", id="1d-sources"),
    pytest.param(
        dict(sources=torch.zeros(2, 3, 8, dtype=torch.int64)), "floating-point", id="int-sources"
    ),
    pytest.param(dict(impl="cuda"), "impl must be one of", id="bad-impl"),
    pytest.param(dict(impl="triton"), "needs CUDA tensors", id="triton-on-cpu"),
]


@pytest.mark.parametrize("override,message", BAD_INPUTS)
def test_bad_inputs_raise_clear_errors(override, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kwargs = dict(
        sources=torch.zeros(2, 3, 8), query=torch.zeros(8), norm_weight=torch.ones(8), num_heads=2
    )
    kwargs.update(override)
    with pytest.raises(ValueError, match=message):
        depth_route(**kwargs)
