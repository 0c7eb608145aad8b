"""``benchmarks/bench_data_loader.py``: the driver's data path per optimizer step, on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_data_loader

ROOT = Path(__file__).resolve().parents[2]
MODULE = ["-m", "benchmarks.bench_data_loader"]


def test_tiny_run_at_the_1b_shapes_writes_the_report(tmp_path):
    out = tmp_path / "data_loader.json"
    subprocess.run(
        [sys.executable, *MODULE, "--device", "cpu", "--steps", "3", "--warmup", "1", "--step-ms", "500",
         "--dir", str(tmp_path), "--out", str(out)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = json.loads(out.read_text())
    for key in ("commit", "date", "command", "versions"):
        assert report[key], key
    assert report["command"].startswith("python -m benchmarks.bench_data_loader --device cpu")
    shapes = report["shapes"]
    assert (shapes["recipe"], shapes["seq_length"], shapes["micro_batch_size"], shapes["global_batch_size"]) == (
        "pretrain_1b_baseline", 1024, 2, 32)
    assert shapes["num_microbatches"] == 16 and shapes["model_vocab_size"] == 151936
    assert shapes["tokenizer_vocab"] == 151669
    assert report["data"]["token_dtype"] == "int32"  # ids above 65535 need 32 bits
    assert report["data"]["tokens"] >= 4 * 32 * 1025
    assert report["batch"]["tokens"] == {"shape": [2, 1024], "dtype": "int64", "device": "cpu", "bytes": 16384}
    assert len(report["step_ms_all"]) == 3
    for key in ("step_ms", "microbatch_ms", "split_step_ms"):
        entry = report[key]
        assert 0 < entry["median"] <= entry["p90"] <= entry["max"], key
    assert sorted(report["split_ms_per_step"]) == ["getitem", "stack", "vocab_check"]  # no copy on CPU
    assert report["compared_to"] == {"step_ms": 500.0, "source": "given as --step-ms"}
    assert report["share_of_step"]["median"] == pytest.approx(report["step_ms"]["median"] / 500)
    assert report["below_1_percent"] == (report["share_of_step"]["median"] < 0.01)
    assert not list(tmp_path.glob("bench_data_loader.*"))  # the dataset is removed


def test_a_builtin_tokenizer_recipe_draws_ids_below_its_vocabulary(tmp_path):
    out = tmp_path / "smoke.json"
    subprocess.run([sys.executable, *MODULE, "--recipe", "smoke_cpu", "--device", "cpu", "--steps", "1",
                    "--warmup", "0", "--out", str(out)],
                   check=True, cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    report = json.loads(out.read_text())
    assert report["shapes"]["tokenizer_vocab"] == 4096 and report["shapes"]["num_microbatches"] == 1
    assert report["data"]["token_dtype"] == "uint16"
    assert report["data"]["documents"] >= 51  # the validation split (2%) gets documents


def test_the_split_runs_microbatches_own_code(tmp_path):
    """``next_in_parts`` gives the batches ``MicroBatches.__next__`` gives, in order."""
    from megatron_mhar.data.datasets import MicroBatches, build_gpt_datasets

    tokenizer = bench_data_loader.StandInTokenizer(1000)
    prefix = str(tmp_path / "data")
    bench_data_loader.write_dataset(prefix, tokenizer, 40 * 65, 64, seed=0, min_documents=201)
    train, _, _ = build_gpt_datasets([prefix], None, "99,1,0", 64, [24, 0, 0], tokenizer, 1,
                                     cache_dir=str(tmp_path / "cache"))  # fmt: skip
    plain = MicroBatches(train, 4, vocab_size=1000)
    parted = MicroBatches(train, 4, vocab_size=1000)
    parts = dict.fromkeys(("getitem", "vocab_check", "stack", "copy"), 0.0)
    for _ in range(6):
        expected, got = next(plain), bench_data_loader.next_in_parts(parted, parts, lambda: None)
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(expected[key], got[key]), key
    assert parted.consumed_samples == plain.consumed_samples == 24
    assert all(seconds > 0 for name, seconds in parts.items() if name != "copy")
    # An id beyond the vocabulary is refused, as the driver's iterator refuses it.
    with pytest.raises(ValueError, match="an id >= 10"):
        bench_data_loader.next_in_parts(MicroBatches(train, 4, vocab_size=10), parts, lambda: None)


def test_default_step_time_is_the_latest_1b_baseline_of_the_training_results():
    runs = json.loads((ROOT / "benchmarks" / "results" / "training" / "h200.json").read_text())["runs"]
    latest = max((run for run in runs.values() if "1b" in run.get("sizes", {})), key=lambda run: run["commit_date"])
    baseline = latest["sizes"]["1b"]["models"]["baseline"]
    assert bench_data_loader.DEFAULT_STEP_MS == round(1e3 * baseline["step_s_median"], 1)


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--step-ms", "0"], "--step-ms must be positive, got 0"),
    (["--vocab", "151937"], "--vocab 151937: must be at least 2 and at most the recipe's model.vocab_size (151936)"),
    (["--recipe", "pretrain_1b_baselin"], "did you mean 'pretrain_1b_baseline'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--out", "{tmp}"], "is a directory"),  # refused before the run, not after it
    (["--out", "{tmp}/file/loader.json"], "is a file, not a directory"),
])  # fmt: skip
def test_arguments_name_their_errors(args, message, tmp_path):
    (tmp_path / "file").write_text("")
    run = subprocess.run([sys.executable, *MODULE, *[a.format(tmp=tmp_path) for a in args]],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_is_refused_without_a_device():
    run = subprocess.run([sys.executable, *MODULE, "--device", "cuda"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2 and "--device cuda: torch sees no CUDA device here" in run.stderr, run.stderr[-2000:]
