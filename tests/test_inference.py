"""megatron_mhar.load_model and its CausalLM: bad arguments and inputs get errors that name
them; a run directory loads with its tokenizer, without autograd, and quietly."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron_mhar
from megatron_mhar.checkpoint import manifest
from megatron_mhar.models.mhar_config import MHARConfig
from tests.helpers import EMBEDDED_BYTES, EMBEDDED_VOCAB, LAUNCHER_ENV, TINY

VOCAB, SEQ = 100, 8  # VOCAB pads to 128 rows: ids 100..127 index padding rows


def _save_model(directory, mhar: MHARConfig, **model_fields):
    """A tiny model at its initialisation, saved in the driver's layout (``latest`` -> ``iter_0000000``)."""
    from megatron_mhar.checkpoint.format import LATEST, common_state
    from megatron_mhar.checkpoint.streaming import save
    from megatron_mhar.conversion.output import ITERATION_DIR
    from megatron_mhar.models.builder import build_gpt_model, make_transformer_config
    from megatron_mhar.models.gpt_config import GPTModelConfig

    model = GPTModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                           seq_length=SEQ, **model_fields)
    gpt = build_gpt_model(model, mhar, make_transformer_config(model, mhar, use_cpu_initialization=True))
    iteration = directory / ITERATION_DIR
    iteration.mkdir(parents=True)
    save(gpt, iteration, common_state(model, mhar, {}))
    manifest.write_manifest(iteration)  # as a conversion publishes it
    (directory / LATEST).write_text(ITERATION_DIR)
    return directory


@pytest.fixture
def checkpoint_dir(megatron_world1, tmp_path):
    """A tiny full-variant model saved in the driver's layout."""
    return _save_model(tmp_path, MHARConfig(variant="full", num_heads=4))


LOAD_ERRORS = [
    pytest.param(dict(dtype="bfloat16"), "dtype must be None .* not a string", id="dtype-string"),
    pytest.param(dict(dtype=torch.int64), "dtype must be None", id="integer-dtype"),
    pytest.param(dict(device="gpu"), "device must be 'cpu', 'cuda'", id="unknown-device"),
    pytest.param(dict(device="meta"), "device must be 'cpu', 'cuda'", id="meta-device"),  # a device type load_model does not run on
]


@pytest.mark.parametrize("kwargs,message", LOAD_ERRORS)
def test_load_model_argument_errors(checkpoint_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        megatron_mhar.load_model(checkpoint_dir, **kwargs)


INPUT_ERRORS = [
    pytest.param(lambda: torch.rand(1, SEQ), "torch.long .* got a tensor of torch.float32", id="float-ids"),
    pytest.param(lambda: [[1, 2, 3]], "torch.long .* got list", id="python-list"),
    pytest.param(lambda: torch.zeros(1, 0, dtype=torch.long), "input_ids is empty", id="empty-sequence"),
    pytest.param(lambda: torch.zeros(0, SEQ, dtype=torch.long), "input_ids is empty", id="empty-batch"),
    pytest.param(lambda: torch.full((1, SEQ), VOCAB), r"\[0, 100\) .* got values in \[100, 100\]",
                 id="padding-row-id"),  # was read silently from a padding row
    pytest.param(lambda: torch.full((1, SEQ), 1000), r"\[0, 100\)", id="id-past-the-table"),
    pytest.param(lambda: torch.full((1, SEQ), -1), r"\[0, 100\)", id="negative-id"),
]


@pytest.mark.parametrize("make_ids,message", INPUT_ERRORS)
def test_forward_input_errors(checkpoint_dir, make_ids, message):
    model = megatron_mhar.load_model(checkpoint_dir)
    with pytest.raises(ValueError, match=message):
        model(make_ids())


def test_position_ids_other_than_the_default_are_refused(checkpoint_dir):
    """Megatron's RoPE ignores position_ids: shifted positions would give unshifted logits."""
    model = megatron_mhar.load_model(checkpoint_dir)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    default = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        logits = model(ids)
        assert logits.shape == (2, SEQ, VOCAB)
        torch.testing.assert_close(model(ids, default), logits, rtol=0, atol=0)
        torch.testing.assert_close(model(ids.int()), logits, rtol=0, atol=0)
        with pytest.raises(ValueError, match="position_ids other than 0 .. seq-1"):
            model(ids, default + 5)
        with pytest.raises(ValueError, match="position_ids other than 0 .. seq-1"):
            model(ids, torch.arange(SEQ // 2)[None])


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, embedded_dir):
    """A tiny MHAR model trained by the driver on the embedded corpus (builtin tokenizer)."""
    from megatron_mhar.training.loop import run
    from megatron_mhar.training.recipes import load_config

    root = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as env:
        for name in LAUNCHER_ENV:
            env.delenv(name, raising=False)
        cfg = load_config("smoke_cpu", TINY + [f"run.output_dir={root}", "run.name=tiny", "eval.interval=0",
                                               f"data.embedded_dir={embedded_dir}"])
        run(cfg)
    return cfg


def test_load_model_takes_a_run_directory(trained_run, megatron_world1):
    """The run directory, its checkpoints/ and the checkpoint itself load the same model."""
    ids = torch.arange(12)[None]
    logits = [megatron_mhar.load_model(path)(ids)
              for path in (trained_run.run.dir, trained_run.checkpoint_dir, trained_run.checkpoint_dir / "iter_0000006")]
    assert all(torch.equal(other, logits[0]) for other in logits[1:])


def test_run_directory_with_its_own_checkpoint_dir(trained_run, megatron_world1, tmp_path):
    """A run whose config.yaml moved its checkpoints (checkpoint.dir) is followed there."""
    import shutil

    run_dir = tmp_path / "moved"
    run_dir.mkdir()
    shutil.copytree(trained_run.checkpoint_dir, tmp_path / "elsewhere")
    config = (trained_run.run.dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text(config.replace("  dir: null", f"  dir: {tmp_path / 'elsewhere'}", 1))
    assert megatron_mhar.load_model(run_dir).config.num_layers == 2
    shutil.rmtree(tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError, match=r"is a run directory without checkpoints .*\(checkpoint.save_at_end\)"):
        megatron_mhar.load_model(run_dir)
    with pytest.raises(FileNotFoundError, match="is not a Megatron distributed checkpoint"):
        megatron_mhar.load_model(tmp_path / "nothing")


def test_inference_builds_no_autograd_graph_unless_asked(trained_run, megatron_world1):
    ids = torch.arange(8)[None]
    logits = megatron_mhar.load_model(trained_run.run.dir)(ids)
    assert logits.grad_fn is None and not logits.requires_grad
    model = megatron_mhar.load_model(trained_run.run.dir, grad=True)
    logits = model(ids)
    assert logits.grad_fn is not None
    logits[0, -1].logsumexp(-1).backward()
    assert model.gpt.embedding.word_embeddings.weight.grad is not None
    with torch.no_grad():  # the caller's no_grad still wins
        assert model(ids).grad_fn is None


def test_the_checkpoint_carries_the_runs_tokenizer(trained_run, embedded_dir, megatron_world1):
    """Trained with the builtin tokenizer, the model maps text to ids without the corpus build."""
    from megatron_mhar.data.corpus import prepare_embedded

    model = megatron_mhar.load_model(trained_run.run.dir)
    builtin = prepare_embedded(str(embedded_dir), EMBEDDED_VOCAB, EMBEDDED_BYTES).tokenizer()
    text = "def main():\n    return 0\n"
    assert model.tokenizer is not None and model.tokenizer.tokenize(text) == builtin.tokenize(text)
    assert model.tokenizer.eod == builtin.eod
    assert (trained_run.checkpoint_dir / "iter_0000006" / "tokenizer" / "tokenizer.json").is_file()


def test_load_model_prints_no_library_warnings(trained_run):
    """load_model in a fresh process: the model loads, and stderr stays empty."""
    code = ("import megatron_mhar, torch, sys; "
            "model = megatron_mhar.load_model(sys.argv[1]); "
            "print(tuple(model(torch.tensor([[1, 2, 3]])).shape))")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    done = subprocess.run([sys.executable, "-c", code, str(trained_run.run.dir)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"(1, 3, {EMBEDDED_VOCAB})"
    assert done.stderr == ""


@pytest.mark.parametrize(
    "mhar, model_fields, architecture",
    [
        pytest.param(MHARConfig(variant="none"), {}, "LlamaForCausalLM", id="baseline-llama"),
        pytest.param(MHARConfig(variant="full", num_heads=4), dict(qk_layernorm=True), "MHARQwen3ForCausalLM",
                     id="full-qwen3"),
        pytest.param(MHARConfig(variant="block", num_heads=2, block_size=3), dict(tie_embeddings=False),
                     "MHARLlamaForCausalLM", id="block-llama-untied"),
        pytest.param(MHARConfig(variant="delta", num_heads=4, delta_block_layers=1), {}, "MHARLlamaForCausalLM",
                     id="delta-llama"),
    ],
)
def test_to_hf_is_the_same_network(megatron_world1, tmp_path, mhar, model_fields, architecture):
    """The in-memory transformers form computes the Megatron model's logits."""
    model = megatron_mhar.load_model(_save_model(tmp_path, mhar, **model_fields))
    hf = model.to_hf()
    assert type(hf).__name__ == architecture and not hf.training
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-5, atol=1e-5)


def test_generate_maps_text_to_text_greedily(trained_run, megatron_world1):
    """``generate`` continues a prompt with the KV-cache decoder of the transformers form;
    the result is the greedy continuation of the Megatron model itself (full-sequence
    forwards, one token at a time), decoded with the checkpoint's tokenizer."""
    model = megatron_mhar.load_model(trained_run.run.dir)
    tokenizer = model.tokenizer
    prompt, new = "def main(", 12
    ids = tokenizer.tokenize(prompt)
    expected = []
    for _ in range(new):
        logits = model(torch.tensor([ids + expected]))[0, -1]
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] > 1e-4  # no near-tie for rounding to decide
        token = int(logits.argmax())
        if token == tokenizer.eod:
            break
        expected.append(token)
    text = model.generate(prompt, max_new_tokens=new)
    assert isinstance(text, str) and text == tokenizer.detokenize(expected)


def test_generate_errors(trained_run, megatron_world1, checkpoint_dir):
    model = megatron_mhar.load_model(trained_run.run.dir)
    with pytest.raises(ValueError, match="the prompt is empty"):
        model.generate("")
    with pytest.raises(ValueError, match=r"plus max_new_tokens=32 exceeds the 32 tokens the model was trained on"):
        model.generate("a b c")
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        model.generate("a", max_new_tokens=0)
    bare = megatron_mhar.load_model(checkpoint_dir)  # saved without a tokenizer
    assert bare.tokenizer is None
    with pytest.raises(ValueError, match=r"carries no tokenizer .* load_model\(..., tokenizer=DIR\)"):
        bare.generate("a")
    tokenizer_dir = trained_run.checkpoint_dir / "iter_0000006" / "tokenizer"
    with pytest.raises(ValueError, match=f"has {EMBEDDED_VOCAB} tokens, more than the model's {VOCAB}"):
        megatron_mhar.load_model(checkpoint_dir, tokenizer=tokenizer_dir)
    # a tokenizer the checkpoint carries but that cannot serve: the model still loads, and says why
    damaged = checkpoint_dir / "iter_0000000" / "tokenizer"
    damaged.mkdir()
    (damaged / "tokenizer.json").write_text("{truncated")
    manifest.write_manifest(checkpoint_dir / "iter_0000000")  # saved so: the manifest lists it
    with pytest.warns(UserWarning, match="the checkpoint's tokenizer is not used: .*tokenizer=DIR"):
        model = megatron_mhar.load_model(checkpoint_dir)
    assert model.tokenizer is None and model(torch.zeros(1, 2, dtype=torch.long)).shape == (1, 2, VOCAB)
