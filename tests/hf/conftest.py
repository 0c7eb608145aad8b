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
    remote: what every export gave when used as a transformers / PEFT user would
        (``use_without_package.py``: loaded with ``trust_remote_code=True``, forwards,
        cache, outputs, activation checkpointing, Trainer, prefix tuning, pipeline), in
        one subprocess where ``megatron_mhar`` and ``mhar_kernels`` cannot be imported.
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

from tests.helpers import (
    EMBEDDED_BYTES,
    EMBEDDED_VOCAB,
    EXPORT_ARCHITECTURE,
    EXPORT_CASES,
    EXPORT_SEQ,
    EXPORT_TRAINING,
    LAUNCHER_ENV,
    ROUTED_CASES,
    export_token_batch,
)

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def embedded(tmp_path_factory):
    from megatron_mhar.data.corpus import prepare_embedded

    return prepare_embedded(str(tmp_path_factory.mktemp("embedded")), EMBEDDED_VOCAB, EMBEDDED_BYTES)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, embedded) -> Dict[str, Path]:
    """``{case: checkpoints dir}``: every case trained, before any test sets up Megatron."""
    from megatron_mhar.train import main

    root = tmp_path_factory.mktemp("runs")
    for case, options in EXPORT_CASES.items():
        overrides = EXPORT_ARCHITECTURE + EXPORT_TRAINING + options + [
            f"run.output_dir={root}", f"run.name={case}", f"data.embedded_dir={embedded.directory.parent}",
        ]
        with pytest.MonkeyPatch.context() as patch:
            for name in LAUNCHER_ENV:
                patch.delenv(name, raising=False)
            assert main(["smoke_cpu", *overrides]) == 0
    return {case: root / case / "checkpoints" for case in EXPORT_CASES}


@pytest.fixture(scope="session")
def exports(tmp_path_factory, checkpoints, embedded) -> Dict[str, Path]:
    """``{case: HF dir}``: every case's export, with the builtin tokenizer."""
    from megatron_mhar.conversion.convert import mcore_to_hf

    root = tmp_path_factory.mktemp("exports")
    return {case: mcore_to_hf(ckpt, root / case, tokenizer=embedded.directory)
            for case, ckpt in checkpoints.items()}


@pytest.fixture(scope="session")
def remote(tmp_path_factory, exports):
    """Every case's export used where megatron_mhar cannot be imported (see the module docstring)."""
    work = tmp_path_factory.mktemp("remote")
    tokens = work / "tokens.pt"
    torch.save(export_token_batch(), tokens)
    dirs = {case: str(path) for case, path in exports.items()}
    (work / "dirs.json").write_text(json.dumps(dirs))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",) + LAUNCHER_ENV}
    env.update(HF_HOME=str(work / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, str(HERE / "use_without_package.py"), str(work / "dirs.json"), str(tokens),
         str(work / "uses.pt")],
        cwd=work, env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return torch.load(work / "uses.pt")
