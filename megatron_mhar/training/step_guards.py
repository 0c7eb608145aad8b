"""When a run skips a step or stops: a step whose loss or gradients are not finite (skipped
while ``training.skip_nonfinite_steps`` allows, else the run stops), data files that changed
under the run, and metrics rank 0 could not write. A mixin of
:class:`~megatron_mhar.training.loop.Trainer`."""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_mhar.data.datasets import DataChanged
from megatron_mhar.errors import PeerFailure, UserError, message_of, on_this_rank


class StepGuards:
    """The Trainer's skip and stop decisions for bad steps and changed inputs (reads its
    ``cfg``, ``model``, ``device``, ``metrics``, ``iteration``, ``checkpoint``,
    ``checkpoint_step`` and ``is_logger``; updates ``skipped_steps``; calls ``save``)."""

    def _nonfinite_grad_norm(self) -> Optional[float]:
        """``None`` where the step's gradients are finite on every rank, else the norm of
        those seen (NaN or Inf). Each rank reads its whole gradient buffers, reduced or not:
        a non-finite value anywhere reaches some rank's reduced share."""
        norms = [torch.linalg.vector_norm(buffer.grad_data, dtype=torch.float32) ** 2
                 for chunk in self.model for buffer in chunk.buffers + chunk.expert_parallel_buffers]
        total = torch.stack(norms).sum() if norms else torch.zeros((), device=self.device)
        torch.distributed.all_reduce(total)
        squared = total.item()
        return None if math.isfinite(squared) else math.sqrt(squared)  # sqrt(nan) is nan, sqrt(inf) inf

    def _skip_or_stop(self, step: int, loss: float, grad_norm: Optional[float]) -> None:
        """Training step ``step``, not made for a non-finite loss or gradients: say so and go on
        while ``training.skip_nonfinite_steps`` allows, else stop before anything more is saved."""
        tr = self.cfg.training
        values = f"loss {loss:.6g}" + (f", grad norm {grad_norm:.6g}" if grad_norm is not None else "")
        self.skipped_steps += 1
        if self.skipped_steps <= tr.skip_nonfinite_steps:
            self.metrics.console(f"step {step:>6}/{tr.train_iters} | skipped: {values} (skipped step "
                                 f"{self.skipped_steps} of training.skip_nonfinite_steps={tr.skip_nonfinite_steps})")
            return
        if self.checkpoint is None:
            last = "no checkpoint was saved before it: start again with other settings (e.g. a lower optimizer.lr)"
        else:
            last = (f"the last checkpoint, {self.checkpoint}, holds step {self.checkpoint_step}. To go on from it "
                    f"with other settings (e.g. a lower optimizer.lr), start a run from it: run.name=<new name> "
                    f"checkpoint.load={self.checkpoint} data.skip_batches={step - self.checkpoint_step} "
                    f"(passing over the batches since)")
        allowed = (f"already skipped {tr.skip_nonfinite_steps}" if tr.skip_nonfinite_steps else
                   "training.skip_nonfinite_steps=N skips up to N such steps")
        raise UserError(f"training diverged at step {step}: {values}; nothing of this step or later "
                        f"is saved, and {last}; {allowed}")

    def _data_changed(self, what: str, in_step: bool) -> DataChanged:
        """The error that stops a run whose data changed under it, after saving this step's
        checkpoint where it can: between steps, or inside a step where a single process runs
        (several ranks are then at different points of the schedule)."""
        single = torch.distributed.get_world_size() == 1
        if (single or not in_step) and (self.checkpoint is None or self.checkpoint_step != self.iteration):
            self.save()
        if self.checkpoint is None:
            then = "No checkpoint was saved: the restarted run starts from step 0"
        else:
            saved = "Saved" if self.checkpoint_step == self.iteration else "The last checkpoint is"
            then = f"{saved} {self.checkpoint} (step {self.checkpoint_step}), which the restarted run resumes from"
        err = DataChanged(f"{what}. {then}. Restore the file, or write it and its .idx again with mhar-preprocess "
                          f"(the launch then checks it again), and restart the run")
        return on_this_rank(err) if in_step and not single else err

    def _stop_for_outputs(self, save_error: Optional[OSError] = None) -> None:
        """Stop the run after rank 0 could not write its metrics: the checkpoint of this step
        (saved with the records not written) or why it could not be saved either."""
        self.metrics.close()
        if not self.is_logger:
            raise PeerFailure("rank 0 could not write the run's metrics")
        if save_error is None:
            then = (f"Saved checkpoint {self.checkpoint} at step {self.iteration} with the "
                    f"{len(self.metrics.unwritten)} records not written: once there is room, the same command "
                    f"resumes from it and writes them")
        else:
            then = f"The checkpoint could not be saved either: {message_of(save_error)}"
        raise UserError(f"{self.metrics.failure}. {then}")
