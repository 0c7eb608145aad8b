"""Row copies of the source history: a sublayer output into its row of the ``[T, R, D]``
buffer, and a row's fp32 gradient out as the sublayer's gradient in its dtype.

A history row is a ``[T, D]`` view whose token stride is ``R * D``; torch's copy of such
a view takes its generic strided path. These kernels move ``[BT, BD]`` tiles with the
token stride as a runtime argument and the channels contiguous, so every row of a tile
is one vectorised access whatever R is (tile: ``launch.copy_tile``).
"""

import torch
import triton
import triton.language as tl

from .launch import copy_tile


@triton.jit
def copy_rows_kernel(
    SRC_ptr,  # [T, D], strides (stride_st, 1)
    DST_ptr,  # [T, D], strides (stride_dt, 1); the values are cast to its dtype
    T,
    stride_st,
    stride_dt,
    D: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = (o_t < T)[:, None] & (o_d < D)[None, :]
    o_t64 = o_t.to(tl.int64)[:, None]
    b_x = tl.load(SRC_ptr + o_t64 * stride_st + o_d[None, :], mask=mask)
    tl.store(DST_ptr + o_t64 * stride_dt + o_d[None, :], b_x.to(DST_ptr.dtype.element_ty), mask=mask)


def copy_rows(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two ``[T, D]`` views with unit stride over D (any token
    strides), casting to ``dst``'s dtype."""
    if src.shape != dst.shape or src.dim() != 2:
        raise ValueError(f"copy_rows needs two [T, D] views of one shape, got {tuple(src.shape)} "
                         f"and {tuple(dst.shape)}")  # fmt: skip
    if src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError(f"copy_rows needs unit stride over D, got strides {src.stride()} and {dst.stride()}")
    t, d = src.shape
    if t == 0 or d == 0:
        return
    block_t, block_d = copy_tile(d)
    copy_rows_kernel[(triton.cdiv(t, block_t), triton.cdiv(d, block_d))](
        src, dst, t, src.stride(0), dst.stride(0), D=d, BT=block_t, BD=block_d, num_warps=4,
    )  # fmt: skip
