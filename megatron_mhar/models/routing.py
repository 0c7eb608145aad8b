"""The Megatron model's routing: routers and the per-forward source stream of each variant
(a :class:`~megatron_mhar.diagnostics.recorder.RoutingRecorder` set as a stream's
``routing`` records what it routes). Which sources each site reads is the routing layout
(:mod:`megatron_mhar.ops.routing_layout`), shared with the transformers model.
"""

from typing import Dict, Optional, Union

import torch

from megatron_mhar.models.main_grad import accumulate_into_main_grad
from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.ops.history import SourceHistory, get_backend
from megatron_mhar.ops.lookahead import GroupSite, LookaheadHistory, get_lookahead_backend
from megatron_mhar.ops.routing_layout import DeltaLayout, DepthLayout, Layout, layout_for
from megatron_mhar.ops.schedules import lookahead_groups, phase1_kernels


class DepthRouter(torch.nn.Module):
    """One routing site: pseudo-query ``w_j`` (zero init) and key RMSNorm weight ``g_j`` (ones).

    The parameters are replicated over tensor-parallel ranks. They are marked
    ``sequence_parallel`` when the tokens are sharded over the TP group, so that
    Megatron's ``finalize_model_grads`` all-reduces their gradients (each rank sees a
    different slice of the sequence).
    """

    def __init__(self, config):
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        kwargs = dict(dtype=config.params_dtype, device=device)
        self.query = torch.nn.Parameter(torch.zeros(config.hidden_size, **kwargs))
        self.norm_weight = torch.nn.Parameter(torch.ones(config.hidden_size, **kwargs))
        for param in (self.query, self.norm_weight):
            setattr(param, "sequence_parallel", config.sequence_parallel)

    def forward(self, stream: "DepthStream", site: int) -> torch.Tensor:
        return stream.read(site, self)


class _SourceStream:
    """The source history of one micro-batch and how a site reads it: per site over all its
    sources, or, under the lookahead schedule (``mhar.routing_schedule``), group by group.

    ``routers`` maps each routing site of this chunk of layers to its router; the lookahead
    schedule needs it to read the queries of a group's later sites, and splits the chunk's
    sites into groups (runs of ``mhar.lookahead_group`` sites in the full variant, the blocks
    in the block and delta variants: ``lookahead_groups``), so no group spans a pipeline
    stage. A site's source outside the history (the block variant's running partial, the
    delta variant's null source) is its group's *extra* source."""

    def __init__(self, layout: Layout, mhar: MHARConfig, eps: float, like: torch.Tensor,
                 routers: Optional[Dict[int, DepthRouter]], group_sites: int, num_sites: int):
        self.layout = layout
        self.routing: Optional[RoutingRecorder] = None
        self.routers = None
        if mhar.routing_schedule != "lookahead":
            self.history = _history(layout.capacity, mhar, eps, like)
            return
        if not routers:
            raise ValueError("routing_schedule='lookahead' needs the chunk's routers by site")
        self.routers = routers
        groups = lookahead_groups(min(routers), max(routers), num_sites, group_sites, mhar.lookahead_group)
        self.groups = {j: g for g in groups for j in g}
        self.history = LookaheadHistory(
            capacity=layout.capacity,
            like=like,
            backend=get_backend(mhar.kernel_impl, like.device),
            lookahead=get_lookahead_backend(mhar.kernel_impl, like.device,
                                            phase1_kernels(mhar.lookahead_kernels, group_sites)),
            num_heads=mhar.num_heads,
            eps=eps,
            logit_scale=mhar.logit_scale,
            param_grads_hook=accumulate_into_main_grad,
        )

    def reads_extra(self, site: int) -> bool:
        raise NotImplementedError

    def group_of(self, site: int):
        """(the sites of ``site``'s lookahead group, ``site``'s index in it)."""
        group = self.groups[site]
        sites = []
        for j in group:
            router = self.routers[j]
            sites.append(GroupSite(j, self.layout.rows_read(j), router.query, router.norm_weight, self.reads_extra(j)))
        return sites, site - group.start

    def route(self, site: int, router: DepthRouter, extra: Optional[torch.Tensor]) -> torch.Tensor:
        """``site``'s routed mixture [s, b, h] of its rows and ``extra`` (if any)."""
        if self.routers is None:
            return self.history.route(self.layout.rows_read(site), router.query, router.norm_weight, extra)
        if self.routers.get(site) is not router:
            raise ValueError(f"site {site} is routed by a router the stream was not given")
        return self.history.route_group(*self.group_of(site), extra=extra)

    def _restore_token(self, token: torch.Tensor) -> None:
        if self.routers is not None and token is not self.history.token:
            # A checkpointed chunk restarts here: rerun its group's phase 1 in this graph.
            self.history.end_group()
        self.history.token = token


class DepthStream(_SourceStream):
    """What flows through an MHAR decoder for one micro-batch: source history + partial.

    Created by the block for each forward call and passed down to every layer.
    """

    def __init__(
        self,
        layout: DepthLayout,
        mhar: MHARConfig,
        eps: float,
        like: torch.Tensor,
        routers: Optional[Dict[int, DepthRouter]] = None,
    ):
        super().__init__(layout, mhar, eps, like, routers, layout.block_size, layout.final_site)
        self.partial: Optional[torch.Tensor] = None

    def reads_extra(self, site: int) -> bool:
        return self.layout.reads_partial(site)

    def read(self, site: int, router: DepthRouter) -> torch.Tensor:
        """The routed input ``x_site`` [s, b, h]."""
        extra = self.partial if self.layout.reads_partial(site) else None
        rows = self.layout.rows_read(site)
        if self.routing is not None:
            self.routing.record(site, self.history, router, rows, extra)
        return self.route(site, router, extra)

    def write(self, site: int, output: torch.Tensor) -> None:
        """Record sublayer ``site``'s output [s, b, h]."""
        block, position = self.layout.position(site)
        self.partial = output if position == 1 else self.partial + output
        if self.layout.completes_block(site):
            self.history.write(block, self.partial)
            self.partial = None

    def write_embedding(self, embedding: torch.Tensor) -> None:
        self.history.write(0, embedding)

    def pack(self, next_site: int, cached_rows: int = 0) -> torch.Tensor:
        """The stream entering ``next_site`` as one [s, b, width * h] tensor (stage output),
        less the first ``cached_rows`` rows, which the receiving rank holds already."""
        rows, has_partial = self.layout.boundary(next_site)
        packed = self.history.pack(rows, cached_rows)
        if has_partial:
            packed = torch.cat([packed, self.partial], dim=-1)
        return packed

    def load(self, packed: torch.Tensor, next_site: int, cached: Optional[SourceHistory] = None,
             cached_rows: int = 0) -> None:
        """Restore the stream entering ``next_site`` from a received stage input, the first
        ``cached_rows`` rows from ``cached`` (this rank's earlier chunk's history)."""
        rows, has_partial = self.layout.boundary(next_site)
        h = self.history.shape[-1]
        received = (rows - cached_rows) * h
        self.history.load(packed[..., :received] if has_partial else packed, rows, cached_rows, cached)
        if has_partial:
            self.partial = packed[..., received:]

    def checkpoint_state(self, next_site: int):
        """Tensors carrying the stream across an activation-checkpoint boundary.

        ``(token,)`` or ``(token, partial)``: the arity is fixed by the layout at a
        given boundary, so a recomputed chunk returns the same structure.
        """
        token = self.history.token
        return (token,) if self.partial is None else (token, self.partial)

    def restore_state(self, token: torch.Tensor, partial: Optional[torch.Tensor] = None) -> None:
        self._restore_token(token)
        self.partial = partial

    def output(self, final_router: DepthRouter) -> torch.Tensor:
        """The decoder output before the final norm: the final site's routed mixture, through
        the router module (a spec may have wrapped it)."""
        return final_router(self, self.layout.final_site)


def make_layout(mhar: MHARConfig, num_layers: int) -> Layout:
    """The routing layout of ``mhar`` over ``num_layers`` decoder layers."""
    return layout_for(mhar.variant, num_layers, mhar.block_size, mhar.delta_block_layers)


def new_stream(layout: Layout, mhar: MHARConfig, eps: float, like: torch.Tensor,
               routers: Optional[Dict] = None) -> Union["DepthStream", "DeltaStream"]:
    """One forward's source stream for ``layout`` (``like``: a [s, b, h] tensor of the
    sources' shape, dtype and device)."""
    if isinstance(layout, DeltaLayout):
        return DeltaStream(layout, mhar, eps, like, routers)
    return DepthStream(layout, mhar, eps, like, routers)


def _history(capacity: int, mhar: MHARConfig, eps: float, like: torch.Tensor) -> SourceHistory:
    return SourceHistory(
        capacity=capacity,
        like=like,
        backend=get_backend(mhar.kernel_impl, like.device),
        num_heads=mhar.num_heads,
        eps=eps,
        logit_scale=mhar.logit_scale,
    )


class DeltaRouter(DepthRouter):
    """A delta routing site: query and key norm, a null source and a scalar gate (zero init)."""

    def __init__(self, config):
        super().__init__(config)
        self.null_source = torch.nn.Parameter(torch.zeros_like(self.query))
        self.gate = torch.nn.Parameter(torch.zeros(1, dtype=self.query.dtype, device=self.query.device))
        for param in (self.null_source, self.gate):
            setattr(param, "sequence_parallel", config.sequence_parallel)


class DeltaStream(_SourceStream):
    """The delta variant's state of one micro-batch: stream ``h``, block start, history."""

    def __init__(self, layout: DeltaLayout, mhar: MHARConfig, eps: float, like: torch.Tensor,
                 routers: Optional[Dict[int, DeltaRouter]] = None):
        super().__init__(layout, mhar, eps, like, routers, 2 * layout.block_layers, 2 * layout.num_layers)
        self.hidden: Optional[torch.Tensor] = None
        self.block_start: Optional[torch.Tensor] = None

    def reads_extra(self, site: int) -> bool:
        return True  # every site reads its null source

    def read(self, site: int, router: DeltaRouter) -> torch.Tensor:
        """``x = h + gate * route([null] + rows)`` [s, b, h]."""
        null = router.null_source.to(self.hidden.dtype).expand_as(self.hidden)
        rows = self.layout.rows_read(site)
        if self.routing is not None:
            self.routing.record(site, self.history, router, rows, null)
        routed = self.route(site, router, null)
        return self.hidden + router.gate.to(routed.dtype) * routed

    def write(self, site: int, output: torch.Tensor) -> None:
        self.hidden = self.hidden + output
        if self.layout.completes_block(site):
            block = self.layout.layer_of(site) // self.layout.block_layers
            self.history.write(block, self.hidden - self.block_start)
            self.block_start = self.hidden

    def write_embedding(self, embedding: torch.Tensor) -> None:
        self.hidden = self.block_start = embedding
        self.history.write(0, embedding)

    def _state(self, site: int):
        """(h,) at a block start, else (h, h_start): the arity is fixed by the layout."""
        if self.layout.starts_block(site):
            return (self.hidden,)
        return self.hidden, self.block_start

    def _restore(self, hidden, block_start=None) -> None:
        self.hidden = hidden
        self.block_start = hidden if block_start is None else block_start

    def pack(self, next_site: int, cached_rows: int = 0) -> torch.Tensor:
        """(h, h_start unless it is h, rows ``[cached_rows, rows_read)``) along the hidden dim."""
        rows = self.layout.rows_read(next_site)
        return torch.cat([*self._state(next_site), self.history.pack(rows, cached_rows)], dim=-1)

    def load(self, packed: torch.Tensor, next_site: int, cached: Optional[SourceHistory] = None,
             cached_rows: int = 0) -> None:
        h = self.history.shape[-1]
        width = 1 if self.layout.starts_block(next_site) else 2
        self._restore(*packed[..., : width * h].split(h, dim=-1))
        self.history.load(packed[..., width * h :], self.layout.rows_read(next_site), cached_rows, cached)

    def checkpoint_state(self, next_site: int):
        return (self.history.token, *self._state(next_site))

    def restore_state(self, token, *state) -> None:
        self._restore_token(token)
        self._restore(*state)

    def output(self, final_router) -> torch.Tensor:
        """The decoder output before the final norm: the additive stream."""
        return self.hidden
