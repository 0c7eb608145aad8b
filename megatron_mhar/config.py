"""Configuration of the depth routing that replaces (or corrects) the residual stream."""

import dataclasses
from typing import Optional

VARIANTS = ("none", "full", "block", "delta")
KERNEL_IMPLS = ("auto", "torch", "triton")
ROUTING_SCHEDULES = ("per_site", "lookahead")


@dataclasses.dataclass
class MHARConfig:
    """How the decoder routes over depth (MHAR.md §2 and §4)."""

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
    """``per_site`` (every site reads all its sources) or ``lookahead`` (full variant: groups of
    sites read the older sources once, MHAR.md §7; see megatron_mhar/ops/lookahead.py)."""

    lookahead_group: int = 0
    """Sites per lookahead group; 0 picks the power of two nearest sqrt(2L + 1)."""

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"mhar.variant must be one of {VARIANTS}, got {self.variant!r}")
        if not isinstance(self.num_heads, int) or self.num_heads < 1:
            raise ValueError(f"mhar.num_heads must be a positive integer, got {self.num_heads!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(
                f"mhar.block_size counts sublayers and must be a positive integer, "
                f"got {self.block_size!r}"
            )
        if not isinstance(self.delta_block_layers, int) or self.delta_block_layers < 1:
            raise ValueError(
                f"mhar.delta_block_layers counts decoder layers and must be a positive integer, "
                f"got {self.delta_block_layers!r}"
            )
        if self.eps is not None and not self.eps > 0:
            raise ValueError(f"mhar.eps must be positive (or None for the model's), got {self.eps}")
        if not self.logit_scale > 0:
            raise ValueError(f"mhar.logit_scale must be positive, got {self.logit_scale}")
        if self.kernel_impl not in KERNEL_IMPLS:
            raise ValueError(
                f"mhar.kernel_impl must be one of {KERNEL_IMPLS}, got {self.kernel_impl!r}"
            )
        if self.routing_schedule not in ROUTING_SCHEDULES:
            raise ValueError(
                f"mhar.routing_schedule must be one of {ROUTING_SCHEDULES}, "
                f"got {self.routing_schedule!r}"
            )
        if self.routing_schedule == "lookahead" and self.variant != "full":
            raise ValueError(
                f"mhar.routing_schedule='lookahead' needs variant='full' (got {self.variant!r}); "
                f"use routing_schedule='per_site' for the block and delta variants"
            )
        if not isinstance(self.lookahead_group, int) or self.lookahead_group < 0:
            raise ValueError(
                f"mhar.lookahead_group must be a non-negative integer (0 = auto), "
                f"got {self.lookahead_group!r}"
            )

    @property
    def enabled(self) -> bool:
        """False for the plain GPT baseline."""
        return self.variant != "none"

    def validate_for_model(self, hidden_size: int, num_layers: int) -> None:
        """Check the fields that depend on the model's shape."""
        if hidden_size % self.num_heads != 0:
            raise ValueError(
                f"mhar.num_heads={self.num_heads} does not divide hidden_size={hidden_size}; "
                f"pick a divisor such as 1, 8 or the number of KV heads"
            )
        if self.variant == "block" and self.block_size > 2 * num_layers:
            raise ValueError(
                f"mhar.block_size={self.block_size} sublayers exceeds the model's "
                f"{2 * num_layers} sublayers ({num_layers} decoder layers x 2)"
            )
