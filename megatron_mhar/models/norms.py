"""Norm modules for the local (non-Transformer-Engine) spec."""

from __future__ import annotations

import torch

__all__ = ["SequenceParallelTorchNorm"]


class SequenceParallelTorchNorm:
    """Torch ``LayerNorm``/``RMSNorm`` that accepts sequence parallelism.

    Drop-in for Megatron's ``WrappedTorchNorm`` (same constructor, same module
    type and state-dict keys ``weight``/``bias``), which asserts
    ``not config.sequence_parallel`` when neither apex nor TE is installed. With
    sequence parallelism each tensor-parallel rank normalises its own slice of
    the tokens, so the norm's weight gradients are partial sums; like Megatron's
    ``FusedLayerNorm`` and TE norms, the parameters are marked
    ``sequence_parallel`` and ``finalize_model_grads`` all-reduces them over the
    tensor-parallel group.

    ``build_gpt_model`` uses it as the layer spec's norms and the block's final norm
    of the local spec whenever sequence parallelism is on.
    """

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma:
            raise ValueError("SequenceParallelTorchNorm: set layernorm_zero_centered_gamma=False")
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"SequenceParallelTorchNorm: normalization must be LayerNorm or RMSNorm, "
                f"got {config.normalization!r}"
            )
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm
