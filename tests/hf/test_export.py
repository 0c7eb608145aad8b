"""Trained MHAR checkpoints exported to transformers: loaded anywhere, same logits, round trips."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import EXPORT_CASES, ROUTED_CASES, export_token_batch

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_mhar"
FAMILY = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def _read(directory: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _megatron_logits(checkpoint: Path, tokens: torch.Tensor) -> torch.Tensor:
    import megatron_mhar

    with torch.no_grad():
        return megatron_mhar.load_model(checkpoint)(tokens)


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_export_loads_without_megatron_mhar(megatron_world1, checkpoints, remote, case):
    """fp32 logits of AutoModelForCausalLM (remote code, no megatron_mhar) == load_model's."""
    expected = _megatron_logits(checkpoints[case], export_token_batch())
    loaded = remote[case]["plain"]
    assert remote["imported"] == []
    family = FAMILY[case.split("-")[0]]
    if case in ROUTED_CASES:
        assert loaded["class"] == "MHAR" + family
        assert loaded["module"].startswith("transformers_modules.")  # the export's own copy
    else:
        assert loaded["class"] == family and loaded["module"].startswith("transformers.models.")
    assert loaded["logits"].shape == expected.shape == (2, 24, 512)
    assert expected.std() > 0.1  # a trained model's logits, not a constant
    assert (loaded["logits"] - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("case", ROUTED_CASES)
def test_export_holds_trained_routing_config_and_code(checkpoints, exports, case):
    """Routing tensors under their HF names (trained away from their initial values), the
    mhar_* fields and auto_map in config.json, the package's files copied verbatim."""
    import yaml

    out = exports[case]
    config = json.loads((out / "config.json").read_text())
    saved = yaml.safe_load((checkpoints[case] / "iter_0000004" / "train_config.yaml").read_text())
    for field in ("variant", "num_heads", "block_size", "delta_block_layers", "eps", "logit_scale"):
        assert config[f"mhar_{field}"] == saved["mhar"][field], field
    family = FAMILY[case.split("-")[0]]
    assert config["architectures"] == ["MHAR" + family]
    assert config["auto_map"] == {
        "AutoConfig": f"configuration_mhar.MHAR{family[:-len('ForCausalLM')]}Config",
        "AutoModel": f"modeling_mhar.MHAR{family[:-len('ForCausalLM')]}Model",
        "AutoModelForCausalLM": f"modeling_mhar.MHAR{family}",
    }
    for name, source in (("configuration_mhar.py", "hf/configuration_mhar.py"),
                         ("modeling_mhar.py", "hf/modeling_mhar.py"), ("depth_route.py", "ops/depth_route.py"),
                         ("routing_layout.py", "ops/routing_layout.py")):
        assert (out / name).read_bytes() == (PACKAGE / source).read_bytes(), name
    assert not (out / "mhar_params.safetensors").exists() and not (out / "mhar_config.json").exists()

    tensors = _read(out)
    assert ("lm_head.weight" in tensors) == (not config["tie_word_embeddings"])
    routers = {n: t for n, t in tensors.items() if "router" in n}
    per_site = ("query", "norm_weight") + (("null_source", "gate") if config["mhar_variant"] == "delta" else ())
    expected = {f"model.layers.{i}.{site}.{p}" for i in range(3)
                for site in ("input_router", "pre_mlp_router") for p in per_site}
    if config["mhar_variant"] != "delta":
        expected |= {"model.final_router.query", "model.final_router.norm_weight"}
    assert set(routers) == expected
    for name, tensor in routers.items():
        if name.startswith("model.layers.0.input_router.") and config["mhar_variant"] != "delta":
            continue  # the first site routes over one source: its softmax has no gradient
        initial = torch.ones_like(tensor) if name.endswith("norm_weight") else torch.zeros_like(tensor)
        assert not torch.equal(tensor, initial), f"{name} kept its initial value: the test trains nothing"


def test_registered_classes_load_without_trust_remote_code(remote, exports):
    """With megatron_mhar.hf imported, the export loads the package's classes, same logits."""
    import megatron_mhar.hf
    from transformers import AutoModelForCausalLM

    for case in ROUTED_CASES:
        model = AutoModelForCausalLM.from_pretrained(exports[case], dtype=torch.float32).eval()
        assert type(model) is getattr(megatron_mhar.hf, remote[case]["plain"]["class"])
        with torch.no_grad():
            assert torch.equal(model(export_token_batch()).logits, remote[case]["plain"]["logits"]), case


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_megatron_hf_megatron_is_bitwise(megatron_world1, checkpoints, exports, tmp_path, case):
    """Import of the export (its variant read from config.json) gives the trained weights
    bit for bit, and exporting that again gives the same directory."""
    import megatron_mhar
    from megatron_mhar.conversion.convert import hf_to_mcore, mcore_to_hf, plan_import

    plain = case not in ROUTED_CASES  # a plain directory names no variant: the import asks for one
    plan = plan_import(exports[case], tmp_path / "back", "none" if plain else None, seq_length=64)
    assert plan.routing_source == ("initial" if plain else "export")
    back = hf_to_mcore(plan)
    original = megatron_mhar.load_model(checkpoints[case]).gpt.state_dict()
    restored = megatron_mhar.load_model(back).gpt.state_dict()
    tensors = sorted(k for k, v in original.items() if torch.is_tensor(v) and not k.endswith("_extra_state"))
    assert tensors == sorted(k for k, v in restored.items() if torch.is_tensor(v) and not k.endswith("_extra_state"))
    for key in tensors:
        assert original[key].dtype == restored[key].dtype and torch.equal(original[key], restored[key]), key

    again = mcore_to_hf(back, tmp_path / "again")
    first, second = _read(exports[case]), _read(again)
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)
    assert json.loads((again / "config.json").read_text()) == json.loads((exports[case] / "config.json").read_text())


def _legacy_export(export_dir: Path, checkpoint: Path, out: Path) -> Path:
    """The layout earlier versions wrote for MHAR models: a plain Llama / Qwen3 directory and
    the routing parameters under their Megatron names in mhar_params.safetensors."""
    from safetensors.torch import save_file

    from megatron_mhar.checkpoint.format import read_configs, require_checkpoint
    from megatron_mhar.conversion import hf_config, mapping

    out.mkdir()
    config = json.loads((export_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(hf_config.plain_hf_config(config)))
    tensors = _read(export_dir)
    routing = {}
    for rule in mapping.ROUTING_RULES:
        for layer in range(3):
            name = rule.hf[0].format(layer)
            if name in tensors:
                routing[rule.megatron.format(layer)] = tensors.pop(name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    model, mhar, _ = read_configs(require_checkpoint(checkpoint))
    description = {"format": "megatron_mhar.routing.v1", "variant": mhar.variant,
                   "mhar": dataclasses.asdict(mhar), "model": dataclasses.asdict(model),
                   "source_checkpoint": str(checkpoint)}
    (out / "mhar_config.json").write_text(json.dumps(description))
    save_file(routing, str(out / "mhar_params.safetensors"),
              metadata={"format": "pt", "megatron_mhar": json.dumps(description)})
    return out


@pytest.mark.parametrize("case", ["llama-block-h4", "qwen3-delta-h8"])
def test_side_file_exports_are_refused(megatron_world1, checkpoints, exports, tmp_path, case):
    """An earlier export's side file is not read; the import says to export again rather
    than convert the model without its routing parameters."""
    from megatron_mhar.conversion.convert import plan_import

    legacy = _legacy_export(exports[case], checkpoints[case], tmp_path / "legacy")
    with pytest.raises(ValueError, match="routing side file of an earlier MHAR export.*export the Megatron "
                                         "checkpoint again with mcore-to-hf"):
        plan_import(legacy, tmp_path / "back", None, seq_length=64)


def test_export_of_a_trained_checkpoint_carries_its_tokenizer(megatron_world1, checkpoints, tmp_path):
    """Without --tokenizer, a trained checkpoint's own tokenizer (iter_*/tokenizer/, saved by
    the driver) goes with the export; transformers reads it, with its EOS as the model's."""
    import transformers

    from megatron_mhar.conversion.convert import mcore_to_hf

    case = ROUTED_CASES[0]
    own = checkpoints[case] / "iter_0000004" / "tokenizer"
    out = mcore_to_hf(checkpoints[case], tmp_path / "hf")
    assert (out / "tokenizer.json").read_bytes() == (own / "tokenizer.json").read_bytes()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = "def main():\n    return 0\n"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_export_is_hub_ready(exports, case):
    """generation_config.json and a pad token from the run's tokenizer, a model card naming the
    variant, the way to load and the run (its config, the commit that trained it), the oldest
    transformers the code runs on, and the file modes a new file gets."""
    import yaml
    from transformers import AutoTokenizer, GenerationConfig

    from megatron_mhar.checkpoint.format import code_provenance
    from megatron_mhar.hf.configuration_mhar import MIN_TRANSFORMERS_VERSION

    out = exports[case]
    config = json.loads((out / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    eod = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    generation = GenerationConfig.from_pretrained(out)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (eod, eod, eod)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|endoftext|>"
    assert (config["bos_token_id"], config["eos_token_id"]) == (eod, eod) and "pad_token_id" not in config

    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    commit = code_provenance()["commit"]
    if commit is not None:
        assert commit in card
    run_config = yaml.safe_load(card.split("```yaml\n")[1].split("```")[0])
    assert run_config["training"]["train_iters"] == 4 and run_config["run"]["name"] == case
    if case in ROUTED_CASES:
        assert config["transformers_version"] == MIN_TRANSFORMERS_VERSION
        assert f"variant `{config['mhar_variant']}`" in card and "trust_remote_code=True" in card
        assert f"| `mhar_num_heads` | {config['mhar_num_heads']} |" in card
    umask = os.umask(0)
    os.umask(umask)
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()}
    assert modes == dict.fromkeys(modes, 0o666 & ~umask) and "model.safetensors" in modes
