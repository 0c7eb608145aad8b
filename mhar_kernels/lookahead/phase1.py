"""Phase 1 of the lookahead schedule: the entry points, which check their arguments and
run one of the two kernel families (``phase1_rows``: row loops; ``phase1_dots``:
tensor-core dots; ``lookahead_kernels`` names one, or ``auto``: ``launch.use_tensor_cores``
picks).

- ``group_forward``: the online-softmax partials of a group's G sites over the old rows,
  and site 0's output (it merges no new rows).
- ``group_backward_deferred``: every site's gradient to its parameters (with its merges'
  share, reduced once per group) and to the old rows: added at once by the row loop, or
  left as factors by the dots for ``row_grads.add_row_grads``.
"""

from typing import Optional, Tuple

import torch
import triton

from ..checks import check_output, check_sources
from ..launch import dot_heads, group_fwd_dots_config, overrides, use_tensor_cores
from .phase1_dots import RowFactors, group_backward_dots, group_forward_dots
from .phase1_rows import group_backward_rows, group_forward_rows


def group_forward(
    sources: torch.Tensor,
    queries: torch.Tensor,
    norm_weights: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
    first_out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    lookahead_kernels: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phase 1: partials of G sites over the old rows, each row read once per token tile.

    Args:
        sources: [T, N, D] view of the old rows (N >= 1), unit stride over D.
        queries, norm_weights: [G, D].
        first_out: (out [T, D] in the sources' dtype, unit stride over D; lse [T, H] fp32,
            contiguous) to finish site 0 here, as ``merge_forward`` would with no new rows
            (bitwise the same). The row loop then leaves its partials unwritten; the
            tensor-core kernel writes them and merges them in a second launch.
        lookahead_kernels: ``tensor_cores``, the dot-product kernel
            (``group_fwd_dots_kernel``); ``row_loop``, the row loop; ``auto`` (the default):
            the family the launch rule picks (``launch.use_tensor_cores``).

    Launch: the row loop holds as many sites per program as about 4K fp32 accumulators
    allow (``sites_per_program`` of ``launch.overridden(group_fwd=...)`` sets fewer; the
    others go to sibling programs of the same token tile); the tensor-core kernel always
    holds SLOTS sites per program.

    Returns:
        (m [G, T, H], l [G, T, H], acc [G, T, D]) online-softmax partials: m and l fp32;
        acc fp32 and unnormalised, except over half-precision rows, where it is
        ``acc / l`` in the rows' dtype (a convex combination of the rows, so within
        their range), which :func:`merge_forward` takes back: half the partials' bytes
        written and read (docs/kernels.md, "Half-precision partials").
    """
    check_sources(sources, None, num_heads)
    t, n, d = sources.shape
    g = queries.shape[0]
    if n < 1:
        raise ValueError("group_forward needs at least one old row")
    _check_first_out(first_out, sources, num_heads)
    loop = dict(overrides("group_fwd"))
    sites_per_program = loop.pop("sites_per_program", None)
    queries, norm_weights = queries.contiguous(), norm_weights.contiguous()
    _, _, dot_dim, dot_bh = dot_heads(d, num_heads)
    use_dots = use_tensor_cores(lookahead_kernels, g, dot_dim, backward=False, dtype=sources.dtype)
    dots = group_fwd_dots_config(dot_bh, dot_dim) if use_dots else None
    partials = _empty_partials(g, num_heads, sources)
    if dots is not None:
        group_forward_dots(sources, queries, norm_weights, num_heads, eps, logit_scale, first_out,
                           dots.override(**loop), sites_per_program, partials)  # fmt: skip
    else:
        group_forward_rows(sources, queries, norm_weights, num_heads, eps, logit_scale, first_out, sites_per_program,
                           partials, **loop)  # fmt: skip
    return partials


def _check_first_out(first_out, sources: torch.Tensor, num_heads: int) -> None:
    """group_forward's (out, lse) for site 0, if given: shapes, dtypes and strides."""
    t, _, d = sources.shape
    if first_out is None:
        return
    out, lse = first_out
    check_output("first_out's output", out, t, d, sources.dtype)
    if lse.shape != (t, num_heads) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"first_out's lse must be a contiguous [{t}, {num_heads}] float32 tensor, "
                         f"got {tuple(lse.shape)} {lse.dtype}")  # fmt: skip


# Row dtypes over which phase 1 stores its accumulators normalised, in that dtype.
HALF = (torch.bfloat16, torch.float16)


def _empty_partials(g: int, num_heads: int, sources: torch.Tensor):
    """Phase 1's outputs over the rows ``sources`` [T, N, D], uninitialised: m, l [G, T, H]
    fp32 and acc [G, T, D], in the rows' dtype where it is in HALF (the kernels then store
    acc / l: ``NORMALISED`` is ``acc.dtype != torch.float32``), otherwise fp32."""
    t, _, d = sources.shape
    kw = dict(dtype=torch.float32, device=sources.device)
    acc_dtype = sources.dtype if sources.dtype in HALF else torch.float32
    stats = (g, t, num_heads)
    return torch.empty(stats, **kw), torch.empty(stats, **kw), sources.new_empty((g, t, d), dtype=acc_dtype)


def group_backward_deferred(
    grad_outs: torch.Tensor,
    sources: torch.Tensor,
    queries: torch.Tensor,
    norm_weights: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
    grad_sources: torch.Tensor,
    site_range: Optional[Tuple[int, int]] = None,
    lookahead_kernels: str = "auto",
    merge_dw: Optional[torch.Tensor] = None,
    accumulate: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, Tuple[RowFactors, ...]]:
    """Backward of phase 1 for the sites ``site_range`` (default all) over the old rows
    [T, N, D], each row read once per kernel. The row loop adds the rows' gradients into
    the fp32 view ``grad_sources`` [T, N, D]; the tensor-core kernels leave them as
    :class:`RowFactors` for :func:`add_row_grads`, which adds several groups' in one
    read-modify-write of each row's gradient.

    Args:
        grad_outs: [G, T, D] contiguous gradients of the sites' outputs.
        queries, norm_weights: [G, D]; lse, delta: [G, T, H] fp32 contiguous.
        lookahead_kernels: ``tensor_cores``, the dot-product kernels where the dot heads
            (``dot_heads``) are at most 256 columns wide (padded); ``row_loop``, the
            row-loop kernel, which holds the sites in registers and adds them one by one;
            ``auto`` (the default): the family the launch rule picks
            (``launch.use_tensor_cores``; docs/kernels.md, "Tensor-core phase 1").
        merge_dw: contiguous fp32 [P, G, D], the merges' unreduced dL/dw partials
            (:func:`merge_backward`'s ``dw_out``, site j's at [:, j]), summed into the
            parameters' gradients with phase 1's (zeros for a site that did not run).
        accumulate: False where ``grad_sources`` holds no gradient yet: the row loop then
            stores into it instead of adding (the tensor-core kernels do not touch it).

    Launch: the row loop runs as many sites per launch as registers allow
    (``sites_per_program`` of ``launch.overridden(group_bwd=...)`` sets fewer), the
    launches over the rows last chunk first.

    Returns:
        (grad_query, grad_norm_weight) fp32 [hi - lo, D] for the sites in ``site_range``
        (with the merges' share where ``merge_dw`` is given), and the deferred rows'
        gradients (empty from the row loop), last chunk first.
    """
    check_sources(sources, None, num_heads)
    t, n, d = sources.shape
    g = queries.shape[0]
    lo, hi = site_range if site_range is not None else (0, g)
    if not (0 <= lo < hi <= g):
        raise ValueError(f"site_range {site_range} outside the group's {g} sites")
    loop = dict(overrides("group_bwd"))
    sites_per_program = loop.pop("sites_per_program", None)
    if grad_sources.shape != sources.shape or grad_sources.dtype != torch.float32:
        raise ValueError(
            f"grad_sources must be an fp32 view of shape {tuple(sources.shape)}, got "
            f"{tuple(grad_sources.shape)} {grad_sources.dtype}"
        )
    queries, norm_weights = queries.contiguous(), norm_weights.contiguous()
    grad_outs, lse, delta = grad_outs.contiguous(), lse.contiguous(), delta.contiguous()
    # w = q * g^ in fp32, g^ rounded to the activation dtype: the product the kernels form.
    folded = queries.float() * norm_weights.to(sources.dtype).float()
    _, _, dot_dim, _ = dot_heads(d, num_heads)
    # A wider head's tiles outgrow registers and shared memory.
    use_dots = use_tensor_cores(lookahead_kernels, g, dot_dim, backward=True, dtype=sources.dtype)
    if use_dots and triton.next_power_of_2(dot_dim) <= 256:
        unused = sorted(set(loop) - {"num_warps"}) + (["sites_per_program"] if sites_per_program else [])
        if unused:
            raise ValueError(
                f"the tensor-core kernels take only num_warps as a launch override, got {unused}; "
                f"drop them or use lookahead_kernels='row_loop'"
            )
        return group_backward_dots(
            grad_outs, sources, queries, norm_weights, folded, lse, delta, num_heads, eps, logit_scale,
            lo, hi, loop.get("num_warps"), merge_dw,
        )  # fmt: skip
    return group_backward_rows(
        grad_outs, sources, queries, norm_weights, folded, lse, delta, num_heads, eps, logit_scale, grad_sources,
        lo, hi, sites_per_program, merge_dw, accumulate, **loop,
    )  # fmt: skip
