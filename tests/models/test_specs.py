"""``model.spec: auto``: Transformer Engine's layers where TE imports and the model runs on a GPU.

The Transformer Engine here is a package written into a temporary directory: one that
imports (the version is what ``auto`` reports) and one whose libraries fail to load (as a
CUDA or cuDNN mismatch makes TE's own import raise OSError).
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.models.specs import SpecChoice, resolve_spec
from tests.helpers import build_gpt, tiny_gpt_config


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
