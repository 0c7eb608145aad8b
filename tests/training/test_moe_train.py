"""``smoke_cpu_moe`` through the training driver on CPU: it trains, logs Megatron's router
losses and every expert's token load, and resumes exactly."""

from __future__ import annotations

import os
import re
import signal

import pytest

from megatron_mhar.training.metrics import read_metrics
from tests.helpers import TINY

# The smoke recipe shrunk to seconds (TINY), its 8 experts top-2 at a width of 16.
MOE_TINY = TINY + ["model.moe_ffn_hidden_size=16", "training.train_iters=6", "eval.interval=3"]


@pytest.fixture
def tiny_moe(tmp_path, embedded_dir, single_process):
    from megatron_mhar.training.recipes import load_config

    def make(*overrides, name):
        return load_config("smoke_cpu_moe", MOE_TINY + [
            f"run.output_dir={tmp_path}", f"run.name={name}", f"data.embedded_dir={embedded_dir}", *overrides])

    return make


def test_smoke_cpu_moe_trains_logs_expert_load_resumes_exactly_and_exports(tiny_moe, tmp_path):
    """6 steps straight == 3 steps, stop (SIGUSR1), resume, 3 steps: every logged record
    bitwise, the router losses and the expert loads included; the trained checkpoint
    exports as an MHAR Qwen3-MoE transformers model (:func:`_exports_as_mhar_qwen3_moe`)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_mhar.training.loop import run

    straight = run(tiny_moe(name="straight"))

    def stop_at_3(trainer, step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)

    cfg = tiny_moe(name="resumed")
    assert run(cfg, step_hook=stop_at_3).iteration == 3
    assert run(cfg).iteration == 6

    records = read_metrics(straight.run_dir, "train")
    assert records == [dict(r, tokens_per_s=s["tokens_per_s"], memory_gb=s["memory_gb"])
                       for r, s in zip(read_metrics(cfg.run.dir, "train"), records)]
    assert records[-1]["loss"] < records[0]["loss"]  # it learns
    for record in records:
        # Megatron's losses averaged over layers and micro-batches; balanced routing gives 1.
        assert 0.9 < record["moe/load_balancing_loss"] < 2.0 and record["moe/z_loss"] > 0
        load = record["expert_load"]
        assert list(load) == ["layer001", "layer002"]  # TINY's 2 layers, every one MoE
        for shares in load.values():
            assert len(shares) == 8 and sum(shares) == pytest.approx(1.0) and min(shares) >= 0
    assert records[0]["expert_load"] != records[1]["expert_load"]  # counted per step
    # the routing diagnostics of dense models: entropy per site, the routing maps
    assert len(records[-1]["routing_entropy"]) == 2 * 2 + 1
    assert (cfg.run.dir / "routing_maps.json").is_file() and (cfg.run.dir / "routing_maps.png").is_file()

    events = EventAccumulator(str(cfg.run.dir / "tensorboard"), size_guidance={"histograms": 0})
    events.Reload()
    assert {"train/moe/load_balancing_loss", "expert_load/layer002/max_over_mean"} <= set(events.Tags()["scalars"])
    imbalance = [e.value for e in events.Scalars("expert_load/layer001/max_over_mean")]
    assert [e.step for e in events.Scalars("expert_load/layer001/max_over_mean")] == list(range(1, 7))
    assert imbalance == pytest.approx([8 * max(r["expert_load"]["layer001"]) for r in records])
    assert "expert_load/layer001" in events.Tags()["histograms"]
    _exports_as_mhar_qwen3_moe(straight.run_dir, tmp_path)


def _exports_as_mhar_qwen3_moe(run_dir, out):
    """The trained checkpoint (full variant, routing trained away from its identity start) as
    an MHAR Qwen3-MoE transformers directory: it computes the Megatron model's logits,
    generates the same tokens with and without the KV cache, and imports back into Megatron
    as the same model."""
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    initialize_model_parallel_from_env(device="cpu")  # for load_model and the import, then torn down
    try:
        _check_export(run_dir, out)
    finally:
        destroy()


def _check_export(run_dir, out):
    import json

    import torch
    from transformers import AutoModelForCausalLM

    import megatron_mhar
    import megatron_mhar.hf  # noqa: F401  (registers the MHAR classes)
    from megatron_mhar.conversion.convert import hf_to_mcore, mcore_to_hf, plan_import

    exported = mcore_to_hf(run_dir / "checkpoints", out / "hf")
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["MHARQwen3MoeForCausalLM"] and config["mhar_variant"] == "full"
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (8, 2, 16)
    tokens = torch.randint(0, config["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    megatron = megatron_mhar.load_model(run_dir)
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        expected, logits = megatron(tokens), model(tokens).logits
    assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max()
    prompt = dict(max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(model.generate(tokens[:1, :8], **prompt), model.generate(tokens[:1, :8], use_cache=False, **prompt))
    back = hf_to_mcore(plan_import(exported, out / "back", seq_length=32))
    with torch.no_grad():
        assert torch.equal(megatron_mhar.load_model(back)(tokens), expected)


def test_moe_and_dense_checkpoints_refuse_each_other(megatron_world1, tmp_path):
    """An MoE checkpoint resumed by a dense recipe, or the reverse, names the differing
    fields (exit 2 through the driver's ConfigError); a dense checkpoint written before the
    MoE fields existed still resumes, its missing fields at their (dense) defaults."""
    import dataclasses

    from megatron.core import dist_checkpointing

    from megatron_mhar.checkpoint import format as fmt
    from megatron_mhar.errors import ConfigError
    from megatron_mhar.models.gpt_config import GPTModelConfig

    dense = dataclasses.asdict(GPTModelConfig())
    moe = dataclasses.asdict(GPTModelConfig(num_moe_experts=8, moe_router_topk=2))
    before_moe = {k: v for k, v in dense.items() if not k.startswith("moe_") and k != "num_moe_experts"}
    for name, model in {"dense": dense, "moe": moe, "before_moe": before_moe}.items():
        (tmp_path / name).mkdir()
        dist_checkpointing.save({"iteration": 1, "config": {"model": model, "mhar": {}}}, str(tmp_path / name))
    mhar = {"mhar": {}}
    assert fmt.check_config(tmp_path / "before_moe", {"model": dense, **mhar})["iteration"] == 1
    with pytest.raises(ConfigError, match=r"model.num_moe_experts: 8 \(checkpoint\) vs None \(config\)"):
        fmt.check_config(tmp_path / "moe", {"model": dense, **mhar})
    with pytest.raises(ConfigError, match=r"model.num_moe_experts: None \(checkpoint\) vs 8 \(config\)"):
        fmt.check_config(tmp_path / "dense", {"model": moe, **mhar})
    # How an MoE model runs and trains may change between runs.
    changed = dict(moe, moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.01, moe_router_dtype="fp32")
    assert fmt.check_config(tmp_path / "moe", {"model": changed, **mhar})["iteration"] == 1


@pytest.mark.parametrize("recipe,overrides,world,message", [
    pytest.param("smoke_cpu_moe", ["parallel.expert_model_parallel_size=3"], 3,
                 r"model.num_moe_experts=8 is not a multiple of parallel.expert_model_parallel_size=3", id="ep-3-of-8"),
    pytest.param("smoke_cpu", ["parallel.expert_model_parallel_size=2"], 2,
                 r"parallel.expert_model_parallel_size is set but the model has no experts", id="ep-dense"),
    pytest.param("smoke_cpu_moe", ["parallel.tensor_model_parallel_size=2"], 2,
                 r"needs parallel.sequence_parallel=true", id="tp-without-sp"),
    pytest.param("smoke_cpu_moe", ["parallel.expert_tensor_parallel_size=5"], 5,
                 r"expert width \(model.moe_ffn_hidden_size or ffn_hidden_size: 96\) is not a multiple of "
                 r"the expert tensor-parallel size 5", id="etp-width"),
    pytest.param("smoke_cpu_moe", ["parallel.pipeline_model_parallel_size=2", "parallel.expert_model_parallel_size=2"], 2,
                 r"world size 2 is not a multiple of expert_tensor_parallel_size x expert_model_parallel_size x "
                 r"pipeline_model_parallel_size = 1 x 2 x 2", id="expert-groups"),
    pytest.param("smoke_cpu_moe", ["model.moe_token_dispatcher_type=alltoall"], 1,
                 r"creates CUDA streams; on CPU set model.moe_token_dispatcher_type=allgather", id="alltoall-on-cpu"),
])
def test_bad_expert_layouts_exit_2_naming_the_field(recipe, overrides, world, message, monkeypatch, capsys,
                                                   single_process):
    from megatron_mhar.train import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exit_info:
        main([recipe, *overrides])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("mhar-train: error: ") and "Traceback" not in err
    assert re.search(message, err), err
