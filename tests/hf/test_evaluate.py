"""``python -m megatron_mhar.evaluate`` on a training run, offline, with a task defined here.

The harness's log-likelihood of every (context, continuation) pair must be the one
computed from the model's own logits, those of the export and those of ``load_model``.
A task whose dataset the Hub would supply fails at once, offline, with one message.
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

from tests.helpers import LAUNCHER_ENV

pytest.importorskip("lm_eval", reason="needs the eval extra (pip install 'megatron_mhar[eval]')")

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    {"context": "def add(a, b):\n    return", "choices": [" a + b", " None", " self.value"], "label": 0},
    {"context": "import os\nimport", "choices": [" sys", " os.path", " re"], "label": 0},
    {"context": "for i in range(10):\n    print", "choices": ["(i)", "(x, y)", " = 3"], "label": 0},
    {"context": "class Point:\n    def __init__(self", "choices": ["):", ", x, y):", "self)"], "label": 1},
]
TASK = """task: mhar_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def harness_run(checkpoints, embedded, tmp_path_factory):
    """The evaluation CLI run on the delta case's run directory (its checkpoint exported on the way)."""
    work = tmp_path_factory.mktemp("evaluate")
    tasks = work / "tasks"
    tasks.mkdir()
    (tasks / "tiny.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tasks / "tiny.yaml").write_text(TASK.format(data=tasks / "tiny.jsonl"))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(PYTHONPATH=str(REPO), HF_HOME=str(work / "hf_home"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    command = [sys.executable, "-m", "megatron_mhar.evaluate", str(checkpoints["qwen3-delta-h8"].parent),
               "--tokenizer", str(embedded.directory), "--export-dir", str(work / "hf"),
               "--tasks", "mhar_tiny", "--include-path", str(tasks), "--batch-size", "3",
               "--dtype", "float32", "--output", str(work / "results.json"), "--log-samples"]
    result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mhar_tiny" in result.stdout  # the results table
    return json.loads((work / "results.json").read_text()), work / "hf"


def _pair_ids(tokenizer, context: str, continuation: str):
    """The harness's split of a pair into token ids: the whole text's ids after the context's."""
    whole = tokenizer.encode(context + continuation).ids
    context_ids = tokenizer.encode(context).ids
    assert whole[: len(context_ids)] == context_ids  # the split falls on a token boundary
    return whole, len(context_ids)


def _loglikelihood(logits: torch.Tensor, ids, start: int):
    """(sum of the continuation's log-probabilities, whether each is the argmax)."""
    logprobs = torch.log_softmax(logits[0, start - 1 : len(ids) - 1].double(), dim=-1)
    targets = torch.tensor(ids[start:])
    chosen = logprobs.gather(-1, targets[:, None])[:, 0]
    return chosen.sum().item(), bool((logprobs.argmax(-1) == targets).all())


def test_harness_loglikelihoods_are_the_models(megatron_world1, checkpoints, harness_run):
    import megatron_mhar
    import megatron_mhar.hf  # noqa: F401
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    results, hf_dir = harness_run
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["MHARQwen3ForCausalLM"]
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    exported = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    megatron = megatron_mhar.load_model(checkpoints["qwen3-delta-h8"])
    samples = results["samples"]["mhar_tiny"]
    assert len(samples) == len(DOCS)
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        lls = []
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            assert context == doc["context"] and continuation in doc["choices"]
            ids, start = _pair_ids(tokenizer, context, continuation)
            harness_ll, harness_greedy = response[0]
            with torch.no_grad():
                for logits in (exported(torch.tensor([ids])).logits, megatron(torch.tensor([ids]))):
                    ll, greedy = _loglikelihood(logits, ids, start)
                    assert harness_ll == pytest.approx(ll, abs=1e-4)
                    assert harness_greedy == greedy
            lls.append(harness_ll)
        correct += int(max(range(len(lls)), key=lls.__getitem__) == doc["label"])
    assert results["results"]["mhar_tiny"]["acc,none"] == pytest.approx(correct / len(DOCS))


def test_evaluate_refuses_a_model_without_tokenizer(exports, tmp_path, capsys):
    from megatron_mhar import evaluate

    bare = tmp_path / "bare"
    shutil.copytree(exports["qwen3-none"], bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([str(bare), "--tasks", "mhar_tiny"])
    assert exit_info.value.code == 2
    assert "has no tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate.main([str(bare), "--tasks", "mhar_tiny", "--tokenizer", str(tmp_path)])
    assert "apply to Megatron checkpoints" in capsys.readouterr().err


def test_a_hub_task_offline_fails_at_once_with_one_line(exports, tmp_path):
    """No HF_HUB_OFFLINE set, the Hub's endpoint refuses connections: arc_easy (whose data
    the harness downloads) fails before any model loads, with the dataset and the way to
    local tasks named in one message."""
    from megatron_mhar.runtime import free_port

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV + ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env.update(PYTHONPATH=str(REPO), HF_HOME=str(tmp_path / "hf_home"), HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    command = [sys.executable, "-m", "megatron_mhar.evaluate", str(exports["qwen3-full-h8"]), "--tasks", "arc_easy"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stdout + result.stderr
    message, hint = result.stderr.splitlines()  # the error contract: the message alone, then the hint
    assert message.startswith("python -m megatron_mhar.evaluate: error: task 'arc_easy' needs the dataset "
                              "allenai/ai2_arc from the Hugging Face Hub, which cannot be reached (127.0.0.1:")
    assert hint == "(MHAR_TRACEBACK=1 shows where it was raised)"
    assert "--include-path" in result.stderr


def test_hub_offline_setting_is_read(monkeypatch):
    from megatron_mhar.evaluate import hub_unreachable

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_unreachable() == "HF_HUB_OFFLINE is set"
