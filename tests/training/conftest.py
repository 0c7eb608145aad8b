"""Fixtures of the training-driver tests: a small embedded corpus and tiny run configs."""

from __future__ import annotations

import pytest

from tests.conftest import _LAUNCHER_ENV

EMBEDDED_BYTES = 200_000  # a few stdlib files: ~100K tokens, enough for every test
EMBEDDED_VOCAB = 512

TINY = [
    "run.device=cpu",
    "run.seed=1234",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=64",
    f"model.vocab_size={EMBEDDED_VOCAB}",
    "model.seq_length=32",
    "mhar.num_heads=4",
    "training.train_iters=6",
    "training.global_batch_size=4",
    "training.micro_batch_size=2",
    "optimizer.lr=1.0e-2",
    "optimizer.min_lr=1.0e-3",
    "optimizer.lr_warmup_iters=2",
    "eval.interval=3",
    "eval.iters=1",
    "eval.tail=2",
    "logging.interval=1",
    "checkpoint.keep_last=0",
    f"data.embedded_vocab_size={EMBEDDED_VOCAB}",
    f"data.embedded_max_bytes={EMBEDDED_BYTES}",
    "data.split=80,20,0",
]


@pytest.fixture(scope="session")
def embedded_dir(tmp_path_factory):
    """The embedded corpus, builtin tokenizer and dataset, built once per session."""
    from megatron_mhar.data.corpus import prepare_embedded

    root = tmp_path_factory.mktemp("embedded")
    prepare_embedded(str(root), EMBEDDED_VOCAB, EMBEDDED_BYTES)
    return root


@pytest.fixture
def single_process(monkeypatch):
    """No launcher variables: the driver starts a world of one."""
    for name in _LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def tiny(tmp_path, embedded_dir, single_process):
    """``tiny(*overrides)``: the smoke recipe shrunk to seconds, writing under tmp_path."""
    from megatron_mhar.training.recipes import load_config

    def make(*overrides, name="tiny"):
        base = TINY + [
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            f"data.embedded_dir={embedded_dir}",
        ]
        return load_config("smoke_cpu", base + list(overrides))

    return make
