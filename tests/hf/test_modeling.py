"""The transformers MHAR models against Megatron's: gradients, config checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import RANDOM_MODELS, ROUTED_CASES, export_token_batch, random_model

REPO = Path(__file__).resolve().parents[2]


def test_transformers_config_gives_the_megatron_layout():
    """The transformers model reads the layout of the same fields the Megatron model does."""
    from transformers import PretrainedConfig

    from megatron_mhar.hf.modeling_mhar import depth_layout
    from megatron_mhar.models.mhar_config import MHARConfig
    from megatron_mhar.models.routing import make_layout

    for variant in ("full", "block", "delta"):
        hf = depth_layout(PretrainedConfig(num_hidden_layers=6, mhar_variant=variant, mhar_block_size=3,
                                           mhar_delta_block_layers=2))
        assert hf == make_layout(MHARConfig(variant=variant, block_size=3, delta_block_layers=2), 6), variant


@pytest.mark.parametrize("case", ROUTED_CASES)
def test_gradients_equal_megatrons(megatron_world1, checkpoints, exports, case):
    """With autograd on (sources stacked, not buffered), the loss and every routing
    parameter's gradient equal the Megatron model's; without it the logits are the same."""
    import megatron_mhar
    import megatron_mhar.hf  # noqa: F401  (registers the classes)
    from megatron_mhar.conversion import mapping
    from transformers import AutoModelForCausalLM

    tokens = export_token_batch(1)
    megatron = megatron_mhar.load_model(checkpoints[case], grad=True)  # autograd: asked for
    hf = AutoModelForCausalLM.from_pretrained(exports[case], dtype=torch.float32).eval()
    losses = []
    for logits in (megatron(tokens), hf(tokens).logits):
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss)
    assert losses[0].item() == pytest.approx(losses[1].item(), abs=1e-6)
    with torch.no_grad():
        assert torch.equal(hf(tokens).logits, hf(tokens).logits)
        assert (hf(tokens).logits - megatron(tokens)).abs().max() <= 1e-5
    hf_params = dict(hf.named_parameters())
    checked = 0
    for name, param in megatron.gpt.named_parameters():
        if not mapping.is_mhar_param(name):
            continue
        rule, layer = mapping.rule_for_megatron(name)
        grad = hf_params[rule.hf[0].format(layer)].grad
        assert (grad - param.grad).abs().max() <= 1e-5 * max(1.0, param.grad.abs().max().item()), name
        checked += 1
    assert checked >= 12


@pytest.mark.parametrize("fields,message", [
    pytest.param(dict(mhar_variant="none"), "mhar_variant must be one of", id="variant-none"),
    pytest.param(dict(mhar_num_heads=5), "mhar_num_heads=5 does not divide hidden_size=32", id="heads"),
    pytest.param(dict(mhar_variant="block", mhar_block_size=7), "mhar_block_size=7 sublayers exceeds",
                 id="block-size"),
    pytest.param(dict(mhar_variant="delta", mhar_delta_block_layers=4),
                 "mhar_delta_block_layers=4 decoder layers exceeds the model's 3", id="delta-block"),
    pytest.param(dict(mhar_logit_scale=0.0), "mhar_logit_scale must be a positive finite number",
                 id="logit-scale"),
    pytest.param(dict(mhar_eps=-1.0), "mhar_eps must be a positive finite number", id="eps"),
])
def test_config_names_the_bad_field(fields, message):
    from megatron_mhar.hf import MHARLlamaConfig

    with pytest.raises(ValueError, match=message):
        MHARLlamaConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, **fields)


@pytest.mark.parametrize("name", ["qwen3-full", "llama-block", "qwen3-delta"])
def test_forward_compiles_as_one_graph(name):
    """_can_compile_fullgraph: torch.compile(fullgraph=True) traces the forward without a
    graph break, with autograd (sources stacked) and without (one buffer); same logits.
    (Dynamo's eager backend: the tracing, without the CPU code generation.)"""
    model, tokens = random_model(name), export_token_batch(3, seq=10)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        expected = model(tokens).logits
        assert torch.equal(compiled(tokens).logits, expected)
    assert torch.equal(compiled(tokens).logits.detach(), expected)


def _counting_fused_route(monkeypatch):
    """Count the calls of the fused op that ``depth_route`` imports when it picks the kernels."""
    import mhar_kernels.depth_route as kernels

    calls = []
    fused = kernels.fused_depth_route

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return fused(*args, **kwargs)

    monkeypatch.setattr(kernels, "fused_depth_route", counted)
    return calls


def _sites(model) -> int:
    config = model.config
    return 2 * config.num_hidden_layers + int(config.mhar_variant != "delta")


def test_installed_package_routes_with_its_own_op():
    """With megatron_mhar installed the model calls the package's depth_route, whose
    ``auto`` picks the fused kernels on CUDA; the export's copy serves only without it."""
    import importlib

    from megatron_mhar.hf import modeling_mhar

    op = importlib.import_module("megatron_mhar.ops.depth_route")
    assert modeling_mhar.depth_route is op.depth_route


def test_fused_kernels_route_the_model_as_the_reference_does(tmp_path):
    """The fused kernels, run by Triton's interpreter on CPU in fp32, give the reference's logits."""
    if torch.cuda.is_available():
        pytest.skip("on CUDA the kernels run natively: test_cuda_routes_with_the_fused_kernels")
    pytest.importorskip("triton")
    out = tmp_path / "logits.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "tests.hf.route_with_kernels", str(out)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    for name, routed in torch.load(out).items():
        assert routed["calls"] == _sites(random_model(name)), name
        reference = routed["reference"]
        assert (routed["fused"] - reference).abs().max() <= 1e-5 * max(1.0, reference.abs().max().item()), name


@pytest.mark.gpu
@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_cuda_routes_with_the_fused_kernels(monkeypatch, name):
    """On CUDA every site routes through the fused kernels; fp32 logits equal the CPU reference's."""
    model, tokens = random_model(name), export_token_batch(3, seq=10)
    with torch.no_grad():
        reference = model(tokens).logits
    calls = _counting_fused_route(monkeypatch)
    with torch.no_grad():
        fused = model.cuda()(tokens.cuda()).logits.cpu()
    assert len(calls) == _sites(model)
    assert (fused - reference).abs().max() <= 1e-4 * max(1.0, reference.abs().max().item())
