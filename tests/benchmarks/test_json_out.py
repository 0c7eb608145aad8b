"""``benchmarks/json_out.py``: where reports go, and every write whole."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks.json_out import default_out, device_name, write_json

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
