"""Fused depth-routing kernels (mhar_kernels.depth_route) against the fp32 reference.

On CPU the kernels run in the Triton interpreter (conftest.py) in fp32 with tight
tolerances. On CUDA they run in bf16 and fp32; bf16 is held to the flash-attention rule:
the kernel's error against an fp32 reference is at most twice the error of the torch
reference run in bf16, plus a small atol.
"""

import pytest
import torch

from megatron_mhar.ops.depth_route import (
    depth_route,
    depth_route_reference,
    torch_route_backward,
    torch_route_forward,
)
from mhar_kernels import launch
from mhar_kernels.depth_route import fused_depth_route, route_backward, route_forward

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-6
# The interpreter is wrong in bf16 (conftest.py), so CPU runs fp32 only.
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]

CASES = [
    # (tokens, N, D, H, extra, logit scale, layout); CPU token counts, GPU uses 64 T + 3.
    # One source: its weight is 1, every logit gradient must vanish.
    pytest.param(5, 1, 768, 8, False, 1.0, "buffer", id="N1"),
    # The block variant's first partial: one source plus the running partial.
    pytest.param(6, 1, 768, 8, True, 8.0, "buffer", id="N1-extra-tauH"),
    # H = 1 (Attention Residuals): one head spans the whole width.
    pytest.param(7, 5, 768, 1, False, 1.0, "buffer", id="H1-D768"),
    # H = D/64 = 12: head axis padded 12 -> 16; sources are a permuted [N, T, D] tensor.
    pytest.param(9, 6, 768, 12, True, 12.0, "stack", id="H12-D768-stack-extra"),
    # Odd token count over several token tiles and several tiles per backward program.
    pytest.param(97, 7, 768, 8, False, 1.0, "buffer", id="odd-T97"),
    # 100M shape, final site of the full variant (N = 2L+1 = 25).
    pytest.param(19, 25, 512, 8, True, 8.0, "stack", id="D512-N25-extra"),
    # 1B final site: 73 sources, head width 160 padded to 256, long online softmax.
    pytest.param(3, 73, 1280, 8, True, 1.0, "buffer", id="D1280-N73-extra"),
    # Head width 100, padded to 128, over a stacked [N, T, D] tensor with tau = H.
    pytest.param(4, 5, 400, 4, False, 4.0, "stack", id="HD100"),
    # H = D/64 = 20 at 1B width: head axis 20 -> 32, tau = H.
    pytest.param(5, 4, 1280, 20, False, 20.0, "buffer", id="H20-D1280-tauH"),
    # 8B delta shape: 9 sources of width 4096, 512-wide heads, tau = H.
    pytest.param(3, 9, 4096, 8, True, 8.0, "buffer", id="D4096-N9-extra-tauH"),
    # 64 heads of 64 at width 4096, contiguous [T, N, D].
    pytest.param(2, 3, 4096, 64, False, 1.0, "contig", id="H64-D4096"),
]


def _tokens(t: int) -> int:
    return 64 * t + 3 if CUDA else t


def _inputs(t, n, d, heads, has_extra, tau, layout, dtype):
    """Sources as a [T, N, D] view in the given layout (with per-source scales, so the
    RMS matters), an optional extra, query/norm weight giving O(1) logits, grad_out."""
    kw = dict(device=DEVICE, dtype=torch.float32)
    scales = 0.1 + 3 * torch.rand(1, n + 3, 1, **kw)
    full = torch.randn(t, n + 3, d, **kw) * scales
    if layout == "buffer":  # slice of a [T, R, D] history buffer
        sources = full.to(dtype)[:, :n]
    elif layout == "stack":  # permuted view of an [N, T, D] tensor
        sources = full[:, :n].transpose(0, 1).contiguous().to(dtype).transpose(0, 1)
    else:
        sources = full[:, :n].contiguous().to(dtype)
    extra = (2 * torch.randn(t, d, **kw)).to(dtype) if has_extra else None
    query = (2.0 / (tau * (d // heads) ** 0.5) * torch.randn(d, **kw)).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(d, **kw)).to(dtype)
    grad_out = torch.randn(t, d, **kw).to(dtype)
    return sources, extra, query, norm_weight, grad_out


def _grad_buffer(sources):
    """An fp32 view with the sources' layout into a larger buffer, nonzero everywhere."""
    t, n, d = sources.shape
    base = torch.randn(t, n + 2, d, device=sources.device)
    if sources.stride(0) < sources.stride(1):  # permuted [N, T, D] layout
        base = torch.randn(n + 2, t, d, device=sources.device).transpose(0, 1)
    return base, base[:, :n]


def _up(x):
    return None if x is None else x.float()


def _reference(sources, extra, query, norm_weight, grad_out, heads, tau):
    """(out, dsources, dextra, dquery, dnorm) of the torch backend, in the inputs' dtype."""
    out, _ = torch_route_forward(sources, extra, query, norm_weight, heads, EPS, tau)
    grad_sources = torch.zeros(sources.shape, device=sources.device)
    ge, gq, gg = torch_route_backward(
        grad_out, sources, extra, query, norm_weight, None, heads, EPS, tau, grad_sources
    )
    return out, grad_sources, ge, gq, gg


def _kernel(sources, extra, query, norm_weight, grad_out, heads, tau):
    out, saved = route_forward(sources, extra, query, norm_weight, heads, EPS, tau)
    assert saved.shape == (sources.shape[0], heads) and saved.dtype == torch.float32
    base, grad_sources = _grad_buffer(sources)
    initial = base.clone()
    ge, gq, gg = route_backward(
        grad_out, sources, extra, query, norm_weight, saved, heads, EPS, tau, grad_sources
    )
    n = sources.shape[1]
    # Columns beyond the N routed sources are untouched; the routed ones are added to.
    torch.testing.assert_close(base[:, n:], initial[:, n:], rtol=0, atol=0)
    return out, grad_sources - initial[:, :n], ge, gq, gg


NAMES = ("out", "dsources", "dextra", "dquery", "dnorm")


def _atol(name, ref, frac, tokens, tau=1.0):
    """frac of the largest reference value, plus, for dquery/dnorm (sums over tokens), a
    floor for per-token rounding: with one source the exact logit gradient is 0, but the
    kernel's recomputed weights (FMA-contracted) leave ~1e-7 per token and unit of tau,
    which scales every logit gradient."""
    floor = 1e-7 * tokens * max(1.0, tau)
    return frac * ref.abs().max().item() + (floor if name in ("dquery", "dnorm") else 1e-6)


def _assert_rule(got, ref32, ref_lp, atol_frac, tokens, tau=1.0):
    """Flash-attention rule: |got - ref32| <= 2 |ref_lp - ref32| + atol, by max error."""
    for name, g, r, lp in zip(NAMES, got, ref32, ref_lp):
        if r is None:
            assert g is None, name
            continue
        r = r.float()
        err = (g.float() - r).abs().max().item()
        err_lp = (lp.float() - r).abs().max().item()
        atol = _atol(name, r, atol_frac, tokens, tau)
        assert err <= 2 * err_lp + atol, f"{name}: kernel err {err:.3e}, torch err {err_lp:.3e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("t,n,d,heads,has_extra,tau,layout", CASES)
def test_route_forward_backward(t, n, d, heads, has_extra, tau, layout, dtype):
    torch.manual_seed(t * 1000 + n)
    inputs = _inputs(_tokens(t), n, d, heads, has_extra, tau, layout, dtype)
    got = _kernel(*inputs, heads, tau)
    assert got[0].dtype == dtype and got[3].dtype == dtype and got[4].dtype == dtype
    if has_extra:
        assert got[2].dtype == dtype
    ref32 = _reference(*[_up(x) for x in inputs], heads, tau)
    if dtype == torch.float32:
        for name, g, r in zip(NAMES, got, ref32):
            if r is None:
                assert g is None, name
                continue
            atol = _atol(name, r, 2e-5, _tokens(t), tau)
            torch.testing.assert_close(g, r, rtol=2e-4, atol=atol, msg=name)
    else:
        ref_lp = _reference(*inputs, heads, tau)
        _assert_rule(got, ref32, ref_lp, atol_frac=2e-3, tokens=_tokens(t), tau=tau)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize(
    "n,tokens,d,heads",
    [
        # [N, B, T, D] with two token dims, as the model calls it.
        pytest.param(5, (2, 3), 768, 8, id="N5-B2"),
        # One head per 64 channels, tokens not a multiple of any tile.
        pytest.param(3, (1, 7), 512, 8, id="N3-T7"),
    ],
)
def test_fused_depth_route_autograd(n, tokens, d, heads, dtype):
    """fused_depth_route (and depth_route(impl='triton')) against autograd of the reference."""
    torch.manual_seed(n)
    if CUDA:
        tokens = tuple(x * 37 for x in tokens)
    kw = dict(device=DEVICE)
    sources = (torch.randn(n, *tokens, d, **kw) * (0.1 + 3 * torch.rand(n, 1, 1, 1, **kw))).to(dtype)
    query = (0.5 * torch.randn(d, **kw)).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(d, **kw)).to(dtype)
    grad_out = torch.randn(*tokens, d, **kw).to(dtype)

    def run(fn, *args):
        leaves = [a.detach().clone().requires_grad_(True) for a in args]
        out = fn(*leaves, heads, EPS, 2.0)
        out.backward(grad_out.to(out.dtype))
        return (out.detach(), *[leaf.grad for leaf in leaves])

    got = run(fused_depth_route, sources, query, norm_weight)
    via_op = run(
        lambda s, q, g, h, e, tau: depth_route(s, q, g, h, e, impl="triton", logit_scale=tau),
        sources, query, norm_weight,
    )  # fmt: skip
    for a, b in zip(got, via_op):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [x.dtype for x in got] == [dtype] * 4
    ref32 = run(depth_route_reference, sources.float(), query.float(), norm_weight.float())
    names = ("out", "dsources", "dquery", "dnorm")
    if dtype == torch.float32:
        for name, g, r in zip(names, got, ref32):
            scale = r.abs().max().item()
            torch.testing.assert_close(g, r, rtol=2e-4, atol=2e-5 * scale + 1e-6, msg=name)
    else:
        ref_lp = run(depth_route_reference, sources, query, norm_weight)
        for name, g, r, lp in zip(names, got, ref32, ref_lp):
            err = (g.float() - r).abs().max().item()
            err_lp = (lp.float() - r).abs().max().item()
            # dquery/dnorm are rounded to bf16 on return: allow one bf16 ulp of the largest.
            atol = 8e-3 * r.abs().max().item() + 1e-6
            assert err <= 2 * err_lp + atol, f"{name}: kernel err {err:.3e}, torch err {err_lp:.3e}"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "t,n,d,heads,has_extra",
    [
        # 1B final site, many backward tiles per program.
        pytest.param(4099, 73, 1280, 8, True, id="D1280-N73"),
        # 8B delta width.
        pytest.param(2051, 9, 4096, 8, False, id="D4096-N9"),
    ],
)
def test_deterministic(t, n, d, heads, has_extra):
    """Two forward+backward passes are bitwise equal (no atomics in the dq/dg reduction)."""
    inputs = _inputs(t, n, d, heads, has_extra, 8.0, "buffer", torch.bfloat16)
    torch.manual_seed(1)  # the same initial gradient buffer for both runs
    first = _kernel(*inputs, heads, 8.0)
    torch.manual_seed(1)
    second = _kernel(*inputs, heads, 8.0)
    for name, a, b in zip(NAMES, first, second):
        if a is not None:
            assert torch.equal(a, b), name


def test_rejects_bad_layout():
    sources = torch.randn(4, 3, 64, device=DEVICE)
    with pytest.raises(ValueError, match="unit stride"):
        route_forward(sources.transpose(1, 2), None, torch.ones(3), torch.ones(3), 1, EPS, 1.0)
    with pytest.raises(ValueError, match="extra"):
        route_forward(sources, sources[:, 0, :32], torch.ones(64), torch.ones(64), 1, EPS, 1.0)


@pytest.mark.parametrize("stages", [1, 3], ids=["plain-loop", "pipelined"])
def test_loop_variants(stages, launch_reads):
    """Both source loops (plain, loads pipelined through shared memory) give the same result."""
    t, n, d, heads = _tokens(6), 5, 512, 8
    sources, extra, query, norm_weight, grad_out = _inputs(t, n, d, heads, True, 1.0, "buffer", torch.float32)
    with launch.overridden(route_fwd=dict(stages=stages), route_bwd=dict(stages=stages)):
        out, lse = route_forward(sources, extra, query, norm_weight, heads, EPS, 1.0)
        grad_sources = torch.zeros(sources.shape, device=DEVICE)
        ge, gq, gg = route_backward(grad_out, sources, extra, query, norm_weight, lse, heads, EPS, 1.0, grad_sources)
    assert launch_reads == {"route_fwd": [{"stages": stages}], "route_bwd": [{"stages": stages}]}
    ref = _reference(sources, extra, query, norm_weight, grad_out, heads, 1.0)
    for name, g, r in zip(NAMES, (out, grad_sources, ge, gq, gg), ref):
        scale = r.abs().max().item()
        torch.testing.assert_close(g, r, rtol=2e-4, atol=2e-5 * scale + 1e-6, msg=name)
