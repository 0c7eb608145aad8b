"""Multi-token prediction losses of the driver (``model.mtp_num_layers``).

Megatron's MTP block adds each depth's loss to its tracker (``MTPLossLoggingHelper``) in
every training forward on the last pipeline stage: the micro-batch's mean token loss. On
logged steps :func:`mtp_losses` reports, for ``metrics.jsonl`` and TensorBoard,
``mtp/depth{k}_loss``: that loss averaged over the step's micro-batches and the
data-parallel replicas, as Megatron-LM's training log averages it. The reduction is a sum
(gloo has no averaging all-reduce), and over the pipeline ranks too, so the rank that
writes the metrics, on the first stage, has the values.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron_mhar.models.mtp import clear_mtp_tracker, tracked_mtp_losses


def reset_mtp_tracker() -> None:
    """Forget the tracker's values (a model with another depth count may have filled it)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()


def mtp_losses(mtp_num_layers: Optional[int], num_microbatches: int, logged: bool,
               device: torch.device) -> Optional[Dict[str, float]]:
    """After a training step, on every rank (a collective on logged steps): ``None`` without
    MTP or on steps not logged, else ``{"mtp/depth1_loss": ..., ...}``. Clears the tracker
    either way, so each logged step reports its own micro-batches only."""
    from megatron.core import parallel_state

    if mtp_num_layers is None:
        return None
    values = tracked_mtp_losses()
    if not logged:
        clear_mtp_tracker()
        return None
    # Only the last stage tracks; the tensor-parallel ranks of a stage hold the same values.
    total = torch.zeros(mtp_num_layers, dtype=torch.float64, device=device)
    if values is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
        total += values.to(device=device, dtype=torch.float64)
    clear_mtp_tracker()
    torch.distributed.all_reduce(total)
    total /= num_microbatches * parallel_state.get_data_parallel_world_size()
    return {f"mtp/depth{depth + 1}_loss": value for depth, value in enumerate(total.tolist())}
