"""Mixture-of-experts runs: the layout checks and the MoE metrics of the driver.

* :func:`check_moe_layout` (when a recipe loads) and :func:`check_moe_launch` (with the
  world size and the device): expert parallelism against the model and the layout, each
  error naming the field and the fix;
* :class:`MoEMetrics`: on logged steps, Megatron's load-balancing and z-losses (its own
  tracker, reduced as Megatron-LM's training log reduces it) and the token load of every
  expert of every MoE layer (the share of the layer's routed token slots each expert got,
  over the global batch), for ``metrics.jsonl`` and TensorBoard.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from megatron_mhar.models.gpt_config import GPTModelConfig

AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}
"""Megatron's tracker name of each ``model.moe_router_load_balancing_type``."""


def check_moe_layout(model: GPTModelConfig, par) -> None:
    """Expert parallelism against the model and the rest of the layout (``par``: the recipe's
    ``parallel`` section)."""
    ep, etp, tp = par.expert_model_parallel_size, par.expert_tensor_parallel_size, par.tensor_model_parallel_size
    if not model.is_moe:
        if ep > 1 or etp is not None:
            field = "expert_model_parallel_size" if ep > 1 else "expert_tensor_parallel_size"
            raise ValueError(
                f"parallel.{field} is set but the model has no experts (model.num_moe_experts is "
                f"null); set model.num_moe_experts or remove parallel.{field}"
            )
        return
    if model.num_moe_experts % ep:
        raise ValueError(
            f"model.num_moe_experts={model.num_moe_experts} is not a multiple of "
            f"parallel.expert_model_parallel_size={ep}: every expert-parallel rank holds as many "
            f"experts; use an expert-parallel size that divides {model.num_moe_experts}"
        )
    width = model.moe_ffn_hidden_size or model.ffn_hidden_size or 4 * model.hidden_size
    if width % (etp or tp):
        raise ValueError(
            f"the expert width (model.moe_ffn_hidden_size or ffn_hidden_size: {width}) is not a multiple "
            f"of the expert tensor-parallel size {etp or tp} (parallel.expert_tensor_parallel_size, else "
            f"tensor_model_parallel_size); change one of them"
        )
    if tp > 1 and not par.sequence_parallel:
        raise ValueError(
            f"MoE with parallel.tensor_model_parallel_size={tp} needs parallel.sequence_parallel=true "
            f"(Megatron's MoE layer refuses to train tensor-parallel without it)"
        )


def check_moe_launch(cfg, world_size: int, on_cpu: bool) -> None:
    """What needs the world size and the device: Megatron's expert groups
    (expert_tensor_parallel_size x expert_model_parallel_size x pipeline_model_parallel_size
    ranks) must tile the world, and the all-to-all dispatcher needs CUDA."""
    model, par = cfg.model, cfg.parallel
    if not model.is_moe:
        return
    ep, pp = par.expert_model_parallel_size, par.pipeline_model_parallel_size
    etp = par.expert_tensor_parallel_size or par.tensor_model_parallel_size
    if world_size % (etp * ep * pp):
        raise ValueError(
            f"world size {world_size} is not a multiple of expert_tensor_parallel_size x "
            f"expert_model_parallel_size x pipeline_model_parallel_size = {etp} x {ep} x {pp} "
            f"(Megatron's expert groups); change the expert-parallel sizes or the number of processes"
        )
    if on_cpu and model.moe_token_dispatcher_type != "allgather":
        raise ValueError(
            f"model.moe_token_dispatcher_type={model.moe_token_dispatcher_type} creates CUDA streams; "
            f"on CPU set model.moe_token_dispatcher_type=allgather"
        )


class MoEMetrics:
    """Megatron's router losses and the experts' token load, on logged steps.

    Every rank calls :meth:`start_step` before and :meth:`end_step` after each training step
    (``end_step`` of a logged step is a collective). A logged step counts the tokens each
    router sends to each expert in the forward whose backward runs (a recomputed forward
    under full recomputation), and reports the values of that step alone, so a resumed run
    logs what an uninterrupted one logs.
    """

    def __init__(self, model: GPTModelConfig, config, chunks: List[torch.nn.Module], num_microbatches: int):
        self.model, self.config, self.num_microbatches = model, config, num_microbatches
        self.routers = {}  # global 0-based layer -> Megatron's router module
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    self.routers[layer.layer_number - 1] = router
        self.counts: Optional[torch.Tensor] = None
        self._hooks = []

    def start_step(self, logged: bool) -> None:
        if not logged:
            return
        device = next(iter(self.routers.values())).weight.device if self.routers else torch.device("cpu")
        self.counts = torch.zeros(self.model.num_layers, self.model.num_moe_experts, dtype=torch.float64,
                                  device=device)
        self._hooks = [router.register_forward_hook(self._counter(layer)) for layer, router in self.routers.items()]

    def _counter(self, layer: int):
        def count(module, args, output):
            if torch.is_grad_enabled():  # not the no-grad forward that full recomputation repeats
                self.counts[layer] += output[1].sum(dim=0).to(torch.float64)
        return count

    def end_step(self, logged: bool) -> Optional[dict]:
        """``None`` on steps not logged; else ``{"scalars": {...}, "expert_load": {layer: [...]}}``
        on every rank: ``moe/<loss>`` averaged over MoE layers and micro-batches, and each
        MoE layer's share of routed token slots per expert (summing to 1)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe import moe_utils

        if not logged:
            moe_utils.clear_aux_losses_tracker()
            return None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        losses: Dict[str, torch.Tensor] = {}
        names = self._loss_names()
        if names:
            moe_utils.track_moe_metrics(
                loss_scale=1.0 / self.num_microbatches, iteration=0, total_loss_dict=losses,
                force_initialize=True, track_names=names, num_layers=self.config.num_layers,
                moe_layer_freq=self.config.moe_layer_freq,
            )
        moe_utils.clear_aux_losses_tracker()
        counts = self.counts
        # Without sequence parallelism the tensor-parallel ranks route the same tokens.
        if not self.config.sequence_parallel and parallel_state.get_tensor_model_parallel_rank() != 0:
            counts = torch.zeros_like(counts)
        torch.distributed.all_reduce(counts)
        self.counts = None
        pattern = self.model.moe_layer_pattern()
        load = {f"layer{layer + 1:03d}": (counts[layer] / counts[layer].sum()).tolist()
                for layer in range(self.model.num_layers) if pattern[layer]}
        scalars = {f"moe/{name}": float(value) for name, value in sorted(losses.items())}
        return {"scalars": scalars, "expert_load": load}

    def _loss_names(self) -> List[str]:
        model = self.model
        names = []
        if model.moe_aux_loss_coeff > 0 and model.moe_router_load_balancing_type in AUX_LOSS_NAMES:
            names.append(AUX_LOSS_NAMES[model.moe_router_load_balancing_type])
        if model.moe_z_loss_coeff is not None:
            names.append("z_loss")
        return names
