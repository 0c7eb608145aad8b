"""The torch reference of the two-phase ("lookahead") routing schedule, full variant.

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

This module holds the pure-torch backend functions: the reference the Triton kernels of
``mhar_kernels.lookahead`` are tested against (same functions, same signatures), and the
CPU path. Shapes: T tokens, N rows, D width, H heads, G sites. The norm weight is rounded
to the sources' dtype and folded into the query (w = q * g), as the fused kernels do; all
statistics in fp32. The groups and the history that call them are in
:mod:`megatron_mhar.ops.lookahead`.
"""

from typing import NamedTuple, Optional, Sequence, Tuple

import torch


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
    row_factors: Optional[Tuple[torch.Tensor, torch.Tensor]],
    delta_out: Optional[torch.Tensor] = None,
    grad_out_copy: Optional[torch.Tensor] = None,
    dw_out: Optional[torch.Tensor] = None,
    row_grads: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Backward of the merge. The new rows' gradients are left as factors, which
    :func:`torch_merge_row_grad` adds when a row is due, or, where this site is their only
    reader, written whole into ``row_grads`` ([T, n, D], any dtype; ``row_factors`` is then
    None); ``delta_out`` receives delta
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
    if (row_grads is None) == (row_factors is None):
        raise ValueError("torch_merge_backward takes either row_factors or row_grads")
    whole = None if row_grads is None else torch.zeros(row_grads.shape, dtype=compute, device=row_grads.device)
    dw = _source_grads(
        sources, w, do[None], lse.to(compute)[None], delta[None], eps, logit_scale, whole, row_factors
    )
    if row_grads is not None:
        row_grads.copy_(whole)
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
