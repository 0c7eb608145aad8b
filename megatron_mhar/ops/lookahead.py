"""Two-phase ("lookahead") routing for the full variant.

The pseudo-queries do not depend on the input, and softmax partials merge exactly. So
consecutive routing sites are grouped: for a group of G sites whose first site reads
rows ``[0, n0)``,

- **phase 1** (at the group's first site, when the rows ``[0, n0)`` exist) reads each
  of those *old* rows once and computes, for all G sites at once, the online-softmax
  partials per token and head: running max ``m`` and denominator ``l`` (fp32 ``[T, H]``
  per site) and the unnormalised accumulator ``acc`` (fp32 ``[T, D]`` per site);
- **merge**: site j then folds only the rows written since the group started (fewer
  than G) into its partial, exactly (log-sum-exp merge), and writes ``x_j`` and its
  log-sum-exp. The first site has no such rows: phase 1 writes its output and
  log-sum-exp itself (``first_out``), bitwise what its merge would, and it runs no merge.

Backward mirrors it. Each site's merge backward computes ``delta[h] = sum_k do[k] x[k]``
from its routed output (the output is the sublayer's saved input, so no extra memory),
leaves the gradients of the few new rows as factors (each new row's gradient is formed once,
when it is due, from the factors of every site reading it), and leaves ``do`` and ``delta``
to the group;
one phase-1 backward then reads each old row once and adds the contributions of all G
sites to it (one read-modify-write of the fp32 gradient per old row and group instead
of one per site). dquery/dnorm: per site, the merge's part plus the phase-1 part.

Source reads per forward drop from ``sum_j N_j`` (O(L^2)) to about ``S^2 / (2G) + S G / 2``
for S sites, i.e. O(S^1.5) at ``G ~ sqrt(S)``; ``benchmarks/routing_bytes.py`` counts the
bytes per training step.

Memory. Saved for backward per site: the log-sum-exp (fp32 ``[T, H]``) and a reference
to the routed output. Transient: the G accumulators of the current group, fp32
``[G, T, D]`` (G * T * D * 4 bytes: 84 MB at the 1B shape, G = 8, T = 2048, D = 1280; the
fused row loop keeps them normalised in the rows' half-precision dtype, half that)
from the group's first site to its last merge, plus ``m`` and ``l`` (``2 G T H * 4``);
during backward, the group's grad outputs ``[G, T, D]`` in the activation dtype and its new
rows' gradient factors (fp32 ``[G, T, G - 1, H, 2]`` and ``[G, T, G - 1]``: 7.8 MB at the
1B shape) from the last site's merge backward to the group's phase-1 backward.

This module holds the pure-torch implementation of the four backend functions (the
reference the Triton kernels of ``mhar_kernels.lookahead`` are tested against, and the
CPU path), the group object and :class:`LookaheadHistory`, a :class:`SourceHistory`
whose reads go through groups. The per-site path is untouched.
"""

import functools
import math
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from megatron_mhar.ops.depth_route import resolve_impl
from megatron_mhar.ops.history import RoutingBackend, SourceHistory

# The Triton kernel families of phase 1 (``mhar.lookahead_kernels``) -> the ``tensor_cores``
# argument of mhar_kernels' phase-1 functions: the row loops (the sites in registers, one
# row at a time), the tensor-core dots per token and head, or per group and direction the
# family the launch rules pick (``auto``).
_TENSOR_CORES = {"auto": None, "row_loop": False, "tensor_cores": True}
LOOKAHEAD_KERNELS = tuple(_TENSOR_CORES)

# ---------------------------------------------------------------------------------------
# Reference backend: same signatures as mhar_kernels.lookahead. Shapes: T tokens, N rows,
# D width, H heads, G sites. The norm weight is rounded to the sources' dtype and folded
# into the query (w = q * g), as the fused kernels do; all statistics in fp32.
# ---------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _folded(queries, norm_weights, dtype, num_heads):
    """[G, D] queries and norm weights -> w [G, H, D/H] in the compute dtype."""
    compute = _compute_dtype(dtype)
    w = queries.to(compute) * norm_weights.to(dtype).to(compute)
    return w.unflatten(-1, (num_heads, -1))


def _logits(v, w, eps, logit_scale):
    """v [T, H, D/H], w [G, H, D/H] -> (inverse RMS [T], dots [G, T, H], logits [G, T, H])."""
    inv_rms = torch.rsqrt(v.pow(2).flatten(-2).mean(-1) + eps)
    dots = (v.unsqueeze(0) * w.unsqueeze(1)).sum(-1)
    return inv_rms, dots, dots * (inv_rms * logit_scale)[None, :, None]


def _online(sources, w, m, l, acc, eps, logit_scale):
    """Fold every row of ``sources`` [T, N, D] into the partials (m, l [G, T, H], acc [G, T, H, D/H])."""
    compute = w.dtype
    heads = w.shape[1]
    for i in range(sources.shape[1]):
        v = sources[:, i].to(compute).unflatten(-1, (heads, -1))
        _, _, s = _logits(v, w, eps, logit_scale)
        m_new = torch.maximum(m, s)
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new)
        l = l * alpha + p
        acc = acc * alpha.unsqueeze(-1) + p.unsqueeze(-1) * v.unsqueeze(0)
        m = m_new
    return m, l, acc


def _source_grads(sources, w, grad_outs, lse, delta, eps, logit_scale, grad_sources, row_factors=None):
    """Add one site's gradient to each row of ``sources`` into ``grad_sources`` (None: skip
    them) or write its factors into ``row_factors`` (see :func:`torch_merge_backward`);
    return dw [1, H, D/H].

    w [1, H, D/H], grad_outs [1, T, H, D/H], lse and delta [1, T, H], in the compute dtype.
    """
    compute = w.dtype
    heads, d = w.shape[1], sources.shape[-1]
    dw = torch.zeros_like(w)
    for i in range(sources.shape[1]):
        v = sources[:, i].to(compute).unflatten(-1, (heads, -1))
        inv_rms, dots, s = _logits(v, w, eps, logit_scale)
        p = torch.exp(s - lse)
        dp = (grad_outs * v.unsqueeze(0)).sum(-1)
        ds = p * (dp - delta)
        rs = (inv_rms * logit_scale)[None, :, None, None]
        if grad_sources is not None or row_factors is not None:
            c = (ds * dots).sum(-1) * (inv_rms * inv_rms / d)  # [G, T]
        if grad_sources is not None:
            dv = p.unsqueeze(-1) * grad_outs + rs * (
                ds.unsqueeze(-1) * w.unsqueeze(1) - c[..., None, None] * v.unsqueeze(0)
            )
            grad_sources[:, i] += dv.sum(0).flatten(-2).to(grad_sources.dtype)
        if row_factors is not None:
            factors, kv = row_factors
            factors[:, i] = torch.stack((p[0], rs[0, :, :, 0] * ds[0]), -1)
            kv[:, i] = rs[0, :, 0, 0] * c[0]
        dw += (rs * ds.unsqueeze(-1) * v.unsqueeze(0)).sum(1)
    return dw


def _weight_grads(dw, queries, norm_weights, dtype):
    """dw [G, H, D/H] -> (dquery, dnorm_weight) fp32 [G, D] (the cast g -> g^ passes through)."""
    dw = dw.flatten(-2).float()
    return dw * norm_weights.to(dtype).float(), dw * queries.float()


def torch_group_forward(
    sources: torch.Tensor,
    queries: torch.Tensor,
    norm_weights: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
    first_out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phase 1: partials of G sites over the old rows, each row read once.

    Args:
        sources: [T, N, D] view of the old rows (N >= 1).
        queries, norm_weights: [G, D], one row per site of the group.
        first_out: (out [T, D] in the sources' dtype, lse [T, H] fp32) that receive site 0's
            output and log-sum-exp, as its merge would compute them with no new rows (site 0
            merges none, so phase 1 finishes it and its merge is skipped).

    Returns:
        (m [G, T, H], l [G, T, H], acc [G, T, D]) fp32 online-softmax partials.
    """
    t, _, d = sources.shape
    g = queries.shape[0]
    w = _folded(queries, norm_weights, sources.dtype, num_heads)
    compute = w.dtype
    m = torch.full((g, t, num_heads), float("-inf"), dtype=compute, device=sources.device)
    l = torch.zeros((g, t, num_heads), dtype=compute, device=sources.device)
    acc = torch.zeros((g, t, num_heads, d // num_heads), dtype=compute, device=sources.device)
    m, l, acc = _online(sources, w, m, l, acc, eps, logit_scale)
    m, l, acc = m.float(), l.float(), acc.flatten(-2).float()
    if first_out is not None:
        out, lse = first_out
        no_rows = sources[:, :0]
        out.copy_(torch_merge_forward(m[0], l[0], acc[0], no_rows, queries[0], norm_weights[0], num_heads, eps,
                                      logit_scale, lse))  # fmt: skip
    return m, l, acc


def torch_merge_forward(
    m: torch.Tensor,
    l: torch.Tensor,
    acc: torch.Tensor,
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
    lse: torch.Tensor,
) -> torch.Tensor:
    """Merge: fold the new rows into one site's partial and normalise.

    Args:
        m, l: [T, H] fp32 and acc: [T, D], the site's phase-1 partial: fp32 and
            unnormalised, or ``acc / l`` in half precision (the fused row loop's form for
            half-precision rows).
        sources: [T, n, D] view of the rows written since the group started (n may be 0).
        query, norm_weight: [D].
        lse: fp32 [T, H] that receives the site's log-sum-exp (saved for backward).

    Returns:
        out [T, D] in the sources' dtype.
    """
    w = _folded(query[None], norm_weight[None], sources.dtype, num_heads)
    compute = w.dtype
    normalised = acc.dtype in (torch.bfloat16, torch.float16)
    acc = acc.to(compute).unflatten(-1, (num_heads, -1))
    if normalised:
        acc = acc * l.to(compute)[..., None]
    acc = acc[None]
    m, l, acc = _online(sources, w, m.to(compute)[None], l.to(compute)[None], acc, eps, logit_scale)
    lse.copy_((m + torch.log(l))[0])
    return (acc / l.unsqueeze(-1))[0].flatten(-2).to(sources.dtype)


def torch_merge_backward(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    lse: torch.Tensor,
    num_heads: int,
    eps: float,
    logit_scale: float,
    row_factors: Tuple[torch.Tensor, torch.Tensor],
    delta_out: Optional[torch.Tensor] = None,
    grad_out_copy: Optional[torch.Tensor] = None,
    dw_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward of the merge. The new rows' gradients are left as factors, which
    :func:`torch_merge_row_grad` adds when a row is due; ``delta_out`` receives delta
    and ``grad_out_copy`` a copy of ``grad_out`` if given; ``dw_out`` ([P, D] fp32, P =
    :func:`torch_merge_dw_partials` = 1) receives dL/dw of the folded query instead of the
    parameters' gradients, for the group's backward to add (``merge_dw``).

    Args:
        grad_out, out: [T, D] gradient and value of the site's routed output.
        sources: [T, n, D] new rows.
        lse: [T, H] saved by the merge.
        row_factors: (factors [T, n, H, 2], kv [T, n]) fp32 views receiving, per new row
            i, head h and token, ``(p, tau r ds)`` and ``tau r c`` (docs/kernels.md,
            "Backward"): row i's gradient is then ``p do + tau r ds w - tau r c v``.

    Returns:
        (delta [T, H] fp32 = sum over each head of grad_out * out, dquery fp32 [D] and
        dnorm_weight fp32 [D] of the new rows' logits, both None with ``dw_out``).
    """
    w = _folded(query[None], norm_weight[None], sources.dtype, num_heads)
    compute = w.dtype
    do = grad_out.to(compute).unflatten(-1, (num_heads, -1))
    delta = (do * out.to(compute).unflatten(-1, (num_heads, -1))).sum(-1)
    dw = _source_grads(
        sources, w, do[None], lse.to(compute)[None], delta[None], eps, logit_scale, None, row_factors
    )
    if grad_out_copy is not None:
        grad_out_copy.copy_(grad_out)
    delta = delta.float() if delta_out is None else delta_out.copy_(delta)
    if dw_out is not None:
        if dw_out.shape != (1, dw.shape[1] * dw.shape[2]):
            raise ValueError(f"dw_out must be [1, D] (torch_merge_dw_partials), got {tuple(dw_out.shape)}")
        dw_out.copy_(dw.flatten(-2))
        return delta, None, None
    dq, dg = _weight_grads(dw, query[None], norm_weight[None], sources.dtype)
    return delta, dq[0], dg[0]


def torch_merge_dw_partials(num_tokens: int, d: int, num_heads: int, device: torch.device) -> int:
    """P of :func:`torch_merge_backward`'s ``dw_out``: the reference sums dL/dw whole."""
    return 1


def torch_merge_row_grad(
    row: torch.Tensor,
    row_grad: torch.Tensor,
    out: torch.Tensor,
    grad_outs: torch.Tensor,
    queries: torch.Tensor,
    norm_weights: torch.Tensor,
    factors: torch.Tensor,
    kv: torch.Tensor,
    index: int,
    site_range: Tuple[int, int],
    num_heads: int,
    accumulate: bool = True,
) -> None:
    """A new row's gradient from its fp32 gradient so far and the factors the merges of a
    group's sites ``site_range`` left (:func:`torch_merge_backward`), written into ``out``.

    Args:
        row: [T, D] the row; row_grad: [T, D] fp32 its gradient from every other read;
            out: [T, D] in any dtype (it may be ``row_grad`` itself).
        grad_outs: [G, T, D] the group's output gradients; queries, norm_weights: [G, D].
        factors: [G, T, R, H, 2] and kv: [G, T, R] fp32, site j's rows' factors at [j];
            index: the row's index among them (R the group's new rows).
        site_range: (lo, hi), the sites reading the row; added last site first, the order
            the merges ran in.
        accumulate: False where ``row_grad`` holds no gradient yet (no other read added
            one): it is then not read.
    """
    lo, hi = site_range
    w = _folded(queries[lo:hi], norm_weights[lo:hi], row.dtype, num_heads)
    compute = w.dtype
    v = row.to(compute).unflatten(-1, (num_heads, -1))
    acc = row_grad.to(compute) if accumulate else torch.zeros_like(row_grad, dtype=compute)
    acc = acc.unflatten(-1, (num_heads, -1))
    for j in reversed(range(lo, hi)):
        f = factors[j, :, index].to(compute)  # [T, H, 2]
        do = grad_outs[j].to(compute).unflatten(-1, (num_heads, -1))
        acc = acc + (f[..., :1] * do + f[..., 1:] * w[j - lo] - kv[j, :, index].to(compute)[:, None, None] * v)
    out.copy_(acc.flatten(-2))


class SiteFactors(NamedTuple):
    """What the reference's deferred phase-1 backward keeps for the rows' gradients: per
    site of the range, in the order they are added (last site first), the folded query
    w [k, H, D/H], output gradient [k, T, H, D/H], lse and delta [k, T, H] in the compute
    dtype."""

    w: torch.Tensor
    grad_outs: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    eps: float
    logit_scale: float


def torch_group_backward_deferred(
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
    merge_dw: Optional[torch.Tensor] = None,
    accumulate: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, Tuple[SiteFactors, ...]]:
    """Backward of phase 1: every site's gradient to its parameters now, and to the old rows
    as factors for :func:`torch_add_row_grads`, which the history calls when the rows'
    gradients are due (``grad_sources`` is not touched here; the kernels' row loop adds
    into it at once, or with ``accumulate`` False stores into it, and their tensor-core
    path defers as this does).

    Args:
        grad_outs: [G, T, D] gradients of the sites' routed outputs.
        sources: [T, N, D] old rows; grad_sources: their fp32 gradients [T, N, D].
        queries, norm_weights: [G, D]; lse, delta: [G, T, H] fp32 from the merges.
        site_range: (lo, hi), the sites whose merges ran in this graph (default: all).
        merge_dw: [P, G, D] fp32, the merges' dL/dw (:func:`torch_merge_backward`'s
            ``dw_out``, site j's at [:, j]), added to the old rows' share.
        accumulate: False where ``grad_sources`` holds no gradient yet (the kernels' row
            loop then stores instead of adding; unused here).

    Returns:
        (dquery, dnorm_weight) fp32 [hi - lo, D]: the old rows' share, plus the merges'
        with ``merge_dw``; and the rows' deferred gradients.
    """
    lo, hi = site_range if site_range is not None else (0, queries.shape[0])
    grad_outs, queries, norm_weights = grad_outs[lo:hi], queries[lo:hi], norm_weights[lo:hi]
    w = _folded(queries, norm_weights, sources.dtype, num_heads)
    compute = w.dtype
    do = grad_outs.to(compute).unflatten(-1, (num_heads, -1))
    lse, delta = lse[lo:hi].to(compute), delta[lo:hi].to(compute)
    dw = torch.empty_like(w)
    for k in range(w.shape[0]):
        dw[k] = _source_grads(
            sources, w[k : k + 1], do[k : k + 1], lse[k : k + 1], delta[k : k + 1], eps, logit_scale, None
        )[0]  # fmt: skip
    if merge_dw is not None:
        dw = dw + merge_dw[:, lo:hi].sum(0).to(compute).unflatten(-1, (num_heads, -1))
    # Site by site, last first: each row's gradient receives the sites' contributions in
    # the same order whether or not a checkpointed chunk split the group's backward.
    last_first = (w.flip(0), do.flip(0), lse.flip(0), delta.flip(0))
    return (*_weight_grads(dw, queries, norm_weights, sources.dtype), (SiteFactors(*last_first, eps, logit_scale),))


def torch_add_row_grads(
    deferred: Sequence[Tuple[Sequence[SiteFactors], int]],
    sources: torch.Tensor,
    grad_sources: torch.Tensor,
    start: int,
    accumulate: bool = True,
) -> None:
    """Add deferred phase-1 gradients (``(factors, owed)`` pairs, in order) to the rows
    ``[start, owed)`` of ``sources`` / ``grad_sources`` [T, R, D] (the rows from row 0);
    ``accumulate`` False: those rows hold no gradient yet, and the sums are stored."""
    if not accumulate:
        stop = max((owed for factors, owed in deferred if factors and owed > start), default=start)
        grad_sources[:, start:stop].zero_()
    for factors, owed in deferred:
        for f in factors if owed > start else ():
            rows, grads = sources[:, start:owed], grad_sources[:, start:owed]
            for k in range(f.w.shape[0]):
                _source_grads(
                    rows, f.w[k : k + 1], f.grad_outs[k : k + 1], f.lse[k : k + 1], f.delta[k : k + 1],
                    f.eps, f.logit_scale, grads,
                )  # fmt: skip


class LookaheadBackend(NamedTuple):
    """The functions of the two-phase schedule (reference or fused). The history runs
    phase 1's backward deferred: ``group_backward_deferred`` returns the parameters'
    gradients and leaves the old rows' to ``add_row_grads``, which the history calls when
    a row's gradient is due, for every group owing it at once; ``merge_backward`` leaves
    the new rows' as factors for ``merge_row_grad``, which the history calls when each new
    row is due."""

    group_forward: object
    merge_forward: object
    merge_backward: object
    group_backward_deferred: object
    add_row_grads: object
    merge_row_grad: object
    merge_dw_partials: object


TORCH_LOOKAHEAD = LookaheadBackend(
    torch_group_forward, torch_merge_forward, torch_merge_backward, torch_group_backward_deferred,
    torch_add_row_grads, torch_merge_row_grad, torch_merge_dw_partials,
)


def get_lookahead_backend(impl: str, device: torch.device, kernels: str = "auto") -> LookaheadBackend:
    """The two-phase backend for ``impl`` (``auto`` picks Triton on CUDA when available);
    ``kernels``: the Triton phase-1 kernels, one of ``mhar.lookahead_kernels``' values."""
    if kernels not in _TENSOR_CORES:
        raise ValueError(f"kernels must be one of {list(LOOKAHEAD_KERNELS)}, got {kernels!r}")
    if resolve_impl(impl, device) == "torch":
        return TORCH_LOOKAHEAD
    from mhar_kernels import lookahead as fused

    tensor_cores = _TENSOR_CORES[kernels]
    return LookaheadBackend(
        functools.partial(fused.group_forward, tensor_cores=tensor_cores),
        fused.merge_forward,
        fused.merge_backward,
        functools.partial(fused.group_backward_deferred, tensor_cores=tensor_cores),
        fused.add_row_grads,
        fused.merge_row_grad,
        fused.merge_dw_partials,
    )


def auto_group_size(num_sites: int) -> int:
    """Sites per group for ``lookahead_group = 0``: the integer nearest sqrt(0.84 * sites),
    i.e. 5 / 6 / 8 at 100M / 350M / 1B (25 / 49 / 73 sites).

    Bytes alone put the optimum at about sqrt(sites) (phase 1 reads ~S^2 / 2G rows, the
    merges ~S G / 2: benchmarks/routing_bytes.py), but a merge's row costs more than a
    phase-1 row (the merges are short, latency-bound kernels), which moves it lower. The
    factor 0.84 is fitted to the H200's training steps at the three sizes
    (docs/performance.md); any factor in [0.81, 0.86) picks the same three sizes. The fit
    does not reach past 1B: ``lookahead_group`` sets G by hand."""
    return max(1, round(math.sqrt(0.84 * max(1, num_sites))))


def group_ranges(first_site: int, last_site: int, group_size: int) -> List[range]:
    """The lookahead groups of sites ``first_site..last_site``: consecutive runs of
    ``group_size`` sites, the remainder (if any) first. A group's phase 1 reads every row
    written before its first site, so the short group goes where there are fewest rows: at
    the 1B shape the 73 sites are 1 + 9 x 8 and the one-site group reads one row, where as
    the last group it read 72 rows on the row-loop kernels (it has too few sites for the
    dots)."""
    if group_size < 1 or last_site < first_site:
        raise ValueError(f"no groups of {group_size} over sites {first_site}..{last_site}")
    remainder = (last_site - first_site + 1) % group_size
    starts = ([first_site] if remainder else []) + list(range(first_site + remainder, last_site + 1, group_size))
    return [range(a, b) for a, b in zip(starts, starts[1:] + [last_site + 1])]


# ---------------------------------------------------------------------------------------
# Groups and the history
# ---------------------------------------------------------------------------------------


class GroupSite(NamedTuple):
    """One routing site of a group: its index, rows read, and parameters."""

    site: int
    num_rows: int
    query: torch.Tensor
    norm_weight: torch.Tensor


class RoutingGroup:
    """One run of a group's phase 1 and the state its merges and backward share.

    Holds no tensor that has an autograd history (the graph references the group through
    the nodes' contexts; the group must not reference the graph back). Per-site slices of
    the group's tensors are taken once per group (``unbind``), not once per site: each
    slice is a dispatched op, and host time per site is what bounds the larger models.
    """

    def __init__(self, sites: Sequence[GroupSite], history: "LookaheadHistory"):
        self.sites = tuple(sites)
        self.old_rows = sites[0].num_rows
        self.grad_enabled = torch.is_grad_enabled()
        t, d, heads = history.num_tokens, history.shape[-1], history.num_heads
        device = history.buffer.device
        # Per site (m, l, acc): the phase-1 partials, set by the group's forward; site 0
        # merges no new rows, so phase 1 writes its output (``first_out``) instead.
        self.partials: Optional[Tuple[Tuple[torch.Tensor, ...], ...]] = None
        self.first_out: Optional[torch.Tensor] = None
        self.lse = torch.empty((len(sites), t, heads), dtype=torch.float32, device=device)
        self.site_lse = self.lse.unbind()
        self.next_index = 0
        # The stacked queries and norm weights [G, D], set by the group's forward.
        self.queries: Optional[torch.Tensor] = None
        self.norms: Optional[torch.Tensor] = None
        # Backward workspaces, [G, ...] each with its per-site slices: the output gradients
        # and deltas, the new rows' gradient factors and the merges' dL/dw partials
        # (torch_merge_backward), which the group's backward reduces with its own.
        self.grad_outs: Optional[torch.Tensor] = None
        self.deltas: Optional[torch.Tensor] = None
        self.row_factors: Optional[torch.Tensor] = None  # [G, T, R, H, 2] fp32, R new rows
        self.row_kv: Optional[torch.Tensor] = None  # [G, T, R] fp32
        self.merge_dw: Optional[torch.Tensor] = None  # [P, G, D] fp32, site j's at [:, j]
        self._slices: Tuple[Tuple[torch.Tensor, ...], ...] = ()
        self.deposited: List[int] = []
        self._zeroed: set = set()

    @property
    def first_site(self) -> int:
        return self.sites[0].site

    @property
    def new_rows(self) -> int:
        """R: the rows written since the group started that its last site reads."""
        return self.sites[-1].num_rows - self.old_rows

    def workspace(self, index: int, grad_out: torch.Tensor, num_heads: int, dw_partials: int):
        """(output gradient [T, D], delta fp32 [T, H], (factors [T, n, H, 2], kv [T, n]) of its
        n new rows, dL/dw partials [P, D] with P = ``dw_partials``) slots of site ``index``
        in the group's backward workspaces, which site ``index``'s merge backward fills
        (uninitialised until then: :meth:`zero_unused` zeroes the slots of the sites whose
        output was not used)."""
        if self.grad_outs is None:
            g, (t, d) = len(self.sites), grad_out.shape
            self.grad_outs = grad_out.new_empty((g, t, d))
            self.deltas = grad_out.new_empty((g, t, num_heads), dtype=torch.float32)
            self.row_factors = self.deltas.new_empty((g, t, self.new_rows, num_heads, 2))
            self.row_kv = self.deltas.new_empty((g, t, self.new_rows))
            self.merge_dw = self.deltas.new_empty((dw_partials, g, d))
            self._slices = tuple(x.unbind() for x in (self.grad_outs, self.deltas, self.row_factors, self.row_kv))
            self._slices += (self.merge_dw.unbind(1),)
        n = self.sites[index].num_rows - self.old_rows
        grad_outs, deltas, factors, kv, merge_dw = self._slices
        return grad_outs[index], deltas[index], (factors[index][:, :n], kv[index][:, :n]), merge_dw[index]

    def zero_unused(self, lo: int, hi: int) -> None:
        """Zero the workspace slots of the sites in ``lo:hi`` that deposited nothing (their
        output was not used): their terms in the phase-1 backward and in the new rows'
        gradients then vanish. Zeroing only those, not whole workspaces up front, saves a
        fill of [G, T, D] per group (at 100M 67 MB, 7 per micro-batch)."""
        for index in sorted(set(range(lo, hi)) - set(self.deposited) - self._zeroed):
            for slices in self._slices:
                slices[index].zero_()
            self._zeroed.add(index)

    def backward_range(self) -> Tuple[int, int]:
        """(lo, hi): the sites the phase-1 backward covers, from the first to the last that
        deposited (:meth:`zero_unused` clears the ones between whose output was not used)."""
        lo, hi = min(self.deposited), max(self.deposited) + 1
        self.zero_unused(lo, hi)
        return lo, hi

    def deposit(self, index: int) -> None:
        """Site ``index``'s merge backward filled its workspace slots (its parameters'
        gradients from the new rows among them, reduced by the phase-1 backward)."""
        self.deposited.append(index)

    def release_backward(self) -> None:
        self.grad_outs = self.deltas = self.lse = self.row_factors = self.row_kv = self.merge_dw = None
        self.queries = self.norms = None
        self._slices = self.site_lse = ()


ParamGradsHook = Callable[[Sequence[torch.Tensor], Tuple[torch.Tensor, ...]], Optional[List[torch.Tensor]]]


class LookaheadHistory(SourceHistory):
    """A :class:`SourceHistory` whose reads run the two-phase schedule group by group.

    ``route_group(sites, index)`` routes site ``sites[index]`` of a group. The group's
    phase 1 runs at the first read of the group; a run of the group is reused while its
    sites are read in order under the same grad mode. Anything else (a read out of order,
    a change of grad mode such as the no-grad first pass of activation checkpointing, or
    :meth:`end_group`, which the stream calls when a checkpointed chunk restores its state)
    starts a new run of the whole group, which computes bit-identical partials, so a
    recomputed chunk reproduces the forward exactly. Each run's backward covers exactly
    the sites merged in its graph.

    Args:
        lookahead: the two-phase backend.
        param_grads_hook: called by each group's backward with the routing parameters of its
            sites (queries, then norm weights) and their fp32 gradients stacked per kind
            ``(dquery [k, D], dnorm [k, D])``; it returns the tensors autograd should get as
            their gradients (the hook took the values itself, e.g. into a gradient buffer),
            or None, and autograd then gets the gradients cast to the parameters' dtypes.
        The other arguments are :class:`SourceHistory`'s.
    """

    def __init__(
        self,
        capacity: int,
        like: torch.Tensor,
        backend: RoutingBackend,
        lookahead: LookaheadBackend,
        num_heads: int,
        eps: float,
        logit_scale: float,
        param_grads_hook: Optional[ParamGradsHook] = None,
    ):
        super().__init__(capacity, like, backend, num_heads, eps, logit_scale)
        self.lookahead = lookahead
        self.param_grads_hook = param_grads_hook
        self.group: Optional[RoutingGroup] = None
        self.group_token: Optional[torch.Tensor] = None
        # The old-row counts of every group run (its first row that phase 1 does not read).
        self.group_starts = {0}
        # [deferred, owed]: a phase-1 backward's rows' gradients not yet added, to rows [0, owed).
        self.owed: List[list] = []
        # Rows whose merges left their gradients as factors: row -> the group runs that did
        # (more than one where a checkpointed chunk split the group's sites between runs).
        self.pending: Dict[int, List[RoutingGroup]] = {}

    @property
    def num_tokens(self) -> int:
        s, b, _ = self.shape
        return s * b

    def end_group(self) -> None:
        """Drop the current run's partials; the next read starts a new run."""
        if self.group is not None:
            self.group.partials = self.group.first_out = None
        self.group, self.group_token = None, None

    def release(self) -> None:
        super().release()
        self.end_group()

    def defer(self, deferred, old_rows: int) -> None:
        """Keep a phase-1 backward's deferred gradients of rows ``[0, old_rows)``."""
        if deferred:
            self.owed.append([deferred, old_rows])

    def _add_owed(self, start: int) -> None:
        """Add what the phase-1 backwards owe the rows from the nearest group start at or
        below ``start`` up. Every group reading row ``start`` as an old row consumed a later
        token than its write, so its backward has run and deferred; and no group starts
        between that start and ``start``, so the groups owing the rows above it are all in.
        One kernel adds them all: each row's fp32 gradient is read and written once for the
        groups behind, not once per group."""
        if any(owed > start for _, owed in self.owed):
            block = max(n for n in self.group_starts if n <= start)
            stop = max(owed for deferred, owed in self.owed if deferred and owed > block)
            _, accumulate = self.grad_rows_to_store(stop, block)
            cap = self.capacity
            self.lookahead.add_row_grads(
                self.owed, self.rows(cap), self._grad_flat[:, :cap], block, accumulate=accumulate
            )  # fmt: skip
            self.mark_stored(stop, block)
            for entry in self.owed:
                entry[1] = min(entry[1], block)
            self.owed = [entry for entry in self.owed if entry[1] > 0]

    def _finish_row(self, row: int, dtype: Optional[torch.dtype] = None, only=None) -> torch.Tensor:
        """Add the merges' factors of pending row ``row`` (of every group run, or of the run
        ``only``) to its fp32 gradient: in place (``dtype`` None) or, from the last run, into
        a new [T, D] tensor of ``dtype``; returns the result. The sites reading the row are a
        suffix of its group's; those whose merge did not run in a group run add zeros."""
        runs = self.pending.pop(row)
        if only is not None:
            if len(runs) > 1:
                self.pending[row] = [g for g in runs if g is not only]
            runs = [only]
        grad, accumulate = self.grad_rows_to_store(row + 1, row)
        grad = grad[:, 0]
        for k, group in enumerate(runs):
            lo = next(j for j, site in enumerate(group.sites) if site.num_rows > row)
            hi = len(group.sites)
            group.zero_unused(lo, hi)
            last = k == len(runs) - 1
            out = torch.empty(grad.shape, dtype=dtype, device=grad.device) if last and dtype else grad
            self.lookahead.merge_row_grad(
                self.rows(row + 1, row)[:, 0], grad, out, group.grad_outs, group.queries, group.norms,
                group.row_factors, group.row_kv, row - group.old_rows, (lo, hi), self.num_heads,
                accumulate=accumulate,
            )  # fmt: skip
            if out is grad:
                self.mark_stored(row + 1, row)
                accumulate = True
        return out

    def finish_rows(self, group: RoutingGroup) -> None:
        """Add the factors of ``group``'s rows still pending into their fp32 gradients, before
        the group releases its workspaces (the rows of a run whose phase-1 backward comes
        before they are due: the later sites' run of a group a checkpointed chunk split)."""
        for row in [r for r, runs in self.pending.items() if any(g is group for g in runs)]:
            self._finish_row(row, only=group)

    def due_grads(self, stop: int, start: int = 0) -> torch.Tensor:
        """The fp32 gradients of rows ``[start, stop)``, with what the phase-1 backwards owe
        them and the factors the merges left for them added."""
        self._add_owed(start)
        for row in [r for r in self.pending if start <= r < stop]:
            self._finish_row(row)
        return super().due_grads(stop, start)

    def due_row_grad(self, row: int, dtype: torch.dtype) -> torch.Tensor:
        """Row ``row``'s gradient in ``dtype``; a row the merges left factors for gets it from
        one kernel that reads its fp32 gradient once and writes the sum in ``dtype``, instead
        of a read-modify-write per merge and a cast."""
        if row not in self.pending:
            return super().due_row_grad(row, dtype)
        self._add_owed(row)
        return self._finish_row(row, dtype).view(self.shape)

    def route_group(self, sites: Sequence[GroupSite], index: int) -> torch.Tensor:
        """Route site ``sites[index]`` of a group (``sites`` in order, all on this stage)."""
        site = sites[index]
        if not 0 < sites[0].num_rows <= site.num_rows <= self.rows_written:
            raise IndexError(
                f"site {site.site} routes over {site.num_rows} rows (group start "
                f"{sites[0].num_rows}) but only {self.rows_written} are written"
            )
        group = self.group
        if (
            group is None
            or group.first_site != sites[0].site
            or len(group.sites) != len(sites)
            or group.next_index != index
            or group.grad_enabled != torch.is_grad_enabled()
        ):
            self.end_group()
            group = self.group = RoutingGroup(sites, self)
            self.group_starts.add(group.old_rows)
            params = [s.query for s in sites] + [s.norm_weight for s in sites]
            self.group_token = _GroupPartials.apply(self, group, self.token, *params)
        out = _MergeSite.apply(
            self, group, index, self.token, self.group_token, site.query, site.norm_weight
        )
        group.next_index = index + 1
        if group.next_index == len(sites):
            self.end_group()
        return out


class _GroupPartials(torch.autograd.Function):
    @staticmethod
    def forward(ctx, history, group, token, *params):
        g = len(group.sites)
        queries, norms = torch.stack(params[:g]), torch.stack(params[g:])
        rows = history.rows(group.old_rows)
        group.first_out = rows.new_empty((rows.shape[0], rows.shape[2]))
        partials = history.lookahead.group_forward(
            rows, queries, norms, history.num_heads, history.eps, history.logit_scale,
            first_out=(group.first_out, group.site_lse[0]),
        )  # fmt: skip
        group.partials = tuple(zip(*(x.unbind() for x in partials)))
        group.queries, group.norms = queries, norms
        # Tokens carry ordering only: with materialize_grads off their gradients stay None
        # (no zero tensors, no kernels) and autograd still runs every producer.
        ctx.set_materialize_grads(False)
        ctx.history, ctx.group = history, group
        ctx.save_for_backward(queries, norms)  # the stacks, not the parameters: no re-stack
        return queries.new_empty(())

    @staticmethod
    def backward(ctx, _grad_group_token):
        history, group = ctx.history, ctx.group
        queries, norms = ctx.saved_tensors
        g = len(group.sites)
        grads: List[Optional[torch.Tensor]] = [None] * (2 * g)
        if group.deposited:
            lo, hi = group.backward_range()  # the sites merged in this graph
            grad_rows, accumulate = history.grad_rows_to_store(group.old_rows)
            # Each site's gradient from the old rows and, through merge_dw, from its new rows
            # (the merge): one reduction per group.
            dq, dg, deferred = history.lookahead.group_backward_deferred(
                group.grad_outs, history.rows(group.old_rows), queries, norms, group.lse,
                group.deltas, history.num_heads, history.eps, history.logit_scale,
                grad_rows, (lo, hi), merge_dw=group.merge_dw, accumulate=accumulate,
            )  # fmt: skip
            if not deferred:  # the rows' gradients were added (stored) now
                history.mark_stored(group.old_rows)
            history.defer(deferred, group.old_rows)
            sites = group.sites[lo:hi]
            params = [s.query for s in sites] + [s.norm_weight for s in sites]
            hook = history.param_grads_hook
            handed = None if hook is None else hook(params, (dq, dg))
            if handed is not None:  # the hook took the fp32 values (no cast)
                grads[lo:hi], grads[g + lo : g + hi] = handed[: hi - lo], handed[hi - lo :]
            else:  # cast once per kind (the stacks carry the parameters' dtypes)
                grads[lo:hi] = dq.to(queries.dtype).unbind()
                grads[g + lo : g + hi] = dg.to(norms.dtype).unbind()
        history.finish_rows(group)
        group.release_backward()
        return (None, None, None, *grads)


class _MergeSite(torch.autograd.Function):
    @staticmethod
    def forward(ctx, history, group, index, token, group_token, query, norm_weight):
        s, b, h = history.shape
        site = group.sites[index]
        if index == 0:  # no new rows: phase 1 finished it
            out, group.first_out = group.first_out, None
        else:
            m, l, acc = group.partials[index]
            out = history.lookahead.merge_forward(
                m, l, acc, history.rows(site.num_rows, group.old_rows),
                query, norm_weight, history.num_heads, history.eps, history.logit_scale,
                group.site_lse[index],
            )  # fmt: skip
        result = out.view(s, b, h)
        ctx.set_materialize_grads(False)
        ctx.history, ctx.group, ctx.index = history, group, index
        # Saved as an output: autograd then refuses a backward after an in-place change.
        ctx.save_for_backward(query, norm_weight, result)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        if grad_out is None:  # the routed output was not used
            return (None,) * 7
        history, group, index = ctx.history, ctx.group, ctx.index
        query, norm_weight, out = ctx.saved_tensors
        s, b, h = history.shape
        rows = group.sites[index].num_rows
        flat_grad = grad_out.reshape(s * b, h)
        partials = history.lookahead.merge_dw_partials(s * b, h, history.num_heads, flat_grad.device)
        grad_out_slot, delta_slot, row_factors, dw_slot = group.workspace(
            index, flat_grad, history.num_heads, partials
        )
        history.lookahead.merge_backward(
            flat_grad, out.reshape(s * b, h), history.rows(rows, group.old_rows),
            query, norm_weight, group.site_lse[index],
            history.num_heads, history.eps, history.logit_scale,
            row_factors, delta_slot, grad_out_slot, dw_slot,
        )  # fmt: skip
        # The new rows' gradients are added when each is due (LookaheadHistory.due_row_grad).
        for row in range(group.old_rows, rows):
            runs = history.pending.setdefault(row, [])
            if not any(g is group for g in runs):
                runs.append(group)
        # The parameters' gradients go out once, summed with the old rows' part, from the
        # group's backward (which runs after every merge of the group: they consume its token).
        group.deposit(index)
        return (None,) * 7
