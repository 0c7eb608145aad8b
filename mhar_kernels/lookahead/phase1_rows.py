"""Phase 1 of the lookahead schedule on the row loops: the sites in registers, one row at a time.

- ``group_fwd_kernel``: one pass over the old rows ``[T, N, D]`` computes, for the G
  sites of a group at once, the online-softmax partials (running max ``m``, denominator
  ``l``, accumulator ``acc``). Each program holds the states of a chunk of the sites for a
  token tile, as tuples of ``[BT, BH, BHD]`` tiles; the chunks of one token tile run side
  by side, so each row comes from memory about once per token tile.
- ``group_bwd_kernel``: every site's gradient to the old rows; each row and its fp32
  gradient are read (and the gradient written) once per launch, one launch per chunk of
  sites. The sites' contributions are added in a fixed order (last site first), and sites
  outside the site range contribute exact zeros, so a group whose backward a checkpointed
  chunk splits gives bit-identical gradients.

Launch rules: ``launch.group_fwd_config`` and ``launch.group_bwd_config``.
"""

import torch
import triton
import triton.language as tl

from ..launch import backward_programs, group_bwd_config, group_fwd_config, group_fwd_tokens, tile
from ..primitives import fast_exp, folded_query, grad_factors, inv_rms, softmax_step, store_output, token_tile
from .reduce import reduce_dw


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _sums_over_heads(b_xs, SG: tl.constexpr):
    """Sum over the head axis of each of the SG [BT, BH] tiles in b_xs, four tiles per
    reduction. Where the heads span warps, every reduction is a round trip through shared
    memory with its barriers whatever its operand count, so four sites share one instead
    of paying one each. Each tile's sum is its own; slots past SG reduce zeros."""
    b_sums = ()
    for i in tl.static_range(0, SG, 4):
        b_zero = tl.zeros_like(b_xs[i])
        b_x1 = b_xs[i + 1] if i + 1 < SG else b_zero
        b_x2 = b_xs[i + 2] if i + 2 < SG else b_zero
        b_x3 = b_xs[i + 3] if i + 3 < SG else b_zero
        b_sums = b_sums + tl.reduce((b_xs[i], b_x1, b_x2, b_x3), 1, _add4)
    return b_sums


@triton.jit
def _head_dots(b_v, b_xs, SG: tl.constexpr):
    """Head dots [BT, BH] of the row tile b_v [BT, BH, BHD] with each of the SG tiles in
    b_xs (broadcast against it), four per reduction. Where a head spans warps (one head
    at D >= 512), each reduction is a round trip through shared memory with its barriers
    whatever its operand count, so four dots share one; where it does not, the sums
    stay inside a warp either way."""
    b_dots = ()
    for i in tl.static_range(0, SG, 4):
        b_zero = tl.zeros_like(b_v)
        b_x1 = b_v * b_xs[i + 1] if i + 1 < SG else b_zero
        b_x2 = b_v * b_xs[i + 2] if i + 2 < SG else b_zero
        b_x3 = b_v * b_xs[i + 3] if i + 3 < SG else b_zero
        b_dots = b_dots + tl.reduce((b_v * b_xs[i], b_x1, b_x2, b_x3), 2, _add4)
    return b_dots


@triton.jit
def group_fwd_kernel(
    V_ptr,  # [T, N, D] old rows, strides (stride_vt, stride_vn, 1)
    Q_ptr,  # [NG, D] pseudo-queries of the group's sites, contiguous
    G_ptr,  # [NG, D] norm weights, contiguous
    M_ptr,  # [NG, T, H] fp32 running max of the logits
    L_ptr,  # [NG, T, H] fp32 softmax denominators (relative to M)
    A_ptr,  # [NG, T, D] fp32 unnormalised accumulators (relative to M), or NORMALISED: acc / L in half precision
    O_ptr,  # [T, D] FIRST: site 0's output in the sources' dtype, strides (stride_ot, 1)
    LSE_ptr,  # [T, H] FIRST: site 0's fp32 log-sum-exp
    T,
    N,
    NG,
    stride_vt,
    stride_vn,
    stride_ot,
    eps,
    scale,
    D: tl.constexpr,
    H: tl.constexpr,
    HD: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    BHD: tl.constexpr,
    BG: tl.constexpr,
    STAGES: tl.constexpr,
    FIRST: tl.constexpr,  # site 0 finished here (it merges no new rows), its partials not stored
    NORMALISED: tl.constexpr,  # A_ptr holds acc / L in its (half-precision) dtype
):
    # Site chunks vary fastest over the 1-D grid: the chunks of one token tile run side by
    # side, so a row the first reads from memory the others find in L2.
    n_chunks = tl.cdiv(NG, BG)
    i_g = tl.program_id(0) % n_chunks
    i_t = tl.program_id(0) // n_chunks
    _, o_h, o_d, m_d, m_t, m_v, _, o_t64 = token_tile(i_t, T, H, HD, BT, BH, BHD)

    # Per site of the chunk a folded query w = q * g^ (g^ rounded to the activation dtype)
    # and an online-softmax state, held in tuples: every tensor is a [BT, BH, BHD] tile in
    # the layout of the row loads, as in the per-site forward, so the head reductions stay
    # inside a warp and nothing is converted between layouts.
    b_ws = ()
    b_ms = ()
    b_ls = ()
    b_accs = ()
    for j in tl.static_range(BG):
        i_site = i_g * BG + j
        m_w = m_d & (tl.full([BH, BHD], i_site, tl.int32) < NG)
        b_ws = b_ws + folded_query(Q_ptr + i_site * D, G_ptr + i_site * D, o_d, m_w, V_ptr.dtype.element_ty, BHD, 1)
        b_ms = b_ms + (tl.full([BT, BH], float("-inf"), tl.float32),)
        b_ls = b_ls + (tl.zeros([BT, BH], dtype=tl.float32),)
        b_accs = b_accs + (tl.zeros([BT, BH, BHD], dtype=tl.float32),)
    p_v = V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :]
    for _ in tl.range(0, N, num_stages=STAGES):
        b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
        b_rs = (inv_rms((b_v,), eps, D, 1) * scale)[:, None]
        b_dots = _head_dots(b_v, b_ws, BG)
        for j in tl.static_range(BG):
            b_m, b_l, b_acc = softmax_step((b_v,), b_dots[j] * b_rs, b_ms[j], b_ls[j], (b_accs[j],), 1)
            b_ms = b_ms[:j] + (b_m,) + b_ms[j + 1 :]
            b_ls = b_ls[:j] + (b_l,) + b_ls[j + 1 :]
            b_accs = b_accs[:j] + b_acc + b_accs[j + 1 :]
        p_v += stride_vn

    for j in tl.static_range(BG):
        i_site = i_g * BG + j
        o_gt = i_site * T + o_t64  # row of the [NG, T, .] outputs
        m_site = m_t & (tl.full([BT], i_site, tl.int32) < NG)
        if FIRST and j == 0:  # the first chunk holds site 0: masks pick the store
            m_first = m_site & (tl.full([BT], i_site, tl.int32) == 0)
            m_site = m_site & (tl.full([BT], i_site, tl.int32) != 0)
            m_fh = m_first[:, None] & (o_h < H)[None, :]
            store_output(O_ptr, LSE_ptr + o_t64[:, None] * H + o_h[None, :], b_ms[j], b_ls[j], b_accs[j],
                         o_t64, o_d, stride_ot, m_fh[:, :, None] & m_d[None, :, :], m_fh)  # fmt: skip
        m_ml = m_site[:, None] & (o_h < H)[None, :]
        p_ml = o_gt[:, None] * H + o_h[None, :]
        tl.store(M_ptr + p_ml, b_ms[j], mask=m_ml)
        tl.store(L_ptr + p_ml, b_ls[j], mask=m_ml)
        m_a = m_site[:, None, None] & m_d[None, :, :]
        b_a = b_accs[j]
        if NORMALISED:  # a convex combination of the rows: within their dtype's range
            b_a = (b_a / b_ls[j][:, :, None]).to(A_ptr.dtype.element_ty)
        tl.store(A_ptr + o_gt[:, None, None] * D + o_d[None, :, :], b_a, mask=m_a)


@triton.jit
def group_bwd_kernel(
    V_ptr,  # [T, N, D] old rows, strides (stride_vt, stride_vn, 1)
    W_ptr,  # [NG, D] fp32 folded queries w = q * g^ of the sites, contiguous
    DO_ptr,  # [NG, T, D] gradients of the sites' outputs, contiguous
    LSE_ptr,  # [NG, T, H] fp32 log-sum-exp of each site
    DELTA_ptr,  # [NG, T, H] fp32 delta of each site (from its merge backward)
    DV_ptr,  # [T, N, D] fp32 gradients of the old rows (+=), strides (stride_dvt, stride_dvn, 1)
    DW_ptr,  # [P, NG, D] fp32 per-program partial dL/dw of each site
    T,
    N,
    NG,
    chunk_lo,
    chunk_hi,
    num_tiles,
    stride_vt,
    stride_vn,
    stride_dvt,
    stride_dvn,
    eps,
    scale,
    D: tl.constexpr,
    H: tl.constexpr,
    HD: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    BHD: tl.constexpr,
    SG: tl.constexpr,
    STAGES: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """The gradients of the sites [chunk_lo, chunk_hi) (at most SG) to the old rows. Slot j
    holds site chunk_hi - 1 - j, so the sites are added last first; slots below chunk_lo
    load lse = +inf and do = delta = 0 and add exact zeros. Chunks run last first, so any
    split of a group into chunks or site ranges adds the same terms in the same order.
    Without ACCUMULATE the rows' gradients hold nothing yet: stored, not read."""
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_h = tl.arange(0, BH)
    o_k = tl.arange(0, BHD)
    o_d = o_h[:, None] * HD + o_k[None, :]
    m_d = (o_h[:, None] < H) & (o_k[None, :] < HD)

    # Per slot: w, and (per token tile) do, lse and delta, held in tuples of tiles in the
    # layout of the row loads, with a dL/dw accumulator: the row loop reads only v and dv.
    b_ws = ()
    b_dws = ()
    for j in tl.static_range(SG):
        m_w = m_d & (tl.full([BH, BHD], chunk_hi - 1 - j, tl.int32) >= chunk_lo)
        b_ws = b_ws + (tl.load(W_ptr + (chunk_hi - 1 - j) * D + o_d, mask=m_w, other=0.0)[None, :, :],)
        b_dws = b_dws + (tl.zeros([BT, BH, BHD], dtype=tl.float32),)

    for i_t in range(i_p, num_tiles, n_p):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        m_v = m_t[:, None, None] & m_d[None, :, :]
        o_t64 = o_t.to(tl.int64)
        b_dos = ()
        b_wdos = ()  # (w_0, do_0, w_1, do_1, ...): the row's dots with both, batched
        b_lses = ()
        b_deltas = ()
        for j in tl.static_range(SG):
            m_s = m_t & (tl.full([BT], chunk_hi - 1 - j, tl.int32) >= chunk_lo)
            o_gt = (chunk_hi - 1 - j) * T + o_t64
            p_do = DO_ptr + o_gt[:, None, None] * D + o_d[None, :, :]
            b_do = tl.load(p_do, mask=m_s[:, None, None] & m_d[None, :, :], other=0.0)
            b_dos = b_dos + (b_do.to(tl.float32),)
            b_wdos = b_wdos + (b_ws[j], b_dos[j])
            p_th = o_gt[:, None] * H + o_h[None, :]
            m_th = m_s[:, None] & (o_h < H)[None, :]
            b_lses = b_lses + (tl.load(LSE_ptr + p_th, mask=m_th, other=float("inf")),)
            b_deltas = b_deltas + (tl.load(DELTA_ptr + p_th, mask=m_th, other=0.0),)
        p_v = V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :]
        p_dv = DV_ptr + o_t64[:, None, None] * stride_dvt + o_d[None, :, :]
        for _ in tl.range(0, N, num_stages=STAGES):
            b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
            b_r = inv_rms((b_v,), eps, D, 1)
            b_rs = b_r * scale
            if ACCUMULATE:
                b_dv = tl.load(p_dv, mask=m_v, other=0.0)
            else:
                b_dv = tl.zeros([BT, BH, BHD], dtype=tl.float32)
            b_ps = ()
            b_dss = ()
            b_cs = ()
            b_dots = _head_dots(b_v, b_wdos, 2 * SG)  # slot j: v . w_j at 2j, v . do_j at 2j + 1
            for j in tl.static_range(SG):
                b_dot = b_dots[2 * j]
                b_p = fast_exp(b_dot * b_rs[:, None] - b_lses[j])
                b_ds = b_p * (b_dots[2 * j + 1] - b_deltas[j])
                b_ps = b_ps + (b_p,)
                b_dss = b_dss + (b_ds,)
                b_cs = b_cs + (b_ds * b_dot,)
            b_cs = _sums_over_heads(b_cs, SG)
            for j in tl.static_range(SG):
                b_kp, b_kw, b_kv = grad_factors(b_ps[j], b_dss[j], b_cs[j], b_r, scale, D)
                b_dv += b_kp * b_dos[j]
                b_dv += b_kw * b_ws[j]
                b_dv -= b_kv * b_v
                b_dws = b_dws[:j] + (b_dws[j] + b_kw * b_v,) + b_dws[j + 1 :]
            tl.store(p_dv, b_dv, mask=m_v)
            p_v += stride_vn
            p_dv += stride_dvn

    for j in tl.static_range(SG):
        m_w = m_d & (tl.full([BH, BHD], chunk_hi - 1 - j, tl.int32) >= chunk_lo)
        tl.store(DW_ptr + (i_p * NG + chunk_hi - 1 - j) * D + o_d, tl.sum(b_dws[j], axis=0), mask=m_w)


def group_forward_rows(sources, queries, norm_weights, num_heads, eps, logit_scale, first_out, sites_per_program,
                       partials, **loop):  # fmt: skip
    """``phase1.group_forward`` through the row loop, into ``partials`` (m, l, acc): the
    sites of a token tile in programs of ``sites_per_program`` (default:
    ``launch.group_fwd_config``) side by side; site 0 finished into ``first_out`` if given."""
    t, n, d = sources.shape
    g = queries.shape[0]
    head_dim, bh, bhd = tile(d, num_heads)
    default_sites, config = group_fwd_config(bh * bhd, g)
    bg = min(g, sites_per_program or default_sites)
    if sites_per_program:  # keep the tile's size: fewer sites, more tokens
        config = config._replace(block_t=group_fwd_tokens(bg, bh * bhd))
    block_t, num_warps, stages, _, _ = config.override(**loop)
    m, l, acc = partials
    if t == 0:
        return
    # Without first_out, placeholders the kernel never stores to (FIRST off).
    out, lse = first_out or (sources.new_empty((1, 1)), sources.new_empty((1,), dtype=torch.float32))
    group_fwd_kernel[(triton.cdiv(t, block_t) * triton.cdiv(g, bg),)](
        sources, queries, norm_weights, m, l, acc, out, lse,
        t, n, g, sources.stride(0), sources.stride(1), out.stride(0), eps, float(logit_scale),
        D=d, H=num_heads, HD=head_dim, BT=block_t, BH=bh, BHD=bhd, BG=bg, STAGES=stages,
        FIRST=first_out is not None, NORMALISED=acc.dtype != torch.float32, num_warps=num_warps,
    )  # fmt: skip


def group_backward_rows(grad_outs, sources, queries, norm_weights, folded, lse, delta, num_heads, eps, logit_scale,
                        grad_sources, lo, hi, sites_per_program, merge_dw, accumulate, **loop):  # fmt: skip
    """``phase1.group_backward_deferred`` through the row loop: the rows' gradients added
    into ``grad_sources`` now (stored where ``accumulate`` is False), the sites ``[lo, hi)``
    in launches of ``sites_per_program`` (default: ``launch.group_bwd_config``), last
    chunk first; returns (dquery, dnorm_weight, no deferred factors)."""
    t, n, d = sources.shape
    g = queries.shape[0]
    head_dim, bh, bhd = tile(d, num_heads)
    default_sites, config = group_bwd_config(bh * bhd, g, bh)
    sg = min(g, sites_per_program or default_sites)
    block_t, num_warps, stages, _, programs_per_sm = config.override(**loop)
    device = sources.device
    num_tiles = triton.cdiv(t, block_t)
    num_programs = backward_programs(num_tiles, device, programs_per_sm)
    dw = torch.empty((num_programs, g, d), dtype=torch.float32, device=device)
    if t == 0:
        dw.zero_()
    for chunk_hi in range(hi, lo, -sg) if t > 0 else ():  # chunks of sites, last first
        first = chunk_hi == hi
        group_bwd_kernel[(num_programs,)](
            sources, folded, grad_outs, lse, delta, grad_sources, dw,
            t, n, g, max(lo, chunk_hi - sg), chunk_hi, num_tiles,
            sources.stride(0), sources.stride(1), grad_sources.stride(0), grad_sources.stride(1),
            eps, float(logit_scale),
            D=d, H=num_heads, HD=head_dim, BT=block_t, BH=bh, BHD=bhd, SG=sg, STAGES=stages,
            ACCUMULATE=accumulate or not first, num_warps=num_warps,
        )  # fmt: skip
    dq, dg = reduce_dw(dw, sources, queries, norm_weights, merge_dw)
    return dq[lo:hi], dg[lo:hi], ()
