"""``benchmarks.common``: where reports go and every write whole, and the cases every
benchmark shares (sizes from the recipes, the compared models)."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks.common import default_out, device_name, write_json

ROOT = Path(__file__).resolve().parents[2]


def test_a_failed_write_keeps_the_previous_report(tmp_path):
    """A report that fails to serialise leaves the last whole one, and no partial file."""
    out = tmp_path / "results" / "report.json"
    write_json(out, {"sizes": {"tiny": 1.0}})
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json(out, {"sizes": {"tiny": 1.0, "100m": object()}})
    assert json.loads(out.read_text()) == {"sizes": {"tiny": 1.0}}
    assert [p.name for p in out.parent.iterdir()] == ["report.json"]


@pytest.mark.parametrize("gpu, count, tag", [
    ("NVIDIA H200", 1, "h200"),
    ("NVIDIA H200", 2, "h200x2"),
    ("NVIDIA H100 80GB HBM3", 1, "h100"),
    ("NVIDIA A100-SXM4-80GB", 4, "a100x4"),
])  # fmt: skip
def test_reports_of_record_are_named_by_benchmark_and_device(gpu, count, tag, monkeypatch):
    """``benchmarks/results/<benchmark>/<device>.json``: the GPU model in lower case with
    the GPU count past one; ``cpu`` for a CPU run or where there is no GPU."""
    assert default_out("routing", "h200") == str(ROOT / "benchmarks" / "results" / "routing" / "h200.json")
    assert device_name(2, device="cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: gpu)
    assert device_name(count) == tag
    assert device_name(count, device="cpu") == "cpu"


def test_routing_cases_are_the_recipes_shapes():
    """The routing benchmarks' shapes come from the recipes (the one definition of the sizes):
    width, depth and micro-batch tokens of the paper's three models and of the 8B delta model
    (over two sequences), and each model's widest site."""
    from benchmarks.common import site_cases, step_cases

    steps = step_cases()
    assert [(c.name, c.d, c.layers, c.t, c.variant) for c in steps] == [
        ("100M", 512, 12, 8 * 2048, "full"), ("350M", 1024, 24, 4 * 1024, "full"),
        ("1B", 1280, 36, 2 * 1024, "full"), ("8B-delta", 4096, 32, 2 * 4096, "delta")]
    sites = {c.name: (c.d, c.n, c.t) for c in site_cases(steps)}
    assert sites["1B-final"] == (1280, 73, 2048) and sites["8B-delta"] == (4096, 9, 8192)
    assert sites["350M-N9"] == (1024, 9, 4096)


def test_models_are_the_recipes_routings():
    """The compared models' routings are the recipes' (recipes/base/variant_*.yaml)."""
    from benchmarks.common import MODELS
    from megatron_mhar.training.recipes import load_config

    for name in ("baseline", "attnres", "mhar"):
        assert MODELS[name] == load_config(f"pretrain_100m_{name}").mhar, name
    assert MODELS["mhar_lookahead"].routing_schedule == "lookahead"


def test_model_overrides_name_their_errors():
    from benchmarks.common import MODELS, parse_model

    assert parse_model("mhar_lookahead") == MODELS["mhar_lookahead"]
    g8 = parse_model("mhar_lookahead@lookahead_group=8@lookahead_kernels=tensor_cores")
    assert (g8.lookahead_group, g8.lookahead_kernels) == (8, "tensor_cores")
    with pytest.raises(ValueError, match="unknown model 'mhr'"):
        parse_model("mhr@lookahead_group=8")
    with pytest.raises(ValueError, match="'group=8' is not field=value"):
        parse_model("mhar_lookahead@group=8")
    with pytest.raises(ValueError, match="lookahead_group takes an integer, got 'eight'"):
        parse_model("mhar_lookahead@lookahead_group=eight")
    with pytest.raises(ValueError, match="lookahead_kernels"):  # MHARConfig's own check
        parse_model("mhar_lookahead@lookahead_kernels=dots")
