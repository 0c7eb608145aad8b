"""Fused Triton depth-routing kernels (import name ``mhar_kernels``); torch and triton only.

- ``depth_route``: one routing site, forward and backward (``route_forward``,
  ``route_backward``; ``fused_depth_route`` as an autograd op).
- ``lookahead``: the two-phase schedule's kernels (phase 1 on row loops or tensor cores,
  merges, row gradients).
- ``rows``: row copies between the history buffer and the sublayers.
- ``launch``: the launch rules (tiles, warps, stages, grids by shape); ``primitives``: the
  Triton building blocks the kernels share; ``checks``: argument checks.

The maths, the kernels and their launch rules are described in docs/kernels.md.
"""

from . import lookahead
from .depth_route import FusedDepthRoute, fused_depth_route, route_backward, route_forward
from .launch import LoopConfig
from .lookahead import (
    RowFactors,
    add_row_grads,
    group_backward_deferred,
    group_forward,
    merge_backward,
    merge_dw_partials,
    merge_forward,
    merge_row_grad,
)
from .rows import copy_rows

__all__ = [
    "FusedDepthRoute",
    "LoopConfig",
    "copy_rows",
    "fused_depth_route",
    "route_backward",
    "route_forward",
    *lookahead.__all__,
]
