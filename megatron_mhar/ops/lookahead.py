"""Two-phase ("lookahead") routing: the groups and the history.

The schedule and its maths are described with its torch reference
(:mod:`megatron_mhar.ops.lookahead_reference`); the Triton kernels of
``mhar_kernels.lookahead`` implement the same functions. This module runs them: a
:class:`LookaheadHistory` is a :class:`SourceHistory` whose reads go through groups of sites
(:class:`RoutingGroup`), each an autograd node for phase 1 and one per site for the merges.
The groups themselves (which sites, how many) are planned in :mod:`megatron_mhar.ops.schedules`.
The per-site path is untouched.

The block and delta variants group the sites of a block: they all read the same completed
block sources (the group's old rows), and each site's only other source is a tensor outside
the history (the block's running partial, the site's null source: its *extra* source),
which its merge folds in as its one new row. Phase 1 then reads each completed block source once per block and its
backward adds each one's fp32 gradient once per block, not once per site.

Memory. Saved for backward per site: the log-sum-exp (fp32 ``[T, H]``) and a reference
to the routed output. Transient: the G accumulators of the current group, fp32
``[G, T, D]`` (G * T * D * 4 bytes: 84 MB at the 1B shape, G = 8, T = 2048, D = 1280; the
fused row loop keeps them normalised in the rows' half-precision dtype, half that)
from the group's first site to its last merge, plus ``m`` and ``l`` (``2 G T H * 4``);
during backward, the group's grad outputs ``[G, T, D]`` in the activation dtype and its new
rows' gradient factors (fp32 ``[G, T, G - 1, H, 2]`` and ``[G, T, G - 1]``: 7.8 MB at the
1B shape) from the last site's merge backward to the group's phase-1 backward.
"""

import functools
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from megatron_mhar.ops import lookahead_reference as reference
from megatron_mhar.ops.depth_route import resolve_impl
from megatron_mhar.ops.history import RoutingBackend, SourceHistory
from megatron_mhar.ops.schedules import LOOKAHEAD_KERNELS


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
    reference.torch_group_forward, reference.torch_merge_forward, reference.torch_merge_backward,
    reference.torch_group_backward_deferred, reference.torch_add_row_grads, reference.torch_merge_row_grad,
    reference.torch_merge_dw_partials,
)


def get_lookahead_backend(impl: str, device: torch.device, lookahead_kernels: str = "auto") -> LookaheadBackend:
    """The two-phase backend for ``impl`` (``auto`` picks Triton on CUDA when available);
    ``lookahead_kernels``: the Triton phase-1 kernels (``mhar.lookahead_kernels``, one of
    :data:`~megatron_mhar.ops.schedules.LOOKAHEAD_KERNELS`)."""
    if lookahead_kernels not in LOOKAHEAD_KERNELS:
        raise ValueError(f"lookahead_kernels must be one of {list(LOOKAHEAD_KERNELS)}, got {lookahead_kernels!r}")
    if resolve_impl(impl, device) == "torch":
        return TORCH_LOOKAHEAD
    from mhar_kernels import lookahead as fused

    return LookaheadBackend(
        functools.partial(fused.group_forward, lookahead_kernels=lookahead_kernels),
        fused.merge_forward,
        fused.merge_backward,
        functools.partial(fused.group_backward_deferred, lookahead_kernels=lookahead_kernels),
        fused.add_row_grads,
        fused.merge_row_grad,
        fused.merge_dw_partials,
    )


class GroupSite(NamedTuple):
    """One routing site of a group: its index, rows read, and parameters; ``extra``: it also
    reads a source outside the history (the block variant's running partial, the delta
    variant's null source), its only new source, so it reads no row written since the group
    started."""

    site: int
    num_rows: int
    query: torch.Tensor
    norm_weight: torch.Tensor
    extra: bool = False


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
        # (reference.torch_merge_backward), which the group's backward reduces with its own.
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

    def route_group(self, sites: Sequence[GroupSite], index: int,
                    extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Route site ``sites[index]`` of a group (``sites`` in order, all on this stage);
        ``extra`` [s, b, h]: its extra source, for a site that reads one."""
        site = sites[index]
        if not 0 < sites[0].num_rows <= site.num_rows <= self.rows_written:
            raise IndexError(
                f"site {site.site} routes over {site.num_rows} rows (group start "
                f"{sites[0].num_rows}) but only {self.rows_written} are written"
            )
        if (extra is not None) != site.extra:
            raise ValueError(f"site {site.site} {'reads' if site.extra else 'does not read'} an extra source, "
                             f"but {'none' if extra is None else 'one'} was given")  # fmt: skip
        if site.extra and site.num_rows != sites[0].num_rows:
            raise ValueError(f"site {site.site} reads an extra source and rows written since its group started")
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
            self, group, index, self.token, self.group_token, site.query, site.norm_weight, extra
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
        # Site 0 merges no new source unless it reads an extra one: phase 1 finishes it.
        first_out = None
        if not group.sites[0].extra:
            group.first_out = rows.new_empty((rows.shape[0], rows.shape[2]))
            first_out = (group.first_out, group.site_lse[0])
        partials = history.lookahead.group_forward(
            rows, queries, norms, history.num_heads, history.eps, history.logit_scale, first_out=first_out,
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


def _new_sources(history, group, index, extra):
    """[T, n, D]: the sources site ``index``'s merge folds in (its extra source as one row)."""
    if extra is None:
        return history.rows(group.sites[index].num_rows, group.old_rows)
    flat = extra.reshape(history.num_tokens, 1, extra.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


class _MergeSite(torch.autograd.Function):
    @staticmethod
    def forward(ctx, history, group, index, token, group_token, query, norm_weight, extra):
        s, b, h = history.shape
        if index == 0 and extra is None:  # no new source: phase 1 finished it
            out, group.first_out = group.first_out, None
        else:
            m, l, acc = group.partials[index]
            out = history.lookahead.merge_forward(
                m, l, acc, _new_sources(history, group, index, extra),
                query, norm_weight, history.num_heads, history.eps, history.logit_scale,
                group.site_lse[index],
            )  # fmt: skip
        result = out.view(s, b, h)
        ctx.set_materialize_grads(False)
        ctx.history, ctx.group, ctx.index = history, group, index
        # Saved as an output: autograd then refuses a backward after an in-place change.
        ctx.save_for_backward(query, norm_weight, result, extra)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        if grad_out is None:  # the routed output was not used
            return (None,) * 8
        history, group, index = ctx.history, ctx.group, ctx.index
        query, norm_weight, out, extra = ctx.saved_tensors
        s, b, h = history.shape
        flat_grad = grad_out.reshape(s * b, h)
        partials = history.lookahead.merge_dw_partials(s * b, h, history.num_heads, flat_grad.device)
        grad_out_slot, delta_slot, row_factors, dw_slot = group.workspace(
            index, flat_grad, history.num_heads, partials
        )
        # The extra source's only reader is this site: the merge writes its gradient whole.
        grad_extra = None if extra is None else torch.empty(extra.shape, dtype=extra.dtype, device=extra.device)
        history.lookahead.merge_backward(
            flat_grad, out.reshape(s * b, h), _new_sources(history, group, index, extra),
            query, norm_weight, group.site_lse[index],
            history.num_heads, history.eps, history.logit_scale,
            None if extra is not None else row_factors, delta_slot, grad_out_slot, dw_slot,
            row_grads=None if extra is None else grad_extra.view(s * b, 1, h),
        )  # fmt: skip
        # The new rows' gradients are added when each is due (LookaheadHistory.due_row_grad).
        for row in range(group.old_rows, group.sites[index].num_rows):
            runs = history.pending.setdefault(row, [])
            if not any(g is group for g in runs):
                runs.append(group)
        # The parameters' gradients go out once, summed with the old rows' part, from the
        # group's backward (which runs after every merge of the group: they consume its token).
        group.deposit(index)
        return (None,) * 7 + (grad_extra,)
