"""``benchmarks/bench_training.py`` on CPU: the report a GPU run fills, at the tiny size."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_throughput_bench_reports_every_model(tmp_path):
    out = tmp_path / "training.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_training.py"), "--sizes", "tiny",
         "--models", "baseline,attnres,mhar", "--steps", "2", "--warmup", "1", "--out", str(out)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    models = json.loads(out.read_text())["sizes"]["tiny"]["models"]
    assert set(models) == {"baseline", "attnres", "mhar"}
    assert models["baseline"]["throughput_ratio"] == 1.0
    for name, entry in models.items():
        assert entry["tokens_per_s"] > 0 and len(entry["step_s_all"]) == 2
        assert len(entry["losses"]) == 3  # one warmup step and two timed ones
        split = entry["micro_batch_host_split"]
        # Completed is never earlier than issued, and both phases took time.
        assert split["forward_ms"] >= split["forward_issued_ms"] > 0
        assert split["backward_ms"] >= split["backward_issued_ms"] > 0
    # AttnRes and MHAR are other models than the baseline: their parameters and losses differ.
    assert models["mhar"]["params"] > models["baseline"]["params"]
    assert models["mhar"]["losses"] != models["baseline"]["losses"]
    assert 0 < models["attnres"]["throughput_vs_mhar"]
