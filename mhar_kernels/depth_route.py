"""Fused Triton depth routing (the MHAR paper): one pass over the sources forward, two backward.

Semantics are those of ``megatron_mhar.ops.depth_route.depth_route_reference``; the
derivation of the backward, the memory kept between the passes and the rounding
differences are in docs/kernels.md.

Layout. The sources are a ``[T, N, D]`` view with unit stride over D and any strides
over T and N: a slice ``buf[:, :n]`` of a ``[T, R, D]`` history buffer, or the permuted
view of an ``[N, T, D]`` tensor. An optional ``extra`` ``[T, D]`` source takes index N:
the running partial of the block variant, or the delta variant's null source. Each
program owns ``BT`` tokens and the full width, held as a ``[BT, BH, BHD]`` tile (heads x
head width, padded to powers of two; forward, a head width that is not a power of two is
a tuple of equal power-of-two chunks instead, ``launch.chunked_tile``), so the RMS over D
and the per-head dot products are register reductions (primitives.py).

Forward: online softmax over the sources. Only the log-sum-exp ``[T, H]`` fp32 is saved.

Backward: pass 1 recomputes the weights and gets ``delta[h] = sum_i p_i[h] dp_i[h]``;
pass 2 recomputes them again and writes the source gradients. (Taking ``delta`` as
``do[h] . out[h]`` from the bf16 output, as flash attention does, would save pass 1 but
fails the bf16 model test; docs/kernels.md.) ``dw`` is reduced over tokens in two
deterministic stages (per-program partials, then a fixed-order sum).

Launch rules: ``launch.route_fwd_config`` and ``launch.route_bwd_config``.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .checks import check_sources
from .launch import chunked_tile, num_sms, overrides, route_bwd_config, route_fwd_config, tile, tile_width
from .primitives import (
    bwd_head_sums,
    fast_exp,
    folded_query,
    grad_factors,
    load_tile,
    route_fwd_step,
    store_tile,
    to_f32,
)


@triton.jit
def route_fwd_kernel(
    V_ptr,  # [T, N, D] sources, strides (stride_vt, stride_vn, 1)
    E_ptr,  # [T, D] extra source (index N), strides (stride_et, 1); read if HAS_EXTRA
    Q_ptr,  # [D] pseudo-query
    G_ptr,  # [D] norm weight
    O_ptr,  # [T, D] routed output in the sources' dtype, strides (stride_ot, 1)
    LSE_ptr,  # [T, H] fp32 log-sum-exp of the logits
    T,
    N,
    stride_vt,
    stride_vn,
    stride_et,
    stride_ot,
    eps,
    scale,
    D: tl.constexpr,
    H: tl.constexpr,
    HD: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    BHD: tl.constexpr,
    C: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    STAGES: tl.constexpr,
    EVICT_SRC: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_h = tl.arange(0, BH)
    o_k = tl.arange(0, BHD)
    o_d = o_h[:, None] * HD + o_k[None, :]  # chunk 0 of each head; chunk c is + c * BHD
    m_d = (o_h[:, None] < H) & (o_k[None, :] < HD)
    m_t = o_t < T
    m_v = m_t[:, None, None] & m_d[None, :, :]
    o_t64 = o_t.to(tl.int64)

    # The reference rounds g to the activation dtype before multiplying the key by it.
    b_w = folded_query(Q_ptr, G_ptr, o_d, m_d, V_ptr.dtype.element_ty, BHD, C)

    b_m = tl.full([BT, BH], float("-inf"), tl.float32)
    b_l = tl.zeros([BT, BH], dtype=tl.float32)
    b_acc = ()
    for c in tl.static_range(C):
        b_acc = b_acc + (tl.zeros([BT, BH, BHD], dtype=tl.float32),)
    p_v = V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :]
    for _ in tl.range(0, N, num_stages=STAGES):
        b_v = to_f32(load_tile(p_v, m_v, BHD, C, EVICT_SRC), C)
        b_m, b_l, b_acc = route_fwd_step(b_v, b_w, b_m, b_l, b_acc, eps, scale, D, C)
        p_v += stride_vn
    if HAS_EXTRA:
        b_e = load_tile(E_ptr + o_t64[:, None, None] * stride_et + o_d[None, :, :], m_v, BHD, C, "")
        b_m, b_l, b_acc = route_fwd_step(to_f32(b_e, C), b_w, b_m, b_l, b_acc, eps, scale, D, C)

    b_o = ()
    for c in tl.static_range(C):
        b_o = b_o + (b_acc[c] / b_l[:, :, None],)
    p_o = O_ptr + o_t64[:, None, None] * stride_ot + o_d[None, :, :]
    store_tile(p_o, b_o, m_v, O_ptr.dtype.element_ty, BHD, C, "")
    p_lse = LSE_ptr + o_t64[:, None] * H + o_h[None, :]
    tl.store(p_lse, b_m + tl.log(b_l), mask=m_t[:, None] & (o_h[None, :] < H))


@triton.jit
def _route_bwd_sums(b_v, b_w, b_do, b_lse, b_l, b_ld, eps, scale, D: tl.constexpr, C: tl.constexpr,
                    ONE_REDUCE: tl.constexpr):
    """Pass 1: add e_i = exp(s_i - lse) to l and e_i * (dout . v_i) to ld, per head [BT, BH]."""
    _, _, b_s, b_dp = bwd_head_sums(b_v, b_w, b_do, eps, scale, D, C, ONE_REDUCE)
    b_e = fast_exp(b_s - b_lse)
    return b_l + b_e, b_ld + b_e * b_dp


@triton.jit
def _route_bwd_step(b_v, b_w, b_do, b_lse, b_l, b_ld, b_il, b_dw, eps, scale, D: tl.constexpr, C: tl.constexpr,
                    ONE_REDUCE: tl.constexpr):
    """Pass 2: gradient of one source tile, and its share of dL/dw (docs/kernels.md)."""
    b_r, b_dot, b_s, b_dp = bwd_head_sums(b_v, b_w, b_do, eps, scale, D, C, ONE_REDUCE)
    b_e = fast_exp(b_s - b_lse)
    # ds = p (dp - sum_j p_j dp_j) with p = e / l: exact zero for one source.
    b_ds = b_e * (b_dp * b_l - b_ld) * (b_il * b_il)
    b_kp, b_kw, b_kv = grad_factors(b_e * b_il, b_ds, tl.sum(b_ds * b_dot, axis=1), b_r, scale, D)
    b_dv = ()
    dw = ()
    for c in tl.static_range(C):
        b_dv = b_dv + (b_kp * b_do[c] + b_kw * b_w[c][None, :, :] - b_kv * b_v[c],)
        dw = dw + (b_dw[c] + b_kw * b_v[c],)
    return b_dv, dw


@triton.jit
def route_bwd_kernel(
    V_ptr,  # [T, N, D] sources, strides (stride_vt, stride_vn, 1)
    E_ptr,  # [T, D] extra source, strides (stride_et, 1); read if HAS_EXTRA
    Q_ptr,  # [D] pseudo-query
    G_ptr,  # [D] norm weight
    DO_ptr,  # [T, D] gradient of the output, strides (stride_dot, 1)
    LSE_ptr,  # [T, H] fp32 log-sum-exp saved by the forward
    DV_ptr,  # [T, N, D] source gradients, strides (stride_dvt, stride_dvn, 1)
    DE_ptr,  # [T, D] contiguous gradient of the extra source; written if HAS_EXTRA
    DW_ptr,  # [P, D] fp32 per-program partial dL/dw, P = number of programs
    T,
    N,
    num_tiles,
    stride_vt,
    stride_vn,
    stride_et,
    stride_dot,
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
    C: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    STAGES: tl.constexpr,
    EVICT_KEEP: tl.constexpr,
    EVICT_STREAM: tl.constexpr,
    ONE_REDUCE: tl.constexpr,
):
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_h = tl.arange(0, BH)
    o_k = tl.arange(0, BHD)
    o_d = o_h[:, None] * HD + o_k[None, :]  # chunk 0 of each head; chunk c is + c * BHD
    m_d = (o_h[:, None] < H) & (o_k[None, :] < HD)
    m_h = o_h < H

    b_w = folded_query(Q_ptr, G_ptr, o_d, m_d, V_ptr.dtype.element_ty, BHD, C)
    b_dw = ()
    for c in tl.static_range(C):
        b_dw = b_dw + (tl.zeros([BT, BH, BHD], dtype=tl.float32),)

    # Fixed tile -> program map (grid-stride), so the dw partials are deterministic.
    for i_t in range(i_p, num_tiles, n_p):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        m_v = m_t[:, None, None] & m_d[None, :, :]
        o_t64 = o_t.to(tl.int64)
        p_do = DO_ptr + o_t64[:, None, None] * stride_dot + o_d[None, :, :]
        b_do = to_f32(load_tile(p_do, m_v, BHD, C, ""), C)
        p_lse = LSE_ptr + o_t64[:, None] * H + o_h[None, :]
        b_lse = tl.load(p_lse, mask=m_t[:, None] & m_h[None, :], other=0.0)
        p_v = V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :]
        p_e = E_ptr + o_t64[:, None, None] * stride_et + o_d[None, :, :]

        b_l = tl.zeros([BT, BH], dtype=tl.float32)
        b_ld = tl.zeros([BT, BH], dtype=tl.float32)
        p_vn = p_v
        for _ in tl.range(0, N, num_stages=STAGES):
            b_v = to_f32(load_tile(p_vn, m_v, BHD, C, EVICT_KEEP), C)
            b_l, b_ld = _route_bwd_sums(b_v, b_w, b_do, b_lse, b_l, b_ld, eps, scale, D, C, ONE_REDUCE)
            p_vn += stride_vn
        if HAS_EXTRA:
            b_v = to_f32(load_tile(p_e, m_v, BHD, C, ""), C)
            b_l, b_ld = _route_bwd_sums(b_v, b_w, b_do, b_lse, b_l, b_ld, eps, scale, D, C, ONE_REDUCE)
        b_il = 1.0 / b_l

        p_dv = DV_ptr + o_t64[:, None, None] * stride_dvt + o_d[None, :, :]
        for _ in tl.range(0, N, num_stages=STAGES):
            b_v = to_f32(load_tile(p_v, m_v, BHD, C, EVICT_STREAM), C)
            b_dv, b_dw = _route_bwd_step(b_v, b_w, b_do, b_lse, b_l, b_ld, b_il, b_dw, eps, scale, D, C, ONE_REDUCE)
            if ACCUMULATE:
                b_old = to_f32(load_tile(p_dv, m_v, BHD, C, EVICT_STREAM), C)
                b_sum = ()
                for c in tl.static_range(C):
                    b_sum = b_sum + (b_dv[c] + b_old[c],)
                b_dv = b_sum
            store_tile(p_dv, b_dv, m_v, DV_ptr.dtype.element_ty, BHD, C, EVICT_STREAM)
            p_v += stride_vn
            p_dv += stride_dvn
        if HAS_EXTRA:
            b_v = to_f32(load_tile(p_e, m_v, BHD, C, ""), C)
            b_dv, b_dw = _route_bwd_step(b_v, b_w, b_do, b_lse, b_l, b_ld, b_il, b_dw, eps, scale, D, C, ONE_REDUCE)
            p_de = DE_ptr + o_t64[:, None, None] * D + o_d[None, :, :]
            store_tile(p_de, b_dv, m_v, DE_ptr.dtype.element_ty, BHD, C, "")

    for c in tl.static_range(C):
        tl.store(DW_ptr + i_p * D + o_d + c * BHD, tl.sum(b_dw[c], axis=0), mask=m_d)


@triton.jit
def route_dw_reduce_kernel(
    DW_ptr,  # [P, D] fp32 per-program partial dL/dw
    V_ptr,  # sources; only their dtype is used (the rounding of g)
    Q_ptr,  # [D] pseudo-query
    G_ptr,  # [D] norm weight
    DQ_ptr,  # [D] gradient of the query, in its dtype
    DG_ptr,  # [D] gradient of the norm weight, in its dtype
    P,
    D: tl.constexpr,
    BP: tl.constexpr,
    BD: tl.constexpr,
):
    i_d = tl.program_id(0)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_acc = tl.zeros([BP, BD], dtype=tl.float32)
    for i_p in range(0, P, BP):
        o_p = i_p + tl.arange(0, BP)
        p_dw = DW_ptr + o_p.to(tl.int64)[:, None] * D + o_d[None, :]
        b_acc += tl.load(p_dw, mask=(o_p < P)[:, None] & m_d[None, :], other=0.0)
    b_dw = tl.sum(b_acc, axis=0)
    b_q = tl.load(Q_ptr + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_g = tl.load(G_ptr + o_d, mask=m_d, other=0.0).to(V_ptr.dtype.element_ty).to(tl.float32)
    tl.store(DQ_ptr + o_d, (b_dw * b_g).to(DQ_ptr.dtype.element_ty), mask=m_d)
    tl.store(DG_ptr + o_d, (b_dw * b_q).to(DG_ptr.dtype.element_ty), mask=m_d)


def _launch_fwd(sources, extra, query, norm_weight, num_heads, eps, logit_scale):
    t, n, d = sources.shape
    head_dim, bh, bhd, chunks = chunked_tile(d, num_heads)
    config = route_fwd_config(tile_width(d, num_heads))
    block_t, num_warps, stages, l2_reuse, _ = config.override(**overrides("route_fwd"))
    out = torch.empty((t, d), dtype=sources.dtype, device=sources.device)
    lse = torch.empty((t, num_heads), dtype=torch.float32, device=sources.device)
    if t == 0:
        return out, lse
    ext = sources if extra is None else extra
    route_fwd_kernel[(triton.cdiv(t, block_t),)](
        sources, ext, query, norm_weight, out, lse,
        t, n, sources.stride(0), sources.stride(1), ext.stride(0), out.stride(0),
        eps, logit_scale,
        D=d, H=num_heads, HD=head_dim, BT=block_t, BH=bh, BHD=bhd, C=chunks,
        HAS_EXTRA=extra is not None,
        STAGES=stages, EVICT_SRC="evict_first" if l2_reuse else "",
        num_warps=num_warps,
    )  # fmt: skip
    return out, lse


def _launch_bwd(
    grad_out, sources, extra, query, norm_weight, lse, num_heads, eps, logit_scale,
    grad_sources, accumulate,
):  # fmt: skip
    t, n, d = sources.shape
    # One padded chunk per head: the chunked tile is the forward's (launch.chunked_tile);
    # the backward holds four tiles per source and keeps the padded one (docs/kernels.md).
    head_dim, bh, bhd = tile(d, num_heads)
    chunks = 1
    block_t, num_warps, stages, l2_reuse, programs_per_sm = route_bwd_config(
        bh * bhd, num_heads == 1
    ).override(**overrides("route_bwd"))
    device = sources.device
    has_extra = extra is not None
    grad_extra = torch.empty((t, d), dtype=sources.dtype, device=device) if has_extra else None
    num_tiles = triton.cdiv(t, block_t)
    num_programs = max(1, min(num_tiles, num_sms(device) * programs_per_sm))
    dw = torch.empty((num_programs, d), dtype=torch.float32, device=device)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    if t > 0:
        ext = sources if extra is None else extra
        route_bwd_kernel[(num_programs,)](
            sources, ext, query, norm_weight, grad_out, lse, grad_sources,
            ext if grad_extra is None else grad_extra, dw,
            t, n, num_tiles,
            sources.stride(0), sources.stride(1), ext.stride(0), grad_out.stride(0),
            grad_sources.stride(0), grad_sources.stride(1),
            eps, logit_scale,
            D=d, H=num_heads, HD=head_dim, BT=block_t, BH=bh, BHD=bhd, C=chunks,
            HAS_EXTRA=has_extra, ACCUMULATE=accumulate,
            STAGES=stages,
            # Pass 2 rereads the tile pass 1 just read: ask L2 to keep those lines and to
            # stream everything read or written once.
            EVICT_KEEP="evict_last" if l2_reuse else "",
            EVICT_STREAM="evict_first" if l2_reuse else "",
            ONE_REDUCE=num_heads == 1,
            num_warps=num_warps,
        )  # fmt: skip
    else:
        dw.zero_()
    grad_query = torch.empty(d, dtype=query.dtype, device=device)
    grad_norm = torch.empty(d, dtype=norm_weight.dtype, device=device)
    block_d = min(64, triton.next_power_of_2(d))
    route_dw_reduce_kernel[(triton.cdiv(d, block_d),)](
        dw, sources, query, norm_weight, grad_query, grad_norm, num_programs,
        D=d, BP=32, BD=block_d, num_warps=4,
    )  # fmt: skip
    return grad_extra, grad_query, grad_norm


def route_forward(
    sources: torch.Tensor,
    extra: Optional[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Route over a history view in one pass.

    Args:
        sources: [T, N, D] view, unit stride over D, any strides over T and N.
        extra: None or [T, D], routed as source N (the block variant's running partial,
            or the delta variant's null source).
        query, norm_weight: [D] (any float dtype).

    Returns:
        (out [T, D] in the sources' dtype, saved = log-sum-exp [T, H] fp32).
    """
    check_sources(sources, extra, num_heads)
    return _launch_fwd(sources, extra, query, norm_weight, num_heads, eps, float(logit_scale))


def route_backward(
    grad_out: torch.Tensor,
    sources: torch.Tensor,
    extra: Optional[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    saved: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
    grad_sources: torch.Tensor,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Backward of :func:`route_forward`; adds the source gradients into ``grad_sources``.

    Args:
        grad_out: [T, D] gradient of the routed output.
        saved: the log-sum-exp returned by :func:`route_forward`.
        grad_sources: fp32 [T, N, D] view (unit stride over D) that receives ``+=`` dsources.

    Returns:
        (grad_extra [T, D] in the extra's dtype or None, grad_query, grad_norm_weight [D]
        in the dtypes of query and norm_weight).
    """
    check_sources(sources, extra, num_heads)
    if (
        grad_sources.shape != sources.shape
        or grad_sources.dtype != torch.float32
        or grad_sources.stride(-1) != 1
    ):
        raise ValueError(
            f"grad_sources must be an fp32 view of shape {tuple(sources.shape)} with unit stride "
            f"over D, got {tuple(grad_sources.shape)} {grad_sources.dtype} strides "
            f"{grad_sources.stride()}"
        )
    return _launch_bwd(
        grad_out, sources, extra, query, norm_weight, saved, num_heads, eps,
        float(logit_scale), grad_sources, accumulate=True,
    )  # fmt: skip


class FusedDepthRoute(torch.autograd.Function):
    """Autograd wrapper over the fused kernels for an [N, ..., D] source stack."""

    @staticmethod
    def forward(ctx, sources, query, norm_weight, num_heads, eps, logit_scale):
        n, d = sources.shape[0], sources.shape[-1]
        stacked = sources.reshape(n, -1, d)
        if stacked.stride(-1) != 1:
            stacked = stacked.contiguous()
        out, lse = route_forward(
            stacked.transpose(0, 1), None, query, norm_weight, num_heads, eps, logit_scale
        )
        ctx.save_for_backward(stacked, query, norm_weight, lse)
        ctx.shape, ctx.num_heads, ctx.eps, ctx.logit_scale = sources.shape, num_heads, eps, logit_scale
        return out.view(sources.shape[1:])

    @staticmethod
    def backward(ctx, grad_out):
        stacked, query, norm_weight, lse = ctx.saved_tensors
        grad_sources = torch.empty_like(stacked, memory_format=torch.contiguous_format)
        _, grad_query, grad_norm = _launch_bwd(
            grad_out.reshape(-1, stacked.shape[-1]), stacked.transpose(0, 1), None,
            query, norm_weight, lse, ctx.num_heads, ctx.eps, float(ctx.logit_scale),
            grad_sources.transpose(0, 1), accumulate=False,
        )  # fmt: skip
        return grad_sources.view(ctx.shape), grad_query, grad_norm, None, None, None


def fused_depth_route(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float = 1e-6,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """Fused MHAR routing with the semantics of ``depth_route_reference``.

    Args:
        sources: [N, ..., D] values; the keys are their RMS-normalised copies.
        query: [D] pseudo-query of the routing site, viewed as [H, D/H].
        norm_weight: [D] RMSNorm weight of the routing site.
        num_heads: H; the RMS is always taken over the full width D.
        eps: RMSNorm epsilon.
        logit_scale: tau in ``softmax(tau * w[h] . k[h])``; 1 is the paper.

    Returns:
        [..., D] routed mixture in the sources' dtype.
    """
    return FusedDepthRoute.apply(sources, query, norm_weight, num_heads, eps, float(logit_scale))
