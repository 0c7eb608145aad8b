"""Routing ops: the functional depth_route and the per-forward source history."""

from megatron_mhar.ops.depth_route import depth_route, depth_route_reference

__all__ = ["depth_route", "depth_route_reference"]
