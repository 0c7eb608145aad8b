"""How a run resumes: from its own checkpoint directory, else from ``checkpoint.load``,
verifying each checkpoint it reads and keeping this run's optimizer settings over the
loaded ones. A mixin of :class:`~megatron_mhar.training.loop.Trainer`."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import torch

from megatron_mhar.checkpoint.format import changed_fields
from megatron_mhar.training import checkpointing

_GROUP_SETTINGS = ("max_lr", "min_lr", "betas", "eps")
"""What a run's config sets in each optimizer param group (a resume keeps them: ``Trainer._resume``)."""


class CheckpointResume:
    """The Trainer's resume (reads its ``cfg``, ``model``, ``optimizer``, ``scheduler`` and
    ``is_logger``; sets its step, data position, losses, checkpoint, ``conversion``,
    ``changed_since_checkpoint`` and ``resumed_own``; adds to ``failed_checkpoints``)."""

    def _check_checkpoint(self, checkpoint: Path) -> Optional[str]:
        """Why ``checkpoint`` fails verification (the ranks share the reading), or None;
        a failure is remembered so that pruning leaves that checkpoint alone."""
        problem = checkpointing.verified_problem(checkpoint, self.cfg.checkpoint.verify)
        if problem is not None:
            self.failed_checkpoints.add(Path(checkpoint))
        return problem

    def _resume(self) -> None:
        """Resume from the run's checkpoint directory, else start from ``checkpoint.load``.

        Leftovers of interrupted saves go first (they may hold the space a save needs).
        The checkpoint is verified first; one that fails is named, and the run resumes
        from the newest one that passes (:func:`megatron_mhar.checkpoint.format.find_checkpoint`).
        """
        cfg = self.cfg
        if self.is_logger and cfg.checkpoint_dir.is_dir():
            checkpointing.remove_leftovers(cfg.checkpoint_dir)
        torch.distributed.barrier()
        found = checkpointing.find_checkpoint(cfg.checkpoint_dir, problem=self._check_checkpoint)
        self.resumed_own = found is not None
        model_only = False
        if found is None and cfg.checkpoint.load:
            load = Path(cfg.checkpoint.load)
            found = checkpointing.find_checkpoint(load, problem=self._check_checkpoint)
            if found is None:
                raise ValueError(f"checkpoint.load={cfg.checkpoint.load!r} holds no checkpoint")
            model_only = cfg.checkpoint.load_model_only
        if found is None:
            return
        own_settings = [{key: group[key] for key in _GROUP_SETTINGS if key in group}
                        for group in self.optimizer.param_groups]
        loaded = checkpointing.load_checkpoint(
            found, self.model, self.optimizer, self.scheduler, cfg.to_dict(), model_only=model_only
        )
        self.iteration = loaded["iteration"]
        self.conversion = loaded["conversion"]
        train_state = loaded["train_state"]
        self.val_losses = [list(v) for v in train_state.get("val_losses", [])]
        self._unwritten_metrics = train_state.get("unwritten_metrics", [])
        self.loss_window = list(train_state.get("loss_window", []))
        self.test_loss = train_state.get("test_loss")
        # Checkpoints from before consumed_samples was saved ran one batch size throughout.
        self.consumed_samples = train_state.get(
            "consumed_samples", self.iteration * cfg.training.global_batch_size
        )
        self.checkpoint = found
        self.checkpoint_step = self.iteration
        self.skipped_steps = train_state.get("skipped_steps", 0)
        if not model_only:  # said on the start line: what this run does otherwise than the saved one
            self._apply_optimizer_settings(own_settings)
            self.changed_since_checkpoint = [
                f"{key} {old!r} -> {new!r}" for key, old, new in changed_fields(loaded["config"], cfg.to_dict())]
        if self.is_logger:
            fresh = loaded.get("fresh_mtp")  # a checkpoint without MTP, loaded for its weights
            fresh = (f"; the model's {fresh} MTP depth(s) (model.mtp_num_layers) start from their "
                     f"initialisation: the checkpoint has no MTP weights" if fresh else "")
            if model_only:
                print(f"loaded the weights of {found} (saved at step {loaded['saved_iteration']}); training starts "
                      f"at step 0 with a new optimizer, schedule and data order{fresh}", flush=True)
            else:
                print(f"resumed from {found} at step {self.iteration}{fresh}", flush=True)

    def _apply_optimizer_settings(self, own_settings: List[dict]) -> None:
        """This run's settings over those of a loaded optimizer state: Megatron restores the
        param groups whole (their peak and minimum lr, Adam's betas and epsilon), and the
        scheduler computes each step's lr from the group's."""
        for group, own in zip(self.optimizer.param_groups, own_settings):
            group.update(own)
        self.scheduler.step(increment=0)  # the resumed step's lr and weight decay from them
