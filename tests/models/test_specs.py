"""Layer specs: ``model.spec: auto`` (Transformer Engine's layers where TE imports and the
model runs on a GPU) and the routers' spec slots.

The Transformer Engine here is a package written into a temporary directory: one that
imports (the version is what ``auto`` reports) and one whose libraries fail to load (as a
CUDA or cuDNN mismatch makes TE's own import raise OSError).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys

import pytest
import torch

from megatron_mhar.models.builder import make_transformer_config
from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.models.routing import DeltaRouter, DepthRouter
from megatron_mhar.models.specs import SpecChoice, get_mhar_block_spec, resolve_spec
from tests.helpers import build_gpt, gpt_batch, randomize_routers, tiny_gpt_config


@pytest.fixture
def transformer_engine(tmp_path, monkeypatch):
    """``install(pytorch_source)``: a ``transformer_engine`` 2.12.0 package whose
    ``pytorch/__init__.py`` is ``pytorch_source``, first on the path; whatever
    ``transformer_engine`` modules were imported before are back after the test."""
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "transformer_engine"}

    def install(pytorch_source: str = "") -> None:
        package = tmp_path / "transformer_engine"
        (package / "pytorch").mkdir(parents=True)
        (package / "__init__.py").write_text('__version__ = "2.12.0"\n')
        (package / "pytorch" / "__init__.py").write_text(pytorch_source)
        for name in saved:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()

    yield install
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]
    sys.modules.update(saved)


@pytest.fixture
def without_transformer_engine(monkeypatch):
    """``import transformer_engine`` fails, whatever is installed."""
    monkeypatch.setitem(sys.modules, "transformer_engine", None)


@pytest.fixture
def cuda(monkeypatch):
    """A machine that says it has a GPU (nothing here runs on one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_auto_is_transformer_engine_where_it_imports_on_a_gpu(transformer_engine, cuda):
    transformer_engine()
    assert resolve_spec("auto") == SpecChoice("transformer_engine", "Transformer Engine 2.12.0")


def test_auto_is_local_without_transformer_engine(without_transformer_engine, cuda):
    choice = resolve_spec("auto")
    assert choice.spec == "local"
    assert choice.reason.startswith("Transformer Engine not importable: ")


def test_auto_is_local_when_transformer_engine_does_not_load(transformer_engine, cuda):
    """Installed, but its libraries fail to load: named, not a crash of the run."""
    transformer_engine('raise OSError("libcudnn.so.9: cannot open shared object file")\n')
    assert resolve_spec("auto") == SpecChoice(
        "local", "Transformer Engine not importable: libcudnn.so.9: cannot open shared object file"
    )


def test_auto_is_local_on_cpu(transformer_engine, cuda):
    """TE layers run on GPUs: a model on the CPU (run.device=cpu) takes the local spec."""
    transformer_engine()
    assert resolve_spec("auto", cuda=False) == SpecChoice(
        "local", "the model runs on CPU; Transformer Engine layers run on GPUs"
    )


def test_auto_is_local_without_a_gpu(transformer_engine):
    transformer_engine()
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert resolve_spec("auto") == SpecChoice("local", "no CUDA device; Transformer Engine layers run on GPUs")


@pytest.mark.parametrize("spec", ["local", "transformer_engine"])
def test_named_specs_stay(spec, without_transformer_engine):
    """A named spec is not second-guessed; the launch checks say if it cannot run."""
    assert resolve_spec(spec, cuda=False) == SpecChoice(spec, "set in model.spec")


def test_builder_resolves_auto(megatron_world1):
    """``build_gpt_model`` with ``spec: auto`` on this CPU machine builds local layers: torch
    pre-norms (the TE spec fuses them into the next linear layer and has none)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine auto may choose Transformer Engine")
    model = build_gpt(tiny_gpt_config(spec="auto"), MHARConfig(variant="full", num_heads=4))
    norm = model.decoder.layers[0].input_layernorm
    assert sum(p.numel() for p in norm.parameters()) == 32  # d=32 weights, not an IdentityOp


class CountingRouter(DepthRouter):
    """A user's router: the default one, counting the sites it routes."""

    def __init__(self, config):
        super().__init__(config)
        self.calls = 0

    def forward(self, stream, site):
        self.calls += 1
        return super().forward(stream, site)


@pytest.mark.parametrize("variant,router", [("full", DepthRouter), ("block", DepthRouter), ("delta", DeltaRouter)])
def test_routers_fill_the_spec_slots(megatron_world1, variant, router):
    """The spec names every routing site's router (the layers' two slots, the block's final
    site where the variant has one), and the model builds them from it."""
    model_cfg = tiny_gpt_config()
    mhar = MHARConfig(variant=variant, num_heads=4, block_size=2, delta_block_layers=1)
    config = make_transformer_config(model_cfg, mhar, use_cpu_initialization=True)
    spec = get_mhar_block_spec(model_cfg, mhar, config)
    layer = spec.layer_specs[0].submodules
    assert layer.input_router.module is layer.pre_mlp_router.module is spec.final_router.module is router
    model = build_gpt(model_cfg, mhar)
    routers = [m for n, m in model.named_modules() if n.endswith("_router")]
    assert routers and all(type(m) is router for m in routers)
    assert (model.decoder.final_router is None) == (variant == "delta")


def test_a_spec_swaps_the_routers(megatron_world1, monkeypatch):
    """A user spec replaces the router of a slot, as it replaces Megatron's own submodules;
    the model routes every site through it and computes what the default routers compute."""
    from megatron_mhar.models import builder

    model_cfg, mhar = tiny_gpt_config(), MHARConfig(variant="full", num_heads=4)
    default = build_gpt(model_cfg, mhar)
    randomize_routers(default)

    def user_spec(*args):
        spec = get_mhar_block_spec(*args)
        spec.layer_specs = [dataclasses.replace(s, submodules=dataclasses.replace(
            s.submodules, input_router=CountingRouter, pre_mlp_router=CountingRouter)) for s in spec.layer_specs]
        spec.final_router = CountingRouter
        return spec

    monkeypatch.setattr(builder, "get_mhar_block_spec", user_spec)
    swapped = build_gpt(model_cfg, mhar)
    swapped.load_state_dict(default.state_dict())
    tokens, positions = gpt_batch()
    assert torch.equal(swapped(tokens, positions, None), default(tokens, positions, None))
    counts = [m.calls for m in swapped.modules() if isinstance(m, CountingRouter)]
    assert counts == [1] * (2 * model_cfg.num_layers + 1)


def test_a_layer_spec_without_routers_is_refused(megatron_world1, monkeypatch):
    """An MHAR layer whose spec leaves a router slot empty names the slot and the fix."""
    from megatron_mhar.models import builder

    def user_spec(*args):
        spec = get_mhar_block_spec(*args)
        spec.layer_specs = [dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, pre_mlp_router=None))
                            for s in spec.layer_specs]
        return spec

    monkeypatch.setattr(builder, "get_mhar_block_spec", user_spec)
    with pytest.raises(ValueError, match="spec names no pre_mlp_router"):
        build_gpt(tiny_gpt_config(), MHARConfig(variant="full", num_heads=4))


def test_te_fused_kernels_are_megatron_fields():
    """The fused kernels of TE-spec models are TransformerConfig fields Megatron accepts,
    only with the TE spec (the local spec's gradient-accumulation fusion needs apex), and
    ``model.fused_kernels: false`` leaves them out."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mhar.models.builder import fused_kernel_fields
    from megatron_mhar.models.gpt_config import GPTModelConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    te = fused_kernel_fields(GPTModelConfig(spec="transformer_engine"))
    assert te["cross_entropy_loss_fusion"] and te["apply_rope_fusion"] and te["bias_activation_fusion"]
    # TE's linears fuse the weight-gradient accumulation themselves (apex or not); TE's
    # cross-entropy cannot be captured by the full-iteration graph.
    assert te["gradient_accumulation_fusion"] and te["cross_entropy_fusion_impl"] == "native"
    assert set(te) <= fields
    assert fused_kernel_fields(GPTModelConfig(spec="transformer_engine", fused_kernels=False)) == {}
    assert fused_kernel_fields(GPTModelConfig(spec="local")) == {}
    with pytest.raises(ValueError, match="model.fused_kernels must be true or false"):
        GPTModelConfig(fused_kernels="yes")


def test_gradient_accumulation_fusion_builds_without_apex(megatron_world1):
    """``gradient_accumulation_fusion`` (TE's linears fuse it) builds without apex's extension:
    Megatron's own linears (here every linear of the local spec; under TE the output layer)
    take the unfused path and compute the gradients of the model built without the fusion,
    and Megatron's flag for the extension is restored after the build."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        pytest.skip("apex's fused_weight_gradient_mlp_cuda is installed: Megatron's linears fuse too")
    mhar = MHARConfig(variant="full", num_heads=4)
    grads = {}
    for fusion in (False, True):
        model = build_gpt(tiny_gpt_config(spec="local"), mhar, gradient_accumulation_fusion=fusion)
        assert not layers._grad_accum_fusion_available
        linears = [m for m in model.modules() if isinstance(m, (layers.ColumnParallelLinear, layers.RowParallelLinear))]
        assert linears and not any(m.gradient_accumulation_fusion for m in linears)
        tokens, positions = gpt_batch()
        model(tokens, positions, None, labels=tokens).float().sum().backward()
        grads[fusion] = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert grads[True].keys() == grads[False].keys()
    for name, grad in grads[False].items():
        assert torch.equal(grads[True][name], grad), name
