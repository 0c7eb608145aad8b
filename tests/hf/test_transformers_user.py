"""Trained exports used as a transformers or PEFT user uses a model, without megatron_mhar.

Each test judges what ``use_without_package.py`` got from every export case (the
``remote`` fixture: one subprocess where megatron_mhar cannot be imported). The plain
Qwen3 export (``qwen3-none``) goes through every test too: what holds for the MHAR
exports holds for a stock model of the same transformers, and the reverse.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import EXPORT_CASES, EXPORT_LAYERS, LAUNCHER_ENV, ROUTED_CASES, export_token_batch

REPO = Path(__file__).resolve().parents[2]
FAMILY = {"qwen3": "Qwen3", "llama": "Llama"}
TOL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_cache_passed_as_past_key_values_or_cache_equals_recomputation(remote, case):
    """The last 8 tokens decoded after the first 16 through a DynamicCache, passed under
    either name, give the logits of the full forward; without the context they would not."""
    full = remote[case]["plain"]["logits"][:, -8:]
    used = remote[case]["cache"]
    for spelling in ("past_key_values", "cache"):
        assert _close(used[spelling], full), spelling
    assert (used["alone"] - full).abs().max() > 0.1  # an ignored cache would show


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_peft_prefix_tuning_changes_the_logits_and_trains(remote, case):
    tuned = remote[case]["prefix_tuning"]
    assert (tuned["prefixed"] - tuned["base"]).abs().max() > 0.1  # the prefix reaches the attention
    assert tuned["trainable"] == ["prompt_encoder.default.embedding.weight"]
    losses = tuned["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_activation_checkpointing_recomputes_and_gives_the_same_gradients(remote, case):
    """gradient_checkpointing_enable, reentrant or not: every gradient equals the one
    without it, and the layers ran again in the backward pass; Trainer(gradient_checkpointing=True)
    trains every parameter that has a gradient."""
    used = remote[case]["checkpointing"]
    grads = used["grads"]
    assert used["mlp_runs"] == {"off": EXPORT_LAYERS, "reentrant": 2 * EXPORT_LAYERS,
                                "non_reentrant": 2 * EXPORT_LAYERS}
    for mode in ("reentrant", "non_reentrant"):
        assert sorted(grads[mode]) == sorted(grads["off"])
        for name, grad in grads["off"].items():
            assert _close(grads[mode][name], grad, 1e-6), (mode, name)
    # the first site of full / block routes over one source: its softmax has no gradient
    still = sorted(name for name, grad in grads["off"].items() if not grad.any())
    assert still == ([] if case not in ROUTED_CASES or "delta" in case else
                     ["model.layers.0.input_router.norm_weight", "model.layers.0.input_router.query"])
    trained = remote[case]["trainer"]
    assert torch.isfinite(torch.tensor(trained["loss"]))
    assert sorted(trained["moved"]) == sorted(set(grads["off"]) - set(still))


def _megatron_layer_inputs(checkpoint: Path, tokens: torch.Tensor) -> list:
    """What each decoder layer of the Megatron model feeds its attention norm, then the final
    norm's output, each [b, s, h]: the reference for hidden_states."""
    import megatron_mhar

    model = megatron_mhar.load_model(checkpoint)
    decoder = model.gpt.decoder
    seen = []
    hooks = [layer.input_layernorm.register_forward_hook(lambda module, args, out: seen.append(args[0]))
             for layer in decoder.layers]
    hooks.append(decoder.final_layernorm.register_forward_hook(lambda module, args, out: seen.append(out)))
    model(tokens)
    for hook in hooks:
        hook.remove()
    return [state.transpose(0, 1) for state in seen]


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_hidden_states_are_each_layers_routed_input_then_the_final_output(megatron_world1, checkpoints, remote,
                                                                          case):
    """len == num_layers + 1, as for Llama: entry i is decoder layer i's input as that layer
    sees it (its routed input before the attention norm; the residual stream for the plain
    model), the last the final norm's output, which AutoModel returns as last_hidden_state.
    The reference is the Megatron model the export came from."""
    outputs = remote[case]["outputs"]
    hidden = outputs["hidden_states"]
    expected = _megatron_layer_inputs(checkpoints[case], export_token_batch())
    assert len(hidden) == len(expected) == EXPORT_LAYERS + 1
    for index, (state, reference) in enumerate(zip(hidden, expected)):
        assert _close(state, reference), index
    assert not torch.equal(hidden[0], hidden[1])
    assert outputs["base_class"] == ("MHAR" if case in ROUTED_CASES else "") + FAMILY[case.split("-")[0]] + "Model"
    assert _close(outputs["base_last"], hidden[-1])


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_attentions_are_each_layers_attention_weights(remote, exports, case):
    """output_attentions (eager): per layer the weights the family's attention module gives
    for that layer's input (hidden_states[i], checked against Megatron above): causal rows
    summing to one."""
    import megatron_mhar.hf  # noqa: F401
    from transformers import AutoModelForCausalLM
    from transformers.masking_utils import create_causal_mask

    outputs = remote[case]["outputs"]
    model = AutoModelForCausalLM.from_pretrained(exports[case], dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    batch, seq = export_token_batch().shape
    positions = torch.arange(seq)[None]
    assert len(outputs["attentions"]) == EXPORT_LAYERS
    with torch.no_grad():
        for layer, hidden, weights in zip(model.model.layers, outputs["hidden_states"], outputs["attentions"]):
            mask = create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                      position_ids=positions)
            _, expected = layer.self_attn(hidden_states=layer.input_layernorm(hidden), attention_mask=mask,
                                          position_embeddings=model.model.rotary_emb(hidden, positions))
            assert weights.shape == (batch, model.config.num_attention_heads, seq, seq)
            assert _close(weights, expected)
            assert _close(weights.sum(-1), torch.ones(batch, weights.shape[1], seq))
            assert weights.triu(1).abs().max() == 0


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_return_dict_false_gives_tuples(remote, case):
    kind, length, loss, logits = remote[case]["plain"]["tuple"]
    assert (kind, length) == ("tuple", 3)  # loss, logits, cache: as the stock model's
    assert torch.isfinite(loss) and torch.equal(logits, remote[case]["plain"]["logits"])
    kind, last = remote[case]["outputs"]["base_tuple"]
    assert kind == "tuple" and torch.equal(last, remote[case]["outputs"]["base_last"])


def test_registered_automodel_is_the_mhar_decoder(exports):
    import megatron_mhar.hf
    from transformers import AutoModel

    for case in ROUTED_CASES:
        model = AutoModel.from_pretrained(exports[case], dtype=torch.float32)
        assert type(model) is getattr(megatron_mhar.hf, f"MHAR{FAMILY[case.split('-')[0]]}Model"), case


def test_too_old_transformers_is_named_on_import(remote):
    """Loading an MHAR config under transformers 5.22.2 (its version set by hand): an
    ImportError naming both versions and the way out, before any TypeError from inside."""
    from megatron_mhar.hf.configuration_mhar import MIN_TRANSFORMERS_VERSION

    error = remote["old_transformers"]
    assert error["type"] == "ImportError"
    assert f"need transformers >= {MIN_TRANSFORMERS_VERSION}" in error["message"]
    assert "transformers 5.22.2 is installed" in error["message"]
    assert f"pip install 'transformers>={MIN_TRANSFORMERS_VERSION}'" in error["message"]


@pytest.mark.parametrize("case", EXPORT_CASES)
def test_batched_pipeline_generates_what_each_prompt_alone_does(remote, exports, case):
    """pipeline("text-generation", batch_size=2) pads with the export's own tokenizer and
    generation config (nothing set by hand); each text is the greedy continuation of its
    prompt generated alone."""
    import megatron_mhar.hf  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.hf.use_without_package import PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(exports[case])
    model = AutoModelForCausalLM.from_pretrained(exports[case], dtype=torch.float32).eval()
    assert tokenizer.pad_token_id is not None and model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert len({len(tokenizer(p).input_ids) for p in PROMPTS}) == 2  # the batch is padded
    used = remote[case]["pipeline"]
    for prompt, text in zip(PROMPTS, used["texts"]):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        alone = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
        assert text == tokenizer.decode(alone, skip_special_tokens=True)
    assert used["padding_side"] == "left"


def test_an_export_routes_with_its_own_code_whatever_package_is_installed(exports, tmp_path):
    """An export whose shipped depth_route.py differs from the installed package's (as one
    written by another version): with megatron_mhar.hf imported (its classes registered,
    which transformers prefers to remote code), trust_remote_code=True runs the shipped
    files, and without it the registered classes refuse the directory."""
    import megatron_mhar.hf  # noqa: F401
    from transformers import AutoModelForCausalLM

    other = tmp_path / "other_version"
    shutil.copytree(exports["qwen3-delta-h8"], other)
    shipped = other / "depth_route.py"
    shipped.write_text(shipped.read_text() + "\n# exported by another version of megatron_mhar\n")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(PYTHONPATH=str(REPO), HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-m", "tests.hf.load_own_code", str(other), str(tmp_path / "own.pt")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    own = torch.load(tmp_path / "own.pt")
    assert own["model_module"].startswith("transformers_modules.")
    assert own["route_module"].startswith("transformers_modules.")
    assert Path(own["route_file"]).read_text() == shipped.read_text()
    with torch.no_grad():  # the same function: only a comment differs
        original = AutoModelForCausalLM.from_pretrained(exports["qwen3-delta-h8"], dtype=torch.float32).eval()
        assert torch.equal(own["logits"], original(export_token_batch()).logits)

    with pytest.raises(ValueError, match=r"ships depth_route\.py unlike the classes running .*Pass "
                                         r"trust_remote_code=True to run the code it ships"):
        AutoModelForCausalLM.from_pretrained(other)


def test_save_pretrained_keeps_the_model_code(exports, tmp_path):
    """A model of the registered classes saved again (fine-tuned, pushed to the Hub) carries
    the files an export loads with trust_remote_code=True, and computes what it did."""
    import megatron_mhar.hf  # noqa: F401
    from transformers import AutoModelForCausalLM

    export = exports["llama-block-h4"]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "saved")
    for name in ("configuration_mhar.py", "modeling_mhar.py", "depth_route.py", "routing_layout.py"):
        assert (tmp_path / "saved" / name).read_bytes() == (export / name).read_bytes(), name
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["auto_map"] == json.loads((export / "config.json").read_text())["auto_map"]
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(export_token_batch()).logits, model(export_token_batch()).logits)


def _tensor_parallel_logits(directory: str) -> torch.Tensor:
    """One rank of ``from_pretrained(tp_plan="auto")`` (transformers sets up the process group)."""
    import megatron_mhar.hf  # noqa: F401
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, tp_plan="auto", dtype=torch.float32).eval()
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "DTensor"  # sharded
    with torch.no_grad():
        logits = model(export_token_batch()).logits
    torch.distributed.destroy_process_group()
    return logits


def test_tensor_parallel_plan_gives_the_single_process_logits(remote, exports):
    """tp_plan="auto" on two CPU ranks (gloo): the family's plan shards attention and MLP,
    the routing stays replicated (as in every variant), and the logits are those of one process."""
    from tests.helpers import run_distributed

    case = "qwen3-full-h8"
    ranks = run_distributed(_tensor_parallel_logits, 2, str(exports[case]), timeout=300)
    for logits in ranks:
        assert _close(logits, remote[case]["plain"]["logits"])


def test_pipeline_parallel_plan_is_absent(exports):
    """transformers' pipeline plan hands one hidden state between stages; MHAR layers read
    every earlier source: no plan, where the stock model has one."""
    import megatron_mhar.hf  # noqa: F401
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(exports["qwen3-none"])
    model = AutoModelForCausalLM.from_pretrained(exports["qwen3-full-h8"])
    assert stock.supports_pp_plan and not model.supports_pp_plan
