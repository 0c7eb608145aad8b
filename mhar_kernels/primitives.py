"""Triton building blocks shared by the routing kernels (device code only).

Register tiles. A token tile is held as ``[BT, BH, BHD]`` (tokens x heads x head width,
padded to powers of two) or, where the head width is not a power of two, as a tuple of
``C`` equal power-of-two chunks of it (``C = 1``: one padded chunk), so the RMS over the
width and the per-head dot products are register reductions. The norm weight is folded
into the query (``w = q * g^``, ``g^`` rounded to the activation dtype as the reference
rounds the normalised key), so the logit of source i for head h is
``tau * r_i * (v_i[h] . w[h])`` with ``r_i`` the inverse RMS of ``v_i``.

Tensor-core operands. The phase-1 dot kernels, and the row-gradient kernel that adds
their factors, take ``SLOTS`` sites per launch as the columns of one operand; bf16 rows
run bf16 dots with the fp32 side split into a bf16 pair (``split_operand``), fp32 rows
IEEE fp32 dots. docs/kernels.md derives what each computes.
"""

import triton
import triton.language as tl


@triton.jit
def load_tile(p, mask, BHD: tl.constexpr, C: tl.constexpr, EVICT: tl.constexpr):
    """The C chunks of a [BT, BH, C * BHD] tile as loaded, chunk c at ``p + c * BHD``."""
    tile = ()
    for c in tl.static_range(C):
        tile = tile + (tl.load(p + c * BHD, mask=mask, other=0.0, eviction_policy=EVICT),)
    return tile


@triton.jit
def to_f32(tile, C: tl.constexpr):
    out = ()
    for c in tl.static_range(C):
        out = out + (tile[c].to(tl.float32),)
    return out


@triton.jit
def store_tile(p, tile, mask, dtype: tl.constexpr, BHD: tl.constexpr, C: tl.constexpr, EVICT: tl.constexpr):
    for c in tl.static_range(C):
        tl.store(p + c * BHD, tile[c].to(dtype), mask=mask, eviction_policy=EVICT)


@triton.jit
def folded_query(Q_ptr, G_ptr, o_d, mask, dtype: tl.constexpr, BHD: tl.constexpr, C: tl.constexpr):
    """Chunks of w = q * g^ in fp32, g^ the norm weight rounded to the activation dtype
    ``dtype`` first: the reference rounds the normalised key before scaling it by g."""
    b_g = load_tile(G_ptr + o_d, mask, BHD, C, "")
    b_q = to_f32(load_tile(Q_ptr + o_d, mask, BHD, C, ""), C)
    b_w = ()
    for c in tl.static_range(C):
        b_w = b_w + (b_q[c] * b_g[c].to(dtype).to(tl.float32),)
    return b_w


@triton.jit
def head_sum(b_a, b_b, C: tl.constexpr):
    """Per-head dot products [BT, BH] of two chunked tiles ([BT, BH, BHD], or [BH, BHD]
    chunks on the right, broadcast over the tokens). The chunks' products are added
    elementwise first, so a head costs one reduction across the lanes, not one per chunk."""
    b_prod = b_a[0] * b_b[0]
    for c in tl.static_range(1, C):
        b_prod += b_a[c] * b_b[c]
    return tl.sum(b_prod, axis=2)


@triton.jit
def inv_rms(b_v, eps, D: tl.constexpr, C: tl.constexpr):
    """Inverse RMS [BT] over the full width of a chunked [BT, BH, BHD] tile."""
    return tl.rsqrt(tl.sum(head_sum(b_v, b_v, C), axis=1) / D + eps)


LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def fast_exp(x):
    """e^x for the softmax weights, as one MUFU.EX2 of x log2(e). Triton lowers tl.exp to
    ex2.approx.f32, around which ptxas adds a compare and two predicated multiplies to
    return subnormal results; exp2 lowers to ex2.approx.ftz.f32, the same approximation
    with results below 2^-126 flushed to zero (the same bits above it). Three of the five
    instructions of every weight go: in the row loops an exp per site, head and row."""
    return tl.math.exp2(x * LOG2_E)


@triton.jit
def route_logits(b_v, b_w, eps, scale, D: tl.constexpr, C: tl.constexpr):
    """Chunked [BT, BH, BHD] source tile, [BH, BHD] folded-query chunks -> (inverse RMS
    [BT], head dots [BT, BH], logits [BT, BH])."""
    b_r = inv_rms(b_v, eps, D, C)
    b_dot = head_sum(b_v, b_w, C)  # the query chunks broadcast over the tokens
    b_s = b_dot * (b_r * scale)[:, None]
    return b_r, b_dot, b_s


@triton.jit
def route_fwd_step(b_v, b_w, b_m, b_l, b_acc, eps, scale, D: tl.constexpr, C: tl.constexpr):
    """Merge one source tile into the running (max, denominator, weighted sum)."""
    _, _, b_s = route_logits(b_v, b_w, eps, scale, D, C)
    return softmax_step(b_v, b_s, b_m, b_l, b_acc, C)


@triton.jit
def softmax_step(b_v, b_s, b_m, b_l, b_acc, C: tl.constexpr):
    """Merge one source tile with logits ``b_s`` [BT, BH] into the running (max,
    denominator, weighted sum)."""
    b_m_new = tl.maximum(b_m, b_s)
    b_alpha = fast_exp(b_m - b_m_new)
    b_p = fast_exp(b_s - b_m_new)
    b_l = b_l * b_alpha + b_p
    acc = ()
    for c in tl.static_range(C):
        acc = acc + (b_acc[c] * b_alpha[:, :, None] + b_p[:, :, None] * b_v[c],)
    return b_m_new, b_l, acc


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def bwd_head_sums(b_v, b_w, b_do, eps, scale, D: tl.constexpr, C: tl.constexpr, ONE_REDUCE: tl.constexpr):
    """(inverse RMS [BT], head dots v.w, logits, head dots do.v [BT, BH]) of one source
    tile. ``ONE_REDUCE`` (one head): the three per-head sums share one reduction. Where a
    head spans warps, each reduction is a round trip through shared memory with its barriers
    whatever its operand count, so one trip serves all three."""
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
        b_r, b_dot, b_s = route_logits(b_v, b_w, eps, scale, D, C)
        b_dp = head_sum(b_do, b_v, C)
    return b_r, b_dot, b_s, b_dp


@triton.jit
def grad_factors(b_p, b_ds, b_c, b_r, scale, D: tl.constexpr):
    """Per-head and per-token factors of one source's gradient (docs/kernels.md, Backward):
    dL/dv = p do + k_w w - k_v v and dL/dw += k_w v, with k_w = tau r ds and
    k_v = tau r^3 c / D (b_c = sum_h ds a), so each term costs one FMA per element."""
    b_rs = b_r * scale
    b_kw = (b_rs[:, None] * b_ds)[:, :, None]
    b_kv = (b_rs * b_c * (b_r * b_r / D))[:, None, None]
    return b_p[:, :, None], b_kw, b_kv


@triton.jit
def token_tile(i_t, T, H: tl.constexpr, HD: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
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
def store_output(O_ptr, p_lse, b_m, b_l, b_acc, o_t64, o_d, stride_ot, m_v, m_th):
    """Normalise a site's finished online-softmax state ([BT, BH] m and l, [BT, BH, BHD]
    acc) into its output rows and store its log-sum-exp at ``p_lse``: what a merge ends
    with, and what phase 1 ends with for a group's first site."""
    b_o = b_acc / b_l[:, :, None]
    p_o = O_ptr + o_t64[:, None, None] * stride_ot + o_d[None, :, :]
    tl.store(p_o, b_o.to(O_ptr.dtype.element_ty), mask=m_v)
    tl.store(p_lse, b_m + tl.log(b_l), mask=m_th)


SLOTS = tl.constexpr(8)  # sites per launch: Y has 2 x SLOTS = 16 columns, the smallest dot width


@triton.jit
def split_operand(x, BF16: tl.constexpr):
    """An fp32 tile as a dot operand pair (hi, lo): for bf16 rows hi + lo in bf16
    (x - hi - lo ~ 2^-16 |x|), otherwise the fp32 tile itself (lo unused)."""
    if BF16:
        hi = x.to(tl.bfloat16)
        pair = (hi, (x - hi.to(tl.float32)).to(tl.bfloat16))
    else:
        pair = (x, x)
    return pair


@triton.jit
def dot_acc(a, b, acc, BF16: tl.constexpr):
    """a @ b + acc in fp32: bf16 operands on bf16 tensor cores, fp32 ones as IEEE fp32."""
    if BF16:
        acc = tl.dot(a, b, acc)
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    return acc


@triton.jit
def dot_split(a_hi, a_lo, b_hi, b_lo, acc, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr, BF16: tl.constexpr):
    """a @ b + acc from split_operand operands. bf16 rows: a_hi b_hi + a_lo b_hi + a_hi b_lo on
    bf16 tensor cores, about 2^-16 relative; *_EXACT: that operand is a bf16 tile, its lo
    part unused. Otherwise (fp32 rows) one IEEE fp32 dot."""
    acc = dot_acc(a_hi, b_hi, acc, BF16)
    if BF16:
        if not B_EXACT:
            acc = tl.dot(a_hi, b_lo, acc)
        if not A_EXACT:
            acc = tl.dot(a_lo, b_hi, acc)
    return acc


@triton.jit
def slot_operand(W_ptr, DO_ptr, t, T, o_c, o_d, mask, D: tl.constexpr, chunk_lo, chunk_hi,
                 BF16: tl.constexpr):  # fmt: skip
    """The backward's Y operand of token t as a split_operand pair, at broadcastable slot columns
    ``o_c`` and channel offsets ``o_d``: column 2j is w of slot j (site chunk_hi - 1 - j),
    column 2j + 1 its output gradient; slots below chunk_lo and ``mask``ed channels are
    zero. W_ptr: the folded queries as ``folded_operand`` leaves them. bf16 rows: the
    pair is loaded as the dots take it, w's rounding and the output gradients by one load,
    w's remainder by another, without the fp32 arithmetic of a split_operand in every program
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
        pair = split_operand(b_w + tl.load(p_do, mask=mask & is_do, other=0.0).to(tl.float32), BF16)
    return pair
