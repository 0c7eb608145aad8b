"""Clear errors for what cannot be converted, and outputs published only when complete."""

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from megatron_mhar.conversion import hf_config, mapping
from tests.helpers import edited_hf_dir as _edited
from tests.helpers import plan_hf_import as _plan

REPO = Path(__file__).resolve().parents[2]

# Llama-3.1-8B's config.json (Marin-8B is this architecture), as published.
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


@pytest.mark.parametrize("edit,message", [
    pytest.param(dict(config={"architectures": ["MistralForCausalLM"], "model_type": "mistral"}),
                 "unsupported architecture 'MistralForCausalLM'", id="unknown-architecture"),
    pytest.param(dict(config={"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}),
                 "RoPE scaling 'yarn' is not supported", id="rope-yarn"),
    pytest.param(dict(config={"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                                                  "high_freq_factor": 4.0, "rope_theta": 5e5,
                                                  "original_max_position_embeddings": 8192}}),
                 "low_freq_factor=2.0; Megatron's RoPE hard-codes low_freq_factor=1.0", id="rope-llama3-factors"),
    pytest.param(dict(config={"attention_bias": True}), "attention_bias=True is not supported",
                 id="attention-bias"),
    pytest.param(dict(drop=["model.layers.1.mlp.up_proj.weight"]),
                 "missing 1 tensors: model.layers.1.mlp.up_proj.weight", id="missing-tensor"),
    pytest.param(dict(add={"model.layers.4.mlp.up_proj.weight": torch.zeros(96, 64)}),
                 "model.layers.4.mlp.up_proj.weight (layer 4 >= num_hidden_layers=4)", id="extra-layer"),
    pytest.param(dict(add={"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}),
                 "q_norm.weight (only expected when qk_layernorm)", id="qk-norm-in-llama"),
    pytest.param(dict(add={"model.vision_tower.weight": torch.ones(3)}),
                 "model.vision_tower.weight (no conversion rule)", id="unknown-tensor"),
])
def test_plan_refuses(hf_dirs, tmp_path, edit, message):
    hf_dir = _edited(hf_dirs["llama"], tmp_path / "hf", **edit)
    with pytest.raises(ValueError) as err:
        _plan(hf_dir, tmp_path / "out")
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


def test_layout_and_variant_errors(hf_dirs, tmp_path):
    with pytest.raises(ValueError, match=r"--tp 4 must divide .* KV heads \(2\)"):
        _plan(hf_dirs["llama"], tmp_path / "out", tp=4)
    with pytest.raises(ValueError, match=r"--pp 3 must divide the number of layers \(4\)"):
        _plan(hf_dirs["llama"], tmp_path / "out", pp=3)
    with pytest.raises(ValueError, match="--variant is required"):
        _plan(hf_dirs["llama"], tmp_path / "out", variant=None)
    with pytest.raises(ValueError, match="--num-heads=7 does not divide hidden_size=64"):
        _plan(hf_dirs["llama"], tmp_path / "out", variant="delta", mhar_overrides=dict(num_heads=7))
    for variant, overrides, flag in (("none", dict(block_size=3), "--block-size applies to the block"),
                                     ("full", dict(delta_block_layers=2), "--delta-block-layers applies to the delta"),
                                     ("none", dict(num_heads=4), "--num-heads applies to the full / block / delta")):
        with pytest.raises(ValueError, match=f"{flag} variant, not '{variant}'"):
            _plan(hf_dirs["llama"], tmp_path / "out", variant=variant, mhar_overrides=overrides)


def test_shape_mismatch_fails_without_publishing(hf_dirs, tmp_path):
    """Names all match, one shape does not: the plan names the tensor, nothing is published."""
    hf_dir = _edited(hf_dirs["llama"], tmp_path / "hf",
                     replace={"model.layers.2.self_attn.k_proj.weight": torch.zeros(16, 64)})
    with pytest.raises(ValueError, match=r"model.layers.2.self_attn.k_proj.weight has shape \(16, 64\), the "
                                         r"config implies \(32, 64\)"):
        _plan(hf_dir, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no out, no .tmp.out


def test_output_is_never_overwritten_by_accident(hf_dirs, convert, tmp_path):
    from megatron_mhar.conversion.convert import hf_to_mcore

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        _plan(hf_dirs["qwen3_tied"], out)  # refused before any process starts
    (tmp_path / ".tmp.out").mkdir()  # leftovers of an interrupted conversion are cleared
    hf_to_mcore(_plan(hf_dirs["qwen3_tied"], out, overwrite=True))
    assert (out / "latest").read_text() == "iter_0000000\n"
    assert not (out / "keep").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_export_errors(hf_dirs, convert, tmp_path):
    from megatron_mhar.conversion.convert import mcore_to_hf

    with pytest.raises(FileNotFoundError, match="not a Megatron distributed checkpoint"):
        mcore_to_hf(hf_dirs["llama"], tmp_path / "out")
    with pytest.raises(FileExistsError):
        mcore_to_hf(convert("qwen3_tied", "none"), hf_dirs["llama"])


def test_exported_variant_must_match(megatron_world1, convert, tmp_path):
    from megatron_mhar.conversion.convert import mcore_to_hf

    exported = mcore_to_hf(convert("qwen3_tied", "delta"), tmp_path / "hf")
    with pytest.raises(ValueError, match="carries MHAR parameters of variant 'delta'"):
        _plan(exported, tmp_path / "out", variant="full")
    with pytest.raises(ValueError, match="routing parameters only fit the configuration"):
        _plan(exported, tmp_path / "out", variant="delta", mhar_overrides=dict(num_heads=4))


def test_cli_reports_errors_and_converts(hf_dirs, tmp_path, capsys):
    """The CLIs are thin: argument parsing, one library call, errors as exit code 2, and
    a good directory converted into a checkpoint that verifies against its manifest."""
    from megatron_mhar.checkpoint.format import checkpoint_problem, read_configs

    sys.path.insert(0, str(REPO / "checkpoint_tools"))
    try:
        import hf_to_mcore_mhar
    finally:
        sys.path.remove(str(REPO / "checkpoint_tools"))
    with pytest.raises(SystemExit) as exit_info:
        hf_to_mcore_mhar.main(["--hf-dir", str(tmp_path), "--out", str(tmp_path / "o"), "--variant", "none"])
    assert exit_info.value.code == 2
    assert "has no config.json" in capsys.readouterr().err
    assert hf_to_mcore_mhar.main(["--hf-dir", str(hf_dirs["qwen3_tied"]), "--out", str(tmp_path / "ok"),
                                  "--variant", "delta", "--seq-length", "16"]) == 0
    assert f"wrote {tmp_path / 'ok'} (delta, float32)" in capsys.readouterr().out
    checkpoint = tmp_path / "ok" / "iter_0000000"
    assert checkpoint_problem(checkpoint, "full") is None
    model, mhar, _ = read_configs(checkpoint)
    assert (model.num_layers, model.qk_layernorm, mhar.variant) == (4, True, "delta")


# ---------------------------------------------------------------- misuse of the CLIs


def _cli(name):
    sys.path.insert(0, str(REPO / "checkpoint_tools"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(REPO / "checkpoint_tools"))


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("damage,message", [
    # an edit that broke the JSON: name the file, not only the parser's position
    pytest.param(lambda d: (d / "config.json").write_text('{"architectures": [LlamaForCausalLM]}'),
                 "config.json is not valid JSON", id="config-not-json"),
    # valid JSON that is not an object
    pytest.param(lambda d: (d / "config.json").write_text("[1, 2]"),
                 "config.json holds a list, expected a JSON object", id="config-not-object"),
    # an interrupted download: the header promises more bytes than the file has
    pytest.param(lambda d: _truncate(d / "model.safetensors", 4096),
                 "model.safetensors is not a readable safetensors file", id="truncated-safetensors"),
    # not a safetensors file at all
    pytest.param(lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64),
                 "model.safetensors is not a readable safetensors file", id="garbage-safetensors"),
])
def test_unreadable_hf_files_are_named(hf_dirs, tmp_path, damage, message):
    hf_dir = shutil.copytree(hf_dirs["llama"], tmp_path / "hf")
    damage(hf_dir)
    with pytest.raises(ValueError, match=message):
        _plan(hf_dir, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_numeric_flags_out_of_range(hf_dirs, tmp_path):
    from megatron_mhar.conversion.convert import plan_import

    with pytest.raises(ValueError, match="--tp must be at least 1, got 0"):
        _plan(hf_dirs["llama"], tmp_path / "out", tp=0)
    with pytest.raises(ValueError, match="--pp must be at least 1, got -1"):
        _plan(hf_dirs["llama"], tmp_path / "out", pp=-1)
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by must be at least 1, got 0"):
        _plan(hf_dirs["llama"], tmp_path / "out", make_vocab_size_divisible_by=0)
    # --seq-length 0 is refused, not silently replaced by max_position_embeddings
    with pytest.raises(ValueError, match="seq_length must be positive, got 0"):
        plan_import(hf_dirs["llama"], tmp_path / "out", "none", seq_length=0)


def test_overwrite_never_deletes_an_input_or_a_file(hf_dirs, tmp_path):
    hf_dir = shutil.copytree(hf_dirs["llama"], tmp_path / "models" / "llama")
    for out in (hf_dir, hf_dir.parent):  # --out is the input, or a directory holding it
        with pytest.raises(ValueError, match="is or contains the input .*; writing it would delete the input"):
            _plan(hf_dir, out, overwrite=True)
    (tmp_path / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="notes.txt is a file; --overwrite replaces only a directory"):
        _plan(hf_dir, tmp_path / "notes.txt", overwrite=True)
    with pytest.raises(ValueError, match="notes.txt is a file, not a directory; choose another --out"):
        _plan(hf_dir, tmp_path / "notes.txt" / "out")
    assert (tmp_path / "notes.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "notes.txt"]


def test_export_never_deletes_its_checkpoint(convert, tmp_path):
    from megatron_mhar.conversion.convert import mcore_to_hf

    ckpt = shutil.copytree(convert("qwen3_tied", "none"), tmp_path / "run" / "ckpt")
    for out in (ckpt, ckpt / "iter_0000000", tmp_path / "run"):
        with pytest.raises(ValueError, match="is or contains the input"):
            mcore_to_hf(ckpt, out, overwrite=True)
    assert (ckpt / "latest").is_file() and (ckpt / "iter_0000000" / "metadata.json").is_file()


def test_export_failures_leave_no_staging_directory(hf_dirs, convert, tmp_path):
    from megatron_mhar.conversion.convert import mcore_to_hf

    ckpt = convert("llama", "none")
    with pytest.raises(FileNotFoundError, match="--hf-reference .* has no config.json"):
        mcore_to_hf(ckpt, tmp_path / "out", hf_reference=tmp_path / "nope")
    with pytest.raises(ValueError, match="--hf-reference .*config.json and the checkpoint's model differ"):
        mcore_to_hf(ckpt, tmp_path / "out", hf_reference=hf_dirs["qwen3_tied"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", [
    pytest.param("common.pt", id="common-state"),  # the configs
    pytest.param("__0_0.distcp", id="tensor-shard"),  # the weights
])
def test_export_names_a_corrupt_checkpoint(convert, tmp_path, damage):
    from megatron_mhar.conversion.convert import mcore_to_hf

    ckpt = shutil.copytree(convert("qwen3_tied", "none"), tmp_path / "ckpt")
    _truncate(ckpt / "iter_0000000" / damage, 100)
    # The manifest names the damaged file before any reader trips over it.
    with pytest.raises(ValueError, match=rf"names 'iter_0000000', which fails verification: .*iter_0000000/{damage} "
                                         rf"has 100 bytes, the manifest says"):
        mcore_to_hf(ckpt, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_cli_reports_a_rank_failure_by_name(hf_dirs, tmp_path, capsys):
    """A NaN in a weight of the second pipeline stage (only that rank reads it): the CLI
    exits 2 with that rank's error (not its peer's lost connection), and nothing is left behind."""
    down = torch.zeros(64, 96)
    down[5, 7] = float("nan")
    hf_dir = _edited(hf_dirs["llama"], tmp_path / "hf", replace={"model.layers.3.mlp.down_proj.weight": down})
    with pytest.raises(SystemExit) as exit_info:
        _cli("hf_to_mcore_mhar").main(["--hf-dir", str(hf_dir), "--out", str(tmp_path / "out"),
                                       "--variant", "none", "--pp", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (f"error: conversion rank 1 of 2: {hf_dir}: model.layers.3.mlp.down_proj.weight holds 1 non-finite "
            f"values (NaN/Inf) of 6144") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_export_names_the_checkpoint_it_converts_and_one_it_passed_over(convert, tmp_path, capsys):
    """``latest`` names a damaged newer checkpoint: the export converts the older intact
    one, and its first and last lines say which, at what step, and what it passed over."""
    ckpt = shutil.copytree(convert("qwen3_tied", "none"), tmp_path / "ckpt")
    shutil.copytree(ckpt / "iter_0000000", ckpt / "iter_0000005")
    (ckpt / "latest").write_text("iter_0000005\n")
    _truncate(ckpt / "iter_0000005" / "common.pt", 100)
    capsys.readouterr()
    assert _cli("mcore_to_hf_mhar").main(["--ckpt", str(ckpt), "--out", str(tmp_path / "hf")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    source = (f"{ckpt / 'iter_0000000'} (step 0); the newer iter_0000005 that {ckpt / 'latest'} names fails "
              f"verification and was passed over")
    assert lines[-1] == f"wrote {tmp_path / 'hf'} from {source}"
    assert f"converting {source}" in lines
    assert not (tmp_path / ".lock.hf").exists()  # the output's lock, released


def test_a_second_conversion_into_one_output_refuses(convert, tmp_path, capsys):
    """While a conversion writes ``--out``, another into it exits 2 naming the holder, and
    leaves the first one's staging directory alone."""
    import os

    from megatron_mhar.conversion.output import output_lock

    out = tmp_path / "hf"
    staging = tmp_path / ".tmp.hf"
    staging.mkdir()
    (staging / "config.json").write_text("{}")  # the first conversion's work in progress
    with output_lock(out):
        with pytest.raises(SystemExit) as exit_info:
            _cli("mcore_to_hf_mhar").main(["--ckpt", str(convert("qwen3_tied", "none")), "--out", str(out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mcore_to_hf_mhar.py: error: output {out} is in use by pid {os.getpid()} on "), err
    assert "choose another --out" in err and "Traceback" not in err
    assert (staging / "config.json").read_text() == "{}" and not out.exists()


def test_a_killed_conversion_takes_its_ranks_along(hf_dirs, tmp_path):
    """``hf-to-mcore --pp 2`` killed with SIGKILL while its ranks convert: 5 s later none of
    the processes it started runs."""
    import os
    import signal
    import subprocess
    import time

    import psutil

    from tests.helpers import LAUNCHER_ENV

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(REPO / "checkpoint_tools" / "hf_to_mcore_mhar.py"), "--hf-dir",
                             str(hf_dirs["llama"]), "--out", str(out), "--variant", "none", "--pp", "2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / ".tmp.out" / "iter_0000000").exists():  # both ranks past their set-up: converting
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        started = psutil.Process(proc.pid).children(recursive=True)
        assert len(started) >= 2
        proc.kill()
        proc.wait()
        time.sleep(5)
        alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [" ".join(p.cmdline()) for p in alive]
    finally:
        try:  # whatever is left, should the test fail
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------- mapping and configs


def test_qkv_layout_is_megatrons_grouped_layout():
    """Rows of linear_qkv: per group, its query heads, then its key head, then its value head."""
    shapes = mapping.Shapes(num_attention_heads=4, num_query_groups=2, head_dim=3,
                            vocab_size=10, padded_vocab_size=16)
    q, k, v = (torch.arange(n * 3).repeat_interleave(5).view(n * 3, 5) + base
               for n, base in ((4, 0), (2, 100), (2, 200)))
    qkv = mapping.fuse_qkv(q, k, v, shapes)
    groups = qkv.view(2, 4 * 3, 5)[..., 0]  # [group, (2 q heads + k + v) * head_dim]
    assert groups[0].tolist() == [0, 1, 2, 3, 4, 5, 100, 101, 102, 200, 201, 202]
    assert groups[1].tolist() == [6, 7, 8, 9, 10, 11, 103, 104, 105, 203, 204, 205]
    assert all(torch.equal(a, b) for a, b in zip(mapping.split_qkv(qkv, shapes), (q, k, v)))
    gate, up = torch.randn(6, 5), torch.randn(6, 5)
    fc1 = mapping.fuse_gate_up(gate, up, shapes)
    assert torch.equal(fc1[:6], gate) and mapping.split_gate_up(fc1, shapes)[1].equal(up)
    padded = mapping.pad_vocab(torch.ones(10, 5), shapes)
    assert padded.shape == (16, 5) and not padded[10:].any()
    assert mapping.strip_vocab(padded, shapes)[0].shape == (10, 5)


def test_reverse_map_covers_the_table_and_refuses_unknown_tensors(hf_dirs):
    from megatron_mhar.conversion.hf_io import SafetensorsReader

    model = hf_config.model_config_from_hf({**LLAMA31_8B, "num_hidden_layers": 2})
    names = mapping.expected_hf_names(model)
    assert len(names) == len(set(names)) == 3 + 9 * 2  # embed, norm, lm_head + 9 per layer
    with pytest.raises(KeyError, match="no conversion rule for Megatron tensor 'decoder.foo'"):
        mapping.rule_for_megatron("decoder.foo")

    raw = json.loads((hf_dirs["llama"] / "config.json").read_text())
    model = hf_config.model_config_from_hf(raw)
    shapes, reader = mapping.Shapes.of(model), SafetensorsReader(hf_dirs["llama"])
    megatron = {
        rule.megatron.format(layer): mapping.megatron_tensor(rule.megatron.format(layer), reader, shapes)
        for rule in mapping.RULES for layer in range(model.num_layers)
        if rule.when != "qk_layernorm" and rule.layers != "moe"  # a dense Llama
    }
    hf = mapping.hf_tensors(megatron, model, shapes)
    assert sorted(hf) == reader.keys() and all(torch.equal(hf[k], reader(k)) for k in hf)
    with pytest.raises(ValueError, match="without a conversion rule: decoder.extra"):
        mapping.hf_tensors({**megatron, "decoder.extra": torch.zeros(1)}, model, shapes)
    del megatron["decoder.layers.3.mlp.linear_fc2.weight"]
    with pytest.raises(ValueError, match="has no 'decoder.layers.3.mlp.linear_fc2.weight'"):
        mapping.hf_tensors(megatron, model, shapes)


def test_cpt_recipe_matches_a_converted_llama31_8b():
    """`hf_to_mcore_mhar.py --variant delta --seq-length 4096` on Marin-8B (Llama-3.1-8B)
    writes exactly the model and mhar sections recipes/cpt_8b_mhar_delta.yaml carries."""
    from megatron_mhar.models.mhar_config import MHARConfig
    from megatron_mhar.training.recipes import load_config

    recipe = load_config("cpt_8b_mhar_delta")
    converted = hf_config.model_config_from_hf(LLAMA31_8B, seq_length=4096)
    # The layer spec is not part of the match: checkpoints load under either spec, and the
    # recipe's ``auto`` picks Transformer Engine where it imports.
    assert converted.spec == "local" and recipe.model.spec == "auto"
    assert dataclasses.asdict(converted) == dataclasses.asdict(dataclasses.replace(recipe.model, spec="local"))
    assert dataclasses.asdict(MHARConfig(variant="delta")) == dataclasses.asdict(recipe.mhar)
    assert recipe.checkpoint.load_model_only


def test_hf_config_round_trip_for_models_trained_from_scratch():
    from megatron_mhar.models.gpt_config import GPTModelConfig

    model = GPTModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                           ffn_hidden_size=96, vocab_size=100, qk_layernorm=True)
    raw = hf_config.hf_config_from_model(model)
    assert raw["architectures"] == ["Qwen3ForCausalLM"]
    hf_config.check_same_function(hf_config.model_config_from_hf(raw), model, "round trip")
    with pytest.raises(ValueError, match="no Llama/Qwen3 equivalent: swiglu must be true"):
        hf_config.hf_config_from_model(dataclasses.replace(model, swiglu=False))
