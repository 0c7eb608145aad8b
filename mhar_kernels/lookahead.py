"""Fused Triton kernels of two-phase ("lookahead") depth routing.

Semantics are those of the reference backend in ``megatron_mhar.ops.lookahead`` (same
four functions, same signatures); the schedule, the derivation and the memory are in
``README.md`` beside this file ("Two-phase routing").

- ``group_forward``: phase 1. One pass over the old rows ``[T, N, D]`` computes, for the
  G sites of a group at once, the online-softmax partials (running max ``m``, denominator
  ``l``, unnormalised fp32 accumulator ``acc``). Each program holds the states of a chunk
  of the sites for a token tile, as tuples of ``[BT, BH, BHD]`` tiles; the chunks of one
  token tile run side by side, so each row comes from memory about once per token tile.
- ``merge_forward``: one site folds the rows written since the group started into its
  partial and writes the output and its log-sum-exp ``[T, H]``.
- ``merge_backward``: one site's new rows in a single pass, with ``delta[h] = do . out`` per
  head taken from the routed output (as in flash attention) instead of a second pass; the
  rows' gradients are left as factors (``(p, tau r ds)`` per head, ``tau r c``).
- ``merge_row_grad``: one new row's gradient from those factors of every site reading it
  and its fp32 gradient from the other reads, written once in any dtype.
- ``group_backward``: every site's gradient to the old rows; each row and its fp32
  gradient are read (and the gradient written) once per launch, one launch per chunk of
  sites (one chunk at 100M and 350M, two at 1B). The sites' contributions are added in a
  fixed order (last site first), and sites outside ``site_range`` contribute exact zeros,
  so a group whose backward a checkpointed chunk splits gives bit-identical gradients.

Both phase-1 functions also run as small tensor-core dots per token and head
(``_group_fwd_dots_kernel``; ``_group_bwd_rows_kernel`` then ``_group_bwd_heads_kernel``),
chosen through ``tensor_cores`` (README.md, "Tensor-core phase 1"; models pass
``mhar.lookahead_kernels``, whose default ``auto`` is ``tensor_cores=None``).

dquery/dnorm are reduced over tokens in two deterministic stages (per-program partials,
then a fixed-order sum), as in ``depth_route.py``; no atomics.
"""

import functools
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .depth_route import (
    LoopConfig,
    _bwd_head_sums,
    _check_sources,
    _exp,
    _folded_query,
    _grad_factors,
    _inv_rms,
    _num_sms,
    _route_fwd_step,
    _softmax_step,
    _tile,
)


@triton.jit
def _token_tile(i_t, T, H: tl.constexpr, HD: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                BHD: tl.constexpr):  # fmt: skip
    """Offsets and masks of token tile ``i_t`` as a [BT, BH, BHD] register tile: (o_t, o_h,
    o_d [BH, BHD], m_d, m_t, m_v [BT, BH, BHD], m_th [BT, BH], o_t64)."""
    o_t = i_t * BT + tl.arange(0, BT)
    o_h = tl.arange(0, BH)
    o_k = tl.arange(0, BHD)
    o_d = o_h[:, None] * HD + o_k[None, :]
    m_d = (o_h[:, None] < H) & (o_k[None, :] < HD)
    m_t = o_t < T
    m_v = m_t[:, None, None] & m_d[None, :, :]
    m_th = m_t[:, None] & (o_h[None, :] < H)
    return o_t, o_h, o_d, m_d, m_t, m_v, m_th, o_t.to(tl.int64)


@triton.jit
def _group_fwd_kernel(
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
    _, o_h, o_d, m_d, m_t, m_v, _, o_t64 = _token_tile(i_t, T, H, HD, BT, BH, BHD)

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
        b_ws = b_ws + _folded_query(Q_ptr + i_site * D, G_ptr + i_site * D, o_d, m_w, V_ptr.dtype.element_ty, BHD, 1)
        b_ms = b_ms + (tl.full([BT, BH], float("-inf"), tl.float32),)
        b_ls = b_ls + (tl.zeros([BT, BH], dtype=tl.float32),)
        b_accs = b_accs + (tl.zeros([BT, BH, BHD], dtype=tl.float32),)
    p_v = V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :]
    for _ in tl.range(0, N, num_stages=STAGES):
        b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
        b_rs = (_inv_rms((b_v,), eps, D, 1) * scale)[:, None]
        b_dots = _head_dots(b_v, b_ws, BG)
        for j in tl.static_range(BG):
            b_m, b_l, b_acc = _softmax_step((b_v,), b_dots[j] * b_rs, b_ms[j], b_ls[j], (b_accs[j],), 1)
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
            _store_output(O_ptr, LSE_ptr + o_t64[:, None] * H + o_h[None, :], b_ms[j], b_ls[j], b_accs[j],
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
def _merge_fwd_kernel(
    V_ptr,  # [T, N, D] rows written since the group started (N may be 0), strides (stride_vt, stride_vn, 1)
    Q_ptr,  # [D] pseudo-query of the site
    G_ptr,  # [D] norm weight of the site
    M_ptr,  # [T, H] fp32 phase-1 running max
    L_ptr,  # [T, H] fp32 phase-1 denominator
    A_ptr,  # [T, D] fp32 phase-1 accumulator, or NORMALISED: acc / L in half precision
    O_ptr,  # [T, D] routed output in the sources' dtype, strides (stride_ot, 1)
    LSE_ptr,  # [T, H] fp32 log-sum-exp over all the site's sources
    T,
    N,
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
    STAGES: tl.constexpr,
    NORMALISED: tl.constexpr,
):
    _, o_h, o_d, m_d, m_t, m_v, m_th, o_t64 = _token_tile(tl.program_id(0), T, H, HD, BT, BH, BHD)
    b_w = _folded_query(Q_ptr, G_ptr, o_d, m_d, V_ptr.dtype.element_ty, BHD, 1)[0]

    p_ml = o_t64[:, None] * H + o_h[None, :]
    b_m = tl.load(M_ptr + p_ml, mask=m_th, other=0.0)
    b_l = tl.load(L_ptr + p_ml, mask=m_th, other=1.0)
    b_acc = tl.load(A_ptr + o_t64[:, None, None] * D + o_d[None, :, :], mask=m_v, other=0.0).to(tl.float32)
    if NORMALISED:
        b_acc = b_acc * b_l[:, :, None]
    p_v = V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :]
    for _ in tl.range(0, N, num_stages=STAGES):
        b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
        b_m, b_l, b_accs = _route_fwd_step((b_v,), (b_w,), b_m, b_l, (b_acc,), eps, scale, D, 1)
        b_acc = b_accs[0]
        p_v += stride_vn

    _store_output(O_ptr, LSE_ptr + p_ml, b_m, b_l, b_acc, o_t64, o_d, stride_ot, m_v, m_th)


@triton.jit
def _store_output(O_ptr, p_lse, b_m, b_l, b_acc, o_t64, o_d, stride_ot, m_v, m_th):
    """Normalise a site's finished online-softmax state ([BT, BH] m and l, [BT, BH, BHD]
    acc) into its output rows and store its log-sum-exp at ``p_lse``: what a merge ends
    with, and what phase 1 ends with for a group's first site."""
    b_o = b_acc / b_l[:, :, None]
    p_o = O_ptr + o_t64[:, None, None] * stride_ot + o_d[None, :, :]
    tl.store(p_o, b_o.to(O_ptr.dtype.element_ty), mask=m_v)
    tl.store(p_lse, b_m + tl.log(b_l), mask=m_th)


@triton.jit
def _merge_bwd_kernel(
    V_ptr,  # [T, N, D] new rows, strides (stride_vt, stride_vn, 1)
    Q_ptr,  # [D] pseudo-query
    G_ptr,  # [D] norm weight
    DO_ptr,  # [T, D] gradient of the output, strides (stride_dot, 1)
    O_ptr,  # [T, D] the routed output, strides (stride_ot, 1)
    LSE_ptr,  # [T, H] fp32 log-sum-exp saved by the merge
    DELTA_ptr,  # [T, H] fp32 out: delta[h] = sum over head h of do * out
    F_ptr,  # [T, N, H, 2] fp32 out: per new row and head (p, tau r ds), strides (stride_ft, stride_fn, 2, 1)
    KV_ptr,  # [T, N] fp32 out: per new row tau r c, strides (stride_kt, 1)
    DW_ptr,  # [P, D] fp32 per-program partial dL/dw, P = number of programs, strides (stride_dwp, 1)
    DOC_ptr,  # [T, D] contiguous out (COPY_DO): a copy of the output gradient
    T,
    N,
    num_tiles,
    stride_vt,
    stride_vn,
    stride_dot,
    stride_ot,
    stride_ft,
    stride_fn,
    stride_kt,
    stride_dwp,
    eps,
    scale,
    D: tl.constexpr,
    H: tl.constexpr,
    HD: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    BHD: tl.constexpr,
    STAGES: tl.constexpr,
    COPY_DO: tl.constexpr,
    ONE_REDUCE: tl.constexpr,  # one reduction for the row's three head sums (one head: they span warps)
):
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_h = tl.arange(0, BH)
    o_k = tl.arange(0, BHD)
    o_d = o_h[:, None] * HD + o_k[None, :]
    m_d = (o_h[:, None] < H) & (o_k[None, :] < HD)

    b_w = _folded_query(Q_ptr, G_ptr, o_d, m_d, V_ptr.dtype.element_ty, BHD, 1)[0]
    b_dw = tl.zeros([BT, BH, BHD], dtype=tl.float32)

    # Fixed tile -> program map (grid-stride), so the dw partials are deterministic.
    for i_t in range(i_p, num_tiles, n_p):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        m_v = m_t[:, None, None] & m_d[None, :, :]
        m_th = m_t[:, None] & (o_h[None, :] < H)
        o_t64 = o_t.to(tl.int64)
        b_do = tl.load(DO_ptr + o_t64[:, None, None] * stride_dot + o_d[None, :, :], mask=m_v, other=0.0)
        if COPY_DO:  # the group's workspace, read by its phase-1 backward
            tl.store(DOC_ptr + o_t64[:, None, None] * D + o_d[None, :, :], b_do, mask=m_v)
        b_do = b_do.to(tl.float32)
        b_o = tl.load(O_ptr + o_t64[:, None, None] * stride_ot + o_d[None, :, :], mask=m_v, other=0.0).to(tl.float32)
        b_delta = tl.sum(b_do * b_o, axis=2)
        p_th = o_t64[:, None] * H + o_h[None, :]
        tl.store(DELTA_ptr + p_th, b_delta, mask=m_th)
        b_lse = tl.load(LSE_ptr + p_th, mask=m_th, other=0.0)
        p_v = V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :]
        p_f = F_ptr + o_t64[:, None] * stride_ft + o_h[None, :] * 2
        p_kv = KV_ptr + o_t64 * stride_kt
        for _ in tl.range(0, N, num_stages=STAGES):
            b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
            b_r, b_dot, b_s, b_dp = _bwd_head_sums((b_v,), (b_w,), (b_do,), eps, scale, D, 1, ONE_REDUCE)
            b_p = _exp(b_s - b_lse)
            b_ds = b_p * (b_dp - b_delta)
            b_rs = b_r * scale
            b_rds = b_rs[:, None] * b_ds
            # The row's gradient p do + tau r ds w - tau r c v as its factors, added when the
            # row is due (merge_row_grad): no read-modify-write of its fp32 gradient here.
            tl.store(p_f, b_p, mask=m_th)
            tl.store(p_f + 1, b_rds, mask=m_th)
            tl.store(p_kv, b_rs * tl.sum(b_ds * b_dot, axis=1) * (b_r * b_r / D), mask=m_t)
            b_dw += b_rds[:, :, None] * b_v
            p_v += stride_vn
            p_f += stride_fn
            p_kv += 1

    tl.store(DW_ptr + i_p * stride_dwp + o_d, tl.sum(b_dw, axis=0), mask=m_d)


# Indices and sizes are not specialised: each value of 1 would be its own compile.
@triton.jit(do_not_specialize=["T", "R", "index", "site_lo", "site_hi"])
def _merge_bwd_row_grad_kernel(
    V_ptr,  # [T, D] the row, strides (stride_vt, 1)
    G_ptr,  # [T, D] fp32 its gradient from every other read, strides (stride_gt, 1)
    O_ptr,  # [T, D] out (may be G_ptr), strides (stride_ot, 1)
    DO_ptr,  # [NG, T, D] the group's output gradients, contiguous
    Q_ptr,  # [NG, D] queries, contiguous
    N_ptr,  # [NG, D] norm weights, contiguous
    F_ptr,  # [NG, T, R, H, 2] fp32 the merges' factors (p, tau r ds), contiguous
    KV_ptr,  # [NG, T, R] fp32 tau r c, contiguous
    T,
    R,
    index,
    site_lo,
    site_hi,
    stride_vt,
    stride_gt,
    stride_ot,
    D: tl.constexpr,
    H: tl.constexpr,
    HD: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    BHD: tl.constexpr,
    STAGES: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    """out = g + sum over the sites [site_lo, site_hi), last first, of p do + tau r ds w
    - tau r c v: one row's gradient from its factors, one token tile per program (g = 0,
    not read, without ACCUMULATE)."""
    _, o_h, o_d, m_d, m_t, m_v, m_th, o_t64 = _token_tile(tl.program_id(0), T, H, HD, BT, BH, BHD)
    p_td = o_t64[:, None, None] * D + o_d[None, :, :]
    b_v = tl.load(V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :], mask=m_v, other=0.0)
    if ACCUMULATE:
        b_acc = tl.load(G_ptr + o_t64[:, None, None] * stride_gt + o_d[None, :, :], mask=m_v, other=0.0)
    else:
        b_acc = tl.zeros([BT, BH, BHD], dtype=tl.float32)
    b_v = b_v.to(tl.float32)
    for k in tl.range(0, site_hi - site_lo, num_stages=STAGES):
        j = site_hi - 1 - k
        b_w = _folded_query(Q_ptr + j * D, N_ptr + j * D, o_d, m_d, V_ptr.dtype.element_ty, BHD, 1)[0]
        b_do = tl.load(DO_ptr + (j * T).to(tl.int64) * D + p_td, mask=m_v, other=0.0).to(tl.float32)
        o_tr = (j * T + o_t64) * R + index
        p_f = F_ptr + (o_tr[:, None] * H + o_h[None, :]) * 2
        b_p = tl.load(p_f, mask=m_th, other=0.0)
        b_rds = tl.load(p_f + 1, mask=m_th, other=0.0)
        b_kv = tl.load(KV_ptr + o_tr, mask=m_t, other=0.0)
        b_acc += b_p[:, :, None] * b_do + b_rds[:, :, None] * b_w[None, :, :] - b_kv[:, None, None] * b_v
    tl.store(O_ptr + o_t64[:, None, None] * stride_ot + o_d[None, :, :], b_acc.to(O_ptr.dtype.element_ty), mask=m_v)


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
def _group_bwd_kernel(
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
            b_r = _inv_rms((b_v,), eps, D, 1)
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
                b_p = _exp(b_dot * b_rs[:, None] - b_lses[j])
                b_ds = b_p * (b_dots[2 * j + 1] - b_deltas[j])
                b_ps = b_ps + (b_p,)
                b_dss = b_dss + (b_ds,)
                b_cs = b_cs + (b_ds * b_dot,)
            b_cs = _sums_over_heads(b_cs, SG)
            for j in tl.static_range(SG):
                b_kp, b_kw, b_kv = _grad_factors(b_ps[j], b_dss[j], b_cs[j], b_r, scale, D)
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


# The tensor-core phase-1 backward. Per token and head the group's work is a few small
# matrix products over the old rows (README.md, "Tensor-core phase 1"): with
# X [rows, head width] a block of the token's rows and Y [head width, 16] holding, for
# slot j, w_j (column 2j) and do_j (column 2j + 1),
#     X @ Y                 -> a_j and dp_j of every row (logit dots, value dots)
#     [kw | p] @ Y^T        -> sum_j kw_j w_j + p_j do_j, the rows' gradient before the RMS
#     [kw | p]^T @ X        -> dL/dw_j (rows 2j)
# and only the RMS terms (r and c = sum_h ds a, which span all heads) stay per element.
SLOTS = tl.constexpr(8)  # sites per launch: Y has 2 x SLOTS = 16 columns, the smallest dot width


@triton.jit
def _split(x, BF16: tl.constexpr):
    """An fp32 tile as a dot operand pair (hi, lo): for bf16 rows hi + lo in bf16
    (x - hi - lo ~ 2^-16 |x|), otherwise the fp32 tile itself (lo unused)."""
    if BF16:
        hi = x.to(tl.bfloat16)
        pair = (hi, (x - hi.to(tl.float32)).to(tl.bfloat16))
    else:
        pair = (x, x)
    return pair


@triton.jit
def _dot(a, b, acc, BF16: tl.constexpr):
    """a @ b + acc in fp32: bf16 operands on bf16 tensor cores, fp32 ones as IEEE fp32."""
    if BF16:
        acc = tl.dot(a, b, acc)
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _dot_split(a_hi, a_lo, b_hi, b_lo, acc, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr, BF16: tl.constexpr):
    """a @ b + acc from _split operands. bf16 rows: a_hi b_hi + a_lo b_hi + a_hi b_lo on
    bf16 tensor cores, about 2^-16 relative; *_EXACT: that operand is a bf16 tile, its lo
    part unused. Otherwise (fp32 rows) one IEEE fp32 dot."""
    acc = _dot(a_hi, b_hi, acc, BF16)
    if BF16:
        if not B_EXACT:
            acc = tl.dot(a_hi, b_lo, acc)
        if not A_EXACT:
            acc = tl.dot(a_lo, b_hi, acc)
    return acc


@triton.jit
def _slot_operand(W_ptr, DO_ptr, t, T, o_c, o_d, mask, D: tl.constexpr, chunk_lo, chunk_hi,
                  BF16: tl.constexpr):  # fmt: skip
    """The backward's Y operand of token t as a _split pair, at broadcastable slot columns
    ``o_c`` and channel offsets ``o_d``: column 2j is w of slot j (site chunk_hi - 1 - j),
    column 2j + 1 its output gradient; slots below chunk_lo and ``mask``ed channels are
    zero. W_ptr: the folded queries as ``_folded_operand`` leaves them. bf16 rows: the
    pair is loaded as the dots take it, w's rounding and the output gradients by one load,
    w's remainder by another, without the fp32 arithmetic of a _split in every program
    (bitwise the same pair)."""
    site = chunk_hi - 1 - o_c // 2
    mask = mask & (site >= chunk_lo)
    is_do = o_c % 2 == 1
    p_do = DO_ptr + (site.to(tl.int64) * T + t) * D + o_d
    if BF16:
        p_w = W_ptr + site * (2 * D) + o_d
        pair = (tl.load(tl.where(is_do, p_do, p_w), mask=mask, other=0.0),
                tl.load(p_w + D, mask=mask & ~is_do, other=0.0))  # fmt: skip
    else:
        b_w = tl.load(W_ptr + site * D + o_d, mask=mask & ~is_do, other=0.0)
        pair = _split(b_w + tl.load(p_do, mask=mask & is_do, other=0.0).to(tl.float32), BF16)
    return pair


@triton.jit
def _site_columns(W_ptr, DO_ptr, t, T, o_h, k0, BH: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
                  HD: tl.constexpr, D: tl.constexpr, chunk_lo, chunk_hi, BF16: tl.constexpr):  # fmt: skip
    """Y [BH, K, 16] of token t over the heads o_h and their channels [k0, k0 + K)
    (_slot_operand's columns last)."""
    o_k = k0 + tl.arange(0, K)
    mask = (o_h < H)[:, None, None] & (o_k < HD)[None, :, None]
    o_d = o_h[:, None, None] * HD + o_k[None, :, None]
    o_c = tl.arange(0, 2 * SLOTS)[None, None, :]
    return _slot_operand(W_ptr, DO_ptr, t, T, o_c, o_d, mask, D, chunk_lo, chunk_hi, BF16)


@triton.jit
def _head_site_rows(W_ptr, DO_ptr, t, T, i_h, k0, K: tl.constexpr, HD: tl.constexpr, D: tl.constexpr,
                    chunk_lo, chunk_hi, BF16: tl.constexpr):  # fmt: skip
    """Y^T [2 * SLOTS, K] of token t over the channels [k0, k0 + K) of head i_h
    (_slot_operand's columns as rows)."""
    o_k = k0 + tl.arange(0, K)
    o_c = tl.arange(0, 2 * SLOTS)[:, None]
    return _slot_operand(W_ptr, DO_ptr, t, T, o_c, i_h * HD + o_k[None, :], (o_k < HD)[None, :], D,
                         chunk_lo, chunk_hi, BF16)  # fmt: skip


@triton.jit
def _update_row_block(p_v, p_dv, rows, stop, stride_vn, stride_dvn, b_kv, b_acc, k0, K: tl.constexpr,
                   HD: tl.constexpr, ACCUMULATE: tl.constexpr):  # fmt: skip
    """dv += acc - kv v over the channels [k0, k0 + K) of a block of rows (one read-modify-write;
    without ACCUMULATE dv holds nothing yet and is only written)."""
    o_k = k0 + tl.arange(0, K)
    m_x = (rows < stop)[:, None] & (o_k < HD)[None, :]
    b_x = tl.load(p_v + rows[:, None] * stride_vn + o_k[None, :], mask=m_x, other=0.0)
    p_dv = p_dv + rows[:, None] * stride_dvn + o_k[None, :]
    if ACCUMULATE:
        b_dv = tl.load(p_dv, mask=m_x, other=0.0) - b_kv[:, None] * b_x.to(tl.float32)
    else:
        b_dv = 0.0 - b_kv[:, None] * b_x.to(tl.float32)
    tl.store(p_dv, b_dv + b_acc, mask=m_x)


@triton.jit
def _row_tile(p, mask, BF16: tl.constexpr):
    """A tile of rows as a dot operand pair: bf16 rows are exact (lo unused)."""
    b_x = tl.load(p, mask=mask, other=0.0)
    if BF16:
        pair = (b_x, b_x)
    else:
        pair = _split(b_x.to(tl.float32), BF16)
    return pair


@triton.jit
def _interleaved_split(x, A: tl.constexpr, S: tl.constexpr, B: tl.constexpr, BF16: tl.constexpr):
    """An fp32 [A, S, B] tile as one [A, 2S, B] dot operand whose row 2j + 1 holds what
    row 2j (x[:, j] rounded to bf16) misses, so a dot that then adds the row pairs
    (``_row_pair_sum``) sums x to about 2^-16 relative in one product; fp32 rows: x and zeros."""
    if BF16:
        hi = x.to(tl.bfloat16)
        lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    else:
        hi = x
        lo = tl.zeros_like(x)
    return tl.reshape(tl.permute(tl.join(hi, lo), (0, 1, 3, 2)), [A, 2 * S, B])


@triton.jit
def _row_pair_sum(x, A: tl.constexpr, S: tl.constexpr, K: tl.constexpr):
    """[A, 2S, K] -> [A, S, K]: the sum of each (hi, lo) pair of rows of ``_interleaved_split``."""
    return tl.sum(tl.reshape(x, [A, S, 2, K]), axis=2)


@triton.jit
def _head_sums(x, BH: tl.constexpr, GH: tl.constexpr, B: tl.constexpr, S: tl.constexpr):
    """[BH, B, S] dots per dot head -> each model head's sum over its GH dot heads,
    repeated on each of them (x itself where GH = 1: a model head is one dot head)."""
    if GH > 1:
        sums = tl.sum(tl.reshape(x, [BH // GH, GH, B, S]), axis=1)
        x = tl.reshape(tl.broadcast_to(tl.expand_dims(sums, 1), [BH // GH, GH, B, S]), [BH, B, S])
    return x


@triton.jit
def _query_rows(Q_ptr, G_ptr, site, m_s, o_h, k0, BH: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
                HD: tl.constexpr, D: tl.constexpr, dtype: tl.constexpr, BF16: tl.constexpr):  # fmt: skip
    """[BH, 2 * SLOTS, K] rows of the folded queries w = q * g^ (g^ rounded to ``dtype``)
    over the head channels [k0, k0 + K): row 2j (and its remainder 2j + 1) is site[j]."""
    o_k = k0 + tl.arange(0, K)
    mask = (o_h < H)[:, None, None] & m_s[None, :, None] & (o_k < HD)[None, None, :]
    p = site[None, :, None] * D + o_h[:, None, None] * HD + o_k[None, None, :]
    b_q = tl.load(Q_ptr + p, mask=mask, other=0.0).to(tl.float32)
    b_w = b_q * tl.load(G_ptr + p, mask=mask, other=0.0).to(dtype).to(tl.float32)
    return _interleaved_split(b_w, BH, SLOTS, K, BF16)


@triton.jit
def _row_block(p_t, rows, m_r, stride_vn, BH: tl.constexpr, H: tl.constexpr, HD: tl.constexpr,
               KA: tl.constexpr, KB: tl.constexpr):  # fmt: skip
    """A block of a token's rows over every head as the dots' channel chunks [BH, BR, KA]
    and [BH, BR, KB] (the first again where KB = 0), in the rows' dtype, and the rows' sums
    of squares [BR] over the full width."""
    o_h = tl.arange(0, BH)
    o_ka = tl.arange(0, KA)
    p_x = p_t + rows[None, :, None] * stride_vn + o_h[:, None, None] * HD
    m_x = m_r[None, :, None] & (o_h < H)[:, None, None]
    b_xa = tl.load(p_x + o_ka[None, None, :], mask=m_x & (o_ka < HD)[None, None, :], other=0.0)
    b_sq = tl.sum(tl.sum(b_xa.to(tl.float32) * b_xa.to(tl.float32), axis=2), axis=0)
    b_xb = b_xa
    if KB > 0:
        o_kb = KA + tl.arange(0, KB)
        b_xb = tl.load(p_x + o_kb[None, None, :], mask=m_x & (o_kb < HD)[None, None, :], other=0.0)
        b_sq += tl.sum(tl.sum(b_xb.to(tl.float32) * b_xb.to(tl.float32), axis=2), axis=0)
    return b_xa, b_xb, b_sq


# Sizes are not specialised: Triton compiles a size of 1 as a constant, and at the 1B
# width that variant asked for more shared memory than the H200 has (first group, N = 1).
@triton.jit(do_not_specialize=["T", "N", "NG"])
def _group_fwd_dots_kernel(
    V_ptr, Q_ptr, G_ptr,  # as in _group_fwd_kernel: [T, N, D] old rows, [NG, D] queries and norms
    M_ptr, L_ptr, A_ptr,  # as in _group_fwd_kernel: fp32 partials [NG, T, H], [NG, T, H], [NG, T, D]
    T, N, NG, stride_vt, stride_vn, eps, scale,
    D: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, BH: tl.constexpr, KA: tl.constexpr,
    KB: tl.constexpr, BR: tl.constexpr, GH: tl.constexpr, STAGES: tl.constexpr, NORMALISED: tl.constexpr,
    QUERIES_LEFT: tl.constexpr,
):  # fmt: skip
    """Phase 1 as dots per token and head (README.md, "Tensor-core phase 1"): for
    a block X [BR, head width] of the token's rows, X @ [w_j] (QUERIES_LEFT: its transpose
    [w_j]^T @ X^T, ``_queries_left``) gives the head dots of SLOTS sites (program axis 1
    picks the sites), and P^T @ X adds the block to the sites'
    accumulators after the online-softmax rescale, one rescale per block of rows. The head
    width is a chunk of KA channels plus, if it is not a power of two, one of KB (160 =
    128 + 32). Tokens in a grid-stride loop over program axis 0. H and HD are the dot
    heads (``_dot_heads``): a model head of GH > 1 of them sums their dots, and m and l
    ([NG, T, H // GH]) are stored per model head. NORMALISED: A_ptr takes acc / l in its
    half-precision dtype, as from _group_fwd_kernel."""
    BF16: tl.constexpr = V_ptr.dtype.element_ty == tl.bfloat16  # bf16 rows: bf16 dots
    o_h = tl.arange(0, BH)
    o_r = tl.arange(0, BR)
    o_ka = tl.arange(0, KA)
    site = tl.program_id(1) * SLOTS + tl.arange(0, SLOTS)
    m_s = site < NG
    site64 = site.to(tl.int64)
    dtype = V_ptr.dtype.element_ty
    b_wa = _query_rows(Q_ptr, G_ptr, site, m_s, o_h, 0, BH, KA, H, HD, D, dtype, BF16)
    if not QUERIES_LEFT:
        b_wa = tl.permute(b_wa, (0, 2, 1))
    if KB > 0:
        o_kb = KA + tl.arange(0, KB)
        b_wb = _query_rows(Q_ptr, G_ptr, site, m_s, o_h, KA, BH, KB, H, HD, D, dtype, BF16)
        if not QUERIES_LEFT:
            b_wb = tl.permute(b_wb, (0, 2, 1))
    for t in range(tl.program_id(0), T, tl.num_programs(0)):
        p_t = V_ptr + tl.cast(t, tl.int64) * stride_vt
        b_m = tl.full([BH, SLOTS], float("-inf"), tl.float32)
        b_l = tl.zeros([BH, SLOTS], dtype=tl.float32)
        b_acca = tl.zeros([BH, 2 * SLOTS, KA], dtype=tl.float32)
        if KB > 0:
            b_accb = tl.zeros([BH, 2 * SLOTS, KB], dtype=tl.float32)
        for i0 in tl.range(0, N, BR, num_stages=STAGES):
            rows = i0 + o_r
            m_r = rows < N
            b_xa, b_xb, b_sq = _row_block(p_t, rows, m_r, stride_vn, BH, H, HD, KA, KB)
            # The logits as [heads, 2 sites, rows] (site pairs as the queries' split), the
            # orientation of P^T in the second dot; _queries_left picks the form of the first.
            if QUERIES_LEFT:
                b_s = _dot(b_wa, tl.permute(b_xa, (0, 2, 1)), tl.zeros([BH, 2 * SLOTS, BR], dtype=tl.float32), BF16)
                if KB > 0:
                    b_s = _dot(b_wb, tl.permute(b_xb, (0, 2, 1)), b_s, BF16)
            else:
                b_s = _dot(b_xa, b_wa, tl.zeros([BH, BR, 2 * SLOTS], dtype=tl.float32), BF16)
                if KB > 0:
                    b_s = _dot(b_xb, b_wb, b_s, BF16)
                b_s = tl.permute(b_s, (0, 2, 1))
            b_s = _head_sums(b_s, BH, GH, 2 * SLOTS, BR)
            b_rs = tl.rsqrt(b_sq / D + eps) * scale
            b_z = _row_pair_sum(b_s, BH, SLOTS, BR) * b_rs[None, None, :]
            b_z = tl.where(m_r[None, None, :], b_z, float("-inf"))
            b_mn = tl.maximum(b_m, tl.max(b_z, axis=2))
            b_alpha = _exp(b_m - b_mn)
            b_p = _exp(b_z - b_mn[:, :, None])
            b_l = b_l * b_alpha + tl.sum(b_p, axis=2)
            b_pt = _interleaved_split(b_p, BH, SLOTS, BR, BF16)  # [BH, 2 SLOTS, BR]
            b_scale = tl.reshape(tl.join(b_alpha, b_alpha), [BH, 2 * SLOTS])[:, :, None]
            b_acca = _dot(b_pt, b_xa, b_acca * b_scale, BF16)
            if KB > 0:
                b_accb = _dot(b_pt, b_xb, b_accb * b_scale, BF16)
            b_m = b_mn
        o_st = site64 * T + t  # row of the [NG, T, .] outputs
        b_suma = _row_pair_sum(b_acca, BH, SLOTS, KA)
        if NORMALISED:  # a convex combination of the rows: within their dtype's range
            b_suma = (b_suma / b_l[:, :, None]).to(A_ptr.dtype.element_ty)
        if KB > 0:
            b_sumb = _row_pair_sum(b_accb, BH, SLOTS, KB)
            if NORMALISED:
                b_sumb = (b_sumb / b_l[:, :, None]).to(A_ptr.dtype.element_ty)
        p_ml = o_st[None, :] * (H // GH) + (o_h // GH)[:, None]
        m_ml = ((o_h < H) & (o_h % GH == 0))[:, None] & m_s[None, :]  # one dot head per model head
        tl.store(M_ptr + p_ml, b_m, mask=m_ml)
        tl.store(L_ptr + p_ml, b_l, mask=m_ml)
        p_a = A_ptr + o_st[None, :, None] * D + o_h[:, None, None] * HD
        m_a = (o_h < H)[:, None, None] & m_s[None, :, None]
        m_ka = m_a & (o_ka < HD)[None, None, :]
        tl.store(p_a + o_ka[None, None, :], b_suma, mask=m_ka)
        if KB > 0:
            m_kb = m_a & (o_kb < HD)[None, None, :]
            tl.store(p_a + o_kb[None, None, :], b_sumb, mask=m_kb)


# Sizes are not specialised: Triton compiles a size of 1 as a constant, and at the 1B
# width that variant asked for more shared memory than the H200 has (first group, N = 1).
@triton.jit(do_not_specialize=["T", "N", "chunk_lo", "chunk_hi"])
def _group_bwd_rows_kernel(
    V_ptr,  # [T, N, D] old rows, strides (stride_vt, stride_vn, 1)
    W_ptr,  # folded queries (_folded_operand)
    DO_ptr,  # [NG, T, D] gradients of the sites' outputs
    LSE_ptr,  # [NG, T, H] fp32
    DELTA_ptr,  # [NG, T, H] fp32
    Z_ptr,  # [T, N, H, 2 * SLOTS] fp32 out: per row, head and slot j, tau r ds (column 2j) and p (2j + 1)
    KV_ptr,  # [T, N] fp32 out: tau r^3 / D * sum over the slots of c
    T, N, chunk_lo, chunk_hi, stride_vt, stride_vn, eps, scale,
    D: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, BH: tl.constexpr, KA: tl.constexpr,
    KB: tl.constexpr, BR: tl.constexpr, GH: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """The per-row factors of the head kernel below: one program per token (grid-stride),
    rows in blocks of BR, every head at once as one batched dot X @ Y per channel chunk
    (KA, and KB where the head width is not a power of two), so the RMS and c, which span
    the heads, need no second pass. H and HD are the dot heads, as in the forward: lse
    and delta are per model head ([NG, T, H // GH]), Z is per dot head (a model head's
    repeated on each of its GH)."""
    BF16: tl.constexpr = V_ptr.dtype.element_ty == tl.bfloat16  # bf16 rows: bf16 dots
    o_h = tl.arange(0, BH)
    o_r = tl.arange(0, BR)
    o_c = tl.arange(0, 2 * SLOTS)
    site = (chunk_hi - 1 - tl.arange(0, SLOTS)).to(tl.int64)
    m_th = (o_h < H)[:, None] & (site >= chunk_lo)[None, :]
    for t in range(tl.program_id(0), T, tl.num_programs(0)):
        b_yah, b_yal = _site_columns(W_ptr, DO_ptr, t, T, o_h, 0, BH, KA, H, HD, D, chunk_lo, chunk_hi, BF16)
        if KB > 0:
            b_ybh, b_ybl = _site_columns(W_ptr, DO_ptr, t, T, o_h, KA, BH, KB, H, HD, D, chunk_lo, chunk_hi, BF16)
        p_th = (site[None, :] * T + t) * (H // GH) + (o_h // GH)[:, None]  # [BH, SLOTS]; empty slots: weight 0
        b_lse = tl.load(LSE_ptr + p_th, mask=m_th, other=float("inf"))
        b_delta = tl.load(DELTA_ptr + p_th, mask=m_th, other=0.0)
        p_t = V_ptr + tl.cast(t, tl.int64) * stride_vt
        for i0 in tl.range(0, N, BR, num_stages=STAGES):
            rows = i0 + o_r
            m_r = rows < N
            b_xa, b_xb, b_sq = _row_block(p_t, rows, m_r, stride_vn, BH, H, HD, KA, KB)
            b_ad = tl.zeros([BH, BR, 2 * SLOTS], dtype=tl.float32)
            b_ad = _dot_split(b_xa, b_xa, b_yah, b_yal, b_ad, BF16, False, BF16)
            if KB > 0:
                b_ad = _dot_split(b_xb, b_xb, b_ybh, b_ybl, b_ad, BF16, False, BF16)
            b_ad = _head_sums(b_ad, BH, GH, BR, 2 * SLOTS)
            b_r = tl.rsqrt(b_sq / D + eps)
            b_rs = (b_r * scale)[None, :, None]
            b_a, b_dp = tl.split(tl.reshape(b_ad, [BH, BR, SLOTS, 2]))
            b_p = tl.where(m_r[None, :, None], _exp(b_a * b_rs - b_lse[:, None, :]), 0.0)
            b_ds = b_p * (b_dp - b_delta[:, None, :])
            b_c = tl.sum(tl.sum(b_ds * b_a, axis=2), axis=0) / GH  # each model head counted GH times
            o_tr = tl.cast(t, tl.int64) * N + rows
            tl.store(KV_ptr + o_tr, b_r * scale * (b_r * b_r / D) * b_c, mask=m_r)
            p_z = Z_ptr + ((o_tr[None, :, None] * H + o_h[:, None, None]) * (2 * SLOTS) + o_c[None, None, :])
            b_z = tl.reshape(tl.join(b_rs * b_ds, b_p), [BH, BR, 2 * SLOTS])
            tl.store(p_z, b_z, mask=(o_h < H)[:, None, None] & m_r[None, :, None])


# Sizes are not specialised: Triton compiles a size of 1 as a constant, and at the 1B
# width that variant asked for more shared memory than the H200 has (first group, N = 1).
@triton.jit(do_not_specialize=["T", "N", "NG", "chunk_lo", "chunk_hi"])
def _group_bwd_heads_kernel(
    V_ptr,  # as in _group_bwd_rows_kernel
    Z_ptr,  # written by _group_bwd_rows_kernel
    DW_ptr,  # [P, NG, D] fp32 per-program partial dL/dw
    T, N, NG, chunk_lo, chunk_hi, stride_vt, stride_vn,
    D: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, BR: tl.constexpr, BHD: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """dL/dw of one head (program axis 1) over a token stride (axis 0) from the rows
    kernel's factors Z: Z^T @ X accumulates in a [16, BHD] dot accumulator, whose even
    rows (tau r ds) are the sites' partials. The rows' gradients are left to
    _group_bwd_row_grads_kernel, which may add several groups' factors at once.
    One loop runs over the program's (token, row block) pairs, token-major as nested
    loops would, so the pipelined loads also cross from one token's blocks to the next
    token's (a token has only N / BR of them: 5 at the 1B shape's deepest group)."""
    BF16: tl.constexpr = V_ptr.dtype.element_ty == tl.bfloat16  # bf16 rows: bf16 dots
    i_p = tl.program_id(0)
    i_h = tl.program_id(1)
    o_r = tl.arange(0, BR)
    o_k = tl.arange(0, BHD)
    o_c = tl.arange(0, 2 * SLOTS)
    m_k = o_k < HD
    site = chunk_hi - 1 - tl.arange(0, SLOTS)
    m_s = site >= chunk_lo
    b_dw = tl.zeros([2 * SLOTS, BHD], dtype=tl.float32)
    num_p = tl.num_programs(0)
    blocks = tl.cdiv(N, BR)
    for j in tl.range(0, tl.cdiv(T - i_p, num_p) * blocks, num_stages=STAGES):
        t = i_p + (j // blocks) * num_p
        rows = (j % blocks) * BR + o_r
        m_r = rows < N
        p_t = V_ptr + tl.cast(t, tl.int64) * stride_vt + i_h * HD
        b_xh, b_xl = _row_tile(p_t + rows[:, None] * stride_vn + o_k[None, :], m_r[:, None] & m_k[None, :], BF16)
        o_tr = tl.cast(t, tl.int64) * N + rows
        p_z = Z_ptr + (o_tr[:, None] * H + i_h) * (2 * SLOTS) + o_c[None, :]
        b_zh, b_zl = _split(tl.load(p_z, mask=m_r[:, None], other=0.0), BF16)
        b_dw = _dot_split(tl.trans(b_zh), tl.trans(b_zl), b_xh, b_xl, b_dw, False, BF16, BF16)
    b_dw, _ = tl.split(tl.permute(tl.reshape(b_dw, [SLOTS, 2, BHD]), [0, 2, 1]))
    p_w = DW_ptr + (i_p * NG + site)[:, None] * D + (i_h * HD + o_k)[None, :]
    tl.store(p_w, b_dw, mask=m_s[:, None] & m_k[None, :])


@triton.jit(do_not_specialize=["T", "start", "stop"])
def _group_bwd_row_grads_kernel(
    V_ptr,  # [T, R, D] the history's rows from row 0, strides (stride_vt, stride_vn, 1)
    DV_ptr,  # [T, R, D] fp32 their gradients (+=), strides (stride_dvt, stride_dvn, 1)
    Z, KV, W, DO,  # J-tuples, per entry (one chunk of a phase-1 backward): its rows kernel's
    # Z [T, N_j, H, 2 * SLOTS] and kv [T, N_j] fp32, folded queries (_folded_operand) and
    # the sites' output gradients [NG_j, T, D]
    N, OWED, CHUNK_LO, CHUNK_HI,  # J-tuples of ints: N_j, the entry adds to rows [start, OWED_j), its sites
    T, start, stop, stride_vt, stride_vn, stride_dvt, stride_dvn,
    D: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, BR: tl.constexpr, KA: tl.constexpr,
    KB: tl.constexpr, J: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    """The rows' gradients of J phase-1 backwards at once: for each block of BR rows in
    [start, stop) of a token and head (axis 1), dv += sum_j (Z_j @ Y_j^T - kv_j v), one
    read-modify-write of the fp32 gradient for all entries (a write only, without
    ACCUMULATE, where dv holds nothing yet). The token programs (axis 0) stride over the
    tokens and run one loop over their (token, block, entry) triples, so the pipeline
    does not drain at every block: H200, five entries at the 1B shape, 0.310 -> 0.257 ms
    against one program per token and head looping over its block's entries, bitwise the
    same sums (benchmarks/results/routing_h200_row_grads_persistent_ab.json; sm_90
    compile, Triton 3.6: 86 registers against 168, 19 KB of shared memory). Every entry's
    operands are whole tiles (Z [BR, 2 * SLOTS], Y [2 * SLOTS, head width]) loaded at
    once and multiplied as one dot, so a program has a few independent loads per entry in
    flight instead of a chain of small ones per slot. The folded queries come as the bf16
    pair the dots take (_folded_operand), so no program forms it. Measured in the 1B
    training step on the H200: 49.2 ms per step, against 58.0 with each program splitting
    fp32 queries (benchmarks/results/training_h200_graph_row_grads_folded_operand.json),
    64.5 ms for the head padded to 256 columns and unpipelined, and 91.1 ms for per-slot
    fp32 outer products. Unpipelined it took 67.7 ms (entries of different groups miss the
    cache). Those figures predate the persistent programs."""
    BF16: tl.constexpr = V_ptr.dtype.element_ty == tl.bfloat16  # bf16 rows: bf16 dots
    i_p = tl.program_id(0)
    i_h = tl.program_id(1)
    num_p = tl.num_programs(0)
    o_r = tl.arange(0, BR)
    o_c = tl.arange(0, 2 * SLOTS)
    blocks = tl.cdiv(stop - start, BR)
    # The head's channels as a chunk of KA plus one of KB where the width is not a power
    # of two (160 = 128 + 32): no dot column and no register on padding.
    b_acca = tl.zeros([BR, KA], dtype=tl.float32)
    b_accb = tl.zeros([BR, KB if KB > 0 else 16], dtype=tl.float32)
    b_kv = tl.zeros([BR], dtype=tl.float32)
    # One loop over the program's (token, row block, entry) triples, in the order of nested
    # loops, so the pipelined loads of the next entries cross into the next block or token.
    for step in range(0, tl.cdiv(T - i_p, num_p) * blocks * J):
        j = step % J
        rows = start + (step // J) % blocks * BR + o_r
        t = i_p + step // (J * blocks) * num_p
        t64 = tl.cast(t, tl.int64)
        # The entry's tensors picked at run time: unrolled, every entry's dot operands took
        # their own shared memory (35 KB each at the 1B width, sm_90 compile).
        p_z, p_kv, p_w, p_do = Z[0], KV[0], W[0], DO[0]
        n, owed, lo, hi = N[0], OWED[0], CHUNK_LO[0], CHUNK_HI[0]
        for e in tl.static_range(1, J):
            pick = j == e
            p_z, p_kv, p_w, p_do = (tl.where(pick, Z[e], p_z), tl.where(pick, KV[e], p_kv),
                                    tl.where(pick, W[e], p_w), tl.where(pick, DO[e], p_do))  # fmt: skip
            n, owed = tl.where(pick, N[e], n), tl.where(pick, OWED[e], owed)
            lo, hi = tl.where(pick, CHUNK_LO[e], lo), tl.where(pick, CHUNK_HI[e], hi)
        m_j = rows < owed
        o_tr = t64 * n + rows
        b_kv += tl.load(p_kv + o_tr, mask=m_j, other=0.0)
        p_zt = p_z + (o_tr[:, None] * H + i_h) * (2 * SLOTS) + o_c[None, :]
        b_zh, b_zl = _split(tl.load(p_zt, mask=m_j[:, None], other=0.0), BF16)
        b_yh, b_yl = _head_site_rows(p_w, p_do, t, T, i_h, 0, KA, HD, D, lo, hi, BF16)
        b_acca = _dot_split(b_zh, b_zl, b_yh, b_yl, b_acca, False, False, BF16)
        if KB > 0:
            b_yh, b_yl = _head_site_rows(p_w, p_do, t, T, i_h, KA, KB, HD, D, lo, hi, BF16)
            b_accb = _dot_split(b_zh, b_zl, b_yh, b_yl, b_accb, False, False, BF16)
        if j == J - 1:  # the block's last entry: one read-modify-write of its gradient
            p_t = V_ptr + t64 * stride_vt + i_h * HD
            p_dt = DV_ptr + t64 * stride_dvt + i_h * HD
            _update_row_block(p_t, p_dt, rows, stop, stride_vn, stride_dvn, b_kv, b_acca, 0, KA, HD, ACCUMULATE)
            if KB > 0:
                _update_row_block(p_t, p_dt, rows, stop, stride_vn, stride_dvn, b_kv, b_accb, KA, KB, HD,
                                  ACCUMULATE)  # fmt: skip
            b_acca = tl.zeros([BR, KA], dtype=tl.float32)
            b_accb = tl.zeros([BR, KB if KB > 0 else 16], dtype=tl.float32)
            b_kv = tl.zeros([BR], dtype=tl.float32)


@triton.jit
def _dw_reduce_kernel(
    DW_ptr,  # [P, NG, D] fp32 per-program partial dL/dw
    EX_ptr,  # [PX, NG, D] fp32 more partials of the same sites (the merges'), PX may be 0
    V_ptr,  # sources; only their dtype is used (the rounding of g)
    Q_ptr,  # [NG, D] pseudo-queries, contiguous
    G_ptr,  # [NG, D] norm weights, contiguous
    DQ_ptr,  # [NG, D] fp32 gradients of the queries
    DG_ptr,  # [NG, D] fp32 gradients of the norm weights
    P,
    PX,
    NG,
    D: tl.constexpr,
    BP: tl.constexpr,
    BD: tl.constexpr,
):
    i_d = tl.program_id(0)
    i_g = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_acc = tl.zeros([BP, BD], dtype=tl.float32)
    for i_p in range(0, P, BP):
        o_p = i_p + tl.arange(0, BP)
        p_dw = DW_ptr + (o_p.to(tl.int64) * NG + i_g)[:, None] * D + o_d[None, :]
        b_acc += tl.load(p_dw, mask=(o_p < P)[:, None] & m_d[None, :], other=0.0)
    for i_p in range(0, PX, BP):
        o_p = i_p + tl.arange(0, BP)
        p_ex = EX_ptr + (o_p.to(tl.int64) * NG + i_g)[:, None] * D + o_d[None, :]
        b_acc += tl.load(p_ex, mask=(o_p < PX)[:, None] & m_d[None, :], other=0.0)
    b_dw = tl.sum(b_acc, axis=0)
    b_q = tl.load(Q_ptr + i_g * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_g = tl.load(G_ptr + i_g * D + o_d, mask=m_d, other=0.0).to(V_ptr.dtype.element_ty).to(tl.float32)
    tl.store(DQ_ptr + i_g * D + o_d, b_dw * b_g, mask=m_d)
    tl.store(DG_ptr + i_g * D + o_d, b_dw * b_q, mask=m_d)


# ---------------------------------------------------------------------------------------
# Launch wrappers
# ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _group_fwd_config(padded_d: int, sites: int) -> Tuple[int, LoopConfig]:
    """(sites per program, launch config) of phase 1: the G accumulators of a token take
    sites * padded_d fp32, so a program holds about 4K of them (as the per-site forward's
    tile, 64 per thread at 2 warps) and the sites that do not fit go to sibling programs,
    which read the same rows through L2. At widths up to 512 one warp: at 100M's G = 5
    over 21 / 11 rows 0.282 / 0.170 ms against 0.320 / 0.197 at 2 warps, one head 0.248 /
    0.153 against 0.429 / 0.256 (4 warps 0.418 / 0.241; H200,
    benchmarks/results/routing_h200_group_fwd_launch.json)."""
    sites_per_program = max(1, min(sites, 4096 // padded_d))
    num_warps = 1 if padded_d <= 512 else 2
    return sites_per_program, LoopConfig(_fwd_tokens(sites_per_program, padded_d), num_warps, 3)


def _fwd_tokens(sites_per_program: int, padded_d: int) -> int:
    """Tokens of the phase-1 forward's tile: as many as 4K accumulators hold, rounded down
    to a power of two (a tile axis must be one; three sites of 256 would give 5)."""
    tokens = max(1, 4096 // (sites_per_program * padded_d))
    return 1 << (tokens.bit_length() - 1)


def _use_tensor_cores(tensor_cores: Optional[bool], sites: int, head_dim: int, backward: bool, *,
                      dtype: torch.dtype) -> bool:
    """Whether phase 1 runs the tensor-core kernels: ``tensor_cores`` if given; None picks
    them where the H200 measured them faster (README.md, "Tensor-core phase 1"): groups of
    more than SLOTS / 2 sites (with fewer, half of every dot is idle; the 100M shape's
    groups of 4 ran faster on the row loops), heads of at most 256 padded columns (one
    1024-wide head took 112 ms per 350M training step in the dot forward), forward, heads
    wider than 64 (100M's 64 in groups of 5: 11.2 ms per training step against 6.5 for
    the row loop) and, backward, heads wider than 128 (at 350M's 128 the three dot
    kernels took 43.9 ms per training step against 28.1 for the row loop at stop 36; at
    1B's 160 the deepest group took 1.28 against 2.63 ms). ``head_dim`` is the dot heads' width
    (``_dot_heads``). Decided by the group's size, never a split's: a recomputed chunk
    runs the kernels of the whole group. The dots take bf16 or fp32 rows: fp16 rows run
    the row loops (``tensor_cores=True`` over them is an error)."""
    if dtype == torch.float16:
        if tensor_cores:
            raise ValueError("tensor_cores=True takes bf16 or fp32 rows, got float16; "
                             "use tensor_cores=None (auto) or False, which run the row loops")
        return False
    if tensor_cores is not None:
        return tensor_cores
    wide_enough = head_dim > (128 if backward else 64)
    return sites > SLOTS // 2 and triton.next_power_of_2(head_dim) <= 256 and wide_enough


# The dot kernels tile a row as at least this many heads: a model with fewer (Attention
# Residuals: one) runs each head as DOT_HEADS // H dot heads whose dots are summed, so
# its tiles, launches and measured choices are those of eight heads and its heads cost
# what eight do (README.md, "Dot heads").
DOT_HEADS = 8


@functools.lru_cache(maxsize=None)
def _dot_heads(d: int, num_heads: int) -> Tuple[int, int, int, int]:
    """(dot heads per model head GH, dot heads, their width, dot heads padded to a power of
    two) of the tensor-core kernels at width ``d``: GH = DOT_HEADS // num_heads where
    num_heads divides DOT_HEADS and d divides into DOT_HEADS heads, otherwise 1."""
    split = 1
    if num_heads < DOT_HEADS and DOT_HEADS % num_heads == 0 and d % DOT_HEADS == 0:
        split = DOT_HEADS // num_heads
    heads = num_heads * split
    return split, heads, d // heads, triton.next_power_of_2(heads)


@functools.lru_cache(maxsize=None)
def _head_chunks(head_dim: int) -> Tuple[int, int]:
    """(KA, KB) channel chunks of a head for the dot kernels: the largest power of two in
    the head width and the rest padded to a power of two (160 = 128 + 32; KB = 0 when the
    width is a power of two), each at least the dots' 16."""
    ka = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - ka
    return ka, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)


@functools.lru_cache(maxsize=None)
def _group_fwd_dots_config(padded_heads: int, head_dim: int) -> Optional[LoopConfig]:
    """Launch config of the tensor-core phase-1 forward, or None where its accumulators
    ([BH, 2 * SLOTS, KA + KB] fp32 per program) would not fit in registers: 4 warps, row
    blocks unpipelined, two programs per SM striding over the tokens. Measured on the H200
    at the deepest groups (benchmarks/results/routing_h200_lookahead_dots.json): 4 warps
    0.266 / 0.289 ms at 350M / 1B against 0.322 / 0.327 at 8; at 1B two stages 0.360 ms;
    four programs per SM tie, one loses at 350M (0.372 ms)."""
    ka, kb = _head_chunks(head_dim)
    if padded_heads * 2 * SLOTS * (ka + kb) > 32768:
        return None
    return LoopConfig(1, 4, 1, programs_per_sm=2)


# Shared memory of one Hopper SM (228 KB) and what the driver reserves per program: two
# programs per SM may each use (233472 - 2 * 1024) / 2 bytes.
_SM_SHARED_BYTES, _PROGRAM_RESERVED_BYTES = 233472, 1024


@functools.lru_cache(maxsize=None)
def _queries_left(padded_heads: int, head_dim: int, element_size: int) -> bool:
    """Which form the tensor-core forward's first dot takes. Rows left (X @ W) holds the
    row block twice in shared memory, once per dot's operand layout, next to the queries:
    BH (KA + KB) (2 SLOTS + 2 BR) bf16 elements, 120 KB at the 1B width, so one program
    fits an SM. Queries left (W^T @ X^T) feeds both dots from one copy (90 KB there, two
    programs per SM) but transposes the block in registers. Queries left where rows left
    would not fit two programs per SM. H200 (CUDA graphs, triton 3.6, same run): 1B deepest
    group 0.409 -> 0.327 ms; at 350M, where both forms fit two programs and the transpose
    only costs, 0.244 -> 0.271 ms. fp32 rows (IEEE dots) keep rows left: one program per
    SM either way, and queries left took more shared memory (229 against 173 KB at the 1B
    width, sm_90 compile)."""
    ka, kb = _head_chunks(head_dim)
    rows_left = element_size * padded_heads * (ka + kb) * (2 * SLOTS + 2 * 16)
    return bool(element_size == 2 and rows_left > _SM_SHARED_BYTES // 2 - _PROGRAM_RESERVED_BYTES)


@functools.lru_cache(maxsize=None)
def _group_bwd_dots_config(padded_heads: int, head_dim: int) -> Tuple[LoopConfig, LoopConfig]:
    """Launch configs of the tensor-core phase-1 backward's (rows, heads) kernels: the rows
    kernel at 4 warps up to 1K channels over its heads' chunks (8 above, the 1B width),
    unpipelined, two programs per SM striding over the tokens; the heads kernel at 4 warps
    (at 1B 1.284 ms for the deepest group against 1.828 at 8; at 350M 8 warps took 1.222
    against 1.288), ``4 * SMs / H`` token programs per head, its one loop over (token, row
    block) pipelined four deep: the 1B backward (rows, heads, reduction) of the deepest /
    middle group 0.564 / 0.348 ms with nested loops at two stages, 0.523 / 0.323 now
    (benchmarks/results/routing_h200_heads_flat_ab.json); 13.5 -> 9.9 ms per 1B training
    step (training_h200_graph_stop38_1b.json)."""
    ka, kb = _head_chunks(head_dim)
    rows = LoopConfig(1, 4 if padded_heads * (ka + kb) <= 1024 else 8, 1, programs_per_sm=2)
    return rows, LoopConfig(1, 4, 4)


@functools.lru_cache(maxsize=None)
def _group_bwd_config(padded_d: int, sites: int, padded_heads: int) -> Tuple[int, LoopConfig]:
    """(sites per launch, launch config) of the phase-1 backward. A program holds, per
    site, w, do and a dL/dw accumulator of its token tile, up to 64 fp32 of each kind per
    thread: one token of 512 at 2 warps (8 sites; narrower widths take two or more tokens),
    of 1024 at 4 warps (8 sites), of 2048 at 8 warps (4 sites); row loads pipelined three
    deep. Sites beyond that run in a further launch over the rows. Measured on H200,
    ms per call (benchmarks/results/routing_h200_group_bwd_launch.json): at width 512 and
    G = 5 over 21 / 11 rows, one token at 2 warps 0.695 / 0.395 against two tokens at 4
    warps 0.876 / 0.488 (one head: 0.835 / 0.470 against 0.876 / 0.497); at width 1024,
    G = 6 over 43 rows, one token at 4 warps 0.840, 2 warps 2.91, 8 warps 1.90. Earlier,
    at each model's deepest group: 4 / 4 / 8 warps 0.78 / 1.40 / 2.63 ms at 100M / 350M /
    1B, 8 / 8 / 4 warps 0.80 / 1.91 / 2.95 ms, 2 sites per launch 1.85 ms at 350M and 2.88
    at 1B (routing_h200_lookahead_shared_reductions.json); before the sites shared their
    cross-head reduction, 0.90 / 1.67 / 3.08 ms (routing_h200_lookahead.json); two stages
    (8 warps at 350M and 1B) 1.29 / 3.23 / 4.23 ms against three 0.90 / 2.58 / 3.08
    (routing_h200_lookahead_2stages.json); one site per launch loses 2x.
    At width 1024 (350M) two programs per SM, and four stages with eight heads: a joint
    sweep of stages and programs per SM (the sweeps above moved one at a time) measured
    the deepest / middle group at 0.968 / 0.965 of the former launch for eight heads, and
    three stages at 0.995 / 0.988 for one head (four: 1.007 / 0.996;
    routing_h200_joint_sweep.json); in the 350M training step 28.1 -> 27.5 ms
    (training_h200_graph_stop38_350m.json)."""
    stages, programs_per_sm = 3, 4
    if padded_d >= 1024:
        block_t, num_warps, per_kind = 1, 8 if padded_d >= 2048 else 4, 8192
        if padded_d == 1024:
            stages, programs_per_sm = (4 if padded_heads > 1 else 3), 2
    else:
        block_t, num_warps, per_kind = max(1, 512 // padded_d), 2, 4096
    sites_per_launch = max(1, min(sites, per_kind // (block_t * padded_d)))
    return sites_per_launch, LoopConfig(block_t, num_warps, stages, programs_per_sm=programs_per_sm)


@functools.lru_cache(maxsize=None)
def _merge_fwd_config(padded_d: int) -> LoopConfig:
    """Merge forward: 2K fp32 per tile at one warp (every head's sums inside the warp), the
    new rows' loads pipelined three deep. A group's merges from a CUDA graph on the H200
    (benchmarks/results/routing_h200_merge_fwd_sweep.json): 0.112 / 0.073 / 0.106 ms at the
    100M / 350M / 1B deepest group, best of the sweep or within 1% of it, against 0.132 /
    0.083 / 0.110 for 8K fp32 at 4 warps unpipelined (the former default)."""
    return LoopConfig(max(1, 2048 // padded_d), 1, 3)


@functools.lru_cache(maxsize=None)
def _merge_bwd_config(padded_d: int) -> LoopConfig:
    """Merge backward: 2K fp32 per tile at 4 warps (8 above), 4 programs per SM, the new
    rows' loop unpipelined."""
    block_t = max(1, 2048 // padded_d)
    return LoopConfig(block_t, 8 if block_t * padded_d > 2048 else 4, 1, programs_per_sm=4)


@functools.lru_cache(maxsize=None)
def _merge_row_grad_config(padded_d: int) -> LoopConfig:
    """A new row's gradient: 4K fp32 per tile at 4 warps, the sites' loop unpipelined."""
    return LoopConfig(max(1, 4096 // padded_d), 4, 1)


def _reduce_dw(dw, sources, queries, norm_weights, extra=None):
    """Sum the [P, G, D] partials, then the [PX, G, D] ``extra`` ones (the group's merges'),
    in a fixed order. Narrow column blocks and tall row blocks: a merge has P = 4 x SMs
    partials (528 on the H200) and one site, so a program walks 5 row blocks of 128 (it
    walked 17 of 32 over 20 column blocks of 64 at D = 1280, and the 1B step's 1,328
    reductions took 8.7 us each)."""
    num_programs, g, d = dw.shape
    if extra is not None and (extra.shape[1:] != dw.shape[1:] or extra.dtype != torch.float32
                              or not extra.is_contiguous()):  # fmt: skip
        raise ValueError(f"merge_dw must be a contiguous fp32 [P, {g}, {d}] tensor, got "
                         f"{tuple(extra.shape)} {extra.dtype}")  # fmt: skip
    grad_query = torch.empty((g, d), dtype=torch.float32, device=dw.device)
    grad_norm = torch.empty((g, d), dtype=torch.float32, device=dw.device)
    block_d = min(16, triton.next_power_of_2(d))
    _dw_reduce_kernel[(triton.cdiv(d, block_d), g)](
        dw, dw if extra is None else extra, sources, queries, norm_weights, grad_query, grad_norm,
        num_programs, 0 if extra is None else extra.shape[0], g,
        D=d, BP=128, BD=block_d, num_warps=4,
    )  # fmt: skip
    return grad_query, grad_norm


def _backward_programs(num_tiles: int, device: torch.device, programs_per_sm: int) -> int:
    return max(1, min(num_tiles, _num_sms(device) * programs_per_sm))


def _check_sites_per_program(sites_per_program: Optional[int]) -> None:
    if sites_per_program is not None and sites_per_program < 1:
        raise ValueError(
            f"sites_per_program must be at least 1 (or None for the default), got {sites_per_program}"
        )


def group_forward(
    sources: torch.Tensor,
    queries: torch.Tensor,
    norm_weights: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
    first_out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    sites_per_program: Optional[int] = None,
    tensor_cores: Optional[bool] = False,
    **loop,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phase 1: partials of G sites over the old rows, each row read once per token tile.

    Args:
        sources: [T, N, D] view of the old rows (N >= 1), unit stride over D.
        queries, norm_weights: [G, D].
        first_out: (out [T, D] in the sources' dtype, unit stride over D; lse [T, H] fp32,
            contiguous) to finish site 0 here, as ``merge_forward`` would with no new rows
            (bitwise the same). The row loop then leaves its partials unwritten; the
            tensor-core kernel writes them and merges them in a second launch.
        sites_per_program: sites held by one program (default: as many as about 4K fp32
            accumulators allow); the others go to sibling programs of the same token tile.
            The tensor-core kernel always holds SLOTS sites per program.
        tensor_cores: the dot-product kernel (``_group_fwd_dots_kernel``) where its
            accumulators fit in registers, instead of the row loop (the default); None:
            where the H200 measured it faster (``_use_tensor_cores``).
        loop: :class:`LoopConfig` fields overriding the default launch (benchmarks).

    Returns:
        (m [G, T, H], l [G, T, H], acc [G, T, D]) online-softmax partials: m and l fp32;
        acc fp32 and unnormalised, except over half-precision rows, where it is
        ``acc / l`` in the rows' dtype (a convex combination of the rows, so within
        their range), which :func:`merge_forward` takes back: half the partials' bytes
        written and read (README.md beside this file, "Half-precision partials").
    """
    _check_sources(sources, None, num_heads)
    t, n, d = sources.shape
    g = queries.shape[0]
    if n < 1:
        raise ValueError("group_forward needs at least one old row")
    _check_sites_per_program(sites_per_program)
    _check_first_out(first_out, sources, num_heads)
    queries, norm_weights = queries.contiguous(), norm_weights.contiguous()
    _, _, dot_dim, dot_bh = _dot_heads(d, num_heads)
    use_dots = _use_tensor_cores(tensor_cores, g, dot_dim, backward=False, dtype=sources.dtype)
    dots = _group_fwd_dots_config(dot_bh, dot_dim) if use_dots else None
    if dots is not None:
        return _group_forward_tensor_cores(sources, queries, norm_weights, num_heads, eps, logit_scale,
                                           first_out, dots.override(**loop), sites_per_program)  # fmt: skip
    head_dim, bh, bhd = _tile(d, num_heads)
    default_sites, config = _group_fwd_config(bh * bhd, g)
    bg = min(g, sites_per_program or default_sites)
    if sites_per_program:  # keep the tile's size: fewer sites, more tokens
        config = config._replace(block_t=_fwd_tokens(bg, bh * bhd))
    block_t, num_warps, stages, _, _ = config.override(**loop)
    m, l, acc = _empty_partials(g, num_heads, sources)
    if t == 0:
        return m, l, acc
    # Without first_out, placeholders the kernel never stores to (FIRST off).
    out, lse = first_out or (sources.new_empty((1, 1)), sources.new_empty((1,), dtype=torch.float32))
    _group_fwd_kernel[(triton.cdiv(t, block_t) * triton.cdiv(g, bg),)](
        sources, queries, norm_weights, m, l, acc, out, lse,
        t, n, g, sources.stride(0), sources.stride(1), out.stride(0), eps, float(logit_scale),
        D=d, H=num_heads, HD=head_dim, BT=block_t, BH=bh, BHD=bhd, BG=bg, STAGES=stages,
        FIRST=first_out is not None, NORMALISED=acc.dtype != torch.float32, num_warps=num_warps,
    )  # fmt: skip
    return m, l, acc


def _check_first_out(first_out, sources: torch.Tensor, num_heads: int) -> None:
    """group_forward's (out, lse) for site 0, if given: shapes, dtypes and strides."""
    t, _, d = sources.shape
    if first_out is None:
        return
    out, lse = first_out
    _check_output("first_out's output", out, t, d, sources.dtype)
    if lse.shape != (t, num_heads) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"first_out's lse must be a contiguous [{t}, {num_heads}] float32 tensor, "
                         f"got {tuple(lse.shape)} {lse.dtype}")  # fmt: skip


def _check_output(name: str, out: torch.Tensor, t: int, d: int, dtype: torch.dtype) -> None:
    """A routed output the caller gives: [T, D] in the sources' dtype, unit stride over D."""
    if out.shape != (t, d) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"{name} must be [{t}, {d}] {dtype} with unit stride over D, "
                         f"got {tuple(out.shape)} {out.dtype} with strides {out.stride()}")  # fmt: skip


# Row dtypes over which phase 1 stores its accumulators normalised, in that dtype.
HALF = (torch.bfloat16, torch.float16)


def _empty_partials(g: int, num_heads: int, sources: torch.Tensor):
    """Phase 1's outputs over the rows ``sources`` [T, N, D], uninitialised: m, l [G, T, H]
    fp32 and acc [G, T, D], in the rows' dtype where it is in HALF (the kernels then store
    acc / l: ``NORMALISED`` is ``acc.dtype != torch.float32``), otherwise fp32."""
    t, _, d = sources.shape
    kw = dict(dtype=torch.float32, device=sources.device)
    acc_dtype = sources.dtype if sources.dtype in HALF else torch.float32
    stats = (g, t, num_heads)
    return torch.empty(stats, **kw), torch.empty(stats, **kw), sources.new_empty((g, t, d), dtype=acc_dtype)


def _group_forward_tensor_cores(sources, queries, norm_weights, num_heads, eps, logit_scale, first_out, config,
                                sites_per_program):  # fmt: skip
    """group_forward through _group_fwd_dots_kernel: SLOTS sites per program (program axis
    1), tokens striding over ``config.programs_per_sm`` programs per SM (axis 0), the
    heads as ``_dot_heads``. It stores site 0's partials and finishes site 0 (``first_out``)
    with a merge of no new rows: finishing it in the kernel (stop 29) took registers the
    row blocks needed, and the forward slowed by more than the merge costs (H200, per
    training step: 350M 11.3 -> 12.1 ms, 1B 36.3 -> 42.4 ms; README.md, "Schedule")."""
    if sites_per_program or config.block_t != 1 or config.l2_reuse:
        raise ValueError(
            "tensor_cores=True takes num_warps, stages and programs_per_sm as launch overrides; "
            "drop sites_per_program, block_t and l2_reuse or use tensor_cores=False"
        )
    t, n, d = sources.shape
    g = queries.shape[0]
    m, l, acc = _empty_partials(g, num_heads, sources)
    if t == 0:
        return m, l, acc
    split, heads, head_dim, padded_heads = _dot_heads(d, num_heads)
    ka, kb = _head_chunks(head_dim)
    programs = _backward_programs(t, sources.device, config.programs_per_sm)
    _group_fwd_dots_kernel[(programs, triton.cdiv(g, SLOTS))](
        sources, queries, norm_weights, m, l, acc,
        t, n, g, sources.stride(0), sources.stride(1), eps, float(logit_scale),
        D=d, H=heads, HD=head_dim, BH=padded_heads, KA=ka, KB=kb, BR=16, GH=split, STAGES=config.stages,
        NORMALISED=acc.dtype != torch.float32,
        QUERIES_LEFT=_queries_left(padded_heads, head_dim, sources.element_size()), num_warps=config.num_warps,
    )  # fmt: skip
    if first_out is not None:  # a merge of no new rows, launched here: the kernel's registers are full
        merge_forward(m[0], l[0], acc[0], sources[:, :0], queries[0], norm_weights[0], num_heads, eps,
                      logit_scale, first_out[1], out=first_out[0])  # fmt: skip
    return m, l, acc


def merge_forward(
    m: torch.Tensor,
    l: torch.Tensor,
    acc: torch.Tensor,
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
    lse: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    **loop,
) -> torch.Tensor:
    """Fold the new rows [T, n, D] (n may be 0) into one site's partial (m, l [T, H] fp32,
    acc [T, D]: fp32, or normalised in the sources' half-precision dtype as
    :func:`group_forward` leaves it; contiguous); write its log-sum-exp into ``lse`` [T, H]
    and return the output [T, D] in the sources' dtype, written into ``out`` where given
    (unit stride over D). ``loop``: :class:`LoopConfig` fields overriding the default
    launch (benchmarks)."""
    _check_sources(sources, None, num_heads)
    t, n, d = sources.shape
    if acc.dtype not in (torch.float32, sources.dtype):
        raise ValueError(f"merge_forward: acc must be fp32 or normalised in the sources' dtype {sources.dtype}, "
                         f"got {acc.dtype}")  # fmt: skip
    head_dim, bh, bhd = _tile(d, num_heads)
    block_t, num_warps, stages, _, _ = _merge_fwd_config(bh * bhd).override(**loop)
    if out is None:
        out = torch.empty((t, d), dtype=sources.dtype, device=sources.device)
    else:
        _check_output("merge_forward's out", out, t, d, sources.dtype)
    if t == 0:
        return out
    src = sources if n > 0 else out  # no row is read; the dtype still rounds g
    _merge_fwd_kernel[(triton.cdiv(t, block_t),)](
        src, query, norm_weight, m, l, acc, out, lse,
        t, n, src.stride(0), src.stride(1) if n > 0 else 0, out.stride(0), eps, float(logit_scale),
        D=d, H=num_heads, HD=head_dim, BT=block_t, BH=bh, BHD=bhd, STAGES=stages,
        NORMALISED=acc.dtype != torch.float32, num_warps=num_warps,
    )  # fmt: skip
    return out


def merge_backward(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    lse: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
    row_factors: Tuple[torch.Tensor, torch.Tensor],
    delta_out: Optional[torch.Tensor] = None,
    grad_out_copy: Optional[torch.Tensor] = None,
    dw_out: Optional[torch.Tensor] = None,
    **loop,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward of :func:`merge_forward` in one pass over the new rows, whose gradients it
    leaves as factors in ``row_factors`` (fp32 views factors [T, n, H, 2] with unit stride
    over the last two dims, kv [T, n] with unit stride over n) for :func:`merge_row_grad`.
    ``delta_out`` (fp32 [T, H]) receives delta and ``grad_out_copy`` (contiguous [T, D],
    grad_out's dtype) a copy of ``grad_out``, from the same kernel (the group's workspaces,
    no copy kernels). ``dw_out``: an fp32 [P, D] view (unit stride over D, P =
    :func:`merge_dw_partials`) receiving the per-program partials of dL/dw unreduced, for
    the group's phase-1 backward to sum with its own (``merge_dw``): one reduction per group
    instead of one per merge. ``loop``: :class:`LoopConfig` fields overriding the default
    launch (benchmarks).

    Returns:
        (delta [T, H] fp32 (``delta_out`` if given), grad_query fp32 [D],
        grad_norm_weight fp32 [D]) of the new rows; both None with ``dw_out``.
    """
    _check_sources(sources, None, num_heads)
    t, n, d = sources.shape
    head_dim, bh, bhd = _tile(d, num_heads)
    block_t, num_warps, stages, _, programs_per_sm = _merge_bwd_config(bh * bhd).override(**loop)
    device = sources.device
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    delta = torch.empty((t, num_heads), dtype=torch.float32, device=device) if delta_out is None else delta_out
    if delta.shape != (t, num_heads) or delta.dtype != torch.float32 or not delta.is_contiguous():
        raise ValueError(f"delta_out must be a contiguous fp32 [{t}, {num_heads}] tensor, got "
                         f"{tuple(delta.shape)} {delta.dtype}")  # fmt: skip
    copy_do = grad_out_copy is not None
    if copy_do and (grad_out_copy.shape != (t, d) or grad_out_copy.dtype != grad_out.dtype
                    or not grad_out_copy.is_contiguous()):  # fmt: skip
        raise ValueError(f"grad_out_copy must be a contiguous {grad_out.dtype} [{t}, {d}] tensor, got "
                         f"{tuple(grad_out_copy.shape)} {grad_out_copy.dtype}")  # fmt: skip
    factors, kv = row_factors
    if (factors.shape != (t, n, num_heads, 2) or kv.shape != (t, n) or factors.dtype != torch.float32
            or kv.dtype != torch.float32 or (n > 0 and (factors.stride()[2:] != (2, 1) or kv.stride(1) != 1))):  # fmt: skip
        raise ValueError(f"row_factors must be fp32 views [{t}, {n}, {num_heads}, 2] and [{t}, {n}] with unit "
                         f"inner strides, got {tuple(factors.shape)} {factors.stride()} and "
                         f"{tuple(kv.shape)} {kv.stride()}")  # fmt: skip
    num_tiles = triton.cdiv(t, block_t)
    num_programs = _backward_programs(num_tiles, device, programs_per_sm)
    if dw_out is not None and (dw_out.shape != (num_programs, d) or dw_out.dtype != torch.float32
                               or dw_out.stride(1) != 1):  # fmt: skip
        raise ValueError(f"dw_out must be an fp32 [{num_programs}, {d}] view with unit stride over D "
                         f"(merge_dw_partials), got {tuple(dw_out.shape)} {dw_out.dtype} {dw_out.stride()}")  # fmt: skip
    dw = torch.empty((num_programs, d), dtype=torch.float32, device=device) if dw_out is None else dw_out
    if t > 0:
        src, f, k = (sources, factors, kv) if n > 0 else (out, dw, dw)  # no row: nothing is stored
        _merge_bwd_kernel[(num_programs,)](
            src, query, norm_weight, grad_out, out, lse, delta, f, k, dw,
            grad_out_copy if copy_do else grad_out, t, n, num_tiles,
            src.stride(0), src.stride(1) if n > 0 else 0, grad_out.stride(0), out.stride(0),
            f.stride(0) if n > 0 else 0, f.stride(1) if n > 0 else 0, k.stride(0) if n > 0 else 0,
            dw.stride(0), eps, float(logit_scale),
            D=d, H=num_heads, HD=head_dim, BT=block_t, BH=bh, BHD=bhd, STAGES=stages, COPY_DO=copy_do,
            ONE_REDUCE=num_heads == 1,
            num_warps=num_warps,
        )  # fmt: skip
    else:
        dw.zero_()
    if dw_out is not None:
        return delta, None, None
    dq, dg = _reduce_dw(dw.unsqueeze(1), sources if n > 0 else out, query.view(1, d), norm_weight.view(1, d))
    return delta, dq[0], dg[0]


def merge_dw_partials(num_tokens: int, d: int, num_heads: int, device: torch.device) -> int:
    """P of :func:`merge_backward`'s ``dw_out`` at its default launch: its programs."""
    head_dim, bh, bhd = _tile(d, num_heads)
    config = _merge_bwd_config(bh * bhd)
    return _backward_programs(triton.cdiv(num_tokens, config.block_t), device, config.programs_per_sm)


def merge_row_grad(
    row: torch.Tensor,
    row_grad: torch.Tensor,
    out: torch.Tensor,
    grad_outs: torch.Tensor,
    queries: torch.Tensor,
    norm_weights: torch.Tensor,
    factors: torch.Tensor,
    kv: torch.Tensor,
    index: int,
    site_range: Tuple[int, int],
    num_heads: int,
    accumulate: bool = True,
    **loop,
) -> None:
    """A new row's gradient from the factors its group's merges left
    (:func:`merge_backward`) and its fp32 gradient from every other read, written into
    ``out`` in ``out``'s dtype (``out`` may be ``row_grad``): one read of the fp32
    gradient (none with ``accumulate`` False, where no other read added one) and of each
    site's output gradient, one write. Arguments as the reference's
    (``megatron_mhar.ops.lookahead.torch_merge_row_grad``); ``row``, ``row_grad`` and
    ``out`` [T, D] with unit stride over D, the group's tensors contiguous. ``loop``:
    :class:`LoopConfig` fields overriding the default launch (benchmarks)."""
    t, d = row.shape
    g, _, r, _, _ = factors.shape
    lo, hi = site_range
    if not (0 <= lo <= hi <= g and 0 <= index < r):
        raise ValueError(f"site_range {site_range} / index {index} outside the group's {g} sites and {r} new rows")
    shapes = {"row_grad": (row_grad, (t, d)), "out": (out, (t, d)), "grad_outs": (grad_outs, (g, t, d)),
              "queries": (queries, (g, d)), "norm_weights": (norm_weights, (g, d)),
              "factors": (factors, (g, t, r, num_heads, 2)), "kv": (kv, (g, t, r))}  # fmt: skip
    for name, (x, shape) in shapes.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"merge_row_grad: {name} must be {list(shape)} for a [{t}, {d}] row of a group of "
                             f"{g} sites and {r} new rows at {num_heads} heads, got {list(x.shape)}")  # fmt: skip
    if row_grad.dtype != torch.float32 or factors.dtype != torch.float32 or kv.dtype != torch.float32:
        raise ValueError("merge_row_grad needs fp32 row_grad, factors and kv")
    for name, x in (("grad_outs", grad_outs), ("queries", queries), ("norm_weights", norm_weights),
                    ("factors", factors), ("kv", kv)):  # fmt: skip
        if not x.is_contiguous():
            raise ValueError(f"merge_row_grad needs a contiguous {name}")
    if any(x.stride(1) != 1 for x in (row, row_grad, out)):
        raise ValueError("merge_row_grad needs row, row_grad and out with unit stride over D")
    if t == 0:
        return
    head_dim, bh, bhd = _tile(d, num_heads)
    block_t, num_warps, stages, _, _ = _merge_row_grad_config(bh * bhd).override(**loop)
    _merge_bwd_row_grad_kernel[(triton.cdiv(t, block_t),)](
        row, row_grad, out, grad_outs, queries, norm_weights, factors, kv,
        t, r, index, lo, hi, row.stride(0), row_grad.stride(0), out.stride(0),
        D=d, H=num_heads, HD=head_dim, BT=block_t, BH=bh, BHD=bhd, STAGES=stages, ACCUMULATE=accumulate,
        num_warps=num_warps,
    )  # fmt: skip


class RowFactors(NamedTuple):
    """The rows' gradients one chunk of a tensor-core phase-1 backward leaves to
    :func:`add_row_grads`: its rows kernel's factors ``z`` [T, N, H, 2 * SLOTS] (H the
    dot heads) and ``kv`` [T, N] fp32 (transient workspace: 69 MB at the 1B shape's
    deepest group), the sites' folded queries as ``_folded_operand`` leaves them and
    their output gradients [NG, T, D], and the chunk's sites ``[chunk_lo, chunk_hi)``."""

    z: torch.Tensor
    kv: torch.Tensor
    folded: torch.Tensor
    grad_outs: torch.Tensor
    chunk_lo: int
    chunk_hi: int


def _folded_operand(folded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The folded queries [NG, D] fp32 as the dot backward's rows and row-gradient kernels
    read them: for bf16 rows [NG, 2, D] bf16, their rounding and what it misses (the pair
    _split forms in a kernel, formed once per group here instead of in each program; two
    elementwise launches, the difference taken in fp32 and rounded once on writing);
    otherwise the fp32 queries themselves."""
    if dtype != torch.bfloat16:
        return folded
    pair = torch.empty((folded.shape[0], 2, folded.shape[1]), dtype=torch.bfloat16, device=folded.device)
    pair[:, 0].copy_(folded)
    torch.sub(folded, pair[:, 0], out=pair[:, 1])
    return pair


# Entries of one _group_bwd_row_grads_kernel launch; more run in further launches, in order.
_ROW_GRADS_ENTRIES = 16


def group_backward_deferred(
    grad_outs: torch.Tensor,
    sources: torch.Tensor,
    queries: torch.Tensor,
    norm_weights: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
    grad_sources: torch.Tensor,
    site_range: Optional[Tuple[int, int]] = None,
    sites_per_program: Optional[int] = None,
    tensor_cores: Optional[bool] = False,
    merge_dw: Optional[torch.Tensor] = None,
    accumulate: bool = True,
    **loop,
) -> Tuple[torch.Tensor, torch.Tensor, Tuple[RowFactors, ...]]:
    """Backward of phase 1 for the sites ``site_range`` (default all) over the old rows
    [T, N, D], each row read once per kernel. The row loop adds the rows' gradients into
    the fp32 view ``grad_sources`` [T, N, D]; the tensor-core kernels leave them as
    :class:`RowFactors` for :func:`add_row_grads`, which adds several groups' in one
    read-modify-write of each row's gradient.

    Args:
        grad_outs: [G, T, D] contiguous gradients of the sites' outputs.
        queries, norm_weights: [G, D]; lse, delta: [G, T, H] fp32 contiguous.
        sites_per_program: sites per launch of the row-loop kernels (default: as
            registers allow); the launches run over the rows last chunk first.
        tensor_cores: the dot-product kernels where the dot heads (``_dot_heads``) are
            at most 256 columns wide (padded), instead of the row-loop kernel (the default), which holds the
            sites in registers and adds them one by one; None: where the H200 measured
            them faster (``_use_tensor_cores``; README.md, "Tensor-core phase 1").
        merge_dw: contiguous fp32 [P, G, D], the merges' unreduced dL/dw partials
            (:func:`merge_backward`'s ``dw_out``, site j's at [:, j]), summed into the
            parameters' gradients with phase 1's (zeros for a site that did not run).
        accumulate: False where ``grad_sources`` holds no gradient yet: the row loop then
            stores into it instead of adding (the tensor-core kernels do not touch it).
        loop: :class:`LoopConfig` fields overriding the default launch (benchmarks).

    Returns:
        (grad_query, grad_norm_weight) fp32 [hi - lo, D] for the sites in ``site_range``
        (with the merges' share where ``merge_dw`` is given), and the deferred rows'
        gradients (empty from the row loop), last chunk first.
    """
    _check_sources(sources, None, num_heads)
    t, n, d = sources.shape
    g = queries.shape[0]
    lo, hi = site_range if site_range is not None else (0, g)
    if not (0 <= lo < hi <= g):
        raise ValueError(f"site_range {site_range} outside the group's {g} sites")
    _check_sites_per_program(sites_per_program)
    if grad_sources.shape != sources.shape or grad_sources.dtype != torch.float32:
        raise ValueError(
            f"grad_sources must be an fp32 view of shape {tuple(sources.shape)}, got "
            f"{tuple(grad_sources.shape)} {grad_sources.dtype}"
        )
    queries, norm_weights = queries.contiguous(), norm_weights.contiguous()
    grad_outs, lse, delta = grad_outs.contiguous(), lse.contiguous(), delta.contiguous()
    # w = q * g^ in fp32, g^ rounded to the activation dtype: the product the kernels form.
    folded = queries.float() * norm_weights.to(sources.dtype).float()
    _, _, dot_dim, _ = _dot_heads(d, num_heads)
    # A wider head's tiles outgrow registers and shared memory.
    use_dots = _use_tensor_cores(tensor_cores, g, dot_dim, backward=True, dtype=sources.dtype)
    if use_dots and triton.next_power_of_2(dot_dim) <= 256:
        unused = sorted(set(loop) - {"num_warps"}) + (["sites_per_program"] if sites_per_program else [])
        if unused:
            raise ValueError(
                f"tensor_cores=True takes only num_warps as a launch override, got {unused}; "
                f"drop them or use tensor_cores=False"
            )
        return _group_backward_tensor_cores(
            grad_outs, sources, queries, norm_weights, folded, lse, delta, num_heads, eps, logit_scale,
            lo, hi, loop.get("num_warps"), merge_dw,
        )  # fmt: skip
    head_dim, bh, bhd = _tile(d, num_heads)
    default_sites, config = _group_bwd_config(bh * bhd, g, bh)
    sg = min(g, sites_per_program or default_sites)
    block_t, num_warps, stages, _, programs_per_sm = config.override(**loop)
    device = sources.device
    num_tiles = triton.cdiv(t, block_t)
    num_programs = _backward_programs(num_tiles, device, programs_per_sm)
    dw = torch.empty((num_programs, g, d), dtype=torch.float32, device=device)
    if t == 0:
        dw.zero_()
    for chunk_hi in range(hi, lo, -sg) if t > 0 else ():  # chunks of sites, last first
        first = chunk_hi == hi
        _group_bwd_kernel[(num_programs,)](
            sources, folded, grad_outs, lse, delta, grad_sources, dw,
            t, n, g, max(lo, chunk_hi - sg), chunk_hi, num_tiles,
            sources.stride(0), sources.stride(1), grad_sources.stride(0), grad_sources.stride(1),
            eps, float(logit_scale),
            D=d, H=num_heads, HD=head_dim, BT=block_t, BH=bh, BHD=bhd, SG=sg, STAGES=stages,
            ACCUMULATE=accumulate or not first, num_warps=num_warps,
        )  # fmt: skip
    dq, dg = _reduce_dw(dw, sources, queries, norm_weights, merge_dw)
    return dq[lo:hi], dg[lo:hi], ()


def _group_backward_tensor_cores(
    grad_outs, sources, queries, norm_weights, folded, lse, delta, num_heads, eps, logit_scale, lo, hi,
    num_warps=None, merge_dw=None,
):  # fmt: skip
    """group_backward_deferred through _group_bwd_rows_kernel (per token, every head at
    once) and _group_bwd_heads_kernel (dL/dw per head), SLOTS sites per launch, last chunk
    first, the heads as ``_dot_heads``; each chunk's factors are kept for add_row_grads
    (per dot head)."""
    t, n, d = sources.shape
    g = queries.shape[0]
    device = sources.device
    split, heads, head_dim, padded_heads = _dot_heads(d, num_heads)
    bhd = triton.next_power_of_2(head_dim)
    token_programs = _head_programs(t, heads, device)
    dw = torch.empty((token_programs, g, d), dtype=torch.float32, device=device)
    if t == 0:
        dw.zero_()
    ka, kb = _head_chunks(head_dim)
    rows_config, heads_config = _group_bwd_dots_config(padded_heads, head_dim)
    rows_programs = _backward_programs(t, device, rows_config.programs_per_sm)
    folded_rows = _folded_operand(folded, sources.dtype)
    deferred = []
    for chunk_hi in range(hi, lo, -SLOTS) if t > 0 else ():
        chunk_lo = max(lo, chunk_hi - SLOTS)
        factors = torch.empty((t, n, heads, 2 * SLOTS), dtype=torch.float32, device=device)
        rms_term = torch.empty((t, n), dtype=torch.float32, device=device)
        _group_bwd_rows_kernel[(rows_programs,)](
            sources, folded_rows, grad_outs, lse, delta, factors, rms_term, t, n, chunk_lo, chunk_hi,
            sources.stride(0), sources.stride(1), eps, float(logit_scale),
            D=d, H=heads, HD=head_dim, BH=padded_heads, KA=ka, KB=kb, BR=16, GH=split,
            STAGES=rows_config.stages, num_warps=rows_config.num_warps,
        )  # fmt: skip
        _group_bwd_heads_kernel[(token_programs, heads)](
            sources, factors, dw, t, n, g, chunk_lo, chunk_hi, sources.stride(0), sources.stride(1),
            D=d, H=heads, HD=head_dim, BR=16, BHD=bhd, STAGES=heads_config.stages,
            num_warps=num_warps or heads_config.num_warps,
        )  # fmt: skip
        deferred.append(RowFactors(factors, rms_term, folded_rows, grad_outs, chunk_lo, chunk_hi))
    dq, dg = _reduce_dw(dw, sources, queries, norm_weights, merge_dw)
    return dq[lo:hi], dg[lo:hi], tuple(deferred)


def _head_programs(t: int, num_heads: int, device: torch.device, programs_per_sm: int = 4) -> int:
    """Token programs of the per-head kernels: ``programs_per_sm * SMs / H`` over the H heads."""
    return max(1, min(t, triton.cdiv(programs_per_sm * _num_sms(device), num_heads)))


def add_row_grads(
    deferred: Sequence[Tuple[Sequence[RowFactors], int]],
    sources: torch.Tensor,
    grad_sources: torch.Tensor,
    start: int,
    accumulate: bool = True,
    num_warps: int = 4,
    stages: int = 2,
    programs_per_sm: int = 4,
) -> None:
    """Add deferred phase-1 gradients to rows ``[start, owed)`` of the history.

    Args:
        deferred: (factors of one :func:`group_backward_deferred`, owed) pairs, added in
            order; each adds to the rows ``[start, owed)`` (owed at most its N).
        sources, grad_sources: [T, R, D] the rows from row 0 and their fp32 gradients.
        accumulate: False where the rows ``[start, max owed)`` hold no gradient yet: the
            sums are stored, the gradients not read.
        num_warps, stages, programs_per_sm: the launch (benchmarks). Two stages overlap
            an entry's loads with the previous entry's dots (the sweep in the kernel's
            docstring); ``programs_per_sm * SMs / H`` token programs per head stride over
            the tokens.
    """
    if programs_per_sm < 1:
        raise ValueError(f"programs_per_sm must be >= 1, got {programs_per_sm}")
    entries = [(f, owed) for factors, owed in deferred for f in factors if owed > start]
    if not entries or sources.shape[0] == 0:
        return
    t, _, d = sources.shape
    num_heads = entries[0][0].z.shape[2]
    head_dim = d // num_heads
    ka, kb = _head_chunks(head_dim)
    stop = max(owed for _, owed in entries)
    block_rows = 16  # the dots' smallest M; a block between group starts has G rows
    programs = _head_programs(t, num_heads, sources.device, programs_per_sm)
    for i in range(0, len(entries), _ROW_GRADS_ENTRIES):
        batch = entries[i : i + _ROW_GRADS_ENTRIES]
        z, kv, folded, grad_outs, chunk_lo, chunk_hi = [tuple(x) for x in zip(*(f for f, _ in batch))]
        _group_bwd_row_grads_kernel[(programs, num_heads)](
            sources, grad_sources, z, kv, folded, grad_outs,
            tuple(f.z.shape[1] for f, _ in batch), tuple(owed for _, owed in batch), chunk_lo, chunk_hi,
            t, start, stop, sources.stride(0), sources.stride(1), grad_sources.stride(0), grad_sources.stride(1),
            D=d, H=num_heads, HD=head_dim, BR=block_rows, KA=ka, KB=kb, J=len(batch),
            ACCUMULATE=accumulate or i > 0, num_warps=num_warps, num_stages=stages,
        )  # fmt: skip
