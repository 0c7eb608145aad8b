"""Every recipe loads, matches the paper's configurations, and builds its model (at reduced width and depth)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_mhar.training.recipes import load_config, recipe_names

RECIPES = recipe_names()

# The paper's configurations: d, layers, heads, KV heads, FFN, seq, global batch, micro-batch
PUBLISHED = {
    "100m": (512, 12, 8, 4, 1536, 2048, 64, 8),
    "350m": (1024, 24, 16, 8, 4096, 1024, 32, 4),
    "1b": (1280, 36, 16, 8, 5120, 1024, 32, 2),
}
VARIANTS = {"baseline": ("none", None), "attnres": ("full", 1), "mhar": ("full", 8)}


def test_recipe_set_is_complete():
    expected = {f"pretrain_{s}_{v}" for s in PUBLISHED for v in VARIANTS}
    expected |= {"smoke_cpu", "smoke_cpu_moe", "cpt_8b_mhar_delta", "cpt_8b_plain", "cpt_30b_a3b_mhar_delta",
                 "cpt_30b_a3b_plain"}
    assert set(RECIPES) == expected


@pytest.mark.parametrize("scale", sorted(PUBLISHED))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pretrain_recipes_match_the_paper(scale, variant):
    cfg = load_config(f"pretrain_{scale}_{variant}")
    m, tr, opt = cfg.model, cfg.training, cfg.optimizer
    got = (m.hidden_size, m.num_layers, m.num_attention_heads, m.num_query_groups,
           m.ffn_hidden_size, m.seq_length, tr.global_batch_size, tr.micro_batch_size)
    assert got == PUBLISHED[scale]
    assert (cfg.mhar.variant, cfg.mhar.num_heads if cfg.mhar.enabled else None) == VARIANTS[variant]
    assert cfg.mhar.logit_scale == 1.0 and cfg.run.name == f"pretrain_{scale}_{variant}"
    assert (m.normalization, m.norm_epsilon, m.swiglu, m.qk_layernorm, m.rotary_base) == (
        "RMSNorm", 1e-6, True, True, 10000.0)
    assert (m.add_bias_linear, m.init_method_std, m.hidden_dropout, m.tie_embeddings) == (
        False, 0.02, 0.0, True)
    assert (opt.adam_beta1, opt.adam_beta2, opt.adam_eps, opt.weight_decay, opt.clip_grad) == (
        0.9, 0.95, 1e-8, 0.1, 1.0)
    assert (opt.lr, opt.min_lr, opt.lr_warmup_iters, cfg.lr_decay_iters, opt.lr_decay_style) == (
        5e-4, 5e-5, 1000, 20000, "cosine")
    assert tr.train_iters == 20000 and tr.precision == "bf16"


@pytest.mark.parametrize("recipe", RECIPES)
def test_gpu_recipes_choose_the_layer_spec_where_they_run(recipe):
    """The GPU recipes take Transformer Engine's layers where TE imports (``spec: auto``);
    the CPU smoke recipes keep Megatron's local layers."""
    assert load_config(recipe).model.spec == ("local" if recipe.startswith("smoke_cpu") else "auto")


@pytest.mark.parametrize("size", ["8b", "30b_a3b"])
def test_cpt_recipes_differ_only_in_routing(size):
    delta, plain = load_config(f"cpt_{size}_mhar_delta"), load_config(f"cpt_{size}_plain")
    assert delta.mhar.variant == "delta" and delta.mhar.num_heads == 8
    assert delta.mhar.delta_block_layers == 4
    assert plain.mhar.variant == "none"
    a, b = delta.to_dict(), plain.to_dict()
    for section in a:
        if section not in ("mhar", "run"):
            assert a[section] == b[section], section
    m = delta.model
    shape = (m.hidden_size, m.num_layers, m.num_attention_heads, m.num_query_groups, m.num_moe_experts)
    assert shape == {"8b": (4096, 32, 32, 8, None), "30b_a3b": (2048, 48, 32, 4, 128)}[size]
    assert (delta.optimizer.lr, delta.optimizer.min_lr, delta.training.train_iters) == (4e-4, 4e-6, 9500)
    assert delta.training.global_batch_size * m.seq_length == 1_048_576 and m.seq_length == 4096


def _reduced(cfg):
    """Same architecture family at width ~128, 2 layers, single process, fp32, local layers
    (the model is built on the CPU runtime, where the driver resolves ``spec: auto`` so)."""
    m = cfg.model
    k = max(1, m.hidden_size // 128)
    moe = dict(moe_ffn_hidden_size=m.moe_ffn_hidden_size // k, moe_token_dispatcher_type="allgather") if m.is_moe else {}
    model = dataclasses.replace(
        m, num_layers=2 * (cfg.mhar.delta_block_layers if cfg.mhar.variant == "delta" else 1),
        hidden_size=m.hidden_size // k, ffn_hidden_size=(m.ffn_hidden_size or 4 * m.hidden_size) // k,
        kv_channels=m.kv_channels and m.kv_channels // k, vocab_size=1024, seq_length=32, spec="local", **moe,
    )
    return dataclasses.replace(
        cfg, model=model,
        parallel=dataclasses.replace(cfg.parallel, tensor_model_parallel_size=1, sequence_parallel=False,
                                     expert_model_parallel_size=1, use_distributed_optimizer=False,
                                     overlap_grad_reduce=False),
        training=dataclasses.replace(cfg.training, precision="fp32", recompute_granularity=None),
    )


def _routing_params(model):
    return sum(p.numel() for n, p in model.named_parameters() if "_router." in n)  # not an MoE layer's router


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_builds_and_runs(recipe, megatron_world1):
    from megatron_mhar.training.model import build_model_chunks, transformer_config, unwrap

    cfg = _reduced(load_config(recipe))
    config = transformer_config(cfg, on_cpu=True)
    (chunk,) = build_model_chunks(cfg, config, on_cpu=True)
    model = unwrap(chunk)
    d, layers = cfg.model.hidden_size, cfg.model.num_layers
    if cfg.mhar.variant == "none":
        assert type(model).__name__ == "GPTModel" and _routing_params(model) == 0
    elif cfg.mhar.variant == "full":  # The paper's initialisation: 2 queries + 2 norm weights per layer, + final site
        assert _routing_params(model) == (4 * layers + 2) * d
    else:
        assert _routing_params(model) > 0
    tokens = torch.randint(0, 1024, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    loss = model(tokens, positions, None, labels=tokens)
    assert loss.shape == (2, 32) and torch.isfinite(loss).all()
