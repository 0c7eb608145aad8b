"""The MHAR GPT model on CPU: parity with Megatron's GPT, routing sites, recompute, params."""

import dataclasses

import pytest
import torch

from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.ops import depth_route_reference
from tests.helpers import (
    GPT_BATCH,
    GPT_VOCAB,
    GPT_SEQ,
    build_gpt,
    capture_sublayers,
    gpt_batch,
    randomize_routers,
    tiny_gpt_config,
)


def _loss_and_grads(model, seed=0):
    tokens, positions = gpt_batch(seed)
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


PARITY_SEQ = 256  # long enough for RoPE's far positions to count (a base of 10001 moves logits by ~1e-3)
PARITY_STD = 0.2  # weights large enough for sharp attention: position errors show in the logits


def _megatron_gpt(seq_length):
    """Megatron's own GPTModel from its local spec, the architecture stated field by field
    (Llama / Qwen3: RMSNorm, SwiGLU, no biases, q/k norms, RoPE base 10000, tied
    embeddings, vocabulary padded to 128): nothing comes from this package's config
    translation."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, qk_layernorm=True, add_bias_linear=False, add_qkv_bias=False,
        init_method_std=PARITY_STD, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        use_cpu_initialization=True,
    )  # fmt: skip
    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
        vocab_size=128, max_sequence_length=seq_length, share_embeddings_and_output_weights=True,
        position_embedding_type="rope", rotary_base=10000,
    )


@pytest.mark.parametrize(
    "attention_backend",
    [
        pytest.param("megatron", id="megatron"),  # Megatron's attention: bitwise, outputs and gradients
        pytest.param("sdpa", id="sdpa"),  # torch's SDPA: fp32 rounding of another kernel, 256 positions
    ],
)
def test_variant_none_is_megatron_gpt(megatron_world1, attention_backend):
    """`none` through the builder == Megatron's GPTModel of the same architecture."""
    from megatron.core.models.gpt import GPTModel

    model_cfg = tiny_gpt_config(attention_backend=attention_backend, seq_length=PARITY_SEQ,
                                init_method_std=PARITY_STD)
    ours = build_gpt(model_cfg, MHARConfig(variant="none"))
    assert type(ours) is GPTModel
    theirs = _megatron_gpt(PARITY_SEQ)

    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert {k: v.shape for k, v in ours_sd.items() if torch.is_tensor(v)} == {
        k: v.shape for k, v in theirs_sd.items() if torch.is_tensor(v)
    }
    for key, value in theirs_sd.items():
        if torch.is_tensor(value):
            assert torch.equal(ours_sd[key], value), key
    tokens = torch.randint(0, GPT_VOCAB, (2, PARITY_SEQ), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(PARITY_SEQ).expand(2, PARITY_SEQ)
    ours_logits = ours(tokens, positions, None)
    theirs_logits = theirs(tokens, positions, None)
    if attention_backend == "megatron":
        assert torch.equal(ours_logits, theirs_logits)
        ours_logits.square().mean().backward()
        theirs_logits.square().mean().backward()
        grads = dict(theirs.named_parameters())
        for name, param in ours.named_parameters():
            assert torch.equal(param.grad, grads[name].grad), name
    else:  # measured 4.5e-6 at most; RoPE base 10001 instead of 10000 is off by 1.4e-3
        torch.testing.assert_close(ours_logits, theirs_logits, rtol=0, atol=2e-5)


@pytest.mark.parametrize("variant,block_size", [("full", 1), ("block", 4)], ids=["full", "block4"])
def test_parameters_and_init(megatron_world1, variant, block_size):
    """The paper's initialisation: zero queries, unit norm weights, 4d per layer + 2d; Megatron keys kept."""
    model_cfg = tiny_gpt_config()
    base = build_gpt(model_cfg, MHARConfig(variant="none"))
    model = build_gpt(model_cfg, MHARConfig(variant=variant, block_size=block_size))
    d, layers = model_cfg.hidden_size, model_cfg.num_layers
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(model) - count(base) == 4 * d * layers + 2 * d
    extra = set(model.state_dict()) - set(base.state_dict())
    assert set(base.state_dict()) <= set(model.state_dict())
    assert all(".input_router." in k or ".pre_mlp_router." in k or "final_router." in k for k in extra)
    for name, param in model.named_parameters():
        if name.endswith("router.query"):
            assert torch.equal(param, torch.zeros_like(param)), name
        if name.endswith("router.norm_weight"):
            assert torch.equal(param, torch.ones_like(param)), name


def _expected_sources(variant, block_size, outputs):
    """Sources [b_0, completed blocks...] and the partial seen by each site, from raw outputs."""
    size = 1 if variant == "full" else block_size
    reads = []
    completed, partial = [outputs[0]], None
    for j in range(1, len(outputs) + 1):
        position = (j - 1) % size + 1
        reads.append(completed + ([partial] if position >= 2 else []))
        if j == len(outputs):
            break
        out = outputs[j]
        partial = out if position == 1 else partial + out
        if position == size:
            completed, partial = completed + [partial], None
    return reads


@pytest.mark.parametrize(
    "variant,block_size,heads",
    [
        pytest.param("full", 1, 8, id="full-H8"),
        pytest.param("full", 1, 1, id="full-H1-attnres"),
        pytest.param("block", 2, 4, id="block2-one-layer-blocks"),
        pytest.param("block", 4, 8, id="block4"),
        pytest.param("block", 5, 2, id="block5-crosses-layers"),  # blocks end mid-layer
    ],
)
@pytest.mark.parametrize("zero_queries", [True, False], ids=["zero-q", "random-q"])
def test_every_site_routes_the_right_sources(megatron_world1, variant, block_size, heads, zero_queries):
    """Capture every sublayer input and output; each input must be the routed mixture of
    exactly the sources the paper's variants list for it (so no site sees a later source)."""
    model_cfg = tiny_gpt_config()
    mhar = MHARConfig(variant=variant, block_size=block_size, num_heads=heads)
    model = build_gpt(model_cfg, mhar)
    if not zero_queries:
        randomize_routers(model)
    inputs, outputs = capture_sublayers(model)
    routers = [r for layer in model.decoder.layers for r in (layer.input_router, layer.pre_mlp_router)]
    routers.append(model.decoder.final_router)
    reads = _expected_sources(variant, block_size, outputs)
    assert len(inputs) == len(reads) == 2 * model_cfg.num_layers + 1
    for site, (x, sources, router) in enumerate(zip(inputs, reads, routers), start=1):
        if zero_queries:
            expected = torch.stack(sources).mean(0)
        else:
            expected = depth_route_reference(
                torch.stack(sources), router.query, router.norm_weight, heads, eps=1e-6
            )
        torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5, msg=f"site {site}")


RECOMPUTE = [
    pytest.param(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                 id="full-uniform-1"),
    pytest.param(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
                 id="full-uniform-2"),  # chunks of two layers, a ragged last chunk
    pytest.param(dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
                 id="full-block-2"),
    pytest.param(dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
                 id="selective-core-attn"),
    pytest.param(dict(recompute_granularity="selective", recompute_modules=["mlp", "layernorm"]),
                 id="selective-mlp-layernorm"),
]


def _assert_same_loss_and_grads(mhar, other_mhar, bitwise, **other_overrides):
    """Two builds with the same weights (random routers): equal loss and gradients."""
    model_cfg = tiny_gpt_config(attention_backend="megatron")
    model = build_gpt(model_cfg, mhar)
    randomize_routers(model)
    other = build_gpt(model_cfg, other_mhar, **other_overrides)
    other.load_state_dict(model.state_dict())
    loss, grads = _loss_and_grads(model)
    loss_o, grads_o = _loss_and_grads(other)
    assert torch.equal(loss, loss_o)
    assert grads.keys() == grads_o.keys() and len(grads) == len(list(model.parameters()))
    for name in grads:
        if bitwise:
            assert torch.equal(grads_o[name], grads[name]), name
        else:
            torch.testing.assert_close(grads_o[name], grads[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "mhar_fields",
    [
        pytest.param(dict(variant="full"), id="full"),
        pytest.param(dict(variant="block", block_size=3), id="block3"),
        pytest.param(dict(variant="delta", delta_block_layers=1), id="delta1"),  # rows every layer
        # Two-phase routing: groups of 3 sites span the recompute chunks' boundaries.
        pytest.param(dict(variant="full", routing_schedule="lookahead", lookahead_group=3),
                     id="full-lookahead3"),
        pytest.param(dict(variant="full", routing_schedule="lookahead"), id="full-lookahead-auto"),
        # Blocks of 3 sites as lookahead groups, split by the recompute chunks.
        pytest.param(dict(variant="block", block_size=3, routing_schedule="lookahead"), id="block3-lookahead"),
        pytest.param(dict(variant="delta", delta_block_layers=2, routing_schedule="lookahead"), id="delta2-lookahead"),
    ],
)
@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_recompute_gives_same_loss_and_grads(megatron_world1, mhar_fields, recompute):
    mhar = MHARConfig(num_heads=4, **mhar_fields)
    _assert_same_loss_and_grads(mhar, mhar, bitwise=False, **recompute)


def test_mhar_trains_through_megatron_schedule(megatron_world1):
    """Megatron's non-pipelined forward/backward schedule with 2 micro-batches on CPU."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model_cfg = tiny_gpt_config()
    model = build_gpt(model_cfg, MHARConfig(variant="full", num_heads=8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = [gpt_batch(seed) for seed in range(2)]

    def forward_step(data_iterator, model):
        tokens, positions = next(data_iterator)
        output = model(tokens, positions, None, labels=tokens)
        return output, lambda out: (out.float().mean(), {"loss": out.float().mean().detach()})

    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        result = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=2, seq_length=GPT_SEQ, micro_batch_size=GPT_BATCH, forward_only=False,
        )
        optimizer.step()
        losses.append(sum(r["loss"].item() for r in result) / 2)
    assert losses[-1] < losses[0] - 0.1
    query_grads = [p for n, p in model.named_parameters() if n.endswith("pre_mlp_router.query")]
    assert all(p.abs().sum() > 0 for p in query_grads)  # routing parameters learn


CONFIG_ERRORS = [
    pytest.param(dict(variant="delta", delta_block_layers=0), {}, "positive integer",
                 id="delta-zero-block"),
    pytest.param(dict(variant="sparse"), {}, "must be one of", id="unknown-variant"),
    pytest.param(dict(num_heads=3), {}, "does not divide hidden_size", id="heads-not-dividing"),
    pytest.param(dict(variant="block", block_size=0), {}, "positive integer", id="zero-block"),
    pytest.param(dict(variant="block", block_size=7), {}, "exceeds the model", id="block-too-big"),
    pytest.param(dict(logit_scale=0.0), {}, "logit_scale must be a positive finite number", id="bad-scale"),
    pytest.param(dict(logit_scale=float("inf")), {}, "logit_scale must be a positive finite number", id="inf-scale"),
    pytest.param(dict(eps="1e-6"), {}, r"eps must be a positive finite number \(or None", id="string-eps"),
    pytest.param(dict(eps=float("inf")), {}, r"eps must be a positive finite number", id="inf-eps"),
    pytest.param(dict(kernel_impl="cuda"), {}, "kernel_impl must be one of", id="bad-impl"),
    pytest.param({}, dict(context_parallel_size=2), "context_parallel_size", id="context-parallel"),
]


@pytest.mark.parametrize("mhar_fields,config_overrides,message", CONFIG_ERRORS)
def test_config_errors_name_the_fix(mhar_fields, config_overrides, message):
    from megatron_mhar.models.builder import make_transformer_config

    with pytest.raises(ValueError, match=message):
        mhar = MHARConfig(**mhar_fields)
        make_transformer_config(tiny_gpt_config(), mhar, **config_overrides)


MODEL_CONFIG_ERRORS = [
    pytest.param(dict(num_layers=2.0), "num_layers must be an integer, got float 2.0", id="float-layers"),
    pytest.param(dict(num_layers="2"), "num_layers must be an integer, got str '2'", id="string-layers"),
    pytest.param(dict(num_query_groups=0), "num_query_groups must be positive, or null", id="zero-groups"),
    pytest.param(dict(num_query_groups=-2), "num_query_groups must be positive, or null", id="negative-groups"),
    pytest.param(dict(ffn_hidden_size=0), "ffn_hidden_size must be positive, or null", id="zero-ffn"),  # was a 0-wide MLP
    pytest.param(dict(kv_channels=0), "kv_channels must be positive, or null", id="zero-kv-channels"),
    pytest.param(dict(make_vocab_size_divisible_by=0), "make_vocab_size_divisible_by must be positive", id="zero-vocab-multiple"),
    pytest.param(dict(make_vocab_size_divisible_by=-1), "make_vocab_size_divisible_by",
                 id="negative-vocab-multiple"),  # padded the vocabulary to 0 rows
    pytest.param(dict(norm_epsilon=-1e-6), "norm_epsilon must be positive", id="negative-eps"),
    pytest.param(dict(rotary_base=0), "rotary_base .* greater than 1", id="zero-theta"),
    pytest.param(dict(rotary_percent=0.0), r"rotary_percent must lie in \(0, 1\]", id="no-rope"),
    pytest.param(dict(rotary_percent=2.0), r"rotary_percent must lie in \(0, 1\]", id="rope-over-1"),
    pytest.param(dict(rope_scaling=True, rope_scaling_factor=0.0), "rope_scaling_factor", id="zero-rope-factor"),
    pytest.param(dict(hidden_dropout=1.5), r"hidden_dropout must lie in \[0, 1\)", id="dropout-over-1"),
    pytest.param(dict(attention_dropout=-0.1), "attention_dropout must lie in", id="negative-dropout"),
    pytest.param(dict(init_method_std=-0.02), "init_method_std must be non-negative", id="negative-std"),
    pytest.param(dict(kv_channels=15), "RoPE rotates 15 channels", id="odd-head-width"),
    pytest.param(dict(hidden_size=60, num_query_groups=None), "RoPE rotates 15 channels", id="odd-derived-width"),
]


@pytest.mark.parametrize("fields,message", MODEL_CONFIG_ERRORS)
def test_model_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_gpt_config(**fields)


def test_builder_refuses_mismatched_inputs(megatron_world1):
    from megatron_mhar.models.builder import build_gpt_model, make_transformer_config

    mhar = MHARConfig(num_heads=4)
    with pytest.raises(ValueError, match="takes a GPTModelConfig and an MHARConfig"):
        make_transformer_config(tiny_gpt_config(), {"variant": "full"})
    with pytest.raises(ValueError, match="params_dtype must be a torch.dtype"):
        make_transformer_config(tiny_gpt_config(), mhar, params_dtype="bf16")
    # A config of another architecture built the config's model, not the one asked for.
    config = make_transformer_config(tiny_gpt_config(), mhar, use_cpu_initialization=True)
    with pytest.raises(ValueError, match="config.num_layers=3 differs from the model's 5"):
        build_gpt_model(tiny_gpt_config(num_layers=5), mhar, config)
    # Parallel sizes that Megatron's parallel state does not have (TP=PP=1 here).
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        config = make_transformer_config(tiny_gpt_config(), mhar, use_cpu_initialization=True,
                                         pipeline_dtype=torch.float32, **{name: 2})
        with pytest.raises(ValueError, match=f"config.{name}=2 but Megatron's parallel state"):
            build_gpt_model(tiny_gpt_config(), mhar, config)


def test_mhar_config_is_a_plain_dataclass():
    mhar = MHARConfig(variant="block", block_size=4)
    assert dataclasses.replace(mhar, num_heads=1).num_heads == 1
    assert not MHARConfig(variant="none").enabled


@pytest.mark.parametrize("variant", ["full", "delta"])
def test_graph_and_history_are_freed_after_backward(megatron_world1, monkeypatch, variant):
    """No reference cycle keeps a micro-batch's history (and with it its graph) alive."""
    import gc
    import weakref

    from megatron_mhar.ops import history as history_module

    created = []
    original_init = history_module.SourceHistory.__init__

    def recording_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        created.append(weakref.ref(self))

    monkeypatch.setattr(history_module.SourceHistory, "__init__", recording_init)
    model = build_gpt(tiny_gpt_config(), MHARConfig(variant=variant, delta_block_layers=1))
    for seed in range(2):
        tokens, positions = gpt_batch(seed)
        model(tokens, positions, None, labels=tokens).float().mean().backward()
    gc.collect()
    assert len(created) == 2
    assert all(ref() is None for ref in created)


@pytest.mark.parametrize(
    "mhar_fields,sources_read",
    [
        pytest.param(dict(variant="full"), lambda site: site, id="full"),
        # blocks of 2 sublayers: the completed blocks, plus the partial at a block's second site
        pytest.param(dict(variant="block", block_size=2), lambda site: (site + 1) // 2 + (site + 1) % 2,
                     id="block"),
        # delta, 1-layer blocks: null + embedding + completed layers before the site's layer
        pytest.param(dict(variant="delta", delta_block_layers=1), lambda site: 1 + (site + 1) // 2,
                     id="delta"),
    ],
)
def test_routing_is_recorded_on_request(megatron_world1, mhar_fields, sources_read):
    """Zero queries route uniformly: every source weighs 1/N, every head's entropy is ln N."""
    import math

    from megatron_mhar.diagnostics.recorder import RoutingRecorder

    model = build_gpt(tiny_gpt_config(), MHARConfig(num_heads=4, **mhar_fields))
    tokens, positions = gpt_batch()
    assert model.decoder.routing_recorder is None  # off by default
    recorder = RoutingRecorder()
    model.decoder.routing_recorder = recorder
    with torch.no_grad():
        model(tokens, positions, None)
    sites = 2 * 3 + (0 if mhar_fields["variant"] == "delta" else 1)
    assert sorted(recorder.sites) == list(range(1, sites + 1))
    for j, record in recorder.sites.items():
        n = sources_read(j)
        assert record.tokens == tokens.numel() and record.weights.shape == (n, 4)
        torch.testing.assert_close(record.entropy / record.tokens, torch.full((4,), math.log(n)),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(record.weights / record.tokens, torch.full((n, 4), 1 / n),
                                   rtol=1e-6, atol=1e-6)