"""Routing sites and the layout of sources over depth for the full and block variants.

Sublayers are numbered globally and 1-based: decoder layer ``l`` (1-based) owns the
attention sublayer ``2l - 1`` and the MLP sublayer ``2l``; the final routing site of a
model with ``L`` layers is ``2L + 1``. The embedding is source 0.

Both variants are one rule with a block size ``S`` counted in sublayers (the paper's variants):
sublayer ``j`` lies in block ``n = (j - 1) // S + 1`` at position ``i = (j - 1) % S + 1``
(both 1-based). It reads the completed block sources ``b_0 .. b_{n-1}`` (history rows
``0 .. n-1``; ``b_0`` is the embedding) plus, when ``i >= 2``, the running partial
``b_n^{i-1}``, the sum of the block's outputs so far. A block of S outputs, once
complete, becomes row ``n``. The full variant is ``S = 1``: every sublayer output is its
own row and no partial ever exists.

The delta variant (continued pretraining, in the paper) keeps the additive stream ``h``
and corrects each sublayer input: ``x_j = h_{j-1} + a_j * route_j([null_j] + sources)``,
with sources the embedding and the delta ``h_end - h_start`` of every completed block of
``delta_block_layers`` decoder layers. The stream itself stays ``h_j = h_{j-1} + f_j``,
so with the zero-initialised gates ``a_j`` the model computes exactly the base model.
The null source joins as the routing op's extra source (softmax over sources does not
depend on their order).
"""

import dataclasses
from typing import Dict, List, Optional

import torch

from megatron_mhar.models.main_grad import accumulate_into_main_grad
from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.ops.depth_route import routing_weights
from megatron_mhar.ops.history import SourceHistory, get_backend
from megatron_mhar.ops.lookahead import GroupSite, LookaheadHistory, get_lookahead_backend
from megatron_mhar.ops.schedules import auto_group_size, group_ranges


@dataclasses.dataclass(frozen=True)
class DepthLayout:
    """Which history rows each routing site reads and each sublayer writes."""

    num_layers: int
    """Decoder layers L of the whole model (all pipeline stages)."""

    block_size: int
    """Sublayers per block; 1 is the full variant."""

    has_final_site = True

    @classmethod
    def from_config(cls, mhar: MHARConfig, num_layers: int) -> "DepthLayout":
        return cls(num_layers=num_layers, block_size=mhar.block_size if mhar.variant == "block" else 1)

    def new_stream(
        self, mhar: MHARConfig, eps: float, like: torch.Tensor, routers: Optional[Dict] = None
    ) -> "DepthStream":
        return DepthStream(self, mhar, eps, like, routers)

    @property
    def final_site(self) -> int:
        return 2 * self.num_layers + 1

    @property
    def capacity(self) -> int:
        """Rows the history ever holds: the embedding plus every completed block."""
        return 1 + (2 * self.num_layers) // self.block_size

    def position(self, site: int):
        """(block n, position i) of routing site / sublayer ``site``, both 1-based."""
        return (site - 1) // self.block_size + 1, (site - 1) % self.block_size + 1

    def rows_read(self, site: int) -> int:
        """Completed rows read by ``site`` (rows ``0 .. n-1``)."""
        return self.position(site)[0]

    def reads_partial(self, site: int) -> bool:
        """Whether ``site`` also reads the running partial of its block."""
        return self.position(site)[1] >= 2

    def completes_block(self, site: int) -> bool:
        """Whether sublayer ``site``'s output completes its block (row ``n`` is written)."""
        return self.position(site)[1] == self.block_size

    def boundary(self, site: int):
        """(rows, has_partial) of the history entering sublayer ``site`` (a stage input)."""
        return self.rows_read(site), self.reads_partial(site)

    def boundary_width(self, site: int) -> int:
        """Number of [s, b, h] slices crossing into sublayer ``site`` from a previous stage."""
        rows, partial = self.boundary(site)
        return rows + int(partial)

    def source_names(self, site: int) -> List[str]:
        """Names of the sources ``site`` routes over, in the routing op's order: ``emb``,
        then ``s<j>`` (sublayer j's output, full variant) or ``b<n>`` (block n), then
        ``partial`` (the running sum of the site's own block)."""
        row = "s" if self.block_size == 1 else "b"
        names = ["emb"] + [f"{row}{k}" for k in range(1, self.rows_read(site))]
        return names + ["partial"] if self.reads_partial(site) else names


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


class DepthStream:
    """What flows through an MHAR decoder for one micro-batch: source history + partial.

    Created by the block for each forward call and passed down to every layer.
    ``routers`` maps each routing site of this chunk of layers to its router; the
    lookahead schedule (``mhar.routing_schedule``) needs it to read the queries of a
    group's later sites, and splits the chunk's sites into groups of
    ``mhar.lookahead_group`` (``group_ranges``), so no group spans a pipeline stage.
    """

    def __init__(
        self,
        layout: DepthLayout,
        mhar: MHARConfig,
        eps: float,
        like: torch.Tensor,
        routers: Optional[Dict[int, DepthRouter]] = None,
    ):
        self.layout = layout
        self.partial: Optional[torch.Tensor] = None
        self.routing: Optional[RoutingRecorder] = None
        self.routers = None
        if mhar.routing_schedule == "lookahead":
            if not routers:
                raise ValueError("routing_schedule='lookahead' needs the chunk's routers by site")
            self.routers = routers
            self.first_site, self.last_site = min(routers), max(routers)
            group_size = mhar.lookahead_group or auto_group_size(layout.final_site)
            self.groups = {j: g for g in group_ranges(self.first_site, self.last_site, group_size) for j in g}
            self.history = LookaheadHistory(
                capacity=layout.capacity,
                like=like,
                backend=get_backend(mhar.kernel_impl, like.device),
                lookahead=get_lookahead_backend(mhar.kernel_impl, like.device, mhar.lookahead_kernels),
                num_heads=mhar.num_heads,
                eps=eps,
                logit_scale=mhar.logit_scale,
                param_grads_hook=accumulate_into_main_grad,
            )
        else:
            self.history = _history(layout.capacity, mhar, eps, like)

    def group_of(self, site: int):
        """(the sites of ``site``'s lookahead group, ``site``'s index in it)."""
        group = self.groups[site]
        sites = []
        for j in group:
            router = self.routers[j]
            sites.append(GroupSite(j, self.layout.rows_read(j), router.query, router.norm_weight))
        return sites, site - group.start

    def read(self, site: int, router: DepthRouter) -> torch.Tensor:
        """The routed input ``x_site`` [s, b, h]."""
        extra = self.partial if self.layout.reads_partial(site) else None
        rows = self.layout.rows_read(site)
        if self.routing is not None:
            self.routing.record(site, self.history, router, rows, extra)
        if self.routers is not None and extra is None:
            if self.routers.get(site) is not router:
                raise ValueError(f"site {site} is routed by a router the stream was not given")
            return self.history.route_group(*self.group_of(site))
        return self.history.route(
            self.layout.rows_read(site), router.query, router.norm_weight, extra
        )

    def write(self, site: int, output: torch.Tensor) -> None:
        """Record sublayer ``site``'s output [s, b, h]."""
        block, position = self.layout.position(site)
        self.partial = output if position == 1 else self.partial + output
        if self.layout.completes_block(site):
            self.history.write(block, self.partial)
            self.partial = None

    def write_embedding(self, embedding: torch.Tensor) -> None:
        self.history.write(0, embedding)

    def pack(self, next_site: int) -> torch.Tensor:
        """The stream entering ``next_site`` as one [s, b, width * h] tensor (stage output)."""
        rows, has_partial = self.layout.boundary(next_site)
        packed = self.history.pack(rows)
        if has_partial:
            packed = torch.cat([packed, self.partial], dim=-1)
        return packed

    def load(self, packed: torch.Tensor, next_site: int) -> None:
        """Restore the stream entering ``next_site`` from a received stage input."""
        rows, has_partial = self.layout.boundary(next_site)
        h = self.history.shape[-1]
        self.history.load(packed[..., : rows * h] if has_partial else packed, rows)
        if has_partial:
            self.partial = packed[..., rows * h :]

    def checkpoint_state(self, next_site: int):
        """Tensors carrying the stream across an activation-checkpoint boundary.

        ``(token,)`` or ``(token, partial)``: the arity is fixed by the layout at a
        given boundary, so a recomputed chunk returns the same structure.
        """
        token = self.history.token
        return (token,) if self.partial is None else (token, self.partial)

    def restore_state(self, token: torch.Tensor, partial: Optional[torch.Tensor] = None) -> None:
        if self.routers is not None and token is not self.history.token:
            # A checkpointed chunk restarts here: rerun its group's phase 1 in this graph.
            self.history.end_group()
        self.history.token = token
        self.partial = partial

    def output(self, final_router: DepthRouter) -> torch.Tensor:
        """The decoder output before the final norm: the final site's routed mixture, through
        the router module (a spec may have wrapped it)."""
        return final_router(self, self.layout.final_site)


ROUTING_SAMPLE_TOKENS = 256
"""Tokens per micro-batch whose routing the training driver records (a diagnostic sample)."""


@dataclasses.dataclass
class SiteRouting:
    """Routing of one site summed over recorded tokens; divide by ``tokens`` for means."""

    weights: torch.Tensor
    """[N, H] fp32: the sum over tokens of each source's softmax weight, per head."""

    entropy: torch.Tensor
    """[H] fp32: the sum over tokens of each head's routing entropy in nats."""

    tokens: int
    """Tokens summed."""

    def add(self, other: "SiteRouting") -> "SiteRouting":
        return SiteRouting(self.weights + other.weights, self.entropy + other.entropy,
                           self.tokens + other.tokens)


class RoutingRecorder:
    """Per-site routing weights and entropy of the forwards it is attached to (a diagnostic).

    ``sample_tokens`` caps the tokens recorded per forward and site (the first tokens of
    the micro-batch); ``None`` records them all. Sums accumulate over forwards.
    """

    def __init__(self, sample_tokens: Optional[int] = ROUTING_SAMPLE_TOKENS):
        self.sample_tokens = sample_tokens
        self.sites: Dict[int, SiteRouting] = {}

    @torch.no_grad()
    def record(self, site: int, history, router, rows: int, extra: Optional[torch.Tensor]) -> None:
        """Add ``site``'s routing over history rows ``[0, rows)`` (then ``extra``) to the sums."""
        limit = self.sample_tokens
        sources = history.rows(rows)[:limit].transpose(0, 1)  # [N, t, h]
        if extra is not None:
            sample = extra.reshape(-1, history.shape[-1])[:limit]
            sources = torch.cat([sources, sample.unsqueeze(0)])
        weights = routing_weights(
            sources, router.query, router.norm_weight, history.num_heads, history.eps,
            history.logit_scale,
        )  # [N, t, H]
        entropy = -(weights * weights.clamp_min(1e-30).log()).sum(0)  # [t, H]
        found = SiteRouting(weights.sum(1), entropy.sum(0), weights.shape[1])
        self.sites[site] = self.sites[site].add(found) if site in self.sites else found


def make_layout(mhar: MHARConfig, num_layers: int):
    """The layout of ``mhar.variant`` (full and block share :class:`DepthLayout`)."""
    if mhar.variant == "delta":
        return DeltaLayout(num_layers=num_layers, block_layers=mhar.delta_block_layers)
    return DepthLayout.from_config(mhar, num_layers)


def _history(capacity: int, mhar: MHARConfig, eps: float, like: torch.Tensor) -> SourceHistory:
    return SourceHistory(
        capacity=capacity,
        like=like,
        backend=get_backend(mhar.kernel_impl, like.device),
        num_heads=mhar.num_heads,
        eps=eps,
        logit_scale=mhar.logit_scale,
    )


@dataclasses.dataclass(frozen=True)
class DeltaLayout:
    """Sources of the delta variant: row 0 the embedding, row k the delta of block k."""

    num_layers: int
    """Decoder layers L of the whole model."""

    block_layers: int
    """Decoder layers per block."""

    has_final_site = False

    @property
    def capacity(self) -> int:
        """Rows ever read: the embedding and every block completed before the last layer."""
        return 1 + (self.num_layers - 1) // self.block_layers

    @staticmethod
    def layer_of(site: int) -> int:
        """1-based decoder layer of sublayer ``site``."""
        return (site + 1) // 2

    def rows_read(self, site: int) -> int:
        return 1 + (self.layer_of(site) - 1) // self.block_layers

    def completes_block(self, site: int) -> bool:
        """Whether sublayer ``site`` ends a block whose delta a later layer reads."""
        layer = self.layer_of(site)
        return site % 2 == 0 and layer % self.block_layers == 0 and layer < self.num_layers

    def starts_block(self, site: int) -> bool:
        """Whether ``site`` is the first sublayer of a block (then ``h_start`` is ``h``)."""
        return site % 2 == 1 and (self.layer_of(site) - 1) % self.block_layers == 0

    def boundary_width(self, site: int) -> int:
        """Stream ``h``, the block's start ``h_start`` (unless it is ``h``) and the rows."""
        return 1 + int(not self.starts_block(site)) + self.rows_read(site)

    def source_names(self, site: int) -> List[str]:
        """``emb``, ``d<k>`` (the delta of block k), then ``null`` (the site's null source)."""
        return ["emb"] + [f"d{k}" for k in range(1, self.rows_read(site))] + ["null"]

    def new_stream(self, mhar: MHARConfig, eps: float, like: torch.Tensor, routers=None) -> "DeltaStream":
        return DeltaStream(self, mhar, eps, like)


class DeltaRouter(DepthRouter):
    """A delta routing site: query and key norm, a null source and a scalar gate (zero init)."""

    def __init__(self, config):
        super().__init__(config)
        self.null_source = torch.nn.Parameter(torch.zeros_like(self.query))
        self.gate = torch.nn.Parameter(torch.zeros(1, dtype=self.query.dtype, device=self.query.device))
        for param in (self.null_source, self.gate):
            setattr(param, "sequence_parallel", config.sequence_parallel)


class DeltaStream:
    """The delta variant's state of one micro-batch: stream ``h``, block start, history."""

    def __init__(self, layout: DeltaLayout, mhar: MHARConfig, eps: float, like: torch.Tensor):
        self.layout = layout
        self.history = _history(layout.capacity, mhar, eps, like)
        self.hidden: Optional[torch.Tensor] = None
        self.block_start: Optional[torch.Tensor] = None
        self.routing: Optional[RoutingRecorder] = None

    def read(self, site: int, router: DeltaRouter) -> torch.Tensor:
        """``x = h + gate * route([null] + rows)`` [s, b, h]."""
        null = router.null_source.to(self.hidden.dtype).expand_as(self.hidden)
        rows = self.layout.rows_read(site)
        if self.routing is not None:
            self.routing.record(site, self.history, router, rows, null)
        routed = self.history.route(rows, router.query, router.norm_weight, extra=null)
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

    def pack(self, next_site: int) -> torch.Tensor:
        rows = self.layout.rows_read(next_site)
        return torch.cat([*self._state(next_site), self.history.pack(rows)], dim=-1)

    def load(self, packed: torch.Tensor, next_site: int) -> None:
        h = self.history.shape[-1]
        width = 1 if self.layout.starts_block(next_site) else 2
        self._restore(*packed[..., : width * h].split(h, dim=-1))
        self.history.load(packed[..., width * h :], self.layout.rows_read(next_site))

    def checkpoint_state(self, next_site: int):
        return (self.history.token, *self._state(next_site))

    def restore_state(self, token, *state) -> None:
        self.history.token = token
        self._restore(*state)

    def output(self, final_router) -> torch.Tensor:
        """The decoder output before the final norm: the additive stream."""
        return self.hidden
