"""Fused Triton depth routing (the MHAR paper): one pass over the sources forward, two backward.

Semantics are those of ``megatron_mhar.ops.depth_route.depth_route_reference``; the
derivation of the backward, the memory kept between the passes and the rounding
differences are in ``README.md`` beside this file.

Layout. The sources are a ``[T, N, D]`` view with unit stride over D and any strides
over T and N: a slice ``buf[:, :n]`` of a ``[T, R, D]`` history buffer, or the permuted
view of an ``[N, T, D]`` tensor. An optional ``extra`` ``[T, D]`` source takes index N:
the running partial of the block variant, or the delta variant's null source. Each program owns
``BT`` tokens and the full width, held as a ``[BT, BH, BHD]`` tile (heads x head width,
padded to powers of two; forward, a head width that is not a power of two is a tuple
of equal power-of-two chunks instead, ``_chunked_tile``), so the RMS over D and the
per-head dot products are register reductions.

Forward: online softmax over the sources; the norm weight is folded into the query
(``w = q * g``), so the logit of source i for head h is ``tau * r_i * (v_i[h] . w[h])``
with ``r_i`` the inverse RMS of ``v_i``. Only the log-sum-exp ``[T, H]`` fp32 is saved.

Backward: pass 1 recomputes the weights and gets ``delta[h] = sum_i p_i[h] dp_i[h]``;
pass 2 recomputes them again and writes the source gradients. (Taking ``delta`` as
``do[h] . out[h]`` from the bf16 output, as flash attention does, would save pass 1 but
fails the bf16 model test; README.md.) ``dw`` is reduced over tokens in two
deterministic stages (per-program partials, then a fixed-order sum).
"""

import functools
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def _load_tile(p, mask, BHD: tl.constexpr, C: tl.constexpr, EVICT: tl.constexpr):
    """The C chunks of a [BT, BH, C * BHD] tile as loaded, chunk c at ``p + c * BHD``."""
    tile = ()
    for c in tl.static_range(C):
        tile = tile + (tl.load(p + c * BHD, mask=mask, other=0.0, eviction_policy=EVICT),)
    return tile


@triton.jit
def _to_f32(tile, C: tl.constexpr):
    out = ()
    for c in tl.static_range(C):
        out = out + (tile[c].to(tl.float32),)
    return out


@triton.jit
def _store_tile(p, tile, mask, dtype: tl.constexpr, BHD: tl.constexpr, C: tl.constexpr, EVICT: tl.constexpr):
    for c in tl.static_range(C):
        tl.store(p + c * BHD, tile[c].to(dtype), mask=mask, eviction_policy=EVICT)


@triton.jit
def _folded_query(Q_ptr, G_ptr, o_d, mask, dtype: tl.constexpr, BHD: tl.constexpr, C: tl.constexpr):
    """Chunks of w = q * g^ in fp32, g^ the norm weight rounded to the activation dtype
    ``dtype`` first: the reference rounds the normalised key before scaling it by g."""
    b_g = _load_tile(G_ptr + o_d, mask, BHD, C, "")
    b_q = _to_f32(_load_tile(Q_ptr + o_d, mask, BHD, C, ""), C)
    b_w = ()
    for c in tl.static_range(C):
        b_w = b_w + (b_q[c] * b_g[c].to(dtype).to(tl.float32),)
    return b_w


@triton.jit
def _head_sum(b_a, b_b, C: tl.constexpr):
    """Per-head dot products [BT, BH] of two chunked tiles ([BT, BH, BHD], or [BH, BHD]
    chunks on the right, broadcast over the tokens). The chunks' products are added
    elementwise first, so a head costs one reduction across the lanes, not one per chunk."""
    b_prod = b_a[0] * b_b[0]
    for c in tl.static_range(1, C):
        b_prod += b_a[c] * b_b[c]
    return tl.sum(b_prod, axis=2)


@triton.jit
def _inv_rms(b_v, eps, D: tl.constexpr, C: tl.constexpr):
    """Inverse RMS [BT] over the full width of a chunked [BT, BH, BHD] tile."""
    return tl.rsqrt(tl.sum(_head_sum(b_v, b_v, C), axis=1) / D + eps)


LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def _exp(x):
    """e^x for the softmax weights, as one MUFU.EX2 of x log2(e). Triton lowers tl.exp to
    ex2.approx.f32, around which ptxas adds a compare and two predicated multiplies to
    return subnormal results; exp2 lowers to ex2.approx.ftz.f32, the same approximation
    with results below 2^-126 flushed to zero (the same bits above it). Three of the five
    instructions of every weight go: in the row loops an exp per site, head and row."""
    return tl.math.exp2(x * LOG2_E)


@triton.jit
def _route_logits(b_v, b_w, eps, scale, D: tl.constexpr, C: tl.constexpr):
    """Chunked [BT, BH, BHD] source tile, [BH, BHD] folded-query chunks -> (inverse RMS
    [BT], head dots [BT, BH], logits [BT, BH])."""
    b_r = _inv_rms(b_v, eps, D, C)
    b_dot = _head_sum(b_v, b_w, C)  # the query chunks broadcast over the tokens
    b_s = b_dot * (b_r * scale)[:, None]
    return b_r, b_dot, b_s


@triton.jit
def _route_fwd_step(b_v, b_w, b_m, b_l, b_acc, eps, scale, D: tl.constexpr, C: tl.constexpr):
    """Merge one source tile into the running (max, denominator, weighted sum)."""
    _, _, b_s = _route_logits(b_v, b_w, eps, scale, D, C)
    return _softmax_step(b_v, b_s, b_m, b_l, b_acc, C)


@triton.jit
def _softmax_step(b_v, b_s, b_m, b_l, b_acc, C: tl.constexpr):
    """Merge one source tile with logits ``b_s`` [BT, BH] into the running (max,
    denominator, weighted sum)."""
    b_m_new = tl.maximum(b_m, b_s)
    b_alpha = _exp(b_m - b_m_new)
    b_p = _exp(b_s - b_m_new)
    b_l = b_l * b_alpha + b_p
    acc = ()
    for c in tl.static_range(C):
        acc = acc + (b_acc[c] * b_alpha[:, :, None] + b_p[:, :, None] * b_v[c],)
    return b_m_new, b_l, acc


@triton.jit
def _route_fwd_kernel(
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
    b_w = _folded_query(Q_ptr, G_ptr, o_d, m_d, V_ptr.dtype.element_ty, BHD, C)

    b_m = tl.full([BT, BH], float("-inf"), tl.float32)
    b_l = tl.zeros([BT, BH], dtype=tl.float32)
    b_acc = ()
    for c in tl.static_range(C):
        b_acc = b_acc + (tl.zeros([BT, BH, BHD], dtype=tl.float32),)
    p_v = V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :]
    for _ in tl.range(0, N, num_stages=STAGES):
        b_v = _to_f32(_load_tile(p_v, m_v, BHD, C, EVICT_SRC), C)
        b_m, b_l, b_acc = _route_fwd_step(b_v, b_w, b_m, b_l, b_acc, eps, scale, D, C)
        p_v += stride_vn
    if HAS_EXTRA:
        b_e = _load_tile(E_ptr + o_t64[:, None, None] * stride_et + o_d[None, :, :], m_v, BHD, C, "")
        b_m, b_l, b_acc = _route_fwd_step(_to_f32(b_e, C), b_w, b_m, b_l, b_acc, eps, scale, D, C)

    b_o = ()
    for c in tl.static_range(C):
        b_o = b_o + (b_acc[c] / b_l[:, :, None],)
    p_o = O_ptr + o_t64[:, None, None] * stride_ot + o_d[None, :, :]
    _store_tile(p_o, b_o, m_v, O_ptr.dtype.element_ty, BHD, C, "")
    p_lse = LSE_ptr + o_t64[:, None] * H + o_h[None, :]
    tl.store(p_lse, b_m + tl.log(b_l), mask=m_t[:, None] & (o_h[None, :] < H))


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _bwd_head_sums(b_v, b_w, b_do, eps, scale, D: tl.constexpr, C: tl.constexpr, ONE_REDUCE: tl.constexpr):
    """(inverse RMS [BT], head dots v.w, logits, head dots do.v [BT, BH]) of one source
    tile. ``ONE_REDUCE``: the three per-head sums share one reduction. Where a head spans
    warps (H = 1), each reduction is a round trip through shared memory with its barriers
    whatever its operand count: on the H200 the H = 1 backward ran 3-6% faster at 350M /
    1B. With 8 heads it ties, except at D = 4096 (one token, 8 warps), where it ran
    1.60 against 1.19 ms (benchmarks/results/routing_h200_configs_ab.json)."""
    if ONE_REDUCE:
        b_sq = b_v[0] * b_v[0]
        b_vw = b_v[0] * b_w[0]
        b_dv = b_do[0] * b_v[0]
        for c in tl.static_range(1, C):
            b_sq += b_v[c] * b_v[c]
            b_vw += b_v[c] * b_w[c]
            b_dv += b_do[c] * b_v[c]
        b_sq, b_dot, b_dp = tl.reduce((b_sq, b_vw, b_dv), 2, _add3)
        b_r = tl.rsqrt(tl.sum(b_sq, axis=1) / D + eps)
        b_s = b_dot * (b_r * scale)[:, None]
    else:
        b_r, b_dot, b_s = _route_logits(b_v, b_w, eps, scale, D, C)
        b_dp = _head_sum(b_do, b_v, C)
    return b_r, b_dot, b_s, b_dp


@triton.jit
def _route_bwd_sums(b_v, b_w, b_do, b_lse, b_l, b_ld, eps, scale, D: tl.constexpr, C: tl.constexpr,
                    ONE_REDUCE: tl.constexpr):
    """Pass 1: add e_i = exp(s_i - lse) to l and e_i * (dout . v_i) to ld, per head [BT, BH]."""
    _, _, b_s, b_dp = _bwd_head_sums(b_v, b_w, b_do, eps, scale, D, C, ONE_REDUCE)
    b_e = _exp(b_s - b_lse)
    return b_l + b_e, b_ld + b_e * b_dp


@triton.jit
def _grad_factors(b_p, b_ds, b_c, b_r, scale, D: tl.constexpr):
    """Per-head and per-token factors of one source's gradient (README.md, Backward):
    dL/dv = p do + k_w w - k_v v and dL/dw += k_w v, with k_w = tau r ds and
    k_v = tau r^3 c / D (b_c = sum_h ds a), so each term costs one FMA per element."""
    b_rs = b_r * scale
    b_kw = (b_rs[:, None] * b_ds)[:, :, None]
    b_kv = (b_rs * b_c * (b_r * b_r / D))[:, None, None]
    return b_p[:, :, None], b_kw, b_kv


@triton.jit
def _route_bwd_step(b_v, b_w, b_do, b_lse, b_l, b_ld, b_il, b_dw, eps, scale, D: tl.constexpr, C: tl.constexpr,
                    ONE_REDUCE: tl.constexpr):
    """Pass 2: gradient of one source tile, and its share of dL/dw (README.md)."""
    b_r, b_dot, b_s, b_dp = _bwd_head_sums(b_v, b_w, b_do, eps, scale, D, C, ONE_REDUCE)
    b_e = _exp(b_s - b_lse)
    # ds = p (dp - sum_j p_j dp_j) with p = e / l: exact zero for one source.
    b_ds = b_e * (b_dp * b_l - b_ld) * (b_il * b_il)
    b_kp, b_kw, b_kv = _grad_factors(b_e * b_il, b_ds, tl.sum(b_ds * b_dot, axis=1), b_r, scale, D)
    b_dv = ()
    dw = ()
    for c in tl.static_range(C):
        b_dv = b_dv + (b_kp * b_do[c] + b_kw * b_w[c][None, :, :] - b_kv * b_v[c],)
        dw = dw + (b_dw[c] + b_kw * b_v[c],)
    return b_dv, dw


@triton.jit
def _route_bwd_kernel(
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

    b_w = _folded_query(Q_ptr, G_ptr, o_d, m_d, V_ptr.dtype.element_ty, BHD, C)
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
        b_do = _to_f32(_load_tile(p_do, m_v, BHD, C, ""), C)
        p_lse = LSE_ptr + o_t64[:, None] * H + o_h[None, :]
        b_lse = tl.load(p_lse, mask=m_t[:, None] & m_h[None, :], other=0.0)
        p_v = V_ptr + o_t64[:, None, None] * stride_vt + o_d[None, :, :]
        p_e = E_ptr + o_t64[:, None, None] * stride_et + o_d[None, :, :]

        b_l = tl.zeros([BT, BH], dtype=tl.float32)
        b_ld = tl.zeros([BT, BH], dtype=tl.float32)
        p_vn = p_v
        for _ in tl.range(0, N, num_stages=STAGES):
            b_v = _to_f32(_load_tile(p_vn, m_v, BHD, C, EVICT_KEEP), C)
            b_l, b_ld = _route_bwd_sums(b_v, b_w, b_do, b_lse, b_l, b_ld, eps, scale, D, C, ONE_REDUCE)
            p_vn += stride_vn
        if HAS_EXTRA:
            b_v = _to_f32(_load_tile(p_e, m_v, BHD, C, ""), C)
            b_l, b_ld = _route_bwd_sums(b_v, b_w, b_do, b_lse, b_l, b_ld, eps, scale, D, C, ONE_REDUCE)
        b_il = 1.0 / b_l

        p_dv = DV_ptr + o_t64[:, None, None] * stride_dvt + o_d[None, :, :]
        for _ in tl.range(0, N, num_stages=STAGES):
            b_v = _to_f32(_load_tile(p_v, m_v, BHD, C, EVICT_STREAM), C)
            b_dv, b_dw = _route_bwd_step(b_v, b_w, b_do, b_lse, b_l, b_ld, b_il, b_dw, eps, scale, D, C, ONE_REDUCE)
            if ACCUMULATE:
                b_old = _to_f32(_load_tile(p_dv, m_v, BHD, C, EVICT_STREAM), C)
                b_sum = ()
                for c in tl.static_range(C):
                    b_sum = b_sum + (b_dv[c] + b_old[c],)
                b_dv = b_sum
            _store_tile(p_dv, b_dv, m_v, DV_ptr.dtype.element_ty, BHD, C, EVICT_STREAM)
            p_v += stride_vn
            p_dv += stride_dvn
        if HAS_EXTRA:
            b_v = _to_f32(_load_tile(p_e, m_v, BHD, C, ""), C)
            b_dv, b_dw = _route_bwd_step(b_v, b_w, b_do, b_lse, b_l, b_ld, b_il, b_dw, eps, scale, D, C, ONE_REDUCE)
            p_de = DE_ptr + o_t64[:, None, None] * D + o_d[None, :, :]
            _store_tile(p_de, b_dv, m_v, DE_ptr.dtype.element_ty, BHD, C, "")

    for c in tl.static_range(C):
        tl.store(DW_ptr + i_p * D + o_d + c * BHD, tl.sum(b_dw[c], axis=0), mask=m_d)


@triton.jit
def _route_dw_reduce_kernel(
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


# ---------------------------------------------------------------------------------------
# Launch wrappers
# ---------------------------------------------------------------------------------------


def _tile(d: int, num_heads: int) -> Tuple[int, int, int]:
    """(head width, padded head count, padded head width) of a one-chunk register tile."""
    head_dim = d // num_heads
    return head_dim, triton.next_power_of_2(num_heads), triton.next_power_of_2(head_dim)


@functools.lru_cache(maxsize=None)
def _chunked_tile(d: int, num_heads: int) -> Tuple[int, int, int, int]:
    """(head width, padded head count, chunk width, chunks) of the per-site kernels' tile.

    A head width that is not a power of two is held as ``chunks`` power-of-two chunks of
    equal width (160 = 5 x 32 at the 1B shape, 96 = 3 x 32) instead of one chunk padded
    to the next power of two (256: 37.5% idle lanes). Chunks narrower than 32 (64-byte
    loads) or more than 8 of them fall back to the padded chunk.
    """
    head_dim, bh, padded = _tile(d, num_heads)
    width = head_dim & -head_dim  # the largest power of two dividing the head width
    if width == head_dim or width < 32 or head_dim // width > 8:
        return head_dim, bh, padded, 1
    return head_dim, bh, width, head_dim // width


def _tile_width(d: int, num_heads: int) -> int:
    """Width the per-site launch configs are keyed on: the tile's, rounded up to a power
    of two (a chunked 1280-wide tile takes the 2048-wide padded tile's token count)."""
    _, bh, bhd, chunks = _chunked_tile(d, num_heads)
    return triton.next_power_of_2(bh * bhd * chunks)


class LoopConfig(NamedTuple):
    """Launch parameters of a routing kernel."""

    block_t: int  # tokens per program
    num_warps: int
    stages: int  # source loads pipelined through shared memory (tl.range num_stages)
    l2_reuse: bool = False  # L2 eviction hints: keep what a later read of this program needs
    programs_per_sm: int = 4  # backward grid cap (programs stride over the token tiles)

    def override(self, **fields) -> "LoopConfig":
        """This config with the given fields replaced (None keeps the default)."""
        if not fields:
            return self  # the model's path: no new tuple per launch
        return self._replace(**{k: v for k, v in fields.items() if v is not None})


@functools.lru_cache(maxsize=None)
def _fwd_config(padded_d: int) -> LoopConfig:
    """Forward: 4K fp32 per tile at 2 warps (64 per thread), source loads pipelined three
    deep through shared memory; at a 2048-wide tile the same 4K at one warp (128 per
    thread) and four stages.

    Measured on H200 at the paper shapes from CUDA graphs (benchmarks/bench_routing.py
    --sweep, benchmarks/results/routing_h200_sweep.json): 0.98 / 1.00 / 0.67 / 0.82 of
    copy bandwidth at the 100M / 350M / 1B / 8B final sites, against 0.97 / 0.99 / 0.65 /
    0.76 for twice the tile at 4 warps (the same 64 per thread) and 0.85 / 0.85 / 0.57 /
    0.64 for a register prefetch of the next source instead of the pipeline; two stages
    lose 15-20%, four tie; 8 warps lose; evict-first hints on the loads change nothing.
    At the 1B width (1280, a 2048-wide tile; benchmarks/results/routing_h200_configs_ab.json,
    fwdcheck) one warp and four stages measured 0.102 / 0.040 / 0.0167 ms at N = 73 /
    25 / 9 (0.90 / 0.81 / 0.74 of copy bandwidth) against 0.114 / 0.039 / 0.0169 ms for
    one token at 2 warps and 0.125 / 0.045 / 0.0188 ms for the former two tokens at 2
    warps and three stages; with one head (AttnRes) 0.091 against 0.100 ms at N = 73.
    """
    if padded_d == 2048:
        return LoopConfig(2, 1, 4)
    block_t = max(1, 4096 // padded_d)
    return LoopConfig(block_t, max(2, min(8, block_t * padded_d // 2048)), 3)


@functools.lru_cache(maxsize=None)
def _bwd_config(padded_d: int, one_head: bool = False) -> LoopConfig:
    """Backward: 2 warps, 1K fp32 per tile (it holds dout, v, dw and the gradient) and
    8 programs per SM, or one token and 4 programs per SM at widths of 2048; both source
    loops pipelined two deep. One head (AttnRes, H = 1) of 1024 or 2048 takes a 4K tile
    with 4 programs per SM.

    Measured on H200 from CUDA graphs (benchmarks/results/routing_h200_configs_ab.json):
    0.701 / 0.692 / 0.856 ms at the 100M / 350M / 1B final sites (0.85 / 0.84 / 0.63 of
    copy bandwidth) against 0.724 / 0.707 / 0.876 ms for the former 2K tile at 4 warps
    and 4 programs per SM; at 2 warps the 1K tile needs 8 programs per SM (4: 0.95 ms at
    100M) and twice the tile loses 5-30%. One head: 0.713 / 0.672 / 0.672 ms against
    0.741 / 0.729 / 0.836 ms, the 1B width gaining most. There a token's row spans both
    warps of the program (TTGIR of an sm_90 compile), so every sum over it is a trip
    through shared memory; a likely cause of the gain is that each trip's barriers now
    serve two tokens instead of one (not profiled). With 8 heads the same two tokens
    measured 1.11 ms: the warps hold heads, and the tile doubles every thread's registers.
    Earlier sweeps (routing_h200_sweep.json): one or three stages lose 10-15%, the
    register prefetch 10%, the L2 hints tie. At D = 4096 one token, 8 warps, plain loops,
    L2 eviction hints (pass 2 rereads what pass 1 asked L2 to keep; the gradient streams)
    and 2 programs per SM: 1.22 ms at the 8B shape, against 1.31 ms without the hints,
    1.38 ms with three stages and 1.55 ms with the register prefetch.

    At the 1B width (1280 padded to 2048) the source loops are pipelined three deep: 1B
    final site 0.858 -> 0.672 ms (0.63 -> 0.81 of copy bandwidth), N = 9 0.117 -> 0.095 ms
    (0.58 -> 0.72), from CUDA graphs (routing_h200_bwd_stages_1b.json, stop 37; the earlier
    sweep had tried three stages there only at 2, 3 and 6 programs per SM). At 350M, N = 9,
    three stages lose (0.142 -> 0.162 ms)."""
    if padded_d > 2048:
        return LoopConfig(1, 8, 1, l2_reuse=True, programs_per_sm=2)
    if one_head and padded_d >= 1024:
        return LoopConfig(4096 // padded_d, 2, 2, programs_per_sm=4)
    block_t = max(1, 1024 // padded_d)
    stages = 3 if padded_d == 2048 else 2
    return LoopConfig(block_t, 2, stages, programs_per_sm=8 if block_t * padded_d <= 1024 else 4)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _check_sources(sources: torch.Tensor, extra: Optional[torch.Tensor], num_heads: int) -> None:
    if sources.dim() != 3 or sources.stride(-1) != 1:
        raise ValueError(
            f"sources must be a [T, N, D] view with unit stride over D, got shape "
            f"{tuple(sources.shape)} strides {sources.stride()}"
        )
    t, _, d = sources.shape
    if d % num_heads != 0:
        raise ValueError(f"width D={d} is not divisible by num_heads={num_heads}")
    if extra is not None:
        if extra.shape != (t, d) or extra.stride(-1) != 1 or extra.dtype != sources.dtype:
            raise ValueError(
                f"extra must be a [T, D]=[{t}, {d}] tensor of dtype {sources.dtype} with unit "
                f"stride over D, got {tuple(extra.shape)} {extra.dtype} strides {extra.stride()}"
            )


def _launch_fwd(sources, extra, query, norm_weight, num_heads, eps, logit_scale, **loop):
    t, n, d = sources.shape
    head_dim, bh, bhd, chunks = _chunked_tile(d, num_heads)
    block_t, num_warps, stages, l2_reuse, _ = _fwd_config(_tile_width(d, num_heads)).override(**loop)
    out = torch.empty((t, d), dtype=sources.dtype, device=sources.device)
    lse = torch.empty((t, num_heads), dtype=torch.float32, device=sources.device)
    if t == 0:
        return out, lse
    ext = sources if extra is None else extra
    _route_fwd_kernel[(triton.cdiv(t, block_t),)](
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
    grad_sources, accumulate, **loop,
):  # fmt: skip
    t, n, d = sources.shape
    # One padded chunk: measured on H200 at the 1B shape, the chunked tile's backward was
    # slower (history 0.907 against 0.885 ms, fused 0.740 against 0.675 ms;
    # benchmarks/results/routing_h200_chunked.json), while its forward is faster.
    head_dim, bh, bhd = _tile(d, num_heads)
    chunks = 1
    block_t, num_warps, stages, l2_reuse, programs_per_sm = _bwd_config(
        bh * bhd, num_heads == 1
    ).override(**loop)
    device = sources.device
    has_extra = extra is not None
    grad_extra = torch.empty((t, d), dtype=sources.dtype, device=device) if has_extra else None
    num_tiles = triton.cdiv(t, block_t)
    num_programs = max(1, min(num_tiles, _num_sms(device) * programs_per_sm))
    dw = torch.empty((num_programs, d), dtype=torch.float32, device=device)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    if t > 0:
        ext = sources if extra is None else extra
        _route_bwd_kernel[(num_programs,)](
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
    _route_dw_reduce_kernel[(triton.cdiv(d, block_d),)](
        dw, sources, query, norm_weight, grad_query, grad_norm, num_programs,
        D=d, BP=32, BD=block_d, num_warps=4,
    )  # fmt: skip
    return grad_extra, grad_query, grad_norm


# ---------------------------------------------------------------------------------------
# Backend interface (mirrors megatron_mhar.ops.depth_route.torch_route_forward/backward)
# ---------------------------------------------------------------------------------------


def route_forward(
    sources: torch.Tensor,
    extra: Optional[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
    **loop,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Route over a history view in one pass.

    Args:
        sources: [T, N, D] view, unit stride over D, any strides over T and N.
        extra: None or [T, D], routed as source N (the block variant's running partial,
            or the delta variant's null source).
        query, norm_weight: [D] (any float dtype).
        loop: :class:`LoopConfig` fields overriding the default launch (tools/perf).

    Returns:
        (out [T, D] in the sources' dtype, saved = log-sum-exp [T, H] fp32).
    """
    _check_sources(sources, extra, num_heads)
    return _launch_fwd(sources, extra, query, norm_weight, num_heads, eps, float(logit_scale), **loop)


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
    **loop,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Backward of :func:`route_forward`; adds the source gradients into ``grad_sources``.

    Args:
        grad_out: [T, D] gradient of the routed output.
        saved: the log-sum-exp returned by :func:`route_forward`.
        grad_sources: fp32 [T, N, D] view (unit stride over D) that receives ``+=`` dsources.
        loop: :class:`LoopConfig` fields overriding the default launch (tools/perf).

    Returns:
        (grad_extra [T, D] in the extra's dtype or None, grad_query, grad_norm_weight [D]
        in the dtypes of query and norm_weight).
    """
    _check_sources(sources, extra, num_heads)
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
        float(logit_scale), grad_sources, accumulate=True, **loop,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------
# Autograd Function and public op
# ---------------------------------------------------------------------------------------


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
