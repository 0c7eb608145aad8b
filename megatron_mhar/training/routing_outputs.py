"""What a run records of its routing: when a step records it, the decoders' recorders, the
records gathered from every rank, and the routing maps in TensorBoard and the run directory
(:mod:`megatron_mhar.diagnostics.maps` draws them). A mixin of
:class:`~megatron_mhar.training.loop.Trainer`."""

from __future__ import annotations

from typing import Dict, Optional

import torch
from megatron.core import parallel_state

from megatron_mhar.diagnostics.recorder import RoutingRecorder, SiteRouting
from megatron_mhar.models.routing import make_layout
from megatron_mhar.training.model import unwrap


class RoutingOutputs:
    """The Trainer's routing diagnostics (reads its ``cfg``, ``model``, ``routing``,
    ``metrics``, ``iteration``, ``dp_rank``, ``is_logger`` and ``run_dir``)."""

    def _records_routing(self, step: int) -> bool:
        """Whether training step ``step`` records the routing diagnostics (same on every rank)."""
        log = self.cfg.logging
        return self.cfg.mhar.enabled and ((log.routing_entropy and self._logged(step)) or self._maps_step(step))

    def _maps_step(self, step: int) -> bool:
        """Whether step ``step`` logs the routing maps to TensorBoard (``logging.routing_interval``)."""
        interval = self.cfg.logging.routing_interval
        return bool(interval) and step % interval == 0

    def _attach_routing_recorder(self, recorder: Optional[RoutingRecorder]) -> None:
        """Have the MHAR decoders of this rank add their routing to ``recorder`` (``None``: stop)."""
        for chunk in self.model:
            decoder = getattr(unwrap(chunk), "decoder", None)
            if hasattr(decoder, "routing_recorder"):
                decoder.routing_recorder = recorder

    def _gather_routing(self, recorder: RoutingRecorder) -> Dict[int, SiteRouting]:
        """Every rank's recorded sites (one copy per site: DP and TP rank 0), on every rank."""
        local = {}
        if self.dp_rank == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
            local = {site: (r.weights.cpu(), r.entropy.cpu(), r.tokens) for site, r in recorder.sites.items()}
        gathered = [local]
        if torch.distributed.get_world_size() > 1:
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, local)
        return {site: SiteRouting(*record) for part in gathered for site, record in part.items()}

    def _routing_maps(self):
        from megatron_mhar.diagnostics.maps import RoutingMaps

        return RoutingMaps.from_records(self.routing, make_layout(self.cfg.mhar, self.cfg.model.num_layers))

    def _log_routing_maps(self) -> None:
        """The routing maps of the step just run into TensorBoard (rank 0)."""
        if not self.is_logger:
            return
        from megatron_mhar.diagnostics.maps import render

        title = f"{self.cfg.run.name}: routing maps, step {self.iteration}"
        self.metrics.add_image("routing/maps", render(self._routing_maps(), title), self.iteration)

    def _write_routing_maps(self) -> None:
        """``routing_maps.png`` / ``.json`` (and a TensorBoard image) of the last recorded step."""
        if not (self.cfg.logging.routing_entropy and self.routing and self.is_logger):
            return
        from megatron_mhar.diagnostics.maps import save_routing_maps

        title = f"{self.cfg.run.name}: routing maps, step {self.iteration}"
        image = save_routing_maps(self._routing_maps(), self.run_dir, title, step=self.iteration,
                                  variant=self.cfg.mhar.variant)
        if not self._maps_step(self.iteration):  # else already in TensorBoard
            self.metrics.add_image("routing/maps", image, self.iteration)
