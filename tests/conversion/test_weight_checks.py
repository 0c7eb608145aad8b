"""What a conversion refuses to read or write: wrong shapes, mixed dtypes, NaN/Inf weights,
and checkpoints that fail their manifest; each error names the tensor or file."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers import edited_hf_dir, plan_hf_import


def test_a_wrongly_shaped_gate_proj_is_named(hf_dirs, tmp_path):
    """gate_proj and up_proj are fused into one tensor: the error names the one that is
    wrong (it used to blame up_proj, compared against the wrong gate_proj)."""
    hf_dir = edited_hf_dir(hf_dirs["llama"], tmp_path / "hf", replace={"model.layers.1.mlp.gate_proj.weight": torch.zeros(95, 64)})
    with pytest.raises(ValueError) as err:
        plan_hf_import(hf_dir, tmp_path / "out")
    message = str(err.value)
    assert "model.layers.1.mlp.gate_proj.weight has shape (95, 64), the config implies (96, 64)" in message
    assert "up_proj" not in message


def test_non_finite_weights_are_refused_unless_allowed(hf_dirs, tmp_path, capsys):
    from megatron_mhar.conversion.convert import hf_to_mcore, mcore_to_hf

    norm = torch.ones(64)
    norm[3] = float("inf")
    hf_dir = edited_hf_dir(hf_dirs["llama"], tmp_path / "hf", replace={"model.layers.0.input_layernorm.weight": norm})
    with pytest.raises(ValueError, match=r"model.layers.0.input_layernorm.weight holds 1 non-finite values "
                                         r"\(NaN/Inf\) of 64: .* pass --allow-nonfinite"):
        hf_to_mcore(plan_hf_import(hf_dir, tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()

    out = hf_to_mcore(plan_hf_import(hf_dir, tmp_path / "allowed", allow_nonfinite=True))
    assert "warning: " in capsys.readouterr().out
    # The export reads the converted checkpoint and refuses it the same way.
    with pytest.raises(ValueError, match=r"decoder.layers.0.self_attention.linear_qkv.layer_norm_weight|"
                                         r"decoder.layers.0.input_layernorm.weight"):
        mcore_to_hf(out, tmp_path / "hf_refused")
    assert not (tmp_path / "hf_refused").exists()
    exported = mcore_to_hf(out, tmp_path / "hf_allowed", allow_nonfinite=True)
    assert (exported / "model.safetensors").is_file()


def test_non_finite_values_are_counted_across_pieces(monkeypatch):
    """The count is checked a piece at a time (bounded temporaries): values at either end
    of a piece, in the last short piece and in a non-contiguous tensor all count."""
    from megatron_mhar.conversion import weight_checks

    monkeypatch.setattr(weight_checks, "FINITE_CHECK_ELEMENTS", 7)
    tensor = torch.zeros(5, 9, dtype=torch.bfloat16)
    for index, value in ((0, "nan"), (6, "inf"), (7, "-inf"), (44, "nan")):
        tensor.view(-1)[index] = float(value)
    assert weight_checks.count_nonfinite(tensor) == 4
    assert weight_checks.count_nonfinite(tensor.t()) == 4
    assert weight_checks.count_nonfinite(torch.zeros(0)) == 0


def test_mixed_dtypes_are_refused_unless_a_dtype_is_chosen(hf_dirs, tmp_path):
    hf_dir = edited_hf_dir(hf_dirs["llama"], tmp_path / "hf",
                     replace={"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r"mixes tensor dtypes .*model.norm.weight \(BF16\); pass --dtype"):
        plan_hf_import(hf_dir, tmp_path / "out")
    assert plan_hf_import(hf_dir, tmp_path / "out", dtype="float32").dtype == "float32"


def test_converted_checkpoints_carry_a_manifest_that_the_export_checks(convert, tmp_path):
    from megatron_mhar.conversion.convert import mcore_to_hf

    checkpoint = shutil.copytree(convert("qwen3_tied", "none"), tmp_path / "ckpt")
    shard = next((checkpoint / "iter_0000000").glob("__*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        mcore_to_hf(checkpoint, tmp_path / "hf")
    assert str(err.value).startswith(f"{checkpoint} holds no checkpoint that can be read:\n  {checkpoint / 'latest'} "
                                     f"names 'iter_0000000', which fails verification: {shard} does not match "
                                     f"its checksum")
    assert not (tmp_path / "hf").exists()
