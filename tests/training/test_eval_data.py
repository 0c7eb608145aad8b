"""Held-out validation and test data (``data.valid_paths`` / ``data.test_paths``).

Training, validation and test data are written with disjoint token ranges, so the ids
that reach the embedding show which data each forward pass read.
"""

from __future__ import annotations

import json
import os

import numpy
import pytest

from megatron_mhar.training.launch_checks import validate_launch
from megatron_mhar.training.metrics import read_metrics
from megatron_mhar.training.recipes import load_config
from tests.helpers import EMBEDDED_VOCAB

RANGES = {"train": (0, 170), "valid": (170, 340), "test": (340, EMBEDDED_VOCAB)}
"""Token ids ``[low, high)`` of each data set."""


def _write_tokens(prefix, low, high, documents=40, length=100, seed=0):
    """``prefix.{bin,idx}`` of random documents with ids in ``[low, high)``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(seed)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=numpy.int32)
    for _ in range(documents):
        builder.add_document(rng.integers(low, high, length, dtype=numpy.int32), [length])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


@pytest.fixture
def data_sets(tmp_path):
    """{name: prefix} of the three disjoint data sets."""
    return {name: _write_tokens(tmp_path / "data" / name, *bounds, seed=i)
            for i, (name, bounds) in enumerate(RANGES.items())}


def _record_embedding_inputs(monkeypatch):
    """[(training?, token ids)] of every forward pass of the driver's model, in order."""
    from megatron_mhar.training import loop
    from megatron_mhar.training.model import unwrap

    calls = []
    build = loop.build_model_chunks

    def record(module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        calls.append((module.training, ids.detach().clone()))

    def build_and_hook(*args, **kwargs):
        chunks = build(*args, **kwargs)
        for chunk in chunks:
            unwrap(chunk).embedding.register_forward_pre_hook(record, with_kwargs=True)
        return chunks

    monkeypatch.setattr(loop, "build_model_chunks", build_and_hook)
    return calls


def _within(ids, name):
    low, high = RANGES[name]
    return int(ids.min()) >= low and int(ids.max()) < high


def test_evaluation_reads_only_the_heldout_paths(tiny, data_sets, monkeypatch):
    """Every training batch from data.paths, every validation batch from data.valid_paths,
    the test batches (after the last step) from data.test_paths."""
    from megatron_mhar.training.loop import run

    calls = _record_embedding_inputs(monkeypatch)
    cfg = tiny("data.split=null", f"data.paths=[{data_sets['train']}]",
               f"data.valid_paths=[{data_sets['valid']}]", f"data.test_paths=[{data_sets['test']}]")
    result = run(cfg)

    training = [ids for is_training, ids in calls if is_training]
    evaluation = [ids for is_training, ids in calls if not is_training]
    micro = cfg.training.global_batch_size // cfg.training.micro_batch_size * cfg.eval.iters
    assert len(training) == cfg.training.train_iters * micro
    assert all(_within(ids, "train") for ids in training)
    # validation at steps 3 and 6 (eval.interval=3), then the test after the last step
    assert len(evaluation) == 3 * micro
    assert all(_within(ids, "valid") for ids in evaluation[: 2 * micro])
    assert all(_within(ids, "test") for ids in evaluation[2 * micro:])

    assert [step for step, _ in result.val_losses] == [3, 6]
    tests = read_metrics(cfg.run.dir, "test")
    assert [r["step"] for r in tests] == [6] and tests[0]["test_loss"] == result.test_loss
    assert json.loads((cfg.run.dir / "summary.json").read_text())["test_loss"] == result.test_loss


def test_without_heldout_paths_evaluation_reads_the_split(tiny, data_sets, monkeypatch):
    """The control: with data.split, validation and test come out of data.paths."""
    from megatron_mhar.training.loop import run

    calls = _record_embedding_inputs(monkeypatch)
    cfg = tiny("data.split=60,20,20", f"data.paths=[{data_sets['train']}]", "eval.interval=0")
    result = run(cfg)
    evaluation = [ids for is_training, ids in calls if not is_training]
    micro = cfg.training.global_batch_size // cfg.training.micro_batch_size
    assert len(evaluation) == 2 * micro  # validation and test after the last step
    assert all(_within(ids, "train") for _, ids in calls)
    assert result.test_loss is not None and result.val_losses[-1][0] == 6


def test_a_heldout_set_too_small_for_an_evaluation_is_refused(tiny, data_sets, tmp_path):
    from megatron_mhar.training.loop import run

    other = _write_tokens(tmp_path / "data" / "valid2", *RANGES["valid"], documents=1, length=40, seed=9)
    cfg = tiny("data.split=null", f"data.paths=[{data_sets['train']}]",
               f"data.valid_paths=[{data_sets['valid']},{other}]", "eval.iters=40")
    with pytest.raises(ValueError, match=r"the validation data \(data.valid_paths\) holds \d+ samples .* = 160: "
                                         r"lower eval.iters"):
        run(cfg)


@pytest.mark.parametrize(
    "overrides, message",
    [
        # held-out sets replace the split: both at once would leave data.split doing nothing
        pytest.param(["data.valid_paths=[v]"], "data.split='80,20,0' carves validation data out of data.paths, "
                     "but data.valid_paths is set: set data.split=null", id="split-and-valid"),
        pytest.param(["data.split=null", "data.test_paths=[t]"], "data.test_paths needs data.valid_paths", id="test-alone"),
        pytest.param(["data.split=null", "data.valid_paths=[v]", "data.valid_weights=[1.0, 2.0]"],
                     "data.valid_weights has 2 entries for 1 data.valid_paths", id="valid-weights"),
        pytest.param(["data.split=null", "data.valid_paths=[v]", "data.test_paths=[t]", "data.test_weights=[0.0]"],
                     "data.test_weights must be non-negative with a positive sum", id="test-weights"),
    ],
)
def test_inconsistent_heldout_settings_are_refused(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config("smoke_cpu", ["data.split=80,20,0", *overrides])
    assert message in str(err.value)


def _damage(prefix, how):
    """Break the pair ``prefix.{bin,idx}`` as ``how`` says."""
    if how == "missing":
        os.remove(prefix + ".idx")
    elif how == "truncated":
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(100)
    elif how == "mismatched":  # an .idx of another run: more documents than the .bin holds
        _write_tokens(prefix + "_other", 0, 10, documents=80)
        os.replace(prefix + "_other.idx", prefix + ".idx")


@pytest.mark.parametrize("key", ["valid_paths", "test_paths"])
@pytest.mark.parametrize(
    "how, message",
    [
        pytest.param("missing", r"\.idx not found", id="missing"),
        pytest.param("truncated", r"\.bin is truncated or the two files come from different runs", id="truncated"),
        pytest.param("mismatched", r"the \.bin is truncated or the two files come from different runs", id="mismatched"),
    ],
)
def test_bad_heldout_pairs_are_refused_at_launch(data_sets, key, how, message):
    _damage(data_sets["valid" if key == "valid_paths" else "test"], how)
    cfg = load_config("smoke_cpu", [
        f"data.paths=[{data_sets['train']}]", f"data.valid_paths=[{data_sets['valid']}]",
        f"data.test_paths=[{data_sets['test']}]", "model.vocab_size=4096",
    ])
    with pytest.raises(ValueError, match=rf"data\.{key}\[0\]='.*': .*{message}"):
        validate_launch(cfg, 1)


def test_heldout_data_of_another_vocabulary_is_refused_at_launch(data_sets):
    cfg = load_config("smoke_cpu", [f"data.paths=[{data_sets['train']}]", f"data.valid_paths=[{data_sets['valid']}]",
                                    "model.vocab_size=300", "data.embedded_vocab_size=300"])
    with pytest.raises(ValueError, match=r"data.valid_paths\[0\]=.* holds token id 3\d\d, beyond model.vocab_size=300"):
        validate_launch(cfg, 1)


@pytest.mark.parametrize(
    "valid, test, message",
    [
        pytest.param("train", None, r"data.valid_paths\[0\]=.* is also data.paths\[0\]", id="valid-is-train"),
        pytest.param("valid", "valid", r"data.test_paths\[0\]=.* is also data.valid_paths\[0\]", id="test-is-valid"),
    ],
)
def test_heldout_data_that_is_trained_on_is_refused_at_launch(data_sets, valid, test, message):
    overrides = [f"data.paths=[{data_sets['train']}]", f"data.valid_paths=[{data_sets[valid]}]"]
    if test:
        overrides.append(f"data.test_paths=[{data_sets[test]}]")
    with pytest.raises(ValueError, match=message + ": held-out data must be neither trained on"):
        validate_launch(load_config("smoke_cpu", overrides), 1)


def test_good_heldout_data_passes_launch(data_sets):
    validate_launch(load_config("smoke_cpu", [
        f"data.paths=[{data_sets['train']}]", f"data.valid_paths=[{data_sets['valid']}]",
        f"data.test_paths=[{data_sets['test']}]", "data.valid_weights=[2.0]",
    ]), 1)


@pytest.mark.parametrize("length, documents, expected", [
    # 2 x 40 tokens, an evaluation reads 1 x 4 x 32: a warning, the run goes on
    pytest.param(40, 2, "warning: the validation data (data.valid_paths) holds 80 tokens and an evaluation reads "
                 "128 (4 x 32): each of its tokens is read ~1.6 times in each; give it more data", id="small"),
    # 12 tokens: not one sequence
    pytest.param(12, 1, "the validation data (data.valid_paths) holds 12 tokens, less than one sequence of "
                 "model.seq_length=32 (+1 for the labels): give it more data", id="below-one-sequence"),
])
def test_tiny_validation_data_is_named(tiny, data_sets, tmp_path, capsys, length, documents, expected):
    from megatron_mhar.training.loop import run

    valid = _write_tokens(tmp_path / "data" / "tiny", *RANGES["valid"], documents=documents, length=length)
    cfg = tiny("data.split=null", f"data.paths=[{data_sets['train']}]", f"data.valid_paths=[{valid}]",
               "training.train_iters=3")
    if expected.startswith("warning: "):
        assert run(cfg).iteration == 3
        assert expected in capsys.readouterr().out.splitlines()
    else:
        with pytest.raises(ValueError) as err:
            run(cfg)
        assert str(err.value) == expected
