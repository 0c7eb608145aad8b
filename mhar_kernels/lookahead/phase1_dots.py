"""Phase 1 of the lookahead schedule on tensor cores: small dots per token and head.

- ``group_fwd_dots_kernel``: for a block of a token's old rows, the head dots of SLOTS
  sites as one dot, then the block added to the sites' accumulators after the online
  softmax's rescale, one rescale per block of rows.
- ``group_bwd_rows_kernel`` then ``group_bwd_heads_kernel``: per token, the rows' logit
  and value dots of SLOTS sites as one dot, leaving per row, head and site the factors
  ``(tau r ds, p)`` and per row ``tau r c``; per head, dL/dw from those factors. The rows'
  gradients stay factors (:class:`RowFactors`) for ``row_grads.add_row_grads``, which adds
  several groups' at once when the rows are due.

bf16 rows run bf16 dots (the fp32 side as a bf16 pair, about 2^-16 relative), fp32 rows
IEEE fp32 dots; fp16 rows take the row loops. Heads narrower than the dots are run as
``launch.DOT_HEADS`` dot heads (``launch.dot_heads``). docs/kernels.md derives the dots;
launch rules: ``launch.use_tensor_cores``, ``launch.group_fwd_dots_config``,
``launch.queries_left`` and ``launch.group_bwd_dots_config``.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..launch import (
    backward_programs,
    dot_heads,
    group_bwd_dots_config,
    head_chunks,
    head_programs,
    queries_left,
)
from ..primitives import SLOTS, dot_acc, dot_split, fast_exp, slot_operand, split_operand
from .merges import merge_forward
from .reduce import reduce_dw


@triton.jit
def _site_columns(W_ptr, DO_ptr, t, T, o_h, k0, BH: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
                  HD: tl.constexpr, D: tl.constexpr, chunk_lo, chunk_hi, BF16: tl.constexpr):  # fmt: skip
    """Y [BH, K, 16] of token t over the heads o_h and their channels [k0, k0 + K)
    (slot_operand's columns last)."""
    o_k = k0 + tl.arange(0, K)
    mask = (o_h < H)[:, None, None] & (o_k < HD)[None, :, None]
    o_d = o_h[:, None, None] * HD + o_k[None, :, None]
    o_c = tl.arange(0, 2 * SLOTS)[None, None, :]
    return slot_operand(W_ptr, DO_ptr, t, T, o_c, o_d, mask, D, chunk_lo, chunk_hi, BF16)


@triton.jit
def _row_tile(p, mask, BF16: tl.constexpr):
    """A tile of rows as a dot operand pair: bf16 rows are exact (lo unused)."""
    b_x = tl.load(p, mask=mask, other=0.0)
    if BF16:
        pair = (b_x, b_x)
    else:
        pair = split_operand(b_x.to(tl.float32), BF16)
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
def group_fwd_dots_kernel(
    V_ptr, Q_ptr, G_ptr,  # as in group_fwd_kernel: [T, N, D] old rows, [NG, D] queries and norms
    M_ptr, L_ptr, A_ptr,  # as in group_fwd_kernel: fp32 partials [NG, T, H], [NG, T, H], [NG, T, D]
    T, N, NG, stride_vt, stride_vn, eps, scale,
    D: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, BH: tl.constexpr, KA: tl.constexpr,
    KB: tl.constexpr, BR: tl.constexpr, GH: tl.constexpr, STAGES: tl.constexpr, NORMALISED: tl.constexpr,
    QUERIES_LEFT: tl.constexpr,
):  # fmt: skip
    """Phase 1 as dots per token and head (docs/kernels.md, "Tensor-core phase 1"): for
    a block X [BR, head width] of the token's rows, X @ [w_j] (QUERIES_LEFT: its transpose
    [w_j]^T @ X^T, ``queries_left``) gives the head dots of SLOTS sites (program axis 1
    picks the sites), and P^T @ X adds the block to the sites'
    accumulators after the online-softmax rescale, one rescale per block of rows. The head
    width is a chunk of KA channels plus, if it is not a power of two, one of KB (160 =
    128 + 32). Tokens in a grid-stride loop over program axis 0. H and HD are the dot
    heads (``dot_heads``): a model head of GH > 1 of them sums their dots, and m and l
    ([NG, T, H // GH]) are stored per model head. NORMALISED: A_ptr takes acc / l in its
    half-precision dtype, as from group_fwd_kernel."""
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
            # orientation of P^T in the second dot; queries_left picks the form of the first.
            if QUERIES_LEFT:
                b_s = dot_acc(b_wa, tl.permute(b_xa, (0, 2, 1)), tl.zeros([BH, 2 * SLOTS, BR], dtype=tl.float32), BF16)
                if KB > 0:
                    b_s = dot_acc(b_wb, tl.permute(b_xb, (0, 2, 1)), b_s, BF16)
            else:
                b_s = dot_acc(b_xa, b_wa, tl.zeros([BH, BR, 2 * SLOTS], dtype=tl.float32), BF16)
                if KB > 0:
                    b_s = dot_acc(b_xb, b_wb, b_s, BF16)
                b_s = tl.permute(b_s, (0, 2, 1))
            b_s = _head_sums(b_s, BH, GH, 2 * SLOTS, BR)
            b_rs = tl.rsqrt(b_sq / D + eps) * scale
            b_z = _row_pair_sum(b_s, BH, SLOTS, BR) * b_rs[None, None, :]
            b_z = tl.where(m_r[None, None, :], b_z, float("-inf"))
            b_mn = tl.maximum(b_m, tl.max(b_z, axis=2))
            b_alpha = fast_exp(b_m - b_mn)
            b_p = fast_exp(b_z - b_mn[:, :, None])
            b_l = b_l * b_alpha + tl.sum(b_p, axis=2)
            b_pt = _interleaved_split(b_p, BH, SLOTS, BR, BF16)  # [BH, 2 SLOTS, BR]
            b_scale = tl.reshape(tl.join(b_alpha, b_alpha), [BH, 2 * SLOTS])[:, :, None]
            b_acca = dot_acc(b_pt, b_xa, b_acca * b_scale, BF16)
            if KB > 0:
                b_accb = dot_acc(b_pt, b_xb, b_accb * b_scale, BF16)
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


# The tensor-core phase-1 backward. Per token and head the group's work is a few small
# matrix products over the old rows (docs/kernels.md, "Tensor-core phase 1"): with
# X [rows, head width] a block of the token's rows and Y [head width, 16] holding, for
# slot j, w_j (column 2j) and do_j (column 2j + 1),
#     X @ Y                 -> a_j and dp_j of every row (logit dots, value dots)
#     [kw | p] @ Y^T        -> sum_j kw_j w_j + p_j do_j, the rows' gradient before the RMS
#     [kw | p]^T @ X        -> dL/dw_j (rows 2j)
# and only the RMS terms (r and c = sum_h ds a, which span all heads) stay per element.


# Sizes are not specialised: Triton compiles a size of 1 as a constant, and at the 1B
# width that variant asked for more shared memory than the H200 has (first group, N = 1).
@triton.jit(do_not_specialize=["T", "N", "chunk_lo", "chunk_hi"])
def group_bwd_rows_kernel(
    V_ptr,  # [T, N, D] old rows, strides (stride_vt, stride_vn, 1)
    W_ptr,  # folded queries (folded_operand)
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
            b_ad = dot_split(b_xa, b_xa, b_yah, b_yal, b_ad, BF16, False, BF16)
            if KB > 0:
                b_ad = dot_split(b_xb, b_xb, b_ybh, b_ybl, b_ad, BF16, False, BF16)
            b_ad = _head_sums(b_ad, BH, GH, BR, 2 * SLOTS)
            b_r = tl.rsqrt(b_sq / D + eps)
            b_rs = (b_r * scale)[None, :, None]
            b_a, b_dp = tl.split(tl.reshape(b_ad, [BH, BR, SLOTS, 2]))
            b_p = tl.where(m_r[None, :, None], fast_exp(b_a * b_rs - b_lse[:, None, :]), 0.0)
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
def group_bwd_heads_kernel(
    V_ptr,  # as in group_bwd_rows_kernel
    Z_ptr,  # written by group_bwd_rows_kernel
    DW_ptr,  # [P, NG, D] fp32 per-program partial dL/dw
    T, N, NG, chunk_lo, chunk_hi, stride_vt, stride_vn,
    D: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, BR: tl.constexpr, BHD: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """dL/dw of one head (program axis 1) over a token stride (axis 0) from the rows
    kernel's factors Z: Z^T @ X accumulates in a [16, BHD] dot accumulator, whose even
    rows (tau r ds) are the sites' partials. The rows' gradients are left to
    group_bwd_row_grads_kernel, which may add several groups' factors at once.
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
        b_zh, b_zl = split_operand(tl.load(p_z, mask=m_r[:, None], other=0.0), BF16)
        b_dw = dot_split(tl.trans(b_zh), tl.trans(b_zl), b_xh, b_xl, b_dw, False, BF16, BF16)
    b_dw, _ = tl.split(tl.permute(tl.reshape(b_dw, [SLOTS, 2, BHD]), [0, 2, 1]))
    p_w = DW_ptr + (i_p * NG + site)[:, None] * D + (i_h * HD + o_k)[None, :]
    tl.store(p_w, b_dw, mask=m_s[:, None] & m_k[None, :])


class RowFactors(NamedTuple):
    """The rows' gradients one chunk of a tensor-core phase-1 backward leaves to
    :func:`add_row_grads`: its rows kernel's factors ``z`` [T, N, H, 2 * SLOTS] (H the
    dot heads) and ``kv`` [T, N] fp32 (transient workspace: 69 MB at the 1B shape's
    deepest group), the sites' folded queries as ``folded_operand`` leaves them and
    their output gradients [NG, T, D], and the chunk's sites ``[chunk_lo, chunk_hi)``."""

    z: torch.Tensor
    kv: torch.Tensor
    folded: torch.Tensor
    grad_outs: torch.Tensor
    chunk_lo: int
    chunk_hi: int


def folded_operand(folded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The folded queries [NG, D] fp32 as the dot backward's rows and row-gradient kernels
    read them: for bf16 rows [NG, 2, D] bf16, their rounding and what it misses (the pair
    split_operand forms in a kernel, formed once per group here instead of in each program; two
    elementwise launches, the difference taken in fp32 and rounded once on writing);
    otherwise the fp32 queries themselves."""
    if dtype != torch.bfloat16:
        return folded
    pair = torch.empty((folded.shape[0], 2, folded.shape[1]), dtype=torch.bfloat16, device=folded.device)
    pair[:, 0].copy_(folded)
    torch.sub(folded, pair[:, 0], out=pair[:, 1])
    return pair


def group_forward_dots(sources, queries, norm_weights, num_heads, eps, logit_scale, first_out, config,
                       sites_per_program, partials):  # fmt: skip
    """``phase1.group_forward`` through ``group_fwd_dots_kernel``, into ``partials``: SLOTS
    sites per program (program axis 1), tokens striding over ``config.programs_per_sm``
    programs per SM (axis 0), the heads as ``launch.dot_heads``. It stores site 0's
    partials and finishes site 0 (``first_out``) with a merge of no new rows launched after
    it: finishing it in the kernel would take registers the row blocks need."""
    if sites_per_program or config.block_t != 1 or config.l2_reuse:
        raise ValueError(
            "the tensor-core kernels take num_warps, stages and programs_per_sm as launch overrides; "
            "drop sites_per_program, block_t and l2_reuse or use lookahead_kernels='row_loop'"
        )
    t, n, d = sources.shape
    g = queries.shape[0]
    m, l, acc = partials
    if t == 0:
        return
    split, heads, head_dim, padded_heads = dot_heads(d, num_heads)
    ka, kb = head_chunks(head_dim)
    programs = backward_programs(t, sources.device, config.programs_per_sm)
    group_fwd_dots_kernel[(programs, triton.cdiv(g, SLOTS))](
        sources, queries, norm_weights, m, l, acc,
        t, n, g, sources.stride(0), sources.stride(1), eps, float(logit_scale),
        D=d, H=heads, HD=head_dim, BH=padded_heads, KA=ka, KB=kb, BR=16, GH=split, STAGES=config.stages,
        NORMALISED=acc.dtype != torch.float32,
        QUERIES_LEFT=queries_left(padded_heads, head_dim, sources.element_size()), num_warps=config.num_warps,
    )  # fmt: skip
    if first_out is not None:  # a merge of no new rows, launched here: the kernel's registers are full
        merge_forward(m[0], l[0], acc[0], sources[:, :0], queries[0], norm_weights[0], num_heads, eps,
                      logit_scale, first_out[1], out=first_out[0])  # fmt: skip


def group_backward_dots(
    grad_outs, sources, queries, norm_weights, folded, lse, delta, num_heads, eps, logit_scale, lo, hi,
    num_warps=None, merge_dw=None,
):  # fmt: skip
    """``phase1.group_backward_deferred`` through ``group_bwd_rows_kernel`` (per token, every
    head at once) and ``group_bwd_heads_kernel`` (dL/dw per head), SLOTS sites per launch,
    last chunk first, the heads as ``launch.dot_heads``; each chunk's factors are returned for
    ``row_grads.add_row_grads`` (per dot head)."""
    t, n, d = sources.shape
    g = queries.shape[0]
    device = sources.device
    split, heads, head_dim, padded_heads = dot_heads(d, num_heads)
    bhd = triton.next_power_of_2(head_dim)
    token_programs = head_programs(t, heads, device)
    dw = torch.empty((token_programs, g, d), dtype=torch.float32, device=device)
    if t == 0:
        dw.zero_()
    ka, kb = head_chunks(head_dim)
    rows_config, heads_config = group_bwd_dots_config(padded_heads, head_dim)
    rows_programs = backward_programs(t, device, rows_config.programs_per_sm)
    folded_rows = folded_operand(folded, sources.dtype)
    deferred = []
    for chunk_hi in range(hi, lo, -SLOTS) if t > 0 else ():
        chunk_lo = max(lo, chunk_hi - SLOTS)
        factors = torch.empty((t, n, heads, 2 * SLOTS), dtype=torch.float32, device=device)
        rms_term = torch.empty((t, n), dtype=torch.float32, device=device)
        group_bwd_rows_kernel[(rows_programs,)](
            sources, folded_rows, grad_outs, lse, delta, factors, rms_term, t, n, chunk_lo, chunk_hi,
            sources.stride(0), sources.stride(1), eps, float(logit_scale),
            D=d, H=heads, HD=head_dim, BH=padded_heads, KA=ka, KB=kb, BR=16, GH=split,
            STAGES=rows_config.stages, num_warps=rows_config.num_warps,
        )  # fmt: skip
        group_bwd_heads_kernel[(token_programs, heads)](
            sources, factors, dw, t, n, g, chunk_lo, chunk_hi, sources.stride(0), sources.stride(1),
            D=d, H=heads, HD=head_dim, BR=16, BHD=bhd, STAGES=heads_config.stages,
            num_warps=num_warps or heads_config.num_warps,
        )  # fmt: skip
        deferred.append(RowFactors(factors, rms_term, folded_rows, grad_outs, chunk_lo, chunk_hi))
    dq, dg = reduce_dw(dw, sources, queries, norm_weights, merge_dw)
    return dq[lo:hi], dg[lo:hi], tuple(deferred)
