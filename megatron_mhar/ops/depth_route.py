"""Depth routing: softmax mixing of earlier sources per token and per head (the MHAR paper).

This module holds the public functional op ``depth_route`` and its fp32 reference.
The reference is the specification every other path (the Triton kernels in
``mhar_kernels``, the model's :class:`~megatron_mhar.ops.history.SourceHistory`) is
tested against; it stays in the library so users can debug with it.

Shapes: ``N`` sources, any number of token dimensions ``...``, width ``D``, ``H``
heads of width ``D // H``.
"""

from typing import Optional, Sequence, Tuple, Union

import torch

IMPLS = ("auto", "torch", "triton")


def check_route_inputs(
    sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, num_heads: int
) -> None:
    """Raise ``ValueError`` naming the problem for inputs ``depth_route`` cannot route."""
    if sources.dim() < 2:
        raise ValueError(
            f"sources must have shape [N, ..., D] (at least 2 dims), got {tuple(sources.shape)}"
        )
    n, d = sources.shape[0], sources.shape[-1]
    if n == 0:
        raise ValueError("depth_route needs at least one source (N = 0 was given)")
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    if d % num_heads != 0:
        raise ValueError(
            f"width D={d} is not divisible by num_heads={num_heads}; choose a head count "
            f"that divides the hidden size"
        )
    for name, t in (("query", query), ("norm_weight", norm_weight)):
        if t.shape != (d,):
            raise ValueError(f"{name} must have shape [D]=[{d}], got {tuple(t.shape)}")
        if t.device != sources.device:
            raise ValueError(f"{name} is on {t.device} but sources are on {sources.device}")
    if not sources.is_floating_point():
        raise ValueError(f"sources must be a floating-point tensor, got {sources.dtype}")
    if not (query.is_floating_point() and norm_weight.is_floating_point()):
        raise ValueError("query and norm_weight must be floating-point tensors")


def depth_route_reference(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float = 1e-6,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """fp32 reference of MHAR routing (the MHAR paper); differentiable by autograd.

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
    weights, values = _routing_weights(sources, query, norm_weight, num_heads, eps, logit_scale)
    head_dim = sources.shape[-1] // num_heads
    mixed = (weights.unsqueeze(-1) * values.unflatten(-1, (num_heads, head_dim))).sum(0)
    return mixed.flatten(-2).to(sources.dtype)


def _routing_weights(sources, query, norm_weight, num_heads, eps, logit_scale):
    """(softmax weights [N, ..., H], sources in the compute dtype) of the reference."""
    dtype = sources.dtype
    head_dim = sources.shape[-1] // num_heads
    # fp32 statistics for 16-bit sources; fp64 stays fp64 (gradcheck).
    compute = torch.promote_types(dtype, torch.float32)
    values = sources.to(compute)
    inv_rms = torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    # The normalised key is rounded to the activation dtype before the weight multiply,
    # as an RMSNorm module running in that dtype would do.
    keys = (values * inv_rms).to(dtype) * norm_weight.to(dtype)
    keys = keys.to(compute).unflatten(-1, (num_heads, head_dim))  # [N, ..., H, D/H]
    logits = (keys * query.to(compute).view(num_heads, head_dim)).sum(-1) * logit_scale
    return torch.softmax(logits, dim=0), values  # over depth, per token and head


@torch.no_grad()
def routing_weights(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float = 1e-6,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """The softmax weight of each source per token and head, [N, ..., H] fp32 (a diagnostic).

    ``sources`` is [N, ..., D]; the weights are those :func:`depth_route_reference` mixes with.
    """
    weights, _ = _routing_weights(sources, query, norm_weight, num_heads, eps, logit_scale)
    return weights.float()


@torch.no_grad()
def routing_entropy(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float = 1e-6,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """Mean over tokens of each head's routing entropy in nats, [H] fp32 (a diagnostic).

    ``sources`` is [N, T, D]; 0 means every token of that head reads one source, ln N
    the uniform mean.
    """
    weights, _ = _routing_weights(sources, query, norm_weight, num_heads, eps, logit_scale)
    entropy = -(weights * weights.clamp_min(1e-30).log()).sum(0)  # [T, H]
    return entropy.float().mean(0)


def triton_available(device: torch.device) -> bool:
    """True when the fused Triton kernels can run on ``device``."""
    if device.type != "cuda":
        return False
    try:
        import mhar_kernels  # noqa: F401  (pulls in triton)
    except ImportError:
        return False
    return True


def resolve_impl(impl: str, device: torch.device) -> str:
    """Map ``auto`` to ``triton`` on CUDA (when importable) and ``torch`` elsewhere."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if triton_available(device) else "torch"
    if impl == "triton" and device.type != "cuda" and not _triton_interpreting():
        raise ValueError(
            "impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter); "
            "use impl='torch' or 'auto'"
        )
    return impl


def _triton_interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def depth_route(
    sources: Union[torch.Tensor, Sequence[torch.Tensor]],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float = 1e-6,
    impl: str = "auto",
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """Route over depth: per token and head, a softmax mixture of the sources.

    Args:
        sources: [N, ..., D] tensor, or a sequence of N tensors [..., D].
        query: [D] pseudo-query (zero gives the uniform mean).
        norm_weight: [D] RMSNorm weight for the keys.
        num_heads: H, must divide D. H = 1 is Attention Residuals.
        eps: RMSNorm epsilon.
        impl: ``"torch"`` (the fp32 reference), ``"triton"`` (fused kernels) or ``"auto"``.
        logit_scale: tau multiplying every logit (this project's extension of the paper).

    Returns:
        [..., D] in the sources' dtype. Differentiable in sources, query and norm_weight.
    """
    if not torch.is_tensor(sources):
        sources = list(sources)
        if not sources:
            raise ValueError("depth_route needs at least one source (an empty sequence was given)")
        shapes = {tuple(s.shape) for s in sources}
        dtypes = {s.dtype for s in sources}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(
                f"all sources must share one shape and dtype, got shapes {sorted(shapes)} "
                f"and dtypes {sorted(map(str, dtypes))}"
            )
        sources = torch.stack(sources)
    check_route_inputs(sources, query, norm_weight, num_heads)
    impl = resolve_impl(impl, sources.device)
    if impl == "torch":
        return depth_route_reference(sources, query, norm_weight, num_heads, eps, logit_scale)
    from mhar_kernels.depth_route import fused_depth_route

    return fused_depth_route(sources, query, norm_weight, num_heads, eps, logit_scale)


# ---------------------------------------------------------------------------------------
# Backend interface used by the source history. A backend routes over a [T, N, D] view of
# the history buffer (plus an optional extra source: the running partial of the block
# variant, or the delta variant's null source) and accumulates source gradients in place
# into an fp32 [T, N, D] view.
# ``mhar_kernels.depth_route`` provides the same two functions with fused kernels.
# ---------------------------------------------------------------------------------------


def _sources_with_extra(sources: torch.Tensor, extra: Optional[torch.Tensor]) -> torch.Tensor:
    """[T, N, D] (+ [T, D]) -> [N(+1), T, D] for the reference."""
    stacked = sources.transpose(0, 1)
    if extra is not None:
        stacked = torch.cat([stacked, extra.unsqueeze(0)], dim=0)
    return stacked


def torch_route_forward(
    sources: torch.Tensor,
    extra: Optional[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
) -> Tuple[torch.Tensor, None]:
    """Reference forward over a history view; returns (out [T, D], saved stats: none)."""
    with torch.no_grad():
        out = depth_route_reference(
            _sources_with_extra(sources, extra), query, norm_weight, num_heads, eps, logit_scale
        )
    return out, None


def torch_route_backward(
    grad_out: torch.Tensor,
    sources: torch.Tensor,
    extra: Optional[torch.Tensor],
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    saved: None,
    num_heads: int,
    eps: float,
    logit_scale: float,
    grad_sources: torch.Tensor,
) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Reference backward: recompute with autograd, add dsources into ``grad_sources``.

    Returns (grad_extra or None, grad_query, grad_norm_weight), each in its input's dtype.
    """
    with torch.enable_grad():
        src = sources.detach().requires_grad_(True)
        ext = None if extra is None else extra.detach().requires_grad_(True)
        q = query.detach().requires_grad_(True)
        g = norm_weight.detach().requires_grad_(True)
        routed = depth_route_reference(
            _sources_with_extra(src, ext), q, g, num_heads, eps, logit_scale
        )
        inputs = [src, q, g] + ([ext] if ext is not None else [])
        grads = torch.autograd.grad(routed, inputs, grad_out)
    grad_sources.add_(grads[0])
    grad_extra = grads[3] if ext is not None else None
    return grad_extra, grads[1], grads[2]
