"""Fused Triton kernels of two-phase ("lookahead") depth routing.

Semantics are those of the reference backend in
``megatron_mhar.ops.lookahead_reference`` (same functions, same signatures); the schedule, the derivation and the memory are in
docs/kernels.md ("Two-phase routing"). A group of G consecutive routing sites reads the
rows written before its first site once (phase 1: ``group_forward``), each site then
folds in the few rows written since (``merge_forward``); backward, each site's merge
(``merge_backward``), the new rows' gradients when due (``merge_row_grad``), then one
phase-1 backward for the group (``group_backward_deferred``) whose deferred old-row
gradients are added when due (``add_row_grads``).

dquery/dnorm are reduced over tokens in two deterministic stages (per-program partials,
then a fixed-order sum); no atomics.
"""

from .merges import merge_backward, merge_dw_partials, merge_forward
from .phase1 import group_backward_deferred, group_forward
from .phase1_dots import RowFactors
from .row_grads import add_row_grads, merge_row_grad

__all__ = [
    "RowFactors",
    "add_row_grads",
    "group_backward_deferred",
    "group_forward",
    "merge_backward",
    "merge_dw_partials",
    "merge_forward",
    "merge_row_grad",
]
