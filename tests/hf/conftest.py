"""Tiny MHAR models trained by the driver, their exports, and the exports loaded elsewhere.

Every case is trained a few steps with ``python -m megatron_mhar.train`` (in-process,
``megatron_mhar.train.main``) on the embedded corpus, so the routing parameters have left
their initial values, then exported with ``mcore_to_hf`` and the builtin tokenizer.
Runs and exports are built once per session, all at once (training in-process needs no
Megatron state set up, so it happens before any test's ``megatron_world1``).

``random_model(name)`` builds the untrained models of ``RANDOM_MODELS`` instead.

Fixtures:
    embedded: the embedded corpus and builtin tokenizer (:class:`EmbeddedData`).
    checkpoints: ``{case: Megatron checkpoints dir}`` of every case.
    exports: ``{case: HF dir}`` of their exports.
    remote_logits: ``{case: logits [2, 24, vocab]}`` of every export loaded with
        ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` in one
        subprocess where ``megatron_mhar`` and ``mhar_kernels`` cannot be imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest
import torch

from tests.conftest import _LAUNCHER_ENV
from tests.training.conftest import EMBEDDED_BYTES, EMBEDDED_VOCAB

HERE = Path(__file__).resolve().parent
LAYERS = 3
SEQ = 64

ARCHITECTURE = [
    "run.device=cpu", "run.seed=1234", f"model.num_layers={LAYERS}", "model.hidden_size=32",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=64",
    f"model.vocab_size={EMBEDDED_VOCAB}", f"model.seq_length={SEQ}",
]
TRAINING = [
    "training.train_iters=4", "training.global_batch_size=4", "training.micro_batch_size=4",
    "optimizer.lr=3.0e-2", "optimizer.min_lr=3.0e-3", "optimizer.lr_warmup_iters=1",
    "eval.interval=0", "logging.interval=1", "logging.tensorboard=false", "checkpoint.keep_last=1",
    f"data.embedded_vocab_size={EMBEDDED_VOCAB}", f"data.embedded_max_bytes={EMBEDDED_BYTES}",
    "data.split=80,20,0",
]
QWEN3 = ["model.qk_layernorm=true"]
LLAMA = ["model.qk_layernorm=false"]

# case -> overrides of the smoke recipe. Together: both families, every variant, H = 8 and
# H = 1, logit_scale != 1, tied and untied embeddings.
CASES = {
    # Qwen3 (q/k norms), every sublayer output a source, 8 heads, tau = 2, tied embeddings
    "qwen3-full-h8": QWEN3 + ["mhar.variant=full", "mhar.num_heads=8", "mhar.logit_scale=2.0",
                              "model.tie_embeddings=true"],
    # Llama, Attention Residuals (one head), untied output layer
    "llama-full-h1": LLAMA + ["mhar.variant=full", "mhar.num_heads=1", "model.tie_embeddings=false"],
    # blocks of 4 sublayers over 6: block 2 spans layers, the final site reads a partial
    "llama-block-h4": LLAMA + ["mhar.variant=block", "mhar.num_heads=4", "mhar.block_size=4",
                               "mhar.logit_scale=4.0", "model.tie_embeddings=true"],
    # delta over blocks of one layer (null source + embedding + 2 deltas), untied, tau = 8
    "qwen3-delta-h8": QWEN3 + ["mhar.variant=delta", "mhar.num_heads=8", "mhar.delta_block_layers=1",
                               "mhar.logit_scale=8.0", "model.tie_embeddings=false"],
    # no routing: a plain Qwen3 export
    "qwen3-none": QWEN3 + ["mhar.variant=none", "model.tie_embeddings=true"],
}
ROUTED = [name for name in CASES if not name.endswith("none")]


VOCAB = EMBEDDED_VOCAB
RANDOM_SHAPE = dict(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, intermediate_size=64, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None)
# name -> (family, MHAR fields) of the random-weight models (random_model)
RANDOM_MODELS = {
    # Qwen3, 8 heads, tau = 2, tied embeddings
    "qwen3-full": ("qwen3", dict(mhar_variant="full", mhar_num_heads=8, mhar_logit_scale=2.0,
                                 tie_word_embeddings=True)),
    # Llama, Attention Residuals (one head), untied
    "llama-full-h1": ("llama", dict(mhar_variant="full", mhar_num_heads=1, tie_word_embeddings=False)),
    # Llama, blocks of 3 sublayers (they straddle layers), partial read at the final site
    "llama-block": ("llama", dict(mhar_variant="block", mhar_num_heads=4, mhar_block_size=3,
                                  mhar_logit_scale=4.0)),
    # Qwen3 delta over blocks of one layer, nonzero gates and null sources
    "qwen3-delta": ("qwen3", dict(mhar_variant="delta", mhar_num_heads=8, mhar_delta_block_layers=1)),
}


def random_model(name: str, seed: int = 0):
    """``RANDOM_MODELS[name]`` with weights drawn large: matrices, queries, null sources and
    gates N(0, 0.3^2), norm weights 1 + N(0, 0.2^2), so logits are O(1) and depend on context."""
    import megatron_mhar.hf as mhar_hf

    family, fields = RANDOM_MODELS[name]
    config_class, model_class = {
        "qwen3": (mhar_hf.MHARQwen3Config, mhar_hf.MHARQwen3ForCausalLM),
        "llama": (mhar_hf.MHARLlamaConfig, mhar_hf.MHARLlamaForCausalLM),
    }[family]
    model = model_class(config_class(**RANDOM_SHAPE, **fields))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            norm = "norm" in param_name.rsplit(".", 2)[-2] or param_name.endswith("norm_weight")
            param.copy_(1 + 0.2 * noise if norm else 0.3 * noise)
    return model.eval()


def token_batch(seed: int = 0, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, EMBEDDED_VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def embedded(tmp_path_factory):
    from megatron_mhar.data.corpus import prepare_embedded

    return prepare_embedded(str(tmp_path_factory.mktemp("embedded")), EMBEDDED_VOCAB, EMBEDDED_BYTES)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, embedded) -> Dict[str, Path]:
    """``{case: checkpoints dir}``: every case trained, before any test sets up Megatron."""
    from megatron_mhar.train import main

    root = tmp_path_factory.mktemp("runs")
    for case, options in CASES.items():
        overrides = ARCHITECTURE + TRAINING + options + [
            f"run.output_dir={root}", f"run.name={case}", f"data.embedded_dir={embedded.directory.parent}",
        ]
        with pytest.MonkeyPatch.context() as patch:
            for name in _LAUNCHER_ENV:
                patch.delenv(name, raising=False)
            assert main(["smoke_cpu", *overrides]) == 0
    return {case: root / case / "checkpoints" for case in CASES}


@pytest.fixture(scope="session")
def exports(tmp_path_factory, checkpoints, embedded) -> Dict[str, Path]:
    """``{case: HF dir}``: every case's export, with the builtin tokenizer."""
    from megatron_mhar.conversion.convert import mcore_to_hf

    root = tmp_path_factory.mktemp("exports")
    return {case: mcore_to_hf(ckpt, root / case, tokenizer=embedded.directory)
            for case, ckpt in checkpoints.items()}


@pytest.fixture(scope="session")
def remote_logits(tmp_path_factory, exports):
    """Every case's logits from its export loaded where megatron_mhar cannot be imported."""
    work = tmp_path_factory.mktemp("remote")
    tokens = work / "tokens.pt"
    torch.save(token_batch(), tokens)
    dirs = {case: str(path) for case, path in exports.items()}
    (work / "dirs.json").write_text(json.dumps(dirs))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",) + _LAUNCHER_ENV}
    env.update(HF_HOME=str(work / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, str(HERE / "load_without_package.py"), str(work / "dirs.json"), str(tokens),
         str(work / "logits.pt")],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return torch.load(work / "logits.pt")
