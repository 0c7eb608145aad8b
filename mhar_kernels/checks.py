"""Argument checks shared by the launch wrappers: what a kernel cannot take is refused by
name before anything is launched."""

from typing import Optional

import torch


def check_sources(sources: torch.Tensor, extra: Optional[torch.Tensor], num_heads: int) -> None:
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


def check_output(name: str, out: torch.Tensor, t: int, d: int, dtype: torch.dtype) -> None:
    """A routed output the caller gives: [T, D] in the sources' dtype, unit stride over D."""
    if out.shape != (t, d) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"{name} must be [{t}, {d}] {dtype} with unit stride over D, "
                         f"got {tuple(out.shape)} {out.dtype} with strides {out.stride()}")  # fmt: skip
