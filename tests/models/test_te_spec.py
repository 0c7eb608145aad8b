"""The Transformer Engine spec on a GPU: Megatron's own TE GPT, MHAR beside TE layers, FP8.

* ``variant: none`` is Megatron's TE GPT bitwise (parameters, logits, every gradient);
* every variant's fused routing beside TE layers against the torch reference, judged
  against an fp32 model (flash-attention's rule);
* TE layers and local layers compute the same logits from the same weights;
* the driver trains TE models with the distributed optimizer over TE's fused Adam and
  resumes them exactly; a checkpoint of one spec resumes under the other;
* ``training.precision: fp8`` trains, with the routing and its history in bf16.

Skipped without a GPU (the ``gpu`` marker) or without Transformer Engine. An installed TE
that fails to import is an error here, not a skip. Attention runs TE's deterministic
backends (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``), so that two runs can be equal bitwise.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch

from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.training.metrics import read_metrics
from tests.helpers import TINY, gradient_tolerance, record_gate_gradient_scales

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None,
        reason="needs Transformer Engine (pip install 'megatron_mhar[te]')",
    ),
]

SEQ, BATCH, VOCAB = 128, 2, 512
BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
TE, LOCAL = "transformer_engine", "local"

# Local parameter name -> TE parameter name: TE fuses each pre-norm into the linear layer
# that follows it (Megatron's sharded_state_dict_keys_map of the local spec, as a rename).
FUSED_NORMS = {
    ".input_layernorm.": ".self_attention.linear_qkv.layer_norm_",
    ".pre_mlp_layernorm.": ".mlp.linear_fc1.layer_norm_",
}


@pytest.fixture(autouse=True)
def deterministic_attention(monkeypatch):
    """TE picks deterministic attention backends for the models built in a test."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")


def _model_config(spec: str):
    from megatron_mhar.models.gpt_config import GPTModelConfig

    return GPTModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                          ffn_hidden_size=512, vocab_size=VOCAB, seq_length=SEQ, qk_layernorm=True, spec=spec)


def _build(mhar: MHARConfig, spec: str = TE, dtype=torch.bfloat16, seed: int = 5):
    from megatron.core import tensor_parallel

    from megatron_mhar.models.builder import build_gpt_model, make_transformer_config

    model_cfg = _model_config(spec)
    config = make_transformer_config(model_cfg, mhar, **(BF16 if dtype == torch.bfloat16 else {}))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = build_gpt_model(model_cfg, mhar, config).cuda()
    # One dtype for every parameter, as the driver makes it: the local spec's torch norms
    # are built in fp32 whatever params_dtype says (TE's follow params_dtype).
    for module in model.modules():
        if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            module.to(dtype)
    return model


def _batch():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).cuda()
    positions = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, SEQ)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator).cuda()
    return tokens, positions, labels


def _logits_and_grads(model):
    """Logits [b, s, v] (fp32) and every parameter's gradient of their cross-entropy."""
    tokens, positions, labels = _batch()
    logits = model(tokens, positions, None)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters()}
    return logits.detach().float(), grads


def _perturb_routers(model, seed: int = 1) -> None:
    """Every routing parameter moved by 0.1 N(0, 1) from its identity init: non-trivial
    routing and open delta gates, with the H=1 logits (sums over all 256 channels) still in
    the range trained queries reach (at 0.3 they saturate the softmax, as
    tests/models/test_model_gpu.py found)."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "router" in name:
                param.add_(0.1 * torch.randn(param.shape, generator=generator, device="cuda", dtype=torch.float32))


def _is_te_layer(model) -> bool:
    return type(model.decoder.layers[0].self_attention.linear_qkv).__name__ == "TELayerNormColumnParallelLinear"


ROUTED = [
    pytest.param(MHARConfig(variant="full", num_heads=8), id="full-H8"),
    pytest.param(MHARConfig(variant="full", num_heads=1), id="full-H1"),  # Attention Residuals
    pytest.param(MHARConfig(variant="block", num_heads=8, block_size=3), id="block3"),  # blocks across layers
    pytest.param(MHARConfig(variant="delta", num_heads=8, delta_block_layers=1), id="delta1"),
    # Two-phase routing in groups of 2, each phase-1 kernel family.
    pytest.param(MHARConfig(variant="full", num_heads=8, routing_schedule="lookahead", lookahead_group=2,
                            lookahead_kernels="tensor_cores"), id="full-lookahead-dots"),
    pytest.param(MHARConfig(variant="full", num_heads=8, routing_schedule="lookahead", lookahead_group=2,
                            lookahead_kernels="row_loop"), id="full-lookahead-row-loop"),
    pytest.param(MHARConfig(variant="block", num_heads=8, block_size=3, routing_schedule="lookahead"),
                 id="block3-lookahead"),
    pytest.param(MHARConfig(variant="delta", num_heads=8, delta_block_layers=1, routing_schedule="lookahead"),
                 id="delta1-lookahead"),
]


def test_variant_none_bitwise_equals_megatron_te_gpt(megatron_cuda_world1):
    """``variant: none`` with ``model.spec: transformer_engine`` is the GPTModel of Megatron's
    own ``get_gpt_layer_with_transformer_engine_spec``: same parameters from the same seed,
    same logits, same gradients, bitwise."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ours = _build(MHARConfig(variant="none"))
    assert _is_te_layer(ours)
    config = TransformerConfig(**_model_config(TE).transformer_config_kwargs(), **BF16)
    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    theirs = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True),
        vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=True,
        position_embedding_type="rope", rotary_base=10000,
    ).cuda()
    ours_state, theirs_state = ours.state_dict(), theirs.state_dict()
    assert list(ours_state) == list(theirs_state)
    for key, value in ours_state.items():
        if torch.is_tensor(value):
            assert torch.equal(value, theirs_state[key]), key
    logits, grads = _logits_and_grads(ours)
    their_logits, their_grads = _logits_and_grads(theirs)
    assert torch.equal(logits, their_logits)
    assert list(grads) == list(their_grads)
    for name, grad in grads.items():
        assert torch.equal(grad, their_grads[name]), name


@pytest.mark.parametrize("mhar", [pytest.param(MHARConfig(variant="none"), id="none"), *ROUTED])
def test_bf16_forward_backward(megatron_cuda_world1, nan_uninitialised, mhar):
    """Every variant beside TE layers: finite logits and gradients, where uninitialised
    memory reads as NaN, and deterministic (two backward passes equal bitwise)."""
    model = _build(mhar)
    assert _is_te_layer(model)
    _perturb_routers(model)
    logits, grads = _logits_and_grads(model)
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(g).all() for g in grads.values())
    model.zero_grad(set_to_none=True)
    again_logits, again_grads = _logits_and_grads(model)
    assert torch.equal(logits, again_logits)
    for name, grad in grads.items():
        assert torch.equal(grad, again_grads[name]), name


@pytest.mark.parametrize("mhar", ROUTED)
def test_fused_kernels_match_reference_beside_te_layers(megatron_cuda_world1, mhar):
    """kernel_impl=triton vs kernel_impl=torch in the bf16 TE model, same weights, judged
    against the fp32 TE model with the torch routing.

    Flash-attention's rule: the fused model's error against the fp32 reference is at most
    twice the bf16 reference path's, plus a small atol, for the logits and every gradient; a
    delta gate's atol is set by its gradient's magnitude sum (``tests.helpers.GATE_NOISE``).
    """
    fp32 = _build(dataclasses.replace(mhar, kernel_impl="torch"), dtype=torch.float32)
    _perturb_routers(fp32)
    results = {}
    for impl, dtype in (("torch", torch.float32), ("torch", torch.bfloat16), ("triton", torch.bfloat16)):
        model = _build(dataclasses.replace(mhar, kernel_impl=impl), dtype=dtype)
        with torch.no_grad():
            for p_model, p_ref in zip(model.parameters(), fp32.parameters()):
                p_model.copy_(p_ref)
        if dtype == torch.float32:
            gate_scales = record_gate_gradient_scales(model)
        results[impl, dtype] = _logits_and_grads(model)
    logits_ref, grads_ref = results["torch", torch.float32]
    logits_bf16, grads_bf16 = results["torch", torch.bfloat16]
    logits_fused, grads_fused = results["triton", torch.bfloat16]
    fused_error = (logits_fused - logits_ref).abs().max()
    bf16_error = (logits_bf16 - logits_ref).abs().max()
    assert fused_error <= 2 * bf16_error + 1e-2 * logits_ref.abs().max(), (fused_error, bf16_error)
    for name, grad in grads_ref.items():
        fused_error = (grads_fused[name] - grad).abs().max()
        bf16_error = (grads_bf16[name] - grad).abs().max()
        assert fused_error <= 2 * bf16_error + gradient_tolerance(name, grad, gate_scales), (
            f"{name}: fused error {fused_error:.3g} vs bf16 reference error {bf16_error:.3g}"
        )


def _te_name(local_name: str) -> str:
    for local, te in FUSED_NORMS.items():
        local_name = local_name.replace(local, te)
    return local_name


@pytest.mark.parametrize("mhar", [pytest.param(MHARConfig(variant="none"), id="none"), *ROUTED[:4]])
def test_te_layers_compute_what_local_layers_compute(megatron_cuda_world1, mhar):
    """The same weights in TE layers and in local layers (TE's fused pre-norm weights are the
    local norms' weights): logits within bf16 tolerance. Both bf16 models are judged
    against the fp32 local model: TE's error at most twice the local bf16 model's, plus 1%
    of the logits' scale."""
    reference = _build(mhar, spec=LOCAL, dtype=torch.float32)
    _perturb_routers(reference)
    with torch.no_grad():  # norm weights away from ones: a wrongly mapped norm shows
        generator = torch.Generator(device="cuda").manual_seed(2)
        for name, param in reference.named_parameters():
            if "norm" in name and "router" not in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator, device="cuda"))
    local = _build(mhar, spec=LOCAL)
    te = _build(mhar, spec=TE)
    assert _is_te_layer(te) and not _is_te_layer(local)
    te_params = dict(te.named_parameters())
    with torch.no_grad():
        for p_local, p_ref in zip(local.parameters(), reference.parameters()):
            p_local.copy_(p_ref)
        mapped = {_te_name(name): param for name, param in reference.named_parameters()}
        assert set(mapped) == set(te_params)  # every TE parameter has its local counterpart
        for name, param in mapped.items():
            te_params[name].copy_(param)
    tokens, positions, _ = _batch()
    with torch.no_grad():
        logits_ref = reference(tokens, positions, None).float()
        logits_local = local(tokens, positions, None).float()
        logits_te = te(tokens, positions, None).float()
    te_error = (logits_te - logits_ref).abs().max()
    local_error = (logits_local - logits_ref).abs().max()
    assert te_error <= 2 * local_error + 1e-2 * logits_ref.abs().max(), (te_error, local_error)


# ---------------------------------------------------------------- the training driver

GPU_RUN = [
    "run.device=cuda",
    "model.num_layers=4",
    "model.hidden_size=256",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=512",
    f"model.seq_length={SEQ}",
    "mhar.num_heads=8",
    "training.precision=bf16",
    "optimizer.lr=3.0e-3",
    "optimizer.min_lr=3.0e-4",
    "eval.interval=0",
    "logging.tensorboard=false",
    "logging.routing_entropy=false",
]
"""Overrides of the driver tests' tiny recipe (tests.helpers.TINY): the models above, on the
GPU, writing metrics.jsonl only."""


@pytest.fixture
def gpu_run(tmp_path, embedded_dir, single_process):
    """``gpu_run(*overrides, name=...)``: a run config of the smoke recipe shrunk as the
    driver tests shrink it, on the GPU, writing under tmp_path."""
    from megatron_mhar.training.recipes import load_config

    def make(*overrides, name):
        base = TINY + GPU_RUN + [f"run.output_dir={tmp_path}", f"run.name={name}", f"data.embedded_dir={embedded_dir}"]
        return load_config("smoke_cpu", base + list(overrides))

    return make


def _run(cfg, step_hook=None):
    from megatron_mhar.training.loop import run

    return run(cfg, step_hook=step_hook)


def _train_losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir, "train")}


@pytest.mark.parametrize("variant", ["none", "full"])
def test_distributed_optimizer_with_te_fused_adam_resumes_exactly(gpu_run, variant):
    """TE layers, Megatron's distributed optimizer over TE's fused Adam, bf16: 2 steps, save,
    resume, 2 more equal 4 straight steps bitwise (weights, fp32 main weights and Adam
    moments through the checkpoint and back)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from transformer_engine.pytorch.optimizers import FusedAdam

    from megatron_mhar.training.model import unwrap

    seen = {}

    def inspect(trainer, step):
        optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
        seen.update(distributed=all(isinstance(o, DistributedOptimizer) for o in optimizers),
                    fused_adam=all(isinstance(o.optimizer, FusedAdam) for o in optimizers),
                    te_layers=_is_te_layer(unwrap(trainer.model[0])))

    common = (f"mhar.variant={variant}", f"model.spec={TE}", "parallel.use_distributed_optimizer=true",
              "optimizer.lr_decay_iters=4")
    straight = _run(gpu_run(*common, "training.train_iters=4", name="straight"), step_hook=inspect)
    assert seen == {"distributed": True, "fused_adam": True, "te_layers": True}
    _run(gpu_run(*common, "training.train_iters=2", name="resumed"))
    resumed = _run(gpu_run(*common, "training.train_iters=4", name="resumed"))
    assert min(resumed.losses) == 3  # resumed after step 2, did not redo steps
    assert _train_losses(resumed.run_dir) == _train_losses(straight.run_dir)  # bitwise
    assert straight.losses[4] < straight.losses[1]


def test_a_checkpoint_resumes_under_the_other_spec(gpu_run, capsys):
    """Local layers 2 steps, then ``model.spec: auto`` (TE here, said at the start) 2 more,
    then local again: each resume continues from the saved weights, which give the losses
    of an uninterrupted local run up to bf16 differences of the layers' kernels."""
    common = ("mhar.variant=full", "optimizer.lr_decay_iters=6")
    straight = _run(gpu_run(*common, f"model.spec={LOCAL}", "training.train_iters=6", name="local"))
    _run(gpu_run(*common, f"model.spec={LOCAL}", "training.train_iters=2", name="switched"))
    capsys.readouterr()
    te = _run(gpu_run(*common, "model.spec=auto", "training.train_iters=4", name="switched"))
    assert "model.spec auto -> transformer_engine (Transformer Engine " in capsys.readouterr().out
    back = _run(gpu_run(*common, f"model.spec={LOCAL}", "training.train_iters=6", name="switched"))
    assert sorted(te.losses) == [3, 4] and sorted(back.losses) == [5, 6]
    for step, loss in {**te.losses, **back.losses}.items():
        assert loss == pytest.approx(straight.losses[step], rel=2e-2), (step, loss, straight.losses[step])


def test_fp8_trains_with_routing_in_bf16(gpu_run):
    """``training.precision: fp8``: TE's linear layers run FP8 GEMMs (per-tensor current
    scaling); parameters, the routing parameters, the history and the routed inputs stay
    bf16; the loss is finite, falls, and follows the bf16 run's."""
    from megatron_mhar.models.routing import DepthRouter
    from megatron_mhar.training.model import unwrap

    seen = {"routing": set()}

    def inspect(trainer, step):
        model = unwrap(trainer.model[0])
        if step == 1:  # from the second step on, every routing site reports its dtypes
            for module in model.modules():
                if isinstance(module, DepthRouter):
                    module.register_forward_hook(
                        lambda m, args, out: seen["routing"].add((args[0].history.buffer.dtype, out.dtype))
                    )
        linear = model.decoder.layers[0].self_attention.linear_qkv
        seen.update(fp8=linear.fp8, recipe=type(linear.fp8_meta["recipe"]).__name__,
                    params={p.dtype for p in model.parameters()})

    common = (f"model.spec={TE}", "mhar.variant=full", "training.train_iters=10", "optimizer.lr_decay_iters=10")
    fp8 = _run(gpu_run(*common, "training.precision=fp8", name="fp8"), step_hook=inspect)
    assert seen == {"routing": {(torch.bfloat16, torch.bfloat16)}, "fp8": True,
                    "recipe": "Float8CurrentScaling", "params": {torch.bfloat16}}
    bf16 = _run(gpu_run(*common, name="bf16"))
    losses = [fp8.losses[step] for step in range(1, 11)]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.2, losses
    for step, loss in fp8.losses.items():
        assert loss == pytest.approx(bf16.losses[step], abs=0.1), (step, loss, bf16.losses[step])
