"""Parallel layouts on real process groups: loss trajectories, throughput and memory.

    python -m benchmarks.bench_parallel      # writes benchmarks/results/parallel/<device>.json
    python -m benchmarks.bench_parallel --layouts tp2,pp2 --variants mhar     # a subset
    python -m benchmarks.bench_parallel --device cpu --steps 3 --recipe smoke_cpu ...  # CPU smoke

Every run is the training driver itself (``torchrun -m megatron_mhar.train``: Megatron's
schedules, DDP, optimizer and GPTDataset), for the plain baseline and for MHAR with the
fused kernels forced (``mhar.kernel_impl=triton`` on CUDA, so a layout where they could
not run fails instead of falling back), once per layout, all from the same seed, global
batch and data order, and from the same weights: a layout's own initialisation draws
its random numbers in another order, so the single-process run saves its starting
weights (``checkpoint.save_initial``) and every other layout loads them
(``checkpoint.load``, ``load_model_only``; Megatron's dist_checkpointing reshards them
to the layout). A layout's trajectory is compared step by step with the
single-process run of the same model by the relative difference
``|loss - loss_single| / loss_single`` per step. bf16 rounding differs between layouts
(other reduction orders in the tensor-parallel matmuls and the all-reduces), and 50
steps of training amplify any difference, so two checks: over the first
``--early-steps`` steps, before that growth, every difference is at most ``--rtol``
(a wrong layout shows here: each bug this benchmark found was off by more than 1e-3 by
step 2); over the whole trajectory, the mean difference is at most ``--noise-factor``
times that of the same model's data-parallel run, which changes nothing but the order of
the fp32 gradient reduction (the noise floor). The baseline's own numbers are reported
next to MHAR's.

Throughput is the median over the steps after ``--skip`` of tokens per second, per GPU
as well; memory is the peak allocated memory of the busiest rank (``memory_gb`` of the
driver's metrics). Layouts that need more GPUs than the machine has are listed under
``not_run`` with the GPU count they need. Single-process runs of different models run
side by side on separate GPUs (they share only the host).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import check_out, default_out, device_name, environment, write_json
from megatron_mhar.runtime import free_port
from megatron_mhar.training.launch_checks import validate_launch
from megatron_mhar.diagnostics.records import read_metrics
from megatron_mhar.training.recipes import load_config

REFERENCE_LAYOUT = "single"

LAYOUTS = {
    # name: (processes, driver overrides)
    "single": (1, []),
    "dp2": (2, []),
    "tp2": (2, ["parallel.tensor_model_parallel_size=2"]),
    "tp2_sp": (2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pipeline_model_parallel_size=2"]),
    "pp2_vpp2": (2, ["parallel.pipeline_model_parallel_size=2",
                     "parallel.virtual_pipeline_model_parallel_size=2"]),
    "tp2_pp2": (4, ["parallel.tensor_model_parallel_size=2",
                    "parallel.pipeline_model_parallel_size=2"]),
    "tp2_sp_pp2": (4, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                       "parallel.pipeline_model_parallel_size=2"]),
}

VARIANTS = {
    "baseline": ["mhar.variant=none"],
    "mhar": ["mhar.variant=full", "mhar.num_heads=8"],
}

# The 100M recipe (the paper's configurations) on the embedded corpus, shortened to a trajectory: 50 steps
# of 16 x 2048 tokens (4 micro-batches of 4, so every pipeline schedule has work to
# interleave), warm-up over the first fifth of the steps; nothing is written but the metrics
# and the single-process runs' starting checkpoints.
DEFAULT_RECIPE = "pretrain_100m_mhar"
DEFAULT_OVERRIDES = [
    "data.paths=[]", "data.tokenizer=builtin", "model.vocab_size=4096",
    "training.global_batch_size=16", "training.micro_batch_size=4",
    "eval.interval=0", "eval.iters=1",
    "checkpoint.save_at_end=false", "logging.interval=1", "logging.tensorboard=false",
    "logging.routing_entropy=false",
]

# NVLink multicast stays off for every process we start (the device's rule).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                    "NVSHMEM_DISABLE_NVLS": "1"}


class Job:
    """One driver run: a model under a layout, started as a torchrun subprocess."""

    def __init__(self, variant, layout, args):
        self.variant, self.layout = variant, layout
        self.processes, layout_overrides = LAYOUTS[layout]
        self.name = f"{variant}_{layout}"
        self.run_dir = Path(args.run_dir) / self.name
        kernel = ["mhar.kernel_impl=triton"] if variant != "baseline" and args.device == "cuda" else []
        if layout == REFERENCE_LAYOUT:
            start = ["checkpoint.save_initial=true"]
        else:
            reference = Path(args.run_dir) / f"{variant}_{REFERENCE_LAYOUT}" / "checkpoints"
            start = [f"checkpoint.load={reference}", "checkpoint.load_model_only=true"]
        self.start_overrides = start
        self.overrides = (DEFAULT_OVERRIDES + VARIANTS[variant] + kernel + start + layout_overrides
                          + [f"training.train_iters={args.steps}", f"optimizer.lr_warmup_iters={args.steps // 5}",
                             f"run.device={args.device}",
                             f"run.output_dir={args.run_dir}", f"run.name={self.name}",
                             f"data.embedded_dir={args.run_dir}/embedded",
                             # own index cache: runs side by side must not write the same files
                             f"data.cache_dir={self.run_dir}/index_cache"] + args.overrides)
        self.command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                        f"--nproc-per-node={self.processes}", f"--master-port={free_port()}",
                        "-m", "megatron_mhar.train", args.recipe, *self.overrides]
        self.recipe = args.recipe
        self.proc = None

    def check(self):
        """The driver's own config and launch checks, before anything starts (less the
        reference's checkpoint, which the reference run writes first)."""
        overrides = [o for o in self.overrides if o not in self.start_overrides]
        cfg = load_config(self.recipe, overrides)
        validate_launch(cfg, self.processes)

    def start(self, gpus, timeout):
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        env = dict(os.environ, **NO_MULTICAST_ENV)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        self.log = open(self.run_dir.parent / f"{self.name}.log", "w")
        self.deadline = time.monotonic() + timeout
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.command, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait(self) -> dict:
        try:
            rc = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            rc = "timeout"
        self.log.close()
        record = {"variant": self.variant, "layout": self.layout, "processes": self.processes,
                  "overrides": self.overrides, "returncode": rc,
                  "wall_s": round(time.monotonic() - self.started, 1)}
        if rc != 0:
            tail = (self.run_dir.parent / f"{self.name}.log").read_text().splitlines()[-40:]
            record["log_tail"] = tail
            print(f"[{self.name}] FAILED ({rc}):\n  " + "\n  ".join(tail[-15:]), flush=True)
            return record
        train = read_metrics(self.run_dir, "train")
        record["loss"] = [r["loss"] for r in train]
        record["grad_norm"] = [r["grad_norm"] for r in train]
        record["tokens_per_s_steps"] = [r["tokens_per_s"] for r in train]
        record["memory_gb"] = max(r["memory_gb"] for r in train)
        print(f"[{self.name}] ok in {record['wall_s']} s, final loss {record['loss'][-1]:.4f}", flush=True)
        return record


def run_jobs(jobs, gpu_count, timeout, done):
    """Runs one-process jobs side by side on separate GPUs, the others one at a time.

    ``done(records)`` follows every finished job, so that a run cut short keeps its results.
    """
    records = {}
    singles = [job for job in jobs if job.processes == 1]
    width = max(1, gpu_count)
    for i in range(0, len(singles), width):
        wave = singles[i:i + width]
        for slot, job in enumerate(wave):
            job.start([slot] if gpu_count else None, timeout)
        for job in wave:
            records[job.name] = job.wait()
            done(records)
    for job in jobs:
        reference = records.get(f"{job.variant}_{REFERENCE_LAYOUT}", {})
        if job.processes > 1 and reference.get("returncode") != 0:
            # It would load the reference's starting checkpoint, which was never written.
            records[job.name] = {"variant": job.variant, "layout": job.layout, "processes": job.processes,
                                 "returncode": "not started: the single-process reference failed"}
            done(records)
        elif job.processes > 1:
            job.start(list(range(job.processes)) if gpu_count else None, timeout)
            records[job.name] = job.wait()
            done(records)
    return records


NOISE_LAYOUT = "dp2"
"""Data parallelism runs the model code of the single process unchanged; only the order of
the fp32 gradient reduction differs. Its divergence from the single-process run is the
noise floor of a trajectory: how far 50 bf16 steps drift from a perturbation that no
parallel model code causes."""


def summarize(records, rtol, skip, early_steps, noise_factor):
    """Per layout and model: trajectory differences to the single-process run, throughput.

    A layout is within tolerance when its first ``early_steps`` losses are within ``rtol``
    (relative) of the reference, before rounding differences have grown, and when its
    mean relative difference over the whole trajectory is at most ``noise_factor`` times
    the same model's data-parallel run (the noise floor), where that ran.
    """
    summary = {}
    for name, record in sorted(records.items()):
        if "loss" not in record:
            summary[name] = {"ran": False, "returncode": record.get("returncode")}
            continue
        steps = record["tokens_per_s_steps"][skip:] or record["tokens_per_s_steps"]
        tokens_per_s = statistics.median(steps)
        entry = {"ran": True, "final_loss": record["loss"][-1], "tokens_per_s": tokens_per_s,
                 "tokens_per_s_per_gpu": tokens_per_s / record["processes"],
                 "memory_gb_per_gpu": record["memory_gb"]}
        reference = records.get(f"{record['variant']}_{REFERENCE_LAYOUT}", {})
        if "loss" in reference and record["layout"] != REFERENCE_LAYOUT:
            ref, loss = reference["loss"], record["loss"]
            if len(ref) != len(loss):
                raise ValueError(f"{name}: {len(loss)} logged steps vs {len(ref)} in the reference")
            rel = [abs(a - b) / abs(b) for a, b in zip(loss, ref)]
            entry.update(early_max_rel_diff=max(rel[:early_steps]), mean_rel_diff=statistics.mean(rel),
                         max_rel_diff=max(rel), max_abs_diff=max(abs(a - b) for a, b in zip(loss, ref)))
        summary[name] = entry
    for name, entry in summary.items():
        variant, layout = name.split("_", 1)
        if "mean_rel_diff" in entry:
            floor = summary.get(f"{variant}_{NOISE_LAYOUT}", {}).get("mean_rel_diff")
            early_ok = entry["early_max_rel_diff"] <= rtol
            if floor is not None and layout != NOISE_LAYOUT:
                entry["noise_floor_mean_rel_diff"] = floor
                entry["within_tolerance"] = early_ok and entry["mean_rel_diff"] <= noise_factor * floor
            else:
                entry["within_tolerance"] = early_ok
        baseline = summary.get(f"baseline_{layout}", {})
        if variant != "baseline" and entry.get("ran") and baseline.get("ran"):
            entry["throughput_vs_baseline"] = entry["tokens_per_s"] / baseline["tokens_per_s"]
            entry["memory_vs_baseline"] = entry["memory_gb_per_gpu"] / baseline["memory_gb_per_gpu"]
            if "mean_rel_diff" in baseline:
                entry["baseline_mean_rel_diff"] = baseline["mean_rel_diff"]
    return summary


def _gpu_count(device):
    if device != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help=f"comma-separated subset of {', '.join(LAYOUTS)} (single, the reference, "
                             f"is always run)")
    parser.add_argument("--variants", default="baseline,mhar", help="baseline,mhar")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the throughput")
    parser.add_argument("--rtol", type=float, default=1e-3,
                        help="largest relative loss difference to the single-process run over the "
                             "first --early-steps steps")
    parser.add_argument("--early-steps", type=int, default=10)
    parser.add_argument("--noise-factor", type=float, default=2.0,
                        help="largest mean relative difference over the whole trajectory, in units of "
                             "the same model's dp2 run (where dp2 ran)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--run-dir", default="runs/bench_parallel")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--out", default=None,
                        help="JSON report, rewritten after every run (default: "
                             "benchmarks/results/parallel/<device>.json, e.g. h200x2)")
    parser.add_argument("overrides", nargs="*", help="extra driver overrides (dotted.key=value)")
    args = parser.parse_args(argv)

    layouts = [name for name in args.layouts.split(",") if name]
    variants = [name for name in args.variants.split(",") if name]
    unknown = sorted(set(layouts) - set(LAYOUTS)) + sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown layouts or variants {unknown}; choose from {list(LAYOUTS)} and {list(VARIANTS)}")
    if not variants:
        parser.error(f"--variants {args.variants!r} names no model; choose from {list(VARIANTS)}")
    if args.skip < 0 or args.early_steps < 1 or args.timeout <= 0:
        parser.error(f"--skip must be >= 0, --early-steps >= 1 and --timeout > 0; got {args.skip}, "
                     f"{args.early_steps} and {args.timeout}")
    gpu_count = _gpu_count(args.device)
    if args.out is None:
        args.out = default_out("parallel", device_name(gpu_count, args.device))
    check_out(parser, args.out)
    settings = {"recipe": args.recipe, "steps": args.steps, "device": args.device,
                "overrides": DEFAULT_OVERRIDES + args.overrides}
    if REFERENCE_LAYOUT not in layouts:
        layouts.insert(0, REFERENCE_LAYOUT)

    if args.device == "cuda" and gpu_count == 0:
        parser.error("--device cuda: no CUDA device visible (use --device cpu for a gloo smoke run)")
    needs = {name: LAYOUTS[name][0] for name in layouts}
    runnable = [name for name in layouts if args.device == "cpu" or needs[name] <= gpu_count]
    not_run = {name: f"needs {needs[name]} GPUs, this machine has {gpu_count}"
               for name in layouts if name not in runnable}
    for name, why in not_run.items():
        print(f"not run: {name} ({why})", flush=True)

    jobs = [Job(variant, layout, args) for layout in runnable for variant in variants]
    for job in jobs:
        try:
            job.check()
        except ValueError as err:
            parser.error(f"{job.name}: {err}")
    env = environment(args.device)

    def report(records):
        result = {"environment": env, "gpus": gpu_count, "settings": settings,
                  "tolerance": {"rtol": args.rtol, "early_steps": args.early_steps,
                                "noise_factor": args.noise_factor},
                  "not_run": not_run,
                  "summary": summarize(records, args.rtol, args.skip, args.early_steps, args.noise_factor),
                  "runs": records}
        write_json(args.out, result)
        return result

    records = run_jobs(jobs, gpu_count, args.timeout, report)
    result = report(records)
    for name, entry in result["summary"].items():
        print(name, json.dumps({k: v for k, v in entry.items()}), flush=True)
    failed = [name for name, record in records.items() if record["returncode"] != 0]
    outside = [name for name, entry in result["summary"].items() if entry.get("within_tolerance") is False]
    if failed or outside:
        print(f"failed runs: {failed}; outside tolerance: {outside}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
