"""``benchmarks/bench_conversion.py``: its steps on a small Llama-3.1-shaped model, and its measuring.

The benchmark runs at Llama-3.1-8B's size; here the same steps run on a model of its
architecture (GQA, Llama-3 RoPE scaling, untied output) but 64 wide and 2 layers deep:
a random sharded checkpoint, ``mhar-convert`` both ways, the export checked tensor by
tensor, and the ``cpt_8b_mhar_delta`` recipe's first step on the converted checkpoint.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_conversion import check_first_step, llama_config, measure, verify_export, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=256)
"""The small model's config.json fields (the rest are Llama-3.1-8B's)."""
RECIPE_OVERRIDES = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
                    "model.num_query_groups=2", "model.ffn_hidden_size=96", "model.vocab_size=256",
                    "mhar.delta_block_layers=2",
                    # its 2 KV heads do not split over the recipe's 4 tensor-parallel ranks
                    "parallel.tensor_model_parallel_size=1", "parallel.sequence_parallel=false"]
"""The recipe at the small model's size."""


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(source HF directory, converted checkpoint, export) of the small model, delta routing."""
    from megatron_mhar.conversion.cli import main

    root = tmp_path_factory.mktemp("conversion")
    weights = write_checkpoint(llama_config(2, **SMALL), root / "hf", max_shard_bytes=40_000)
    per_layer = 2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 64 * 96  # norms, q, k + v, o, gate/up/down
    assert weights == 2 * (2 * 256 * 64 + 64 + 2 * per_layer)  # bf16: embeddings, lm_head, final norm
    assert len(list((root / "hf").glob("model-*-of-*.safetensors"))) >= 3
    assert (root / "hf" / "model.safetensors.index.json").is_file()
    with pytest.MonkeyPatch.context() as patch:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            patch.delenv(name, raising=False)  # a world of one
        assert main(["hf-to-mcore", "--hf-dir", str(root / "hf"), "--out", str(root / "mcore"), "--variant",
                     "delta", "--num-heads", "8", "--delta-block-layers", "2", "--seq-length", "4096"]) == 0
        assert main(["mcore-to-hf", "--ckpt", str(root / "mcore"), "--out", str(root / "export"),
                     "--max-shard-size", "40KB"]) == 0
    return root / "hf", root / "mcore", root / "export"


def test_the_export_equals_the_source(converted):
    source, _, export = converted
    assert len(json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]) == 3 + 9 * 2 + 8 * 2
    assert verify_export(source, export) == {"base_tensors_equal": 3 + 9 * 2, "routing_tensors_at_identity": 8 * 2}


def test_verify_export_finds_a_changed_tensor(converted, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    source, _, export = converted
    changed = tmp_path / "changed"
    shutil.copytree(export, changed)
    index = json.loads((changed / "model.safetensors.index.json").read_text())["weight_map"]
    shard = changed / index["model.layers.1.mlp.down_proj.weight"]
    tensors = load_file(str(shard))
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] += 1
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(AssertionError, match="model.layers.1.mlp.down_proj.weight differs from the source"):
        verify_export(source, changed)


def test_the_recipes_first_step_loads_the_converted_checkpoint(converted, single_process):
    source, checkpoint, _ = converted
    result = check_first_step(checkpoint, source, RECIPE_OVERRIDES)
    assert result["config_matches"] and result["weights_equal_source"] and result["logits_finite"]
    assert result["iteration"] == 0 and result["optimizer_state"] is False
    # delta routing: per site a query, a norm weight, a null source (d each) and a gate;
    # two sites per layer, no final site
    base = 2 * 256 * 64 + 64 + 2 * (2 * 64 + 64 * 128 + 64 * 64 + 3 * 64 * 96)
    assert result["parameters"] == base + 2 * 2 * (3 * 64 + 1)


def test_a_recipe_that_does_not_match_the_checkpoint_is_refused(converted, single_process):
    source, checkpoint, _ = converted
    with pytest.raises(ValueError, match=r"model.rotary_base: 500000.0 \(checkpoint\) vs 10000.0 \(config\)"):
        check_first_step(checkpoint, source, RECIPE_OVERRIDES + ["model.rotary_base=10000.0"])


def test_measure_counts_the_memory_of_child_processes(tmp_path):
    """A parent holding 512 MiB starts a child holding 512 MiB and mapping a file of 256 MiB:
    the tree's peak is their sum, the largest single process's peak one of them; the
    anonymous figures leave the file's pages out."""
    data = tmp_path / "mapped"
    data.write_bytes(bytes(2**28))
    child = ("import mmap, torch, time; x = torch.ones(2**27); f = open({path!r}, 'rb'); "
             "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); sum(m[i] for i in range(0, len(m), 4096)); "
             "time.sleep(1.5)").format(path=str(data))
    parent = ("import subprocess, sys, torch; x = torch.ones(2**27); "
              f"subprocess.run([sys.executable, '-c', {child!r}], check=True)")
    result = measure([sys.executable, "-c", parent], tmp_path / "log")
    assert "error" not in result and result["memory_samples"] > 5
    assert result["peak_rss_gib"] >= 0.75 and result["peak_tree_pss_gib"] >= 0.5 + 0.4 + 0.2
    assert 0.5 <= result["peak_rss_anon_gib"] < 0.7  # the child's tensor, not its mapped file
    assert 0.9 <= result["peak_tree_anon_pss_gib"] < result["peak_tree_pss_gib"] - 0.2
    failed = measure([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "failed")
    assert failed["error"].startswith("exit code 3")


@pytest.mark.parametrize("args, message", [
    (["--work-dir", "{tmp}", "--num-layers", "0"], "--num-layers must be >= 1, got 0"),
    (["--work-dir", "{tmp}", "--out", "{tmp}"], "is a directory"),  # refused before any step runs
])  # fmt: skip
def test_arguments_name_their_errors(args, message, tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_conversion",
                          *[a.format(tmp=tmp_path) for a in args]],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
