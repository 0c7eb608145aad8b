"""Configuration of the depth routing that replaces (or corrects) the residual stream."""

import dataclasses
import math
from typing import Optional

from megatron_mhar.ops.depth_route import IMPLS
from megatron_mhar.ops.routing_layout import layout_error
from megatron_mhar.ops.schedules import LOOKAHEAD_KERNELS, ROUTING_SCHEDULES

VARIANTS = ("none", "full", "block", "delta")
EXECUTION_FIELDS = ("kernel_impl", "routing_schedule", "lookahead_group", "lookahead_kernels", "pipeline_cache")
"""MHARConfig fields that choose how routing runs, not what it computes: a checkpoint or a
converted model may be loaded with other values."""


def function_fields(mhar: dict) -> dict:
    """An MHARConfig as a dict, without :data:`EXECUTION_FIELDS`: what defines the model."""
    return {k: v for k, v in mhar.items() if k not in EXECUTION_FIELDS}


@dataclasses.dataclass
class MHARConfig:
    """How the decoder routes over depth (the MHAR paper: multi-head routing and its variants)."""

    variant: str = "full"
    """``none`` (plain Megatron GPT), ``full`` (every sublayer output is a source),
    ``block`` (sources are sums of blocks of sublayers) or ``delta`` (gated correction)."""

    num_heads: int = 8
    """Routing heads H; must divide the hidden size. H = 1 is Attention Residuals."""

    block_size: int = 8
    """Block variant: sublayers (not decoder layers) per block; each decoder layer has two."""

    delta_block_layers: int = 4
    """Delta variant: decoder layers per block; each completed block adds one source."""

    eps: Optional[float] = None
    """RMSNorm epsilon of the routing keys; ``None`` takes the model's ``layernorm_epsilon``."""

    logit_scale: float = 1.0
    """tau multiplying every routing logit; 1 is the paper, H restores single-head speed."""

    kernel_impl: str = "auto"
    """``auto`` (Triton on CUDA, else torch), ``torch`` (the reference) or ``triton``."""

    routing_schedule: str = "per_site"
    """``per_site`` (every site reads all its sources) or ``lookahead`` (groups of sites read the
    older sources once, as the paper's fused kernel does; the block and delta variants' groups
    are their blocks; see megatron_mhar/ops/lookahead_reference.py)."""

    lookahead_group: int = 0
    """Sites per lookahead group of the full variant; 0 picks the integer nearest sqrt(0.84 (2L + 1)), measured
    best on the H200 at the paper's sizes (``megatron_mhar.ops.schedules.auto_group_size``)."""

    lookahead_kernels: str = "auto"
    """Triton kernels of the lookahead schedule's phase 1: ``row_loop`` (the sites in
    registers, one row at a time), ``tensor_cores`` (dots per token and head) or ``auto``
    (per group and direction, the family the launch rules pick: docs/kernels.md; the block
    and delta variants' is the row loops, ``megatron_mhar.ops.schedules.phase1_kernels``)."""

    pipeline_cache: bool = True
    """Cross-stage caching of the source history under interleaved (virtual) pipelines: a rank
    keeps, per micro-batch, the sources its earlier chunk held, and a stage boundary sends only
    the sources the receiving rank has not seen. No effect without virtual pipeline stages."""

    def __post_init__(self):
        _require_choice("variant", self.variant, VARIANTS)
        _require_int("num_heads", self.num_heads, 1, "must be a positive integer")
        _require_int("block_size", self.block_size, 1,
                     "counts sublayers and must be a positive integer")
        _require_int("delta_block_layers", self.delta_block_layers, 1,
                     "counts decoder layers and must be a positive integer")
        _require_int("lookahead_group", self.lookahead_group, 0,
                     "must be a non-negative integer (0 = auto)")
        if self.eps is not None and not _positive_finite(self.eps):
            raise ValueError(f"mhar.eps must be a positive finite number (or None for the model's), got {self.eps!r}")
        if not _positive_finite(self.logit_scale):
            raise ValueError(f"mhar.logit_scale must be a positive finite number, got {self.logit_scale!r}")
        _require_choice("kernel_impl", self.kernel_impl, IMPLS)
        _require_choice("routing_schedule", self.routing_schedule, ROUTING_SCHEDULES)
        _require_choice("lookahead_kernels", self.lookahead_kernels, LOOKAHEAD_KERNELS)
        _require_choice("pipeline_cache", self.pipeline_cache, (True, False))
        if self.routing_schedule == "lookahead" and self.variant == "none":
            raise ValueError(
                "mhar.routing_schedule='lookahead' needs a routed variant (full, block or delta), got 'none'; "
                "use routing_schedule='per_site' with variant 'none'"
            )
        if self.routing_schedule == "lookahead" and self.variant in ("block", "delta") and self.lookahead_group:
            size = "mhar.block_size" if self.variant == "block" else "mhar.delta_block_layers"
            raise ValueError(
                f"mhar.lookahead_group={self.lookahead_group} has no effect with variant={self.variant!r}: its "
                f"lookahead groups are its blocks ({size}); leave lookahead_group at 0"
            )

    @property
    def enabled(self) -> bool:
        """False for the plain GPT baseline."""
        return self.variant != "none"

    def validate_for_model(self, hidden_size: int, num_layers: int) -> None:
        """Check the fields that depend on the model's shape (the baseline's routing fields
        do nothing, so they are not held to it)."""
        if not self.enabled:
            return
        if hidden_size % self.num_heads != 0:
            raise ValueError(
                f"mhar.num_heads={self.num_heads} does not divide hidden_size={hidden_size}; "
                f"pick a divisor such as 1, 8 or the number of KV heads"
            )
        error = layout_error(self.variant, num_layers, self.block_size, self.delta_block_layers,
                             names=("mhar.block_size", "mhar.delta_block_layers"))
        if error:
            raise ValueError(error)
        sites = 2 * num_layers + 1  # every sublayer's input and the final norm's
        if self.routing_schedule == "lookahead" and self.lookahead_group > sites:
            raise ValueError(
                f"mhar.lookahead_group={self.lookahead_group} exceeds the model's {sites} routing sites; "
                f"use at most {sites}, or 0 for the measured default"
            )


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _require_choice(field: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"mhar.{field} must be one of {choices}, got {value!r}")


def _require_int(field: str, value, minimum: int, rule: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"mhar.{field} {rule}, got {value!r}")
