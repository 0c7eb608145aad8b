"""The memory estimate printed at start counts exactly the parameters the driver builds."""

from __future__ import annotations

import pytest

from tests.helpers import TINY


@pytest.mark.parametrize("overrides", [
    pytest.param(["mhar.variant=none"], id="dense-baseline"),
    pytest.param(["mhar.variant=full", "model.tie_embeddings=false"], id="dense-full-untied"),
    # MoE and dense layers mixed, a shared expert, the delta variant's routers
    pytest.param(["model.num_moe_experts=4", "model.moe_ffn_hidden_size=16", "model.moe_layer_freq=[1,0]",
                  "model.moe_shared_expert_intermediate_size=8", "mhar.variant=delta", "mhar.delta_block_layers=1"],
                 id="moe-delta-shared-mixed"),
])
def test_estimate_counts_the_built_parameters(megatron_world1, tmp_path, overrides):
    from megatron_mhar.training.memory import estimate_memory
    from megatron_mhar.training.model import build_model_chunks, transformer_config, unwrap
    from megatron_mhar.training.recipes import load_config

    cfg = load_config("smoke_cpu", TINY + [f"run.output_dir={tmp_path}", *overrides])
    (chunk,) = build_model_chunks(cfg, transformer_config(cfg, on_cpu=True), on_cpu=True)
    model = unwrap(chunk)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in model.parameters()) - experts
    estimate = estimate_memory(cfg, world_size=1)
    assert (estimate.dense_params, estimate.expert_params) == (dense, experts)
    assert estimate.weights == 4 * (dense + experts) and estimate.optimizer == 8 * (dense + experts)  # fp32, Adam
    assert 0 < estimate.activations < estimate.total


def test_a_model_larger_than_the_memory_is_refused_before_it_is_built(tiny, monkeypatch, capsys):
    """A 64 MiB host: a vocabulary of 100K rows (weights, gradients and Adam state ~100 MB)
    is refused with the estimate, the memory and the field to lower, before any model is
    built; a model that fits runs."""
    from megatron_mhar.training import loop, memory

    monkeypatch.setattr(memory, "host_memory", lambda: 64 * 2**20)
    built = loop.build_model_chunks

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(loop, "build_model_chunks", refuse)
    with pytest.raises(ValueError, match=r"^the model does not fit: its weights, gradients and optimizer state take "
                                         r"\d+\.\d MB \(of ~\d+\.\d [MG]B with activations\), more than the host's memory "
                                         r"\(64\.0 MB\)\. Lower model\.vocab_size, or spread it over more GPUs "
                                         r"\(parallel\.tensor_model_parallel_size, parallel\.pipeline_model_parallel_size, "
                                         r"parallel\.use_distributed_optimizer=true\)$"):
        loop.run(tiny("model.vocab_size=100000", "model.tie_embeddings=false"))
    monkeypatch.setattr(loop, "build_model_chunks", built)
    assert loop.run(tiny("training.train_iters=3", "eval.interval=0")).iteration == 3


def test_pipeline_cache_memory_is_counted_under_interleaving_only():
    """PP4 x VPP3, 1B full (12 chunks of 3 layers): rank 0's chunks 1 and 2 cache the rows
    entering global chunks 1 and 5 (sites 7 and 31: 7 and 31 rows), their fp32 gradients
    held for up to 4 micro-batches."""
    from megatron_mhar.training.memory import pipeline_cache_bytes
    from megatron_mhar.training.recipes import load_config

    base = ["parallel.pipeline_model_parallel_size=4", "mhar.variant=full"]
    vpp = ["parallel.virtual_pipeline_model_parallel_size=3"]
    cfg = load_config("pretrain_1b_mhar", base + vpp)
    m = cfg.model
    assert pipeline_cache_bytes(cfg) == 4 * (7 + 31) * m.seq_length * cfg.training.micro_batch_size * m.hidden_size * 4
    assert pipeline_cache_bytes(load_config("pretrain_1b_mhar", base + vpp + ["mhar.pipeline_cache=false"])) == 0
    assert pipeline_cache_bytes(load_config("pretrain_1b_mhar", base)) == 0
