"""megatron_mhar.quiet: the known-harmless messages are silenced at the entry points, others show."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_mhar import quiet
from tests.helpers import EMBEDDED_BYTES, EMBEDDED_VOCAB, LAUNCHER_ENV

ROOT = Path(__file__).resolve().parents[1]
RERUN_LOGGER = "megatron.core.rerun_state_machine"

# One emitted message per known entry, as the libraries word them.
KNOWN = [
    (UserWarning, "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."),
    (UserWarning, "Apex is not installed. Falling back to Torch Norm"),
    (UserWarning, "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer."),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
    (FutureWarning, "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead."),
]


@pytest.fixture
def quieted(monkeypatch):
    """quiet_known_warnings() in force; the filters and the logger filter are undone after."""
    monkeypatch.setattr(sys, "warnoptions", [])
    logger = logging.getLogger(RERUN_LOGGER)
    filters = list(logger.filters)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert quiet.quiet_known_warnings()
        yield
    logger.filters[:] = filters


def test_every_known_entry_says_why_it_is_harmless():
    assert len(quiet.KNOWN_WARNINGS) == len(KNOWN)
    for entry in (*quiet.KNOWN_WARNINGS, *quiet.KNOWN_LOG_MESSAGES):
        assert len(entry.why) > 30, entry


def test_known_warnings_are_silenced_and_others_shown(quieted):
    with warnings.catch_warnings(record=True) as caught:
        for category, message in KNOWN:
            warnings.warn(message, category)
        warnings.warn("Apex is not installed; something else entirely")  # not the known sentence
        warnings.warn("a warning about the user's own run", UserWarning)
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", UserWarning)  # other category
    assert [str(w.message) for w in caught] == [
        "Apex is not installed; something else entirely",
        "a warning about the user's own run",
        "Please use DTensor instead and we are deprecating ShardedTensor.",
    ]


def test_known_log_messages_are_dropped_and_others_kept(quieted, caplog):
    logger = logging.getLogger(RERUN_LOGGER)
    with caplog.at_level(logging.WARNING, logger=RERUN_LOGGER):
        logger.warning("Implicit initialization of Rerun State Machine!")
        logger.warning("RerunStateMachine initialized in mode %s", "RerunMode.DISABLED")
        logger.warning("RerunStateMachine initialized in mode %s", "RerunMode.VALIDATE_RESULTS")
    assert [r.getMessage() for r in caplog.records] == [
        "RerunStateMachine initialized in mode RerunMode.VALIDATE_RESULTS"
    ]
    quiet.quiet_known_warnings()  # idempotent: one filter on the logger
    assert sum(isinstance(f, quiet._DropKnownMessages) for f in logger.filters) == 1


def test_a_warning_policy_of_the_user_wins(monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", ["default"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not quiet.quiet_known_warnings()
        warnings.warn(KNOWN[0][1], KNOWN[0][0])
    assert len(caught) == 1


def test_preprocess_prints_its_result_and_nothing_else(tmp_path, embedded_dir):
    """mhar-preprocess imports Megatron (its dataset writer): no library warnings on stderr."""
    (tmp_path / "doc.txt").write_text("def main():\n    return 0\n")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and k != "PYTHONWARNINGS"}
    done = subprocess.run(
        [sys.executable, "-m", "megatron_mhar.data.preprocess", "--input", str(tmp_path / "doc.txt"),
         "--output-prefix", str(tmp_path / "doc"), "--tokenizer", "builtin", "--embedded-dir", str(embedded_dir),
         "--vocab-size", str(EMBEDDED_VOCAB), "--embedded-max-bytes", str(EMBEDDED_BYTES)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"wrote .*doc.bin/.idx/.meta.json: 1 documents, \d+ tokens, largest id \d+ .*\n", done.stdout)
    assert done.stderr == ""


def test_the_readme_model_snippet_prints_nothing(tmp_path):
    """README's "Build a model" block, run as written: importing the package silences the
    library warnings that its model modules' imports and the config would print."""
    readme = (ROOT / "README.md").read_text()
    snippet = readme.split("## Build a model", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")
