"""megatron_mhar.load_model and its CausalLM: bad arguments and inputs get errors that name them."""

import pytest
import torch

import megatron_mhar
from megatron_mhar.models.mhar_config import MHARConfig

VOCAB, SEQ = 100, 8  # VOCAB pads to 128 rows: ids 100..127 index padding rows


@pytest.fixture
def checkpoint_dir(megatron_world1, tmp_path):
    """A tiny full-variant model saved in the driver's layout (``latest`` -> ``iter_0000000``)."""
    from megatron_mhar import manifest
    from megatron_mhar.conversion import checkpoint
    from megatron_mhar.models.builder import build_gpt_model, make_transformer_config
    from megatron_mhar.models.gpt_config import GPTModelConfig

    model = GPTModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                           seq_length=SEQ)
    mhar = MHARConfig(variant="full", num_heads=4)
    gpt = build_gpt_model(model, mhar, make_transformer_config(model, mhar, use_cpu_initialization=True))
    iteration = tmp_path / checkpoint.ITERATION_DIR
    iteration.mkdir()
    checkpoint.save(gpt, iteration, checkpoint.common_state(model, mhar, {}))
    manifest.write_manifest(iteration)  # as a conversion publishes it
    (tmp_path / checkpoint.LATEST).write_text(checkpoint.ITERATION_DIR)
    return tmp_path


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
