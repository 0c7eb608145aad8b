"""``benchmarks/bench_generation.py``: KV-cache vs recomputation tokens/s on CPU."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generation_bench_reports_every_model_and_mode(tmp_path):
    out = tmp_path / "generation.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_generation", "--models", "plain,mhar_delta",
         "--prompt", "4", "--new-tokens", "8", "--rounds", "2", "--out", str(out)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["args"]["new_tokens"] == 8 and report["environment"]["threads"] == 1
    results = report["results"]
    assert sorted(results) == ["mhar_delta", "plain"]
    for entry in results.values():
        for mode in ("kv_cache", "recompute"):
            for clock in ("cpu_s", "s"):
                assert len(entry[f"{mode}_tokens_per_{clock}_all"]) == 2 and entry[f"{mode}_tokens_per_{clock}"] > 0
        assert entry["cache_speedup"] == entry["kv_cache_tokens_per_cpu_s"] / entry["recompute_tokens_per_cpu_s"]
    assert results["plain"]["decode_overhead_vs_plain"] == 1.0
    assert results["mhar_delta"]["decode_overhead_vs_plain"] == (
        results["plain"]["kv_cache_tokens_per_cpu_s"] / results["mhar_delta"]["kv_cache_tokens_per_cpu_s"])
