"""Row gradients of the lookahead schedule, added when a row's gradient is due.

- ``merge_row_grad``: one new row's gradient from the factors every merge reading it
  left (``merges.merge_backward``) and its fp32 gradient from the other reads, written
  once in any dtype.
- ``add_row_grads``: the old rows' gradients that tensor-core phase-1 backwards deferred
  (``phase1_dots.RowFactors``), several groups' at once: one read-modify-write of each
  row's fp32 gradient for all of them.

Launch rules: ``launch.merge_row_grad_config``; ``add_row_grads`` takes its launch
(warps, stages, token programs per SM) as arguments.
"""

from typing import Sequence, Tuple

import torch
import triton
import triton.language as tl

from ..launch import ROW_GRADS_ENTRIES, head_chunks, head_programs, merge_row_grad_config, overrides, row_grads_config, tile
from ..primitives import SLOTS, dot_split, folded_query, slot_operand, split_operand, token_tile
from .phase1_dots import RowFactors


# Indices and sizes are not specialised: each value of 1 would be its own compile.
@triton.jit(do_not_specialize=["T", "R", "index", "site_lo", "site_hi"])
def merge_bwd_row_grad_kernel(
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
    _, o_h, o_d, m_d, m_t, m_v, m_th, o_t64 = token_tile(tl.program_id(0), T, H, HD, BT, BH, BHD)
    p_td = o_t64[:, None, None] * D + o_d[None, :, :]
    b_v = tl.load(V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :], mask=m_v, other=0.0)
    if ACCUMULATE:
        b_acc = tl.load(G_ptr + o_t64[:, None, None] * stride_gt + o_d[None, :, :], mask=m_v, other=0.0)
    else:
        b_acc = tl.zeros([BT, BH, BHD], dtype=tl.float32)
    b_v = b_v.to(tl.float32)
    for k in tl.range(0, site_hi - site_lo, num_stages=STAGES):
        j = site_hi - 1 - k
        b_w = folded_query(Q_ptr + j * D, N_ptr + j * D, o_d, m_d, V_ptr.dtype.element_ty, BHD, 1)[0]
        b_do = tl.load(DO_ptr + (j * T).to(tl.int64) * D + p_td, mask=m_v, other=0.0).to(tl.float32)
        o_tr = (j * T + o_t64) * R + index
        p_f = F_ptr + (o_tr[:, None] * H + o_h[None, :]) * 2
        b_p = tl.load(p_f, mask=m_th, other=0.0)
        b_rds = tl.load(p_f + 1, mask=m_th, other=0.0)
        b_kv = tl.load(KV_ptr + o_tr, mask=m_t, other=0.0)
        b_acc += b_p[:, :, None] * b_do + b_rds[:, :, None] * b_w[None, :, :] - b_kv[:, None, None] * b_v
    tl.store(O_ptr + o_t64[:, None, None] * stride_ot + o_d[None, :, :], b_acc.to(O_ptr.dtype.element_ty), mask=m_v)


@triton.jit
def _head_site_rows(W_ptr, DO_ptr, t, T, i_h, k0, K: tl.constexpr, HD: tl.constexpr, D: tl.constexpr,
                    chunk_lo, chunk_hi, BF16: tl.constexpr):  # fmt: skip
    """Y^T [2 * SLOTS, K] of token t over the channels [k0, k0 + K) of head i_h
    (slot_operand's columns as rows)."""
    o_k = k0 + tl.arange(0, K)
    o_c = tl.arange(0, 2 * SLOTS)[:, None]
    return slot_operand(W_ptr, DO_ptr, t, T, o_c, i_h * HD + o_k[None, :], (o_k < HD)[None, :], D,
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


@triton.jit(do_not_specialize=["T", "start", "stop"])
def group_bwd_row_grads_kernel(
    V_ptr,  # [T, R, D] the history's rows from row 0, strides (stride_vt, stride_vn, 1)
    DV_ptr,  # [T, R, D] fp32 their gradients (+=), strides (stride_dvt, stride_dvn, 1)
    Z, KV, W, DO,  # J-tuples, per entry (one chunk of a phase-1 backward): its rows kernel's
    # Z [T, N_j, H, 2 * SLOTS] and kv [T, N_j] fp32, folded queries (folded_operand) and
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
    tokens and run one loop over their (token, block, entry) triples, so the pipeline does
    not drain at every block, and a block's entries are summed in the same order whichever
    program runs it. Every entry's operands are whole tiles (Z [BR, 2 * SLOTS], Y
    [2 * SLOTS, head width]) loaded at once and multiplied as one dot, so a program has a
    few independent loads per entry in flight instead of a chain of small ones per slot.
    The folded queries come as the bf16 pair the dots take (``phase1_dots.folded_operand``),
    so no program forms it."""
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
        b_zh, b_zl = split_operand(tl.load(p_zt, mask=m_j[:, None], other=0.0), BF16)
        b_yh, b_yl = _head_site_rows(p_w, p_do, t, T, i_h, 0, KA, HD, D, lo, hi, BF16)
        b_acca = dot_split(b_zh, b_zl, b_yh, b_yl, b_acca, False, False, BF16)
        if KB > 0:
            b_yh, b_yl = _head_site_rows(p_w, p_do, t, T, i_h, KA, KB, HD, D, lo, hi, BF16)
            b_accb = dot_split(b_zh, b_zl, b_yh, b_yl, b_accb, False, False, BF16)
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
) -> None:
    """A new row's gradient from the factors its group's merges left
    (:func:`merge_backward`) and its fp32 gradient from every other read, written into
    ``out`` in ``out``'s dtype (``out`` may be ``row_grad``): one read of the fp32
    gradient (none with ``accumulate`` False, where no other read added one) and of each
    site's output gradient, one write. Arguments as the reference's
    (``megatron_mhar.ops.lookahead_reference.torch_merge_row_grad``); ``row``, ``row_grad`` and
    ``out`` [T, D] with unit stride over D, the group's tensors contiguous."""
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
    head_dim, bh, bhd = tile(d, num_heads)
    block_t, num_warps, stages, _, _ = merge_row_grad_config(bh * bhd).override(**overrides("merge_row_grad"))
    merge_bwd_row_grad_kernel[(triton.cdiv(t, block_t),)](
        row, row_grad, out, grad_outs, queries, norm_weights, factors, kv,
        t, r, index, lo, hi, row.stride(0), row_grad.stride(0), out.stride(0),
        D=d, H=num_heads, HD=head_dim, BT=block_t, BH=bh, BHD=bhd, STAGES=stages, ACCUMULATE=accumulate,
        num_warps=num_warps,
    )  # fmt: skip


def add_row_grads(
    deferred: Sequence[Tuple[Sequence[RowFactors], int]],
    sources: torch.Tensor,
    grad_sources: torch.Tensor,
    start: int,
    accumulate: bool = True,
) -> None:
    """Add deferred phase-1 gradients to rows ``[start, owed)`` of the history.

    Args:
        deferred: (factors of one ``group_backward_deferred``, owed) pairs, added in
            order; each adds to the rows ``[start, owed)`` (owed at most its N).
        sources, grad_sources: [T, R, D] the rows from row 0 and their fp32 gradients.
        accumulate: False where the rows ``[start, max owed)`` hold no gradient yet: the
            sums are stored, the gradients not read.

    Launch: ``launch.row_grads_config`` (``launch.overridden`` sets others); ``programs_per_sm
    * SMs / H`` token programs per head stride over the tokens."""
    config = row_grads_config().override(**overrides("add_row_grads"))
    block_rows, num_warps, stages, _, programs_per_sm = config
    entries = [(f, owed) for factors, owed in deferred for f in factors if owed > start]
    if not entries or sources.shape[0] == 0:
        return
    t, _, d = sources.shape
    num_heads = entries[0][0].z.shape[2]
    head_dim = d // num_heads
    ka, kb = head_chunks(head_dim)
    stop = max(owed for _, owed in entries)
    programs = head_programs(t, num_heads, sources.device, programs_per_sm)
    for i in range(0, len(entries), ROW_GRADS_ENTRIES):
        batch = entries[i : i + ROW_GRADS_ENTRIES]
        z, kv, folded, grad_outs, chunk_lo, chunk_hi = [tuple(x) for x in zip(*(f for f, _ in batch))]
        group_bwd_row_grads_kernel[(programs, num_heads)](
            sources, grad_sources, z, kv, folded, grad_outs,
            tuple(f.z.shape[1] for f, _ in batch), tuple(owed for _, owed in batch), chunk_lo, chunk_hi,
            t, start, stop, sources.stride(0), sources.stride(1), grad_sources.stride(0), grad_sources.stride(1),
            D=d, H=num_heads, HD=head_dim, BR=block_rows, KA=ka, KB=kb, J=len(batch),
            ACCUMULATE=accumulate or i > 0, num_warps=num_warps, num_stages=stages,
        )  # fmt: skip
