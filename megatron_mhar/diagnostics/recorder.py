"""Recording the routing weights: per site, the sum over sampled tokens of each source's
softmax weight and of each head's routing entropy. An MHAR decoder's source stream calls
:meth:`RoutingRecorder.record` at each site when one is attached (``routing_recorder``)."""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from megatron_mhar.ops.depth_route import routing_weights

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
