"""The merges of the lookahead schedule: one site folds the rows written since its group
started into its phase-1 partial, and back.

- ``merge_forward``: the new rows ``[T, n, D]`` (n < G) into the site's online-softmax
  partial; writes the output and its log-sum-exp ``[T, H]``.
- ``merge_backward``: one pass over the new rows, with ``delta[h] = do . out`` per head
  taken from the routed output (as in flash attention) instead of a second pass; the
  rows' gradients are left as factors (``(p, tau r ds)`` per head, ``tau r c``) for
  ``row_grads.merge_row_grad``, or written whole where this site is their only reader
  (the block variant's running partial), and dL/dw as per-program partials for the
  group's reduction.

Launch rules: ``launch.merge_fwd_config`` and ``launch.merge_bwd_config``.
"""

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..checks import check_output, check_sources
from ..launch import backward_programs, merge_bwd_config, merge_fwd_config, overrides, tile
from ..primitives import bwd_head_sums, fast_exp, folded_query, route_fwd_step, store_output, token_tile
from .reduce import reduce_dw


@triton.jit
def merge_fwd_kernel(
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
    _, o_h, o_d, m_d, m_t, m_v, m_th, o_t64 = token_tile(tl.program_id(0), T, H, HD, BT, BH, BHD)
    b_w = folded_query(Q_ptr, G_ptr, o_d, m_d, V_ptr.dtype.element_ty, BHD, 1)[0]

    p_ml = o_t64[:, None] * H + o_h[None, :]
    b_m = tl.load(M_ptr + p_ml, mask=m_th, other=0.0)
    b_l = tl.load(L_ptr + p_ml, mask=m_th, other=1.0)
    b_acc = tl.load(A_ptr + o_t64[:, None, None] * D + o_d[None, :, :], mask=m_v, other=0.0).to(tl.float32)
    if NORMALISED:
        b_acc = b_acc * b_l[:, :, None]
    p_v = V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :]
    for _ in tl.range(0, N, num_stages=STAGES):
        b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
        b_m, b_l, b_accs = route_fwd_step((b_v,), (b_w,), b_m, b_l, (b_acc,), eps, scale, D, 1)
        b_acc = b_accs[0]
        p_v += stride_vn

    store_output(O_ptr, LSE_ptr + p_ml, b_m, b_l, b_acc, o_t64, o_d, stride_ot, m_v, m_th)


@triton.jit
def merge_bwd_kernel(
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
    DV_ptr,  # [T, N, D] out (ROW_GRADS): the rows' gradients, strides (stride_dvt, stride_dvn, 1)
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
    STAGES: tl.constexpr,
    COPY_DO: tl.constexpr,
    ONE_REDUCE: tl.constexpr,  # one reduction for the row's three head sums (one head: they span warps)
    ROW_GRADS: tl.constexpr,  # write the rows' gradients instead of their factors (this site reads them alone)
):
    i_p = tl.program_id(0)
    n_p = tl.num_programs(0)
    o_h = tl.arange(0, BH)
    o_k = tl.arange(0, BHD)
    o_d = o_h[:, None] * HD + o_k[None, :]
    m_d = (o_h[:, None] < H) & (o_k[None, :] < HD)

    b_w = folded_query(Q_ptr, G_ptr, o_d, m_d, V_ptr.dtype.element_ty, BHD, 1)[0]
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
        p_dv = DV_ptr + o_t64[:, None, None] * stride_dvt + o_d[None, :, :]
        for _ in tl.range(0, N, num_stages=STAGES):
            b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
            b_r, b_dot, b_s, b_dp = bwd_head_sums((b_v,), (b_w,), (b_do,), eps, scale, D, 1, ONE_REDUCE)
            b_p = fast_exp(b_s - b_lse)
            b_ds = b_p * (b_dp - b_delta)
            b_rs = b_r * scale
            b_rds = b_rs[:, None] * b_ds
            b_kv = b_rs * tl.sum(b_ds * b_dot, axis=1) * (b_r * b_r / D)
            if ROW_GRADS:  # p do + tau r ds w - tau r c v, whole: no other site reads the row
                b_dv = b_p[:, :, None] * b_do + b_rds[:, :, None] * b_w[None, :, :] - b_kv[:, None, None] * b_v
                tl.store(p_dv, b_dv.to(DV_ptr.dtype.element_ty), mask=m_v)
                p_dv += stride_dvn
            else:
                # The row's gradient as its factors, added when the row is due
                # (merge_row_grad): no read-modify-write of its fp32 gradient here.
                tl.store(p_f, b_p, mask=m_th)
                tl.store(p_f + 1, b_rds, mask=m_th)
                tl.store(p_kv, b_kv, mask=m_t)
                p_f += stride_fn
                p_kv += 1
            b_dw += b_rds[:, :, None] * b_v
            p_v += stride_vn

    tl.store(DW_ptr + i_p * stride_dwp + o_d, tl.sum(b_dw, axis=0), mask=m_d)


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
) -> torch.Tensor:
    """Fold the new rows [T, n, D] (n may be 0) into one site's partial (m, l [T, H] fp32,
    acc [T, D]: fp32, or normalised in the sources' half-precision dtype as
    :func:`group_forward` leaves it; contiguous); write its log-sum-exp into ``lse`` [T, H]
    and return the output [T, D] in the sources' dtype, written into ``out`` where given
    (unit stride over D)."""
    check_sources(sources, None, num_heads)
    t, n, d = sources.shape
    if acc.dtype not in (torch.float32, sources.dtype):
        raise ValueError(f"merge_forward: acc must be fp32 or normalised in the sources' dtype {sources.dtype}, "
                         f"got {acc.dtype}")  # fmt: skip
    head_dim, bh, bhd = tile(d, num_heads)
    block_t, num_warps, stages, _, _ = merge_fwd_config(bh * bhd).override(**overrides("merge_fwd"))
    if out is None:
        out = torch.empty((t, d), dtype=sources.dtype, device=sources.device)
    else:
        check_output("merge_forward's out", out, t, d, sources.dtype)
    if t == 0:
        return out
    src = sources if n > 0 else out  # no row is read; the dtype still rounds g
    merge_fwd_kernel[(triton.cdiv(t, block_t),)](
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
    row_factors: Optional[Tuple[torch.Tensor, torch.Tensor]],
    delta_out: Optional[torch.Tensor] = None,
    grad_out_copy: Optional[torch.Tensor] = None,
    dw_out: Optional[torch.Tensor] = None,
    row_grads: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward of :func:`merge_forward` in one pass over the new rows, whose gradients it
    leaves as factors in ``row_factors`` (fp32 views factors [T, n, H, 2] with unit stride
    over the last two dims, kv [T, n] with unit stride over n) for :func:`merge_row_grad`,
    or, where this site is the rows' only reader, writes whole into ``row_grads`` ([T, n, D]
    in any dtype, unit stride over D; ``row_factors`` is then None).
    ``delta_out`` (fp32 [T, H]) receives delta and ``grad_out_copy`` (contiguous [T, D],
    grad_out's dtype) a copy of ``grad_out``, from the same kernel (the group's workspaces,
    no copy kernels). ``dw_out``: an fp32 [P, D] view (unit stride over D, P =
    :func:`merge_dw_partials`) receiving the per-program partials of dL/dw unreduced, for
    the group's phase-1 backward to sum with its own (``merge_dw``): one reduction per group
    instead of one per merge.

    Returns:
        (delta [T, H] fp32 (``delta_out`` if given), grad_query fp32 [D],
        grad_norm_weight fp32 [D]) of the new rows; both None with ``dw_out``.
    """
    check_sources(sources, None, num_heads)
    t, n, d = sources.shape
    head_dim, bh, bhd = tile(d, num_heads)
    block_t, num_warps, stages, _, programs_per_sm = merge_bwd_config(bh * bhd).override(**overrides("merge_bwd"))
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
    if (row_grads is None) == (row_factors is None):
        raise ValueError("merge_backward takes either row_factors or row_grads")
    if row_grads is not None:
        if row_grads.shape != (t, n, d) or row_grads.stride(-1) != 1:
            raise ValueError(f"row_grads must be a [{t}, {n}, {d}] view with unit stride over D, got "
                             f"{tuple(row_grads.shape)} {row_grads.stride()}")  # fmt: skip
        factors = kv = None
    else:
        factors, kv = row_factors
        if (factors.shape != (t, n, num_heads, 2) or kv.shape != (t, n) or factors.dtype != torch.float32
                or kv.dtype != torch.float32 or (n > 0 and (factors.stride()[2:] != (2, 1) or kv.stride(1) != 1))):  # fmt: skip
            raise ValueError(f"row_factors must be fp32 views [{t}, {n}, {num_heads}, 2] and [{t}, {n}] with unit "
                             f"inner strides, got {tuple(factors.shape)} {factors.stride()} and "
                             f"{tuple(kv.shape)} {kv.stride()}")  # fmt: skip
    num_tiles = triton.cdiv(t, block_t)
    num_programs = backward_programs(num_tiles, device, programs_per_sm)
    if dw_out is not None and (dw_out.shape != (num_programs, d) or dw_out.dtype != torch.float32
                               or dw_out.stride(1) != 1):  # fmt: skip
        raise ValueError(f"dw_out must be an fp32 [{num_programs}, {d}] view with unit stride over D "
                         f"(merge_dw_partials), got {tuple(dw_out.shape)} {dw_out.dtype} {dw_out.stride()}")  # fmt: skip
    dw = torch.empty((num_programs, d), dtype=torch.float32, device=device) if dw_out is None else dw_out
    if t > 0:
        grads_whole = row_grads is not None and n > 0
        src = sources if n > 0 else out
        f, k = (factors, kv) if n > 0 and not grads_whole else (dw, dw)  # nothing is stored there
        dv = row_grads if grads_whole else out
        merge_bwd_kernel[(num_programs,)](
            src, query, norm_weight, grad_out, out, lse, delta, f, k, dw,
            grad_out_copy if copy_do else grad_out, dv, t, n, num_tiles,
            src.stride(0), src.stride(1) if n > 0 else 0, grad_out.stride(0), out.stride(0),
            f.stride(0) if f is factors else 0, f.stride(1) if f is factors else 0, k.stride(0) if k is kv else 0,
            dw.stride(0), dv.stride(0), dv.stride(1) if grads_whole else 0, eps, float(logit_scale),
            D=d, H=num_heads, HD=head_dim, BT=block_t, BH=bh, BHD=bhd, STAGES=stages, COPY_DO=copy_do,
            ONE_REDUCE=num_heads == 1, ROW_GRADS=grads_whole,
            num_warps=num_warps,
        )  # fmt: skip
    else:
        dw.zero_()
    if dw_out is not None:
        return delta, None, None
    dq, dg = reduce_dw(dw.unsqueeze(1), sources if n > 0 else out, query.view(1, d), norm_weight.view(1, d))
    return delta, dq[0], dg[0]


def merge_dw_partials(num_tokens: int, d: int, num_heads: int, device: torch.device) -> int:
    """P of :func:`merge_backward`'s ``dw_out`` at its default launch: its programs."""
    head_dim, bh, bhd = tile(d, num_heads)
    config = merge_bwd_config(bh * bhd)
    return backward_programs(triton.cdiv(num_tokens, config.block_t), device, config.programs_per_sm)
