"""Driver runs under parallel layouts follow the single-process run from the same weights.

This is ``benchmarks/bench_parallel.py`` (the multi-GPU validation) on gloo processes in
fp32: every layout loads the reference run's starting checkpoint (resharded by Megatron's
dist_checkpointing), trains with Megatron's schedules, and must reproduce the reference
losses to fp32 rounding.
"""

import json

from megatron_mhar.runtime import free_port
from tests.helpers import TINY

# The tiny model, deep enough for two pipeline stages of two virtual chunks each.
LAYOUT_MODEL = [o for o in TINY if o.startswith(("model.", "mhar.", "data.", "optimizer.lr="))] + [
    "model.num_layers=4",
    "training.global_batch_size=4",
    "training.micro_batch_size=1",
]


def test_tp_sp_and_interleaved_pp_follow_single_process(tmp_path, embedded_dir):
    from benchmarks.bench_parallel import main

    out = tmp_path / "parallel.json"
    argv = ["--device", "cpu", "--recipe", "smoke_cpu", "--steps", "3", "--skip", "0",
            "--rtol", "1e-5", "--layouts", "tp2_sp,pp2_vpp2", "--run-dir", str(tmp_path / "runs"),
            "--out", str(out), *LAYOUT_MODEL, f"data.embedded_dir={embedded_dir}"]
    returncode = main(argv)
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert returncode == 0, summary
    assert set(summary) == {f"{v}_{l}" for v in ("baseline", "mhar") for l in ("single", "tp2_sp", "pp2_vpp2")}
    for variant in ("baseline", "mhar"):
        reference = result["runs"][f"{variant}_single"]["loss"]
        assert len(reference) == 3 and reference[-1] < reference[0]  # it trains
        for layout in ("tp2_sp", "pp2_vpp2"):
            entry = summary[f"{variant}_{layout}"]
            assert result["runs"][f"{variant}_{layout}"]["processes"] == 2
            assert entry["within_tolerance"] and entry["max_rel_diff"] <= 1e-5, entry
    # MHAR and the baseline are different models: equal losses would mean no routing ran.
    assert result["runs"]["mhar_single"]["loss"][1:] != result["runs"]["baseline_single"]["loss"][1:]


def test_interleaved_schedule_does_not_batch_p2p_on_gpus(tiny):
    """NCCL runs batched p2p, except for the interleaved schedule, which overlaps its p2p
    instead: batched at PP=2, the tensors for the previous and the next stage go to the
    same rank in one batch and arrive swapped (PP=2 x VPP=2 on two H200s trained from a
    wrong loss at step 1). gloo has no batched p2p, so CPU runs never take that path and
    this is checked on the config the driver builds for a GPU run."""
    from megatron_mhar.training.model import transformer_config

    layouts = {
        "pp2": ["parallel.pipeline_model_parallel_size=2"],
        "pp2_vpp2": ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
                     "model.num_layers=4"],
    }
    for name, overrides in layouts.items():
        gpu = transformer_config(tiny(*overrides), on_cpu=False)
        cpu = transformer_config(tiny(*overrides), on_cpu=True)
        interleaved = name == "pp2_vpp2"
        assert (gpu.batch_p2p_comm, gpu.overlap_p2p_comm) == (not interleaved, interleaved), name
        assert (cpu.batch_p2p_comm, cpu.overlap_p2p_comm) == (False, False), name


def _torchrun(tmp_path, name, *overrides):
    """``torchrun --nproc-per-node=2 -m megatron_mhar.train``: train losses by step, output."""
    import subprocess
    import sys

    from megatron_mhar.training.metrics import read_metrics

    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
               f"--master-port={free_port()}", "-m", "megatron_mhar.train", "smoke_cpu",
               *TINY, f"run.output_dir={tmp_path}", f"run.name={name}", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {r["step"]: r["loss"] for r in read_metrics(tmp_path / name, "train")}, done.stdout


def test_resume_under_interleaved_pipeline_is_exact(tmp_path, embedded_dir):
    """MHAR on PP=2 x VPP=2: stopped after step 2 (checkpoint: every chunk's parameters,
    optimizer state, data position, RNG) and resumed, steps 3-4 reproduce bitwise the
    losses of the uninterrupted run. Dropout is on: the restored RNG streams draw its masks."""
    common = ("model.hidden_dropout=0.1", "model.attention_dropout=0.1",
              "model.num_layers=4", "parallel.pipeline_model_parallel_size=2",
              "parallel.virtual_pipeline_model_parallel_size=2", "training.micro_batch_size=1",
              "optimizer.lr_decay_iters=4", "eval.interval=0", f"data.embedded_dir={embedded_dir}")
    whole, _ = _torchrun(tmp_path, "whole", *common, "training.train_iters=4")
    first, _ = _torchrun(tmp_path, "split", *common, "training.train_iters=2")
    resumed, output = _torchrun(tmp_path, "split", *common, "training.train_iters=4")
    assert "at step 2" in output and "from step 2" in output, output  # resumed, not restarted
    assert sorted(first) == [1, 2] and sorted(resumed) == [1, 2, 3, 4]  # metrics of one run
    assert resumed == whole
