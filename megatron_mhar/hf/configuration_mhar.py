"""Configurations of the MHAR forms of Llama, Qwen3 and Qwen3-MoE (transformers' ``PreTrainedConfig``).

Each is its family's config plus the routing fields (``mhar_*``) that define the
function an MHAR checkpoint computes; the fields that only choose how Megatron runs the
routing (kernels, schedules) have no place here. The export (``mcore_to_hf_mhar.py``)
copies this file beside ``modeling_mhar.py`` and ``routing_layout.py``, so it imports only
transformers (and ``packaging``, a dependency of transformers) and the routing layout.

Importing it checks the installed transformers against :data:`MIN_TRANSFORMERS_VERSION`,
which an export's ``config.json`` states as its ``transformers_version``.
"""

import math

import transformers
from packaging.version import Version

MIN_TRANSFORMERS_VERSION = "5.24.0"
"""The oldest transformers the MHAR models run on: the first whose modules take the KV cache
as ``cache`` (``past_key_values`` before), the name the models pass it under."""


def check_transformers_version() -> None:
    """Raise an ``ImportError`` naming both versions unless transformers is recent enough."""
    installed = transformers.__version__
    if Version(installed) < Version(MIN_TRANSFORMERS_VERSION):
        raise ImportError(
            f"the MHAR models need transformers >= {MIN_TRANSFORMERS_VERSION} (the transformers_version "
            f"an export's config.json states), but transformers {installed} is installed; upgrade it: "
            f"pip install 'transformers>={MIN_TRANSFORMERS_VERSION}'"
        )


# Before the names below: an older transformers may not have them.
check_transformers_version()

from transformers import LlamaConfig, PreTrainedConfig, Qwen3Config, Qwen3MoeConfig  # noqa: E402

try:  # an export: the routing layout shipped beside this file
    from .routing_layout import layout_error
except ModuleNotFoundError as missing:  # the package's own classes (megatron_mhar.hf) ship none
    if missing.name != f"{__package__}.routing_layout":
        raise
    from megatron_mhar.ops.routing_layout import layout_error

ROUTED_VARIANTS = ("full", "block", "delta")


class MHARRoutingFields(PreTrainedConfig):
    """The routing fields shared by every MHAR config (the names of ``MHARConfig``, prefixed)."""

    mhar_variant: str = "full"
    """``full`` (every sublayer output is a source), ``block`` (sums of blocks of sublayers)
    or ``delta`` (a gated correction of the kept additive stream)."""

    mhar_num_heads: int = 8
    """Routing heads H; must divide hidden_size. H = 1 is Attention Residuals."""

    mhar_block_size: int = 8
    """Block variant: sublayers (not decoder layers) per block."""

    mhar_delta_block_layers: int = 4
    """Delta variant: decoder layers per block; each completed block adds one source."""

    mhar_eps: float | None = None
    """RMSNorm epsilon of the routing keys; ``None`` takes ``rms_norm_eps``."""

    mhar_logit_scale: float = 1.0
    """tau multiplying every routing logit."""

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        check_routing_fields(self)

    @property
    def routing_eps(self) -> float:
        return self.rms_norm_eps if self.mhar_eps is None else self.mhar_eps


def check_routing_fields(config) -> None:
    """Raise a ``ValueError`` naming the first routing field the model cannot have."""
    layers, hidden = config.num_hidden_layers, config.hidden_size
    if config.mhar_variant not in ROUTED_VARIANTS:
        raise ValueError(
            f"mhar_variant must be one of {ROUTED_VARIANTS}, got {config.mhar_variant!r} (a model "
            f"without routing is a plain Llama / Qwen3 checkpoint)"
        )
    for name, low in (("mhar_num_heads", 1), ("mhar_block_size", 1), ("mhar_delta_block_layers", 1)):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if hidden % config.mhar_num_heads:
        raise ValueError(f"mhar_num_heads={config.mhar_num_heads} does not divide hidden_size={hidden}")
    error = layout_error(config.mhar_variant, layers, config.mhar_block_size, config.mhar_delta_block_layers,
                         names=("mhar_block_size", "mhar_delta_block_layers"))
    if error:
        raise ValueError(error)
    for name in ("mhar_eps", "mhar_logit_scale"):
        value = getattr(config, name)
        if value is None and name == "mhar_eps":
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")


class MHARLlamaConfig(LlamaConfig, MHARRoutingFields):
    """A Llama whose residual stream is replaced (or corrected) by routing over depth."""

    model_type = "mhar_llama"
    # transformers' pipeline plan hands one hidden state between stages; MHAR layers read every earlier source
    base_model_pp_plan = None


class MHARQwen3Config(Qwen3Config, MHARRoutingFields):
    """A Qwen3 whose residual stream is replaced (or corrected) by routing over depth."""

    model_type = "mhar_qwen3"
    # transformers' pipeline plan hands one hidden state between stages; MHAR layers read every earlier source
    base_model_pp_plan = None


class MHARQwen3MoeConfig(Qwen3MoeConfig, MHARRoutingFields):
    """A Qwen3-MoE whose residual stream is replaced (or corrected) by routing over depth; its
    MLPs are Qwen3-MoE's own (experts, top-k router)."""

    model_type = "mhar_qwen3_moe"
    # transformers' pipeline plan hands one hidden state between stages; MHAR layers read every earlier source
    base_model_pp_plan = None


__all__ = ["MHARLlamaConfig", "MHARQwen3Config", "MHARQwen3MoeConfig"]
