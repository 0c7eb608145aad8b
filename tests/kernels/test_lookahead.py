"""Two-phase ("lookahead") routing: one group's outputs and every gradient against the
per-site fp32 reference, for the Triton kernels (mhar_kernels.lookahead) and the torch
backend of the same grouped algorithm (megatron_mhar.ops.lookahead_reference).

A group of G sites over a history of ``n0 + G - 1`` rows: site g reads rows
``[0, n0 + g)``. Phase 1 reads rows ``[0, n0)`` once for all sites; site g merges rows
``[n0, n0 + g)``. Backward runs the merges last site first, then phase 1, adding into one
fp32 gradient buffer, as the history does. On CPU the kernels run in the Triton
interpreter in fp32 (conftest.py); on CUDA in bf16 (flash-attention rule: error against
the fp32 reference at most twice the bf16 torch reference's, plus a small atol) and fp32.
"""

import functools
import types

import pytest
import torch

from megatron_mhar.ops.depth_route import torch_route_backward, torch_route_forward
from megatron_mhar.ops.lookahead import TORCH_LOOKAHEAD
from megatron_mhar.ops.lookahead_reference import torch_merge_row_grad
from mhar_kernels import launch
from mhar_kernels import lookahead as fused
from mhar_kernels.lookahead import phase1_dots

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]
GPU_ONLY = pytest.mark.skipif(not CUDA, reason="slow in the Triton interpreter")


def _whole_group_backward(group_backward_deferred, add_row_grads):
    """Phase 1's backward with the old rows' gradients added before it returns, as the
    history has them once they are due: the deferred backward, then its rows' factors
    (none from the row loop, which adds at once)."""

    def group_backward(grad_outs, sources, *args, **options):
        grad_sources = args[7]
        dq, dg, deferred = group_backward_deferred(grad_outs, sources, *args, **options)
        add_row_grads([(deferred, sources.shape[1])], sources, grad_sources, 0,
                      accumulate=options.get("accumulate", True))  # fmt: skip
        return dq, dg

    return group_backward


def _phase1_kernels(lookahead_kernels: str) -> types.SimpleNamespace:
    """The Triton backend with one of phase 1's kernel families, forward and backward: the
    row loops that hold the sites in registers, or the tensor-core dots per token and head
    (the default picks one by group size; every case here runs both)."""
    return types.SimpleNamespace(
        group_forward=functools.partial(fused.group_forward, lookahead_kernels=lookahead_kernels),
        merge_forward=fused.merge_forward,
        merge_backward=fused.merge_backward,
        group_backward=_whole_group_backward(
            functools.partial(fused.group_backward_deferred, lookahead_kernels=lookahead_kernels), fused.add_row_grads
        ),
        group_backward_deferred=functools.partial(fused.group_backward_deferred, lookahead_kernels=lookahead_kernels),
        add_row_grads=fused.add_row_grads,
        merge_row_grad=fused.merge_row_grad,
        merge_dw_partials=fused.merge_dw_partials,
    )


def _fused_group_backward(*args, lookahead_kernels="row_loop", **options):
    """The Triton phase-1 backward with its rows' gradients added (``_whole_group_backward``)."""
    deferred = functools.partial(fused.group_backward_deferred, lookahead_kernels=lookahead_kernels)
    return _whole_group_backward(deferred, fused.add_row_grads)(*args, **options)


BACKENDS = {
    "triton-row-loop": _phase1_kernels("row_loop"),
    "triton-tensor-cores": _phase1_kernels("tensor_cores"),
    # The history's backend, plus the one-call backward the group tests run.
    "torch": types.SimpleNamespace(
        **TORCH_LOOKAHEAD._asdict(),
        group_backward=_whole_group_backward(TORCH_LOOKAHEAD.group_backward_deferred, TORCH_LOOKAHEAD.add_row_grads),
    ),
}

CASES = [
    # (tokens, n0 old rows, G sites, D, H, tau); CPU token counts, GPU uses 64 T + 3.
    # One source and a group of one: weight 1, every logit gradient vanishes.
    pytest.param(5, 1, 1, 768, 8, 1.0, id="N1-G1"),
    # A group of one site at depth: phase 1 does all the work, no merge rows.
    pytest.param(6, 5, 1, 768, 8, 8.0, id="n5-G1-tauH"),
    # H = 1 (Attention Residuals), one old row, three sites merging 0, 1, 2 new rows.
    pytest.param(7, 1, 3, 768, 1, 1.0, id="N1-G3-H1"),
    # Odd token count over several tiles and several tiles per backward program.
    pytest.param(13, 2, 3, 768, 8, 1.0, id="odd-T13-G3"),
    # 1B width: head width 160 padded to 256, a group of 4 (no padded sites).
    pytest.param(2, 3, 4, 1280, 8, 1.0, id="D1280-n3-G4"),
    # The 1B group (G = 8) at depth; too slow for the interpreter, so CUDA only.
    pytest.param(3, 9, 8, 1280, 8, 1.0, id="D1280-n9-G8", marks=GPU_ONLY),
    # 1B width, G = 5 (site axis padded 5 -> 8), H = 1, tau = 8.
    pytest.param(3, 6, 5, 1280, 1, 8.0, id="D1280-G5-H1"),
    # H = 2: each head as four dot heads of the tensor-core kernels (two model heads).
    pytest.param(4, 4, 5, 512, 2, 1.0, id="D512-G5-H2"),
    # A narrow model, G = 3: the row-loop forward's 4K accumulators hold 5 tokens of three
    # sites, and its tile takes 4 (a tile's token axis is a power of two).
    pytest.param(6, 3, 3, 256, 8, 1.0, id="D256-G3"),
    # The first group at the 100M width: one old row (the embedding's), G = 4, eight heads
    # and one.
    pytest.param(7, 1, 4, 512, 8, 1.0, id="D512-N1-G4"),
    pytest.param(5, 1, 3, 512, 1, 8.0, id="D512-N1-G3-H1"),
]


def _tokens(t: int) -> int:
    return 64 * t + 3 if CUDA else t


def _inputs(t, n0, g, d, heads, tau, dtype):
    """History rows [T, R, D] (per-row scales, so the RMS matters), per-site queries and
    norm weights [G, D] giving O(1) logits, and per-site output gradients [G, T, D]."""
    kw = dict(device=DEVICE, dtype=torch.float32)
    rows = n0 + g - 1
    scales = 0.1 + 3 * torch.rand(1, rows + 2, 1, **kw)
    buffer = (torch.randn(t, rows + 2, d, **kw) * scales).to(dtype)[:, :rows]
    queries = (2.0 / (tau * (d // heads) ** 0.5) * torch.randn(g, d, **kw)).to(dtype)
    norms = (1 + 0.3 * torch.randn(g, d, **kw)).to(dtype)
    grad_outs = torch.randn(g, t, d, **kw).to(dtype)
    return buffer, queries, norms, grad_outs


def _grouped(backend, buffer, queries, norms, grad_outs, n0, heads, tau, site_range=None, grad_rows=None):
    """Run one group: (outputs [G, T, D], grad rows [T, R, D] fp32, dquery, dnorm [G, D]).

    Only the sites in ``site_range`` run their backward; ``grad_rows`` is accumulated into.
    """
    g, t, d = grad_outs.shape
    lse = torch.empty((g, t, heads), device=DEVICE)
    # As the history runs it: phase 1 finishes site 0 (no new rows), the others merge.
    first = torch.empty((t, d), dtype=buffer.dtype, device=DEVICE)
    m, l, acc = backend.group_forward(buffer[:, :n0], queries, norms, heads, EPS, tau, first_out=(first, lse[0]))
    outs = [first] + [
        backend.merge_forward(
            m[k], l[k], acc[k], buffer[:, n0 : n0 + k], queries[k], norms[k], heads, EPS, tau, lse[k]
        )
        for k in range(1, g)
    ]
    lo, hi = site_range or (0, g)
    if grad_rows is None:
        grad_rows = torch.zeros(buffer.shape, device=DEVICE)
    deltas = torch.zeros((g, t, heads), device=DEVICE)
    used = torch.zeros_like(grad_outs)
    # The new rows' factors; a site that does not run leaves zeros, as the history's zeroed slots.
    factors = torch.zeros((g, t, g - 1, heads, 2), device=DEVICE)
    kv = torch.zeros((g, t, g - 1), device=DEVICE)
    # The merges' dL/dw partials, reduced with phase 1's by the group backward.
    merge_dw = torch.zeros((backend.merge_dw_partials(t, d, heads, torch.device(DEVICE)), g, d), device=DEVICE)
    dq = torch.zeros((g, d), device=DEVICE)
    dg = torch.zeros((g, d), device=DEVICE)
    for k in reversed(range(lo, hi)):
        # As the history calls it: delta, the output gradient and the dL/dw partials land in
        # the group's workspaces.
        delta, merge_dq, merge_dg = backend.merge_backward(
            grad_outs[k], outs[k], buffer[:, n0 : n0 + k], queries[k], norms[k], lse[k],
            heads, EPS, tau, (factors[k, :, :k], kv[k, :, :k]), deltas[k], used[k], merge_dw[:, k],
        )  # fmt: skip
        assert torch.equal(delta, deltas[k]) and torch.equal(used[k], grad_outs[k])
        assert merge_dq is None and merge_dg is None
        if k > 0:  # row n0 + k - 1 is due: the sites from k on read it
            _finish_row(backend, buffer, grad_rows, used, queries, norms, factors, kv, n0, k - 1, heads)
    for i in range(max(lo - 1, 0)):  # rows these sites read that become due in an earlier range
        _finish_row(backend, buffer, grad_rows, used, queries, norms, factors, kv, n0, i, heads)
    old_q, old_g = backend.group_backward(
        used, buffer[:, :n0], queries, norms, lse, deltas, heads, EPS, tau, grad_rows[:, :n0], (lo, hi),
        merge_dw=merge_dw,
    )
    dq[lo:hi] += old_q
    dg[lo:hi] += old_g
    return torch.stack(outs), grad_rows, dq, dg


def _finish_row(backend, buffer, grad_rows, grad_outs, queries, norms, factors, kv, n0, i, heads):
    """Add the merges' factors to new row i (history row n0 + i; the sites from i + 1 read
    it) in place, as the history does when the row is due."""
    row = n0 + i
    backend.merge_row_grad(buffer[:, row], grad_rows[:, row], grad_rows[:, row], grad_outs, queries, norms,
                           factors, kv, i, (i + 1, factors.shape[0]), heads)  # fmt: skip


def _per_site(buffer, queries, norms, grad_outs, n0, heads, tau):
    """The same quantities from the per-site torch reference."""
    g = queries.shape[0]
    grad_rows = torch.zeros(buffer.shape, device=buffer.device)
    outs, dqs, dgs = [], [], []
    for k in range(g):
        rows = buffer[:, : n0 + k]
        out, _ = torch_route_forward(rows, None, queries[k], norms[k], heads, EPS, tau)
        _, dq, dg = torch_route_backward(
            grad_outs[k], rows, None, queries[k], norms[k], None, heads, EPS, tau, grad_rows[:, : n0 + k]
        )
        outs.append(out)
        dqs.append(dq)
        dgs.append(dg)
    return torch.stack(outs), grad_rows, torch.stack(dqs), torch.stack(dgs)


NAMES = ("out", "dsources", "dquery", "dnorm")


def _atol(name, ref, frac, tokens, per_token=1e-7):
    # dquery/dnorm sum over tokens: with one source the exact logit gradient is 0 but the
    # recomputed weights leave ~1e-7 per token (as in test_depth_route_kernels.py).
    return frac * ref.abs().max().item() + (per_token * tokens if name in ("dquery", "dnorm") else 1e-6)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("t,n0,g,d,heads,tau", CASES)
def test_group_matches_per_site(t, n0, g, d, heads, tau, dtype, backend):
    torch.manual_seed(t * 100 + n0 * 10 + g)
    t = _tokens(t)
    inputs = _inputs(t, n0, g, d, heads, tau, dtype)
    got = _grouped(BACKENDS[backend], *inputs, n0, heads, tau)
    assert got[0].dtype == dtype and got[2].dtype == torch.float32
    ref32 = _per_site(*[x.float() for x in inputs], n0, heads, tau)
    if dtype == torch.float32:
        # The Triton phase-1 backward forms the value dots in another order than the
        # merge's delta (on tensor cores, or four to a reduction in the row loop), so one
        # source's vanishing logit gradient is left as rounding: up to 3e-5 per token in
        # dquery at N1-G1, where the other cases' dquery reach 1e2-1e3.
        per_token = 1e-7 if backend == "torch" else 1e-4
        for name, a, r in zip(NAMES, got, ref32):
            torch.testing.assert_close(a, r, rtol=2e-4, atol=_atol(name, r, 2e-5, t, per_token), msg=name)
        return
    ref_lp = _per_site(*inputs, n0, heads, tau)
    for name, a, r, lp in zip(NAMES, got, ref32, ref_lp):
        err = (a.float() - r).abs().max().item()
        err_lp = (lp.float() - r).abs().max().item()
        atol = _atol(name, r, 2e-3, t)
        assert err <= 2 * err_lp + atol, f"{name}: lookahead err {err:.3e}, torch err {err_lp:.3e}"


# Half-precision rows: CPU runs fp16 in the interpreter (numpy has no bfloat16).
HALF_DTYPES = [torch.bfloat16, torch.float16] if CUDA else [torch.float16]


# The dots take bf16 or fp32 rows (test_fp16_rows_refuse_the_dots): on CPU only the row loop.
HALF_KERNELS = [pytest.param(dtype, "row_loop", id=f"row-loop-{str(dtype)[6:]}") for dtype in HALF_DTYPES]
HALF_KERNELS += [pytest.param(torch.bfloat16, "tensor_cores", id="dots-bfloat16")] * CUDA


@pytest.mark.parametrize("dtype,lookahead_kernels", HALF_KERNELS)
@pytest.mark.parametrize("d,heads", [(512, 8), (768, 1)], ids=["512", "768-one-head"])
def test_half_precision_partials(d, heads, lookahead_kernels, dtype):
    """Over half-precision rows phase 1 (the row loop and the tensor-core kernel) leaves
    each site's accumulator normalised, ``acc / l``, in the rows' dtype (half the bytes of
    fp32): within one rounding of the reference's fp32 partial. A merge takes it back; its
    outputs match the reference merge of the same partials to the output's rounding and
    the fp32 per-site reference as closely as the torch reference run in the rows' dtype
    (plus that one rounding)."""
    t, n0, g = _tokens(5), 4, 3
    torch.manual_seed(d + heads)
    buffer, queries, norms, _ = _inputs(t, n0, g, d, heads, 1.0, dtype)
    m, l, acc = fused.group_forward(buffer[:, :n0], queries, norms, heads, EPS, 1.0,
                                    lookahead_kernels=lookahead_kernels)
    assert acc.dtype == dtype and m.dtype == l.dtype == torch.float32
    rm, rl, racc = TORCH_LOOKAHEAD.group_forward(buffer[:, :n0], queries, norms, heads, EPS, 1.0)
    normalised = (racc.unflatten(-1, (heads, -1)) / rl[..., None]).flatten(-2)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(acc.float(), normalised, rtol=ulp, atol=ulp * normalised.abs().max().item())
    torch.testing.assert_close(m, rm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l, rl, rtol=1e-5, atol=1e-5)
    exact = buffer.float()
    for k in range(g):
        new = buffer[:, n0 : n0 + k]
        lse, ref_lse = torch.empty((t, heads), device=DEVICE), torch.empty((t, heads), device=DEVICE)
        out = fused.merge_forward(m[k], l[k], acc[k], new, queries[k], norms[k], heads, EPS, 1.0, lse)
        same = TORCH_LOOKAHEAD.merge_forward(m[k], l[k], acc[k], new, queries[k], norms[k], heads, EPS, 1.0, ref_lse)
        torch.testing.assert_close(out.float(), same.float(), rtol=ulp, atol=ulp * same.float().abs().max().item())
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
        want, _ = torch_route_forward(exact[:, : n0 + k], None, queries[k].float(), norms[k].float(), heads, EPS, 1.0)
        low, _ = torch_route_forward(buffer[:, : n0 + k], None, queries[k], norms[k], heads, EPS, 1.0)
        err, err_low = ((x.float() - want).abs().max().item() for x in (out, low))
        assert err <= 2 * err_low + 2 * ulp * want.abs().max().item(), f"site {k}: err {err:.3e}, torch {err_low:.3e}"
    wrong = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="acc must be fp32 or normalised"):
        fused.merge_forward(m[1], l[1], acc[1].to(wrong), buffer[:, n0 : n0 + 1], queries[1], norms[1], heads, EPS,
                            1.0, torch.empty((t, heads), device=DEVICE))  # fmt: skip


@pytest.mark.parametrize("queries_left", [True, False], ids=["queries-left", "rows-left"])
@pytest.mark.parametrize("d,heads,n0", [(1280, 8, 19), (768, 1, 5)], ids=["1B-width", "768-one-head"])
def test_dot_forward_forms(d, heads, n0, queries_left, monkeypatch):
    """The tensor-core forward's two forms of its first dot (``launch.queries_left``: W^T @ X^T
    where X @ W would not fit two programs per SM) give the reference's partials, over a
    row block and a remainder (n0 = 19), for every dtype the dots take. The rule picks
    queries left at the 1B width in bf16 only."""
    assert launch.queries_left(8, 160, 2) and not launch.queries_left(8, 128, 2)
    assert not launch.queries_left(8, 160, 4)
    monkeypatch.setattr(phase1_dots, "queries_left", lambda *shape: queries_left)
    t, g = _tokens(3), 6
    torch.manual_seed(n0 + heads)
    for dtype in DTYPES:
        buffer, queries, norms, _ = _inputs(t, n0, g, d, heads, 1.0, dtype)
        m, l, acc = fused.group_forward(buffer[:, :n0], queries, norms, heads, EPS, 1.0,
                                        lookahead_kernels="tensor_cores")
        rm, rl, racc = TORCH_LOOKAHEAD.group_forward(buffer[:, :n0].float(), queries.float(), norms.float(),
                                                     heads, EPS, 1.0)  # fmt: skip
        if acc.dtype != torch.float32:  # normalised half-precision partials
            acc = (acc.float().unflatten(-1, (heads, -1)) * l[..., None]).flatten(-2)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(m, rm, rtol=tol, atol=tol)
        torch.testing.assert_close(l, rl, rtol=tol, atol=tol)
        torch.testing.assert_close(acc, racc, rtol=tol, atol=tol * racc.abs().max().item())


def test_fp16_rows_refuse_the_dots():
    """The dots take bf16 or fp32 rows: ``lookahead_kernels='tensor_cores'`` over fp16 rows is an
    error that names the way out (``auto`` runs the row loops: test_tensor_cores_auto)."""
    t, n0, g, d, heads = _tokens(1), 2, 5, 1280, 8
    buffer, queries, norms, grad_outs = _inputs(t, n0, g, d, heads, 1.0, torch.float16)
    rows = buffer[:, :n0]
    lse, delta = torch.zeros(g, t, heads, device=DEVICE), torch.zeros(g, t, heads, device=DEVICE)
    refused = "lookahead_kernels='tensor_cores' takes bf16 or fp32 rows, got float16"
    with pytest.raises(ValueError, match=refused):
        fused.group_forward(rows, queries, norms, heads, EPS, 1.0, lookahead_kernels="tensor_cores")
    with pytest.raises(ValueError, match=refused):
        fused.group_backward_deferred(grad_outs, rows, queries, norms, lse, delta, heads, EPS, 1.0,
                                      torch.zeros(rows.shape, device=DEVICE), lookahead_kernels="tensor_cores")


@pytest.mark.parametrize("d,heads", [(768, 8), (1280, 8), (1280, 1)], ids=["768", "1B-width", "1B-one-head"])
def test_merge_row_grad_matches_reference(d, heads):
    """A new row's gradient from given factors: the kernel against the reference, into the
    fp32 gradient in place and into a new tensor of the rows' dtype (as the history hands
    a due row to its sublayer); sites 1-3 of 4 read the row, index 1 of 3 new rows."""
    t, g, r, index, sites = _tokens(5), 4, 3, 1, (1, 4)
    torch.manual_seed(d + heads)
    kw = dict(device=DEVICE)
    for dtype in DTYPES:
        buffer, queries, norms, grad_outs = _inputs(t, 2, g, d, heads, 1.0, dtype)
        row, row_grad = buffer[:, 1], torch.randn(buffer.shape, **kw)[:, 1]
        factors, kv = torch.randn(g, t, r, heads, 2, **kw), torch.randn(g, t, r, **kw)
        args = (grad_outs, queries, norms, factors, kv, index, sites, heads)
        want = torch.empty(t, d, **kw)
        torch_merge_row_grad(row, row_grad, want, *args)
        in_place = row_grad.clone()
        fused.merge_row_grad(row, in_place, in_place, *args)
        torch.testing.assert_close(in_place, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        cast = torch.empty(t, d, dtype=dtype, **kw)
        fused.merge_row_grad(row, row_grad, cast, *args)
        torch.testing.assert_close(cast, want.to(dtype), rtol=1e-5 if dtype == torch.float32 else 8e-3,
                                   atol=1e-5 * want.abs().max().item())  # fmt: skip


@pytest.mark.parametrize("d,heads", [(256, 8), (256, 1)], ids=["8-heads", "one-head"])
def test_merge_writes_the_gradient_of_a_source_only_it_reads(d, heads):
    """``row_grads``: a merge whose new source no other site reads (the block variant's
    running partial) writes its gradient whole, what its factors give through
    ``merge_row_grad`` (the path of a shared row); the kernel and the reference alike, the
    kernel against the reference, and the merge's other outputs unchanged."""
    t, n0 = _tokens(5), 2
    torch.manual_seed(d + heads)
    for dtype in DTYPES:
        buffer, queries, norms, grad_outs = _inputs(t, n0 + 1, 1, d, heads, 1.3, dtype)
        results = {}
        for name in ("triton-row-loop", "torch"):
            b = BACKENDS[name]
            m, l, acc = b.group_forward(buffer[:, :n0], queries, norms, heads, EPS, 1.3)
            lse = torch.empty((t, heads), device=DEVICE)
            new = buffer[:, n0:]
            out = b.merge_forward(m[0], l[0], acc[0], new, queries[0], norms[0], heads, EPS, 1.3, lse)
            factors = (torch.empty(t, 1, heads, 2, device=DEVICE), torch.empty(t, 1, device=DEVICE))
            args = (grad_outs[0], out, new, queries[0], norms[0], lse, heads, EPS, 1.3)
            delta, dq, dg = b.merge_backward(*args, factors)
            via_factors = torch.empty(t, d, dtype=dtype, device=DEVICE)
            unread = torch.empty(t, d, device=DEVICE)  # no other read: accumulate=False does not read it
            b.merge_row_grad(new[:, 0], unread, via_factors, grad_outs, queries, norms, factors[0][None],
                             factors[1][None], 0, (0, 1), heads, accumulate=False)  # fmt: skip
            whole = torch.full((t, 1, d), float("nan"), dtype=dtype, device=DEVICE)
            delta_w, dq_w, dg_w = b.merge_backward(*args, None, row_grads=whole)
            scale = via_factors.float().abs().max().item()
            assert scale > 0
            torch.testing.assert_close(whole[:, 0].float(), via_factors.float(), rtol=1e-5 if dtype == torch.float32
                                       else 8e-3, atol=1e-5 * scale)  # fmt: skip
            for got, want in ((delta_w, delta), (dq_w, dq), (dg_w, dg)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            results[name] = whole[:, 0].float()
        if dtype == torch.float32:  # in bf16 the kernels' rounding differs (tests of the merges above hold it)
            torch.testing.assert_close(results["triton-row-loop"], results["torch"], rtol=1e-4,
                                       atol=1e-4 * results["torch"].abs().max().item())  # fmt: skip
    with pytest.raises(ValueError, match="either row_factors or row_grads"):
        fused.merge_backward(*args, factors, row_grads=whole)


@pytest.mark.parametrize("backend", ["triton-row-loop", "torch"])
def test_merge_dw_partials_reduce_to_the_merge_gradients(backend):
    """A merge's unreduced dL/dw partials (``dw_out``, as the history keeps them for its
    group's backward) sum, through the group's reduction of a group whose phase 1 adds
    nothing (its only site's output gradient and delta are zero), to the parameters' gradients the
    merge returns when it reduces them itself."""
    b = BACKENDS[backend]
    t, n0, d, heads = _tokens(5), 2, 768, 8
    torch.manual_seed(11)
    buffer, queries, norms, grad_outs = _inputs(t, n0 + 3, 1, d, heads, 1.0, torch.float32)
    m, l, acc = b.group_forward(buffer[:, :n0], queries, norms, heads, EPS, 1.0)
    lse = torch.empty((t, heads), device=DEVICE)
    new = buffer[:, n0 : n0 + 3]
    out = b.merge_forward(m[0], l[0], acc[0], new, queries[0], norms[0], heads, EPS, 1.0, lse)
    factors = (torch.empty(t, 3, heads, 2, device=DEVICE), torch.empty(t, 3, device=DEVICE))
    _, want_q, want_g = b.merge_backward(grad_outs[0], out, new, queries[0], norms[0], lse, heads, EPS, 1.0, factors)
    merge_dw = torch.full((b.merge_dw_partials(t, d, heads, torch.device(DEVICE)), 1, d), float("nan"), device=DEVICE)
    with pytest.raises(ValueError, match="dw_out must be"):
        b.merge_backward(grad_outs[0], out, new, queries[0], norms[0], lse, heads, EPS, 1.0, factors,
                         dw_out=merge_dw[1:, 0])  # fmt: skip
    delta, dq, dg = b.merge_backward(grad_outs[0], out, new, queries[0], norms[0], lse, heads, EPS, 1.0, factors,
                                     dw_out=merge_dw[:, 0])  # fmt: skip
    assert dq is None and dg is None and not merge_dw.isnan().any()
    zero = torch.zeros_like(grad_outs)
    got_q, got_g = b.group_backward(zero, buffer[:, :n0], queries, norms, lse[None], 0 * delta[None], heads, EPS, 1.0,
                                    torch.zeros(t, n0, d, device=DEVICE), merge_dw=merge_dw)  # fmt: skip
    for got, want in ((got_q[0], want_q), (got_g[0], want_g)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())
        assert want.abs().max() > 0


def test_merge_row_grad_errors():
    g, t, d = 2, 3, 64
    kw = dict(device=DEVICE)
    row, grads, q = torch.zeros(t, d, **kw), torch.zeros(g, t, d, **kw), torch.zeros(g, d, **kw)
    factors, kv = torch.zeros(g, t, 1, 8, 2, **kw), torch.zeros(g, t, 1, **kw)
    with pytest.raises(ValueError, match="outside the group"):
        fused.merge_row_grad(row, row, row, grads, q, q, factors, kv, 0, (1, 3), 8)
    with pytest.raises(ValueError, match="grad_outs must be"):
        fused.merge_row_grad(row, row, row, grads[:, :2], q, q, factors, kv, 0, (1, 2), 8)
    with pytest.raises(ValueError, match="factors must be"):  # heads other than the factors'
        fused.merge_row_grad(row, row, row, grads, q, q, factors, kv, 0, (1, 2), 4)
    with pytest.raises(ValueError, match="contiguous factors"):
        fused.merge_row_grad(row, row, row, grads, q, q, factors.transpose(0, 1).contiguous().transpose(0, 1),
                             kv, 0, (1, 2), 8)  # fmt: skip


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_split_group_backward(backend):
    """A group whose backward is split (a checkpointed chunk ends mid-group) gives the same
    bits as the whole group: sites outside the range add exact zeros, in a fixed order.
    The tensor-core kernel sums a launch's sites inside its dots, so there the old rows'
    gradients agree to rounding and everything else bitwise."""
    t, n0, g, d, heads = _tokens(5), 3, 4, 512, 8
    buffer, queries, norms, grad_outs = _inputs(t, n0, g, d, heads, 1.0, torch.float32)
    b = BACKENDS[backend]
    whole = _grouped(b, buffer, queries, norms, grad_outs, n0, heads, 1.0)
    # The later sites' graph runs its backward first; the earlier sites' adds onto it.
    rows = torch.zeros(buffer.shape, device=DEVICE)
    late = _grouped(b, buffer, queries, norms, grad_outs, n0, heads, 1.0, (2, 4), rows)
    early = _grouped(b, buffer, queries, norms, grad_outs, n0, heads, 1.0, (0, 2), rows)
    assert torch.equal(whole[0], late[0]) and torch.equal(whole[0], early[0])
    if backend == "triton-tensor-cores":
        torch.testing.assert_close(rows, whole[1], rtol=1e-6, atol=1e-6 * whole[1].abs().max().item())
    else:
        assert torch.equal(whole[1], rows)
    # The interpreter runs tl.dot as numpy's matmul, whose BLAS kernel (chosen per CPU)
    # may sum a row of the product in an order that depends on the other rows, here the
    # sites outside the range: there the tensor-core kernel's dquery/dnorm agree to
    # rounding. On a GPU every row of an MMA is summed alike, and they are bitwise equal.
    exact = backend != "triton-tensor-cores" or CUDA
    for k in (2, 3):  # dquery, dnorm
        for got, ref in ((late[k][2:], whole[k][2:]), (early[k][:2], whole[k][:2])):
            if exact:
                assert torch.equal(got, ref)
            else:
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("d,heads", [(512, 8), pytest.param(1280, 8, id="1B-width")], ids=["512", "1280"])
def test_deferred_row_grads(backend, d, heads):
    """Two groups' phase-1 backwards as the history runs them: the later group (old rows
    [0, 5), G = 3) defers its rows' gradients, rows [3, 5) get them when due, then the
    earlier group (rows [0, 3), G = 2, over fp32 gradients its merges already touched)
    defers too and rows [0, 3) get both groups' in one call. Same gradients as adding
    each group's at once: bitwise where the additions keep their order (the reference, the
    row loop), to rounding where the dots sum both groups' in one accumulator."""
    t = _tokens(3)
    torch.manual_seed(d)
    buffer, queries, norms, grad_outs = _inputs(t, 5, 3, d, heads, 1.0, torch.float32)
    groups = [(5, queries, norms, grad_outs), (3, queries[:2] * 1.5, norms[:2], grad_outs[:2] * -0.5)]
    b = BACKENDS[backend]
    stats = []
    for n0, q, w, do in groups:
        m, l, _ = b.group_forward(buffer[:, :n0], q, w, heads, EPS, 1.0)
        stats.append(((m + l.log()).contiguous(), torch.randn(m.shape, device=DEVICE)))
    start = 0.01 * torch.randn(buffer.shape, device=DEVICE)  # earlier reads' share
    at_once, deferred_rows = start.clone(), start.clone()
    param_grads, owed = [], []
    for (n0, q, w, do), (lse, delta) in zip(groups, stats):
        args = (do, buffer[:, :n0], q, w, lse, delta, heads, EPS, 1.0)
        param_grads.append(b.group_backward(*args, at_once[:, :n0]))
        untouched = deferred_rows.clone()
        *grads, deferred = b.group_backward_deferred(*args, deferred_rows[:, :n0])
        deferred_is_empty = backend == "triton-row-loop"
        assert (len(deferred) == 0) == deferred_is_empty
        assert torch.equal(deferred_rows, untouched) != deferred_is_empty  # the row loop adds at once
        for got, ref in zip(grads, param_grads[-1]):
            assert torch.equal(got, ref)
        owed.append([deferred, n0])
        b.add_row_grads(owed, buffer, deferred_rows, 3 if n0 == 5 else 0)
        for entry in owed:
            entry[1] = min(entry[1], 3 if n0 == 5 else 0)
    if backend == "triton-tensor-cores":
        torch.testing.assert_close(deferred_rows, at_once, rtol=1e-6, atol=1e-6 * at_once.abs().max().item())
        assert not torch.equal(deferred_rows, start)
    else:
        assert torch.equal(deferred_rows, at_once)


def _deferred_groups(backend, buffer, queries, norms, grad_outs, heads, groups, deltas, rows):
    """Phase 1 forward and deferred backward of each group (n0, query scale, site range)
    with its delta, into ``rows``; the [deferred, n0] entries add_row_grads takes. Every
    group must defer and add nothing to ``rows`` before the flush."""
    untouched, owed = rows.clone(), []
    for (n0, scale, site_range), delta in zip(groups, deltas):
        m, l, _ = backend.group_forward(buffer[:, :n0], queries * scale, norms, heads, EPS, 1.0)
        *_, deferred = backend.group_backward_deferred(
            grad_outs, buffer[:, :n0], queries * scale, norms, (m + l.log()).contiguous(), delta, heads, EPS, 1.0,
            rows[:, :n0], site_range,
        )  # fmt: skip
        assert deferred and torch.equal(rows, untouched)  # nothing added before the flush
        owed.append([deferred, n0])
    return owed


def test_add_row_grads_spanning_blocks_and_owed_rows():
    """One flush over 40 rows (more than one 16-row block, as a pipeline stage's loaded rows
    are flushed) from three groups owing different rows ([0, 40), [0, 25), [0, 9)), one of
    them split in two chunks by its site range: the tensor-core factors against the
    reference's, every row to rounding, rows no group owes untouched."""
    t, d, heads = _tokens(2), 1280, 8
    torch.manual_seed(3)
    buffer, queries, norms, grad_outs = _inputs(t, 42, 3, d, heads, 1.0, torch.float32)
    start = 0.01 * torch.randn(buffer.shape, device=DEVICE)
    groups = ((40, 1.0, None), (25, -0.7, (1, 3)), (9, 1.3, None))
    deltas = [torch.randn((3, t, heads), device=DEVICE) for _ in groups]
    results = []
    for backend in (BACKENDS["triton-tensor-cores"], BACKENDS["torch"]):
        rows = start.clone()
        owed = _deferred_groups(backend, buffer, queries, norms, grad_outs, heads, groups, deltas, rows)
        backend.add_row_grads(owed, buffer, rows, 0)
        results.append(rows)
    got, ref = results
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(got[:, 40:], start[:, 40:]) and not torch.equal(got[:, 30], start[:, 30])


def test_add_row_grads_independent_of_the_token_programs(launch_reads):
    """The row-gradient kernel's token programs stride over the tokens, each with one loop
    over its (token, row block, entry) triples: one program for every token, a few, and
    one per token give bitwise the same gradients (a block's entries are summed in the
    same order whoever runs it), and the reference's to rounding. Two groups owe 20 and
    11 rows (two 16-row blocks), over an odd token count."""
    t, d, heads = 5 if not CUDA else _tokens(2), 1280, 8  # the width where the reference defers too
    torch.manual_seed(11)
    buffer, queries, norms, grad_outs = _inputs(t, 20, 3, d, heads, 1.0, torch.float32)
    start = 0.01 * torch.randn(buffer.shape, device=DEVICE)
    groups = ((20, 1.0, None), (11, -0.6, None))
    deltas = [torch.randn((3, t, heads), device=DEVICE) for _ in groups]
    results = []
    for backend in (BACKENDS["triton-tensor-cores"], BACKENDS["torch"]):
        owed = _deferred_groups(backend, buffer, queries, norms, grad_outs, heads, groups, deltas, start.clone())
        is_fused = backend is BACKENDS["triton-tensor-cores"]
        for override in [dict(programs_per_sm=p) for p in (1, 3, 1024)] if is_fused else [{}]:
            rows = start.clone()
            with launch.overridden(add_row_grads=override):
                backend.add_row_grads(owed, buffer, rows, 0)
            results.append(rows)
    *fused_rows, ref = results
    for got in fused_rows[1:]:
        assert torch.equal(got, fused_rows[0])
    assert launch_reads == {"add_row_grads": [dict(programs_per_sm=p) for p in (1, 3, 1024)]}
    torch.testing.assert_close(fused_rows[0], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert not torch.equal(fused_rows[0][:, :20], start[:, :20])


def test_add_row_grads_more_entries_than_one_launch():
    """More owing entries than one launch takes (launch.ROW_GRADS_ENTRIES): the further
    launches add the rest, in order, to the same rows (one-site groups over 3 rows), into
    rows that held no gradient (NaN, ``accumulate=False``): the first launch stores."""
    t, d, heads, entries = _tokens(2), 512, 8, launch.ROW_GRADS_ENTRIES + 2
    torch.manual_seed(5)
    buffer, queries, norms, grad_outs = _inputs(t, 3, 1, d, heads, 1.0, torch.float32)
    scales = torch.linspace(-1.5, 1.5, entries).tolist()
    deltas = [torch.randn((1, t, heads), device=DEVICE) for _ in scales]
    results = []
    for backend in (BACKENDS["triton-tensor-cores"], BACKENDS["torch"]):
        rows, owed = torch.full(buffer.shape, float("nan"), device=DEVICE), []
        for scale, delta in zip(scales, deltas):
            m, l, _ = backend.group_forward(buffer, queries * scale, norms, heads, EPS, 1.0)
            *_, deferred = backend.group_backward_deferred(
                grad_outs * scale, buffer, queries * scale, norms, (m + l.log()).contiguous(), delta,
                heads, EPS, 1.0, rows,
            )  # fmt: skip
            owed.append([deferred, 3])
        backend.add_row_grads(owed, buffer, rows, 0, accumulate=False)
        results.append(rows)
    got, ref = results
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("g", [3, 9], ids=["one-launch", "two-launches"])
def test_store_into_rows_holding_no_gradient(backend, g):
    """``accumulate=False`` (the history's rows that no read has reached yet, left
    unfilled): the phase-1 backward with its flush, and a new row's gradient, store what
    they would add to zeros, bitwise, and read nothing there (NaN destinations). Nine sites
    take two launches of the row loop (eight slots each at D = 512), and their flush two
    entries, so the later launches add to what the first stored."""
    t, n0, d, heads = _tokens(3), 4, 512, 8
    torch.manual_seed(g)
    buffer, queries, norms, grad_outs = _inputs(t, n0, g, d, heads, 1.0, torch.float32)
    b = BACKENDS[backend]
    m, l, _ = b.group_forward(buffer[:, :n0], queries, norms, heads, EPS, 1.0)
    lse, delta = (m + l.log()).contiguous(), torch.randn(m.shape, device=DEVICE)
    args = (grad_outs, buffer[:, :n0], queries, norms, lse, delta, heads, EPS, 1.0)
    added, stored = torch.zeros(t, n0, d, device=DEVICE), torch.full((t, n0, d), float("nan"), device=DEVICE)
    want = b.group_backward(*args, added)
    got = b.group_backward(*args, stored, accumulate=False)
    assert torch.equal(stored, added) and not torch.equal(added, torch.zeros_like(added))
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    factors, kv = torch.randn(g, t, 2, heads, 2, device=DEVICE), torch.randn(g, t, 2, device=DEVICE)
    row_args = (grad_outs, queries, norms, factors, kv, 1, (1, g), heads)
    row_added, row_stored = torch.zeros(t, d, device=DEVICE), torch.full((t, d), float("nan"), device=DEVICE)
    b.merge_row_grad(buffer[:, 1], row_added, row_added, *row_args)
    b.merge_row_grad(buffer[:, 1], row_stored, row_stored, *row_args, accumulate=False)
    assert torch.equal(row_stored, row_added)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize(
    "t,n0,g,d",
    [
        pytest.param(4099, 65, 8, 1280, id="1B-last-full-group"),  # many backward tiles per program
        pytest.param(2051, 17, 4, 512, id="100M-group"),
    ],
)
@pytest.mark.parametrize("backend", ["triton-row-loop", "triton-tensor-cores"])
def test_deterministic(t, n0, g, d, backend):
    """Two runs of a group's forward and backward are bitwise equal (no atomics)."""
    inputs = _inputs(t, n0, g, d, 8, 8.0, torch.bfloat16)
    first = _grouped(BACKENDS[backend], *inputs, n0, 8, 8.0)
    second = _grouped(BACKENDS[backend], *inputs, n0, 8, 8.0)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def _family(dots: bool) -> str:
    return "tensor_cores" if dots else "row_loop"


@pytest.mark.parametrize(
    "d,heads,g,forward_dots,backward_dots,dtype",
    [
        # Head width 160 (the 1B shape): dots forward and backward.
        pytest.param(1280, 8, 5, True, True, torch.float32, id="1B-width"),
        # The dots take bf16 or fp32 rows: over fp16 the row loops, at any shape.
        pytest.param(1280, 8, 5, False, False, torch.float16, id="1B-width-fp16"),
        # Head width 128 (350M): dot forward, row-loop backward.
        pytest.param(1024, 8, 5, True, False, torch.float32, id="350M-width"),
        # A group of 4 fills half a dot: row loops.
        pytest.param(512, 8, 4, False, False, torch.float32, id="group-of-4"),
        # Head width 64 (100M) in a group of 5: row loops both ways.
        pytest.param(512, 8, 5, False, False, torch.float32, id="100M-width"),
        # One head runs as eight dot heads: of 96 columns at 768 (dot forward, row-loop
        # backward), of 160 at the 1B width (dots both ways), as eight heads would.
        pytest.param(768, 1, 5, True, False, torch.float32, id="one-head"),
        pytest.param(1280, 1, 5, True, True, torch.float32, id="one-head-1B-width"),
        # Three heads do not divide eight and stay three dot heads, of 256 columns.
        pytest.param(768, 3, 5, True, True, torch.float32, id="three-heads"),
    ],
)
def test_tensor_cores_auto(d, heads, g, forward_dots, backward_dots, dtype):
    """lookahead_kernels="auto" runs the family its rule names (bitwise the same results), also
    for a split group's site range: the rule reads the group's size, not the range's."""
    t, n0 = _tokens(2), 3
    buffer, queries, norms, grad_outs = _inputs(t, n0, g, d, heads, 1.0, dtype)
    rows = buffer[:, :n0]
    auto = fused.group_forward(rows, queries, norms, heads, EPS, 1.0, lookahead_kernels="auto")
    named = fused.group_forward(rows, queries, norms, heads, EPS, 1.0, lookahead_kernels=_family(forward_dots))
    for a, b in zip(auto, named):
        assert torch.equal(a, b)
    lse = (auto[0] + auto[1].log()).contiguous()
    delta = torch.randn(g, t, heads, device=DEVICE)
    grads = []
    for lookahead_kernels in ("auto", _family(backward_dots)):
        grad_rows = torch.zeros(rows.shape, device=DEVICE)
        dq, dg = _fused_group_backward(grad_outs, rows, queries, norms, lse, delta, heads, EPS, 1.0,
                                      grad_rows, (0, 2), lookahead_kernels=lookahead_kernels)  # fmt: skip
        grads.append((grad_rows, dq, dg))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_sites_per_program_split(launch_reads):
    """Phase 1 with the sites split over sibling programs, and its backward with the sites
    split over launches, give the same bits as one program / one launch per token tile."""
    t, n0, g, d, heads = _tokens(4), 3, 5, 512, 8
    buffer, queries, norms, grad_outs = _inputs(t, n0, g, d, heads, 1.0, torch.float32)
    rows = buffer[:, :n0]
    row_loop = dict(lookahead_kernels="row_loop")
    with launch.overridden(group_fwd=dict(sites_per_program=g, block_t=1)):
        whole = fused.group_forward(rows, queries, norms, heads, EPS, 1.0, **row_loop)
    with launch.overridden(group_fwd=dict(sites_per_program=2, block_t=1)):
        split = fused.group_forward(rows, queries, norms, heads, EPS, 1.0, **row_loop)
    for a, b in zip(whole, split):
        assert torch.equal(a, b)
    lse = (whole[0] + whole[1].log()).contiguous()
    delta = torch.randn(g, t, heads, device=DEVICE)
    grads = []
    for sites in (g, 2, 1):
        grad_rows = torch.zeros(rows.shape, device=DEVICE)
        with launch.overridden(group_bwd=dict(sites_per_program=sites)):
            dq, dg = _fused_group_backward(grad_outs, rows, queries, norms, lse, delta, heads, EPS, 1.0,
                                          grad_rows, lookahead_kernels="row_loop")  # fmt: skip
        grads.append((grad_rows, dq, dg))
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)
    assert launch_reads == {"group_fwd": [dict(sites_per_program=k, block_t=1) for k in (g, 2)],
                            "group_bwd": [dict(sites_per_program=k) for k in (g, 2, 1)]}  # fmt: skip


def test_sites_per_program_keeps_a_power_of_two_tile(launch_reads):
    """A sites-per-program override that leaves room for a token count that is not a power
    of two (three sites of 256: 5 tokens) runs on the tile's power of two below it (Triton
    refuses a tile of 5), with the partials of one program per token tile. The two tiles
    hold 2 and 4 tokens: the interpreter sums alike, a GPU may lay the row sums out
    differently (H200: 1e-6 apart), so there they agree to fp32 rounding."""
    t, n0, g, d, heads = _tokens(5), 2, 6, 256, 8
    buffer, queries, norms, _ = _inputs(t, n0, g, d, heads, 1.0, torch.float32)
    rows = buffer[:, :n0]
    with launch.overridden(group_fwd=dict(sites_per_program=g)):
        whole = fused.group_forward(rows, queries, norms, heads, EPS, 1.0, lookahead_kernels="row_loop")
    with launch.overridden(group_fwd=dict(sites_per_program=3)):
        split = fused.group_forward(rows, queries, norms, heads, EPS, 1.0, lookahead_kernels="row_loop")
    for a, b in zip(whole, split):
        if CUDA:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b)
    assert launch_reads == {"group_fwd": [dict(sites_per_program=k) for k in (g, 3)]}


def test_merge_launch_overrides_reach_the_kernels(launch_reads):
    """The merges' launches set with launch.overridden (as tools/perf sweeps them) reach
    their kernels, which compute what they compute at the rules' launches."""
    t, n0, g, d, heads = _tokens(3), 2, 3, 512, 8
    torch.manual_seed(5)
    buffer, queries, norms, grad_outs = _inputs(t, n0, g, d, heads, 1.0, torch.float32)
    m, l, acc = fused.group_forward(buffer[:, :n0], queries, norms, heads, EPS, 1.0)
    new = buffer[:, n0:]  # site 2's two new rows
    factors, kv = torch.randn(g, t, 2, heads, 2, device=DEVICE), torch.randn(g, t, 2, device=DEVICE)

    def merges():
        lse = torch.empty((t, heads), device=DEVICE)
        out = fused.merge_forward(m[2], l[2], acc[2], new, queries[2], norms[2], heads, EPS, 1.0, lse)
        row_factors = (torch.zeros(t, 2, heads, 2, device=DEVICE), torch.zeros(t, 2, device=DEVICE))
        delta, dq, dg = fused.merge_backward(grad_outs[2], out, new, queries[2], norms[2], lse, heads, EPS, 1.0,
                                             row_factors)  # fmt: skip
        row_grad = torch.randn(t, d, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
        fused.merge_row_grad(new[:, 0], row_grad, row_grad, grad_outs, queries, norms, factors, kv, 0, (1, g), heads)
        return out, lse, delta, dq, dg, *row_factors, row_grad

    rules = merges()
    fields = dict(block_t=1, stages=2)
    with launch.overridden(merge_fwd=fields, merge_bwd=fields, merge_row_grad=fields):
        overridden = merges()
    assert launch_reads == {kernel: [fields] for kernel in ("merge_fwd", "merge_bwd", "merge_row_grad")}
    for want, got in zip(rules, overridden):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize(
    "t, n0, g, d, heads",
    [
        pytest.param(5, 3, 5, 512, 8, id="D512-G5"),
        # Two site blocks of the tensor-core kernel (only the first holds site 0); head
        # width 160 as two channel chunks (128 + 32).
        pytest.param(2, 2, 10, 1280, 8, id="D1280-G10"),
        # A model head of four dot heads in the tensor-core kernel.
        pytest.param(3, 2, 3, 512, 2, id="D512-H2"),
    ],
)
@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("sites_per_program", [None, 1])
def test_first_site_finished_by_phase1(name, sites_per_program, t, n0, g, d, heads, nan_uninitialised):
    """Phase 1 with ``first_out`` writes site 0's output and lse bitwise as its merge with
    no new rows would and every other site's partials as without it; the row loop leaves
    site 0's partials unwritten (NaN: ``nan_uninitialised``), the tensor-core kernel
    stores them for the merge it launches."""
    backend = BACKENDS[name]
    if sites_per_program is not None and name != "triton-row-loop":
        pytest.skip("sites_per_program is the row loop's")
    t = _tokens(t)
    for dtype in DTYPES:
        buffer, queries, norms, _ = _inputs(t, n0, g, d, heads, 1.0, dtype)
        rows = buffer[:, :n0]
        with launch.overridden(group_fwd=dict(sites_per_program=sites_per_program)):
            m, l, acc = backend.group_forward(rows, queries, norms, heads, EPS, 1.0)
        lse = torch.empty((t, heads), device=DEVICE)
        merged = backend.merge_forward(m[0], l[0], acc[0], buffer[:, n0:n0], queries[0], norms[0],
                                       heads, EPS, 1.0, lse)  # fmt: skip
        first, first_lse = torch.full_like(merged, float("nan")), torch.full_like(lse, float("nan"))
        with launch.overridden(group_fwd=dict(sites_per_program=sites_per_program)):
            parts = backend.group_forward(rows, queries, norms, heads, EPS, 1.0, first_out=(first, first_lse))
        assert torch.equal(first, merged) and torch.equal(first_lse, lse)
        for a, b in zip((m, l, acc), parts):
            assert torch.equal(a[1:], b[1:])
            if name == "triton-row-loop":
                assert b[0].isnan().all()
            else:
                assert torch.equal(a[0], b[0])


def test_first_out_is_checked():
    """A first_out of the wrong shape or dtype is refused before any launch."""
    t, n0, g, d, heads = _tokens(2), 2, 3, 512, 8
    buffer, queries, norms, _ = _inputs(t, n0, g, d, heads, 1.0, torch.float32)
    rows = buffer[:, :n0]
    lse = torch.empty((t, heads), device=DEVICE)
    with pytest.raises(ValueError, match="first_out's output must be"):
        fused.group_forward(rows, queries, norms, heads, EPS, 1.0, first_out=(torch.empty(t, d - 1, device=DEVICE), lse))
    with pytest.raises(ValueError, match="first_out's lse must be"):
        fused.group_forward(rows, queries, norms, heads, EPS, 1.0,
                            first_out=(torch.empty(t, d, device=DEVICE), lse.double()))  # fmt: skip


def test_merge_out_is_checked():
    """merge_forward's out of the wrong shape, dtype or stride is refused before any launch."""
    t, n0, g, d, heads = _tokens(2), 2, 2, 512, 8
    buffer, queries, norms, _ = _inputs(t, n0, g, d, heads, 1.0, torch.float32)
    m, l, acc = fused.group_forward(buffer[:, :n0], queries, norms, heads, EPS, 1.0)
    lse = torch.empty((t, heads), device=DEVICE)
    for bad in (torch.empty(t, d - 1, device=DEVICE), torch.empty(t, d, device=DEVICE).double(),
                torch.empty(d, t, device=DEVICE).t()):  # fmt: skip
        with pytest.raises(ValueError, match="merge_forward's out must be"):
            fused.merge_forward(m[1], l[1], acc[1], buffer[:, n0:n0 + 1], queries[1], norms[1], heads, EPS, 1.0,
                                lse, out=bad)  # fmt: skip


@pytest.mark.parametrize("kernel, fields, message", [
    ("group_fwd", dict(sites_per_program=0), "group_fwd: sites_per_program must be at least 1, got 0"),
    ("group_bwd", dict(sites_per_program=-2), "group_bwd: sites_per_program must be at least 1, got -2"),
    ("add_row_grads", dict(programs_per_sm=0), "add_row_grads: programs_per_sm must be at least 1, got 0"),
    ("merge_fwd", dict(sites_per_program=2), "merge_fwd takes no launch field sites_per_program"),
    ("group_forward", dict(num_warps=4), "no kernel 'group_forward' to override"),
])
def test_launch_overrides_are_checked(kernel, fields, message):
    """A launch override that would cover no site or program, or that names a field or
    kernel there is none of, is an error when it is set, not a launch that silently
    covers nothing or ignores it; the block it would have covered does not run."""
    with pytest.raises(ValueError, match=message):
        with launch.overridden(**{kernel: fields}):
            raise AssertionError("not reached")
    assert launch.overrides(kernel) == {}


def test_unknown_kernel_family_is_refused():
    """A kernel family other than auto, row_loop and tensor_cores is an error naming them."""
    t, n0, g, d, heads = _tokens(2), 2, 2, 512, 8
    rows, queries, norms, _ = _inputs(t, n0, g, d, heads, 1.0, torch.float32)
    with pytest.raises(ValueError, match=r"lookahead_kernels must be one of \['auto', 'row_loop', 'tensor_cores'\]"):
        fused.group_forward(rows, queries, norms, heads, EPS, 1.0, lookahead_kernels="dots")


def test_tensor_cores_reject_row_loop_overrides():
    """The tensor-core kernels take only their own launch fields; a row-loop override is an
    error, not silently ignored."""
    t, n0, g, d, heads = _tokens(2), 2, 2, 512, 8
    rows, queries, norms, grad_outs = _inputs(t, n0, g, d, heads, 1.0, torch.float32)
    for override in (dict(block_t=2), dict(sites_per_program=1), dict(l2_reuse=True)):
        with pytest.raises(ValueError, match="tensor-core kernels take num_warps, stages and programs_per_sm"):
            with launch.overridden(group_fwd=override):
                fused.group_forward(rows, queries, norms, heads, EPS, 1.0, lookahead_kernels="tensor_cores")
    stats = torch.zeros(g, t, heads, device=DEVICE)
    grad_rows = torch.zeros(rows.shape, device=DEVICE)
    for override in (dict(block_t=2), dict(sites_per_program=1)):
        with pytest.raises(ValueError, match="the tensor-core kernels take only num_warps"):
            with launch.overridden(group_bwd=override):
                _fused_group_backward(grad_outs, rows, queries, norms, stats, stats, heads, EPS, 1.0,
                                     grad_rows, lookahead_kernels="tensor_cores")  # fmt: skip
    assert not grad_rows.any()  # nothing written before the error


def test_folded_operand_is_the_kernels_split():
    """The dot backward's queries over bf16 rows: [NG, 2, D] holding their bf16 rounding and
    the rounding of what it misses, bitwise the pair the kernels' split_operand formed in fp32
    (round to nearest even, the difference exact in fp32); other dtypes keep fp32."""
    folded = torch.randn(3, 320, generator=torch.Generator().manual_seed(0)) * torch.logspace(-20, 20, 320)
    pair = phase1_dots.folded_operand(folded, torch.bfloat16)
    hi = folded.to(torch.bfloat16)
    assert pair.shape == (3, 2, 320) and pair.dtype == torch.bfloat16
    assert torch.equal(pair[:, 0].view(torch.int16), hi.view(torch.int16))
    assert torch.equal(pair[:, 1].view(torch.int16), (folded - hi.float()).to(torch.bfloat16).view(torch.int16))
    assert (pair.float().sum(1) - folded).abs().le(folded.abs() * 2.0**-16).all()
    assert phase1_dots.folded_operand(folded, torch.float32) is folded
