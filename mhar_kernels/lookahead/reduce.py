"""dL/dquery and dL/dnorm of a group's sites from per-program partials of dL/dw.

Every lookahead backward kernel leaves its programs' partial sums of dL/dw (w = q * g^, the
folded query) in a ``[P, G, D]`` fp32 tensor; one reduction per group sums them, and the
merges' partials with them, in a fixed order: deterministic, no atomics.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def dw_reduce_kernel(
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


def reduce_dw(dw, sources, queries, norm_weights, extra=None):
    """Sum the [P, G, D] partials, then the [PX, G, D] ``extra`` ones (the group's merges'),
    in a fixed order, into (dquery, dnorm_weight) fp32 [G, D]. Narrow column blocks and tall
    row blocks: a merge has P = 4 x SMs partials and one site, so a program walks a few
    row blocks of 128 instead of many of 32."""
    num_programs, g, d = dw.shape
    if extra is not None and (extra.shape[1:] != dw.shape[1:] or extra.dtype != torch.float32
                              or not extra.is_contiguous()):  # fmt: skip
        raise ValueError(f"merge_dw must be a contiguous fp32 [P, {g}, {d}] tensor, got "
                         f"{tuple(extra.shape)} {extra.dtype}")  # fmt: skip
    grad_query = torch.empty((g, d), dtype=torch.float32, device=dw.device)
    grad_norm = torch.empty((g, d), dtype=torch.float32, device=dw.device)
    block_d = min(16, triton.next_power_of_2(d))
    dw_reduce_kernel[(triton.cdiv(d, block_d), g)](
        dw, dw if extra is None else extra, sources, queries, norm_weights, grad_query, grad_norm,
        num_programs, 0 if extra is None else extra.shape[0], g,
        D=d, BP=128, BD=block_d, num_warps=4,
    )  # fmt: skip
    return grad_query, grad_norm
