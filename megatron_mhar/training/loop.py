"""The training loop: Megatron-Core schedules, DDP, optimizer and scheduler, run by one Trainer.

:func:`run` is the whole life of a run on one rank: launch checks, process
groups, data, model, optimizer, resume, the loop, the last evaluation and save,
teardown. The pieces are Megatron's own:

* Megatron's schedule for the layout (no pipelining, 1F1B, interleaved 1F1B), through
  ``megatron_mhar.parallel.pipeline.forward_backward`` which adds the p2p shapes of an
  MHAR history; :meth:`Trainer.forward_backward` is the one place that calls it, for
  training and for evaluation.
* The loss is a sum over tokens (``calculate_per_token_loss``), and Megatron's
  ``finalize_model_grads`` divides the gradients by the global token count after
  the data-parallel reduction: the step is the same for any DP x micro-batch split.
* ``DistributedDataParallel`` (optionally with the distributed optimizer),
  ``get_megatron_optimizer`` (AdamW, fp32 master weights under bf16, gradient
  clipping), ``OptimizerParamScheduler`` (linear warm-up, then cosine decay).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_mhar.checkpoint.format import checkpoint_name
from megatron_mhar.data.datasets import DataChanged, MicroBatches, build_gpt_datasets, changed_data
from megatron_mhar.errors import UserError
from megatron_mhar.files import write_atomic
from megatron_mhar.diagnostics.recorder import RoutingRecorder, SiteRouting
from megatron_mhar.parallel import pipeline
from megatron_mhar.runtime import lifetime
from megatron_mhar.runtime.distributed import (
    DistributedContext,
    destroy,
    initialize_model_parallel_from_env,
    on_all_ranks,
)
from megatron_mhar.training import checkpointing, cuda_graphs
from megatron_mhar.training.data_setup import check_split_sizes, heldout_blends, prepare_data
from megatron_mhar.training.launch_checks import runs_on_cpu, validate_launch, with_resolved_spec
from megatron_mhar.training.memory import check_fits, estimate_memory
from megatron_mhar.training.metrics import MetricsWriter, StepTimer, format_duration
from megatron_mhar.training.model import build_model_chunks, transformer_config, unwrap
from megatron_mhar.training.moe import MoEMetrics
from megatron_mhar.training.mtp import mtp_losses, reset_mtp_tracker
from megatron_mhar.training.recipes import to_yaml
from megatron_mhar.training.resume import CheckpointResume
from megatron_mhar.training.routing_outputs import RoutingOutputs
from megatron_mhar.training.run_files import (  # noqa: F401  (LOCK_FILE and run_lock: their loop names)
    LOCK_FILE,
    SUMMARY_FILE,
    RunReports,
    TrainResult,
    run_lock,
)
from megatron_mhar.training.schema import TrainConfig
from megatron_mhar.training.signals import SIGNALS as STOP_SIGNALS
from megatron_mhar.training.signals import StopSignal
from megatron_mhar.training.step_guards import StepGuards


def run(
    cfg: TrainConfig,
    step_hook: Optional[Callable[["Trainer", int], None]] = None,
    stop: Optional[StopSignal] = None,
) -> TrainResult:
    """Train one run on this rank (single process, or one rank under torchrun/srun).

    ``stop``: an entered :class:`StopSignal` (``python -m megatron_mhar.train`` installs
    it at process start, so a signal during start-up is not lost); by default the
    handlers are installed for the training loop only.
    """
    validate_launch(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    cfg = with_resolved_spec(cfg)
    par = cfg.parallel
    on_cpu = runs_on_cpu(cfg)
    lifetime.install()  # the checkpoint writer's processes die with this one
    ctx = initialize_model_parallel_from_env(
        tp=par.tensor_model_parallel_size,
        pp=par.pipeline_model_parallel_size,
        vpp=par.virtual_pipeline_model_parallel_size,
        ep=par.expert_model_parallel_size,
        etp=par.expert_tensor_parallel_size,
        seed=cfg.run.seed,
        device="cpu" if on_cpu else "cuda",
        create_gloo_process_groups=not on_cpu,
        cuda_graph_rng=cfg.training.cuda_graph != "none",
    )
    try:
        with run_lock(cfg):
            # With CUDA graphs the whole run, from model construction on, is on the capture
            # stream (megatron_mhar.training.cuda_graphs says why).
            with cuda_graphs.capture_stream(cfg.training.cuda_graph):
                return Trainer(cfg, ctx, step_hook).train(stop)
    finally:
        destroy()


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses, token count, and the pair for reporting (schedule case 2b)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), mask.sum()])
    return loss, num_tokens, {"lm loss": report}


class Trainer(CheckpointResume, StepGuards, RoutingOutputs, RunReports):
    """Model chunks, optimizer, scheduler, data iterators and the loop of one run."""

    def __init__(self, cfg: TrainConfig, ctx: DistributedContext, step_hook=None):
        self.cfg = cfg
        self.ctx = ctx
        self.device = ctx.device
        self.on_cpu = ctx.device.type == "cpu"
        self.step_hook = step_hook
        self.is_logger = ctx.rank == 0
        self.run_dir = cfg.run.dir
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        tr = cfg.training
        self.num_microbatches = tr.global_batch_size // (tr.micro_batch_size * self.dp_size)
        self.tokens_per_step = tr.global_batch_size * cfg.model.seq_length

        # Megatron's convention: each pipeline stage seeds differently, so layers at the
        # same position of different stages do not start equal.
        seed = cfg.run.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
        graphs = tr.cuda_graph != "none"
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, use_cudagraphable_rng=graphs, force_reset_rng=True
        )
        import random

        import numpy

        random.seed(seed)
        numpy.random.seed(seed)
        torch.manual_seed(seed)

        if self.is_logger:
            self.run_dir.mkdir(parents=True, exist_ok=True)

        self.tokenizer, data_paths = prepare_data(cfg)
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                f"{self.tokenizer.vocab_size} tokens; set model.vocab_size>={self.tokenizer.vocab_size}"
            )

        self.config = transformer_config(cfg, self.on_cpu)
        estimate = estimate_memory(cfg, ctx.world_size)
        if self.is_logger:
            print(estimate.describe(self._layout()), flush=True)
        check_fits(estimate, cfg, self.on_cpu, int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size)))
        self.model = build_model_chunks(cfg, self.config, self.on_cpu)
        self.optimizer = get_megatron_optimizer(
            self._optimizer_config(), self.model, use_gloo_process_groups=not self.on_cpu
        )
        opt = cfg.optimizer
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=opt.lr,
            min_lr=opt.min_lr,
            lr_warmup_steps=opt.lr_warmup_iters,
            lr_decay_steps=cfg.lr_decay_iters,
            lr_decay_style=opt.lr_decay_style,
            start_wd=opt.weight_decay,
            end_wd=opt.weight_decay,
            wd_incr_steps=tr.train_iters,
            wd_incr_style="constant",
            # A resume applies this run's schedule at the checkpoint's step (Megatron-LM's
            # --override-opt_param-scheduler): what the start line reports as changed is used.
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )
        self._wire_model_config()
        self.moe_metrics = (MoEMetrics(cfg.model, self.config, [unwrap(c) for c in self.model], self.num_microbatches)
                            if cfg.model.is_moe else None)
        self._moe_logged: Optional[dict] = None  # the MoE metrics of the step just logged
        reset_mtp_tracker()
        self._mtp_logged: Optional[dict] = None  # the MTP losses of the step just logged
        self.train_schedule = (
            cuda_graphs.FullIterationGraph(pipeline.forward_backward) if graphs else pipeline.forward_backward
        )
        """The schedule training steps run: Megatron's (``pipeline.forward_backward``), or it
        under the full-iteration CUDA graph (``training.cuda_graph``); evaluation runs eager."""

        self.iteration = 0
        self.consumed_samples = 0  # the data position (a resume may change the batch size)
        self.val_losses: List[List[float]] = []
        # Training losses since the last logged step; saved with a checkpoint, so that the
        # first loss logged after a resume averages the same steps as an uninterrupted run.
        self.loss_window: List[float] = []
        self.test_loss: Optional[List[float]] = None  # [step, loss] after the last step
        self.routing: Dict[int, SiteRouting] = {}  # routing of the last recorded step, by site
        self.checkpoint: Optional[Path] = None
        self.checkpoint_step = 0  # the step self.checkpoint holds
        self.skipped_steps = 0  # steps not made for a non-finite loss or gradients (saved)
        self.failed_checkpoints: Set[Path] = set()
        self.stop: Optional[StopSignal] = None  # the run's, while it trains: told which checkpoint is being saved
        self.conversion: Optional[dict] = None
        """The conversion record of the converted checkpoint the weights come from, carried
        into every save (an export restores the source model's config from it)."""
        self.changed_since_checkpoint: List[str] = []
        """``key old -> new`` of each config field a resume changed (said on the start line)."""
        self._unwritten_metrics: List[list] = []  # a resumed checkpoint's records its run could not write
        self._resume()
        if cfg.data.skip_batches and not self.resumed_own:  # a resume's data position includes them
            skipped = cfg.data.skip_batches * tr.global_batch_size
            if self.is_logger:
                print(f"data.skip_batches={cfg.data.skip_batches}: passing over samples {self.consumed_samples} to "
                      f"{self.consumed_samples + skipped - 1}", flush=True)
            self.consumed_samples += skipped
        # A finished run restarted (a requeue after the end) writes nothing: no metrics,
        # events, evaluation, checkpoint or summary.
        self.finished = self.iteration >= tr.train_iters
        if self.is_logger and not self.finished:
            write_atomic(self.run_dir / "config.yaml", to_yaml(cfg))

        eval_samples = cfg.eval.iters * tr.global_batch_size
        self.train_ds, self.valid_ds, self.test_ds = build_gpt_datasets(
            data_paths,
            cfg.data.weights,
            None if cfg.data.heldout else cfg.data.train_split,
            cfg.model.seq_length,
            [self.consumed_samples + max(tr.train_iters - self.iteration, 0) * tr.global_batch_size,
             eval_samples, eval_samples if cfg.data.has_test_data else 0],
            self.tokenizer,
            cfg.run.seed,
            cache_dir=cfg.data.cache_dir,
            eod_mask_loss=cfg.data.eod_mask_loss,
            heldout=heldout_blends(cfg),
        )
        check_split_sizes(cfg, [self.train_ds, self.valid_ds, self.test_ds], self.is_logger)
        self.train_iterators = self._iterators(self.train_ds, self.consumed_samples)
        self.metrics = MetricsWriter(
            self.run_dir, self.is_logger, cfg.logging.tensorboard, self.iteration, write_files=not self.finished,
            unwritten=self._unwritten_metrics,
        )

    # ---------------------------------------------------------------- setup

    def _layout(self) -> str:
        """``dp=.. tp=.. pp=..`` (and ``ep=..`` for MoE)."""
        par = self.cfg.parallel
        ep = f" ep={par.expert_model_parallel_size}" if self.cfg.model.is_moe else ""
        return (f"dp={self.dp_size} tp={par.tensor_model_parallel_size} "
                f"pp={par.pipeline_model_parallel_size}{ep}")

    def _optimizer_config(self) -> MegatronOptimizerConfig:
        opt, bf16 = self.cfg.optimizer, self.cfg.training.bf16_params
        return MegatronOptimizerConfig(
            optimizer="adam",
            lr=opt.lr,
            min_lr=opt.min_lr,
            weight_decay=opt.weight_decay,
            adam_beta1=opt.adam_beta1,
            adam_beta2=opt.adam_beta2,
            adam_eps=opt.adam_eps,
            clip_grad=opt.clip_grad,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=self.cfg.parallel.use_distributed_optimizer,
            overlap_param_gather=self.cfg.parallel.overlap_param_gather,
        )

    def _wire_model_config(self) -> None:
        """The hooks Megatron's schedules call on the model config."""
        config, par = self.config, self.cfg.parallel
        config.grad_scale_func = self.optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        if par.overlap_grad_reduce:
            config.no_sync_func = [chunk.no_sync for chunk in self.model]
            config.grad_sync_func = [chunk.start_grad_sync for chunk in self.model]
            if len(self.model) == 1:
                config.no_sync_func = config.no_sync_func[0]
                config.grad_sync_func = config.grad_sync_func[0]
        if par.overlap_param_gather:
            config.param_sync_func = [chunk.start_param_sync for chunk in self.model]
            if len(self.model) == 1:
                config.param_sync_func = config.param_sync_func[0]

    def _iterators(self, dataset, consumed_samples: int) -> List[MicroBatches]:
        """One iterator per model chunk (the interleaved schedule reads one per chunk)."""
        return [
            MicroBatches(
                dataset,
                self.cfg.training.micro_batch_size,
                self.dp_rank,
                self.dp_size,
                consumed_samples,
                self.device,
                vocab_size=self.cfg.model.vocab_size,
            )
            for _ in self.model
        ]

    # ---------------------------------------------------------------- steps

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(_loss_func, batch["loss_mask"])

    def forward_backward(self, iterators, forward_only: bool) -> list:
        """The one call into Megatron's schedule (training and evaluation).

        ``megatron_mhar.parallel.pipeline.forward_backward`` is Megatron's schedule for
        the layout plus, for MHAR pipelines, the per-boundary p2p shapes of the history;
        training steps go through the CUDA graph when ``training.cuda_graph`` asks.
        """
        tr = self.cfg.training
        schedule = pipeline.forward_backward if forward_only else self.train_schedule
        return schedule(
            forward_step_func=self._forward_step,
            data_iterator=iterators,
            model=self.model,
            num_microbatches=self.num_microbatches,
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=tr.micro_batch_size,
            decoder_seq_length=self.cfg.model.seq_length,
            forward_only=forward_only,
        )

    def _global_loss(self, reports: list) -> torch.Tensor:
        """``[sum of token losses, tokens]`` over the global batch, on every rank."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        if parallel_state.get_tensor_model_parallel_rank() == 0:  # one copy per DP replica
            for report in reports:  # empty except on the last pipeline stage
                total += report["lm loss"].to(torch.float64)
        torch.distributed.all_reduce(total)
        return total

    def train_step(self):
        """One optimizer step; returns (loss, grad norm, learning rate). A step whose loss or
        gradients are not finite on some rank makes no update: it is skipped or stops the run
        (:meth:`_skip_or_stop`)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self.forward_backward(self.train_iterators, forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]
        loss_sum, tokens = self._global_loss(reports).tolist()
        bad_grads = self._nonfinite_grad_norm()
        if bad_grads is not None or not math.isfinite(loss_sum):
            self._skip_or_stop(self.iteration + 1, loss_sum / tokens, bad_grads)
            return loss_sum / tokens, bad_grads, lr
        update_ok, grad_norm, _ = self.optimizer.step()
        if update_ok:
            self.scheduler.step(increment=1)
        return loss_sum / tokens, grad_norm, lr

    @torch.no_grad()
    def evaluate(self, dataset=None) -> float:
        """Mean token loss over the first ``eval.iters`` global batches of ``dataset``
        (default: the validation data)."""
        for chunk in self.model:
            chunk.eval()
        iterators = self._iterators(self.valid_ds if dataset is None else dataset, 0)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for _ in range(self.cfg.eval.iters):
            total += self._global_loss(self.forward_backward(iterators, forward_only=True))
        for chunk in self.model:
            chunk.train()
        loss_sum, tokens = total.tolist()
        return loss_sum / tokens

    # ---------------------------------------------------------------- outputs

    def _logged(self, step: int) -> bool:
        """Whether training step ``step`` is logged (same on every rank)."""
        return step % self.cfg.logging.interval == 0 or step == self.cfg.training.train_iters

    def val_loss_tail(self) -> Optional[float]:
        tail = [loss for _, loss in self.val_losses[-self.cfg.eval.tail :]]
        return sum(tail) / len(tail) if tail else None

    def _run_eval(self) -> None:
        start = time.perf_counter()
        loss = self.evaluate()
        self.val_losses.append([self.iteration, loss])
        tail = self.val_loss_tail()
        self.metrics.log("eval", self.iteration, {"val_loss": loss, "val_loss_tail": tail})
        self.metrics.console(
            f"eval step {self.iteration:>6} | val loss {loss:.4f} | tail({len(self.val_losses[-self.cfg.eval.tail:])}) "
            f"{tail:.4f} | ppl {math.exp(min(loss, 50)):.2f} | {time.perf_counter() - start:.1f}s"
        )

    def _run_test(self) -> None:
        start = time.perf_counter()
        loss = self.evaluate(self.test_ds)
        self.test_loss = [self.iteration, loss]
        self.metrics.log("test", self.iteration, {"test_loss": loss})
        self.metrics.console(
            f"test step {self.iteration:>6} | test loss {loss:.4f} | ppl {math.exp(min(loss, 50)):.2f} | "
            f"{time.perf_counter() - start:.1f}s"
        )

    def save(self) -> None:
        if self.stop is not None:
            self.stop.saving = self.cfg.checkpoint_dir / checkpoint_name(self.iteration)
        try:
            self.checkpoint = checkpointing.save_checkpoint(
                self.cfg.checkpoint_dir,
                self.iteration,
                self.model,
                self.optimizer,
                self.scheduler,
                {
                    "val_losses": self.val_losses,
                    "consumed_samples": self.consumed_samples,
                    "loss_window": self.loss_window,
                    "test_loss": self.test_loss,
                    "unwritten_metrics": self.metrics.unwritten,
                    "skipped_steps": self.skipped_steps,
                },
                self.cfg.to_dict(),
                keep_last=self.cfg.checkpoint.keep_last,
                verify=self.cfg.checkpoint.verify,
                failed=self.failed_checkpoints,
                tokenizer=self.tokenizer,
                conversion=self.conversion,
            )
        finally:
            if self.stop is not None:
                self.stop.saving = None
        self.checkpoint_step = self.iteration
        self.metrics.console(f"saved checkpoint {self.checkpoint}")

    # ---------------------------------------------------------------- loop

    def train(self, stop: Optional[StopSignal] = None) -> TrainResult:
        cfg, tr = self.cfg, self.cfg.training
        losses: Dict[int, float] = {}
        timer = StepTimer()
        last_saved = self.iteration if self.checkpoint is not None else -1
        self.metrics.console(
            f"training {cfg.run.name}: {tr.train_iters} steps of {tr.global_batch_size} x "
            f"{cfg.model.seq_length} tokens, mhar={cfg.mhar.variant}, {self._layout()}, from step {self.iteration}"
            + (f"; changed since the checkpoint: {', '.join(self.changed_since_checkpoint)}"
               if self.changed_since_checkpoint else "")
        )
        if self.finished:
            self.metrics.console(
                f"the checkpoint {self.checkpoint} is at step {self.iteration}, at or past "
                f"training.train_iters={tr.train_iters}: nothing to train, nothing written; raise "
                f"training.train_iters to continue"
            )
            self.metrics.close()
            result = TrainResult(self.run_dir, self.iteration, losses, self.val_losses, self.val_loss_tail(),
                                 checkpoint=self.checkpoint)
            if not (self.run_dir / SUMMARY_FILE).is_file():  # the first run stopped before writing it
                self._write_summary(result)
            return result
        lifetime.start_writer_helper(deaf_to=STOP_SIGNALS)
        with contextlib.nullcontext(stop) if stop is not None else StopSignal() as stop:
            self.stop = stop
            signalled = False
            if cfg.checkpoint.save_initial and self.iteration == 0 and self.checkpoint is None:
                self.save()
                last_saved = 0
                signalled = stop.requested(self.device)  # one that came during the save is answered by it
            while self.iteration < tr.train_iters and not signalled:
                recorder = RoutingRecorder() if self._records_routing(self.iteration + 1) else None
                self._attach_routing_recorder(recorder)
                logged = self._logged(self.iteration + 1)
                if self.moe_metrics is not None:
                    self.moe_metrics.start_step(logged)
                timer.start()
                try:
                    loss, grad_norm, lr = self.train_step()
                except DataChanged as err:
                    raise self._data_changed(str(err), in_step=True) from None
                timer.stop()
                self._attach_routing_recorder(None)
                if self.moe_metrics is not None:
                    self._moe_logged = self.moe_metrics.end_step(logged)
                self._mtp_logged = mtp_losses(cfg.model.mtp_num_layers, self.num_microbatches, logged, self.device)
                self.iteration += 1
                if recorder is not None:
                    self.routing = self._gather_routing(recorder)
                    if self._maps_step(self.iteration):
                        self._log_routing_maps()
                self.consumed_samples += tr.global_batch_size
                losses[self.iteration] = loss
                if math.isfinite(loss):  # a skipped step's may not be
                    self.loss_window.append(loss)

                if logged and self.loss_window:
                    self._log_train(self.loss_window, grad_norm, lr, timer)
                    self.loss_window = []
                    timer.reset()
                if self.step_hook is not None:
                    self.step_hook(self, self.iteration)

                # The last evaluation comes before the last save, so the checkpoint holds it
                # and a restart of the finished run has nothing left to do.
                done = self.iteration == tr.train_iters
                if done or (cfg.eval.interval and self.iteration % cfg.eval.interval == 0):
                    self._run_eval()
                if done and self.test_ds is not None:
                    self._run_test()
                signalled = stop.requested(self.device, outputs_failed=self.metrics.failure is not None)
                if signalled or (cfg.checkpoint.interval and self.iteration % cfg.checkpoint.interval == 0):
                    changed = next(filter(None, on_all_ranks(
                        lambda: changed_data([self.train_ds, self.valid_ds, self.test_ds]))), None)
                    try:
                        self.save()
                    except OSError as err:
                        if not stop.outputs_failed:
                            raise
                        self._stop_for_outputs(err)
                    last_saved = self.iteration
                    if changed is not None:
                        raise self._data_changed(changed + "; the steps since may have read its new bytes",
                                                 in_step=False)
                    # A signal that came during this save is answered by it, not by another
                    # save after one more step.
                    signalled = signalled or stop.requested(self.device,
                                                            outputs_failed=self.metrics.failure is not None)
                if stop.outputs_failed:
                    self._stop_for_outputs()
            if signalled:
                self.metrics.console(f"received {stop.name} at step {self.iteration}: checkpoint saved, exiting")
            elif cfg.checkpoint.save_at_end and last_saved != self.iteration:
                self.save()
            self.stop = None

        result = TrainResult(
            run_dir=self.run_dir,
            iteration=self.iteration,
            losses=losses,
            val_losses=self.val_losses,
            val_loss_tail=self.val_loss_tail(),
            test_loss=self.test_loss[1] if self.test_loss else None,
            stopped_by=stop.name,
            checkpoint=self.checkpoint,
        )
        self._write_routing_maps()
        self._write_summary(result)
        self.metrics.close()
        if self.metrics.failure is not None:  # TensorBoard reports a failed write late: at its close
            raise UserError(f"{self.metrics.failure}. The run finished and its last checkpoint, {self.checkpoint}, "
                            f"is saved; only those files lack their last records")
        return result

    def _log_train(self, window: List[float], grad_norm: float, lr: float, timer: StepTimer) -> None:
        cfg = self.cfg
        loss = sum(window) / len(window)
        tokens_per_s = self.tokens_per_step / timer.seconds_per_step
        memory = self._memory_gb()
        scalars = {
            "loss": loss,
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_s": tokens_per_s,
            "memory_gb": memory,
            "consumed_samples": self.consumed_samples,
        }
        extra = {}
        if cfg.logging.routing_entropy and self.routing:
            entropy = {f"site{site:03d}": (record.entropy / record.tokens).tolist()
                       for site, record in sorted(self.routing.items())}
            extra["routing_entropy"] = entropy
            self.metrics.log_routing_entropy(self.iteration, entropy)
        if self._mtp_logged is not None:
            scalars.update(self._mtp_logged)
        if self._moe_logged is not None:
            scalars.update(self._moe_logged["scalars"])
            extra["expert_load"] = self._moe_logged["expert_load"]
            self.metrics.log_expert_load(self.iteration, self._moe_logged["expert_load"])
        self.metrics.log("train", self.iteration, scalars, extra)
        eta = (cfg.training.train_iters - self.iteration) * timer.seconds_per_step
        self.metrics.console(
            f"step {self.iteration:>6}/{cfg.training.train_iters} | loss {loss:.4f} | lr {lr:.3e} | "
            f"grad norm {scalars['grad_norm'] or 0:.3f} | {tokens_per_s:,.0f} tok/s | "
            f"mem {memory:.2f} GB | ETA {format_duration(eta)}"
        )
