"""Evaluate a trained, continued-pretrained or converted model with lm-evaluation-harness.

    python -m megatron_mhar.evaluate runs/cpt_8b_mhar_delta --hf-reference /models/marin-8b \\
        --tasks gsm8k,gpqa_main_n_shot --device cuda --dtype bfloat16 --output results.json

MODEL is a run directory, a Megatron checkpoint (a run's ``checkpoints/``, or the output of
``hf_to_mcore_mhar.py``), which is first exported with ``mcore_to_hf`` (into
``--export-dir``, else a temporary directory), or a Hugging Face directory (an export,
or any Llama / Qwen3). The harness runs its ``hf`` model on it: transformers'
``AutoModelForCausalLM``, which loads MHAR exports through the classes of
:mod:`megatron_mhar.hf` (registered here, so no remote code is run unless
``--trust-remote-code`` lets an export of another megatron_mhar version run its own). The
same directory evaluates without this package installed:

    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --tasks ...

Tasks whose data the harness downloads need the Hugging Face Hub, or the data in the local
cache. Where the Hub cannot be reached (or ``HF_HUB_OFFLINE`` is set), the tasks are built
from the cache alone before the model loads, and a task whose dataset is not there fails at
once with its name; tasks of your own over local files (``dataset_path: json``) come from
``--include-path``.

Needs the ``eval`` extra: ``pip install -e '.[eval]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import List, Optional, Sequence

from megatron_mhar.errors import UserError, command_errors
from megatron_mhar.files import write_atomic

# Files one of which an HF directory needs for transformers' AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
HUB_PROBE_SECONDS = 5.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_mhar.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path,
                        help="run directory, Megatron checkpoint directory or Hugging Face directory")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--num-fewshot", type=int, help="few-shot examples per task (default: the task's)")
    parser.add_argument("--batch-size", default="1", help="batch size, or 'auto'")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<index>")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="dtype the model runs in (auto: the stored one)")
    parser.add_argument("--limit", type=float, help="examples per task (a fraction if below 1); for quick checks")
    parser.add_argument("--include-path", type=Path, help="directory of extra task YAMLs (local tasks)")
    parser.add_argument("--output", type=Path, help="write the results (and samples) as JSON here")
    parser.add_argument("--log-samples", action="store_true", help="keep every request and response in --output")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let an MHAR export written by another megatron_mhar version run the model code it "
                             "ships (the installed classes refuse it otherwise)")
    parser.add_argument("--export-dir", type=Path,
                        help="where a Megatron checkpoint's HF export is written and kept "
                             "(default: a temporary directory)")
    parser.add_argument("--hf-reference", type=Path,
                        help="checkpoint export: HF directory whose config.json and tokenizer to use "
                             "(e.g. the base model of a continued-pretraining run)")
    parser.add_argument("--tokenizer", type=Path,
                        help="checkpoint export: directory holding the tokenizer.json the model was trained with")
    return parser


def hub_unreachable() -> Optional[str]:
    """Why the Hugging Face Hub cannot be reached (``HF_HUB_OFFLINE`` set, or no connection to
    its endpoint, or its proxy, within a few seconds), or ``None`` when it can."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    proxy = None if urllib.request.proxy_bypass(endpoint.hostname or "") else (
        urllib.request.getproxies().get(endpoint.scheme))
    target = urllib.parse.urlsplit(proxy) if proxy else endpoint
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        socket.create_connection((target.hostname, port), timeout=HUB_PROBE_SECONDS).close()
    except OSError as err:
        return f"cannot be reached ({target.hostname}:{port}: {err.strerror or err})"
    return None


def _harness():
    try:
        import lm_eval
        import lm_eval.tasks
    except ImportError as err:
        raise ImportError(f"{err}; the evaluation needs the eval extra: pip install -e '.[eval]'") from None
    return lm_eval


def load_tasks(names: List[str], include_path: Optional[Path], offline: Optional[str]):
    """``(task manager, tasks and groups)`` of the harness for ``names``, built before any
    model is exported or loaded.

    Offline (``offline`` says why), a task whose dataset is not in the local cache raises a
    ``FileNotFoundError`` naming the task, the dataset and the way to local tasks.
    """
    manager = _harness().tasks.TaskManager(include_path=str(include_path) if include_path else None)
    built = []
    for name in names:
        try:
            loaded = manager.load(name)
        except KeyError as err:  # the harness's "not a registered task/group/tag name or valid YAML path"
            raise ValueError(f"{err.args[0]}; lm-eval's tasks: lm_eval ls tasks; yours: --include-path") from None
        except ConnectionError as err:
            if offline is None:
                raise
            found = re.search(r"reach '([^']+)'", str(err))  # datasets: Couldn't reach 'org/name' on the Hub
            dataset = found[1] if found else "its dataset"
            raise FileNotFoundError(
                f"task {name!r} needs the dataset {dataset} from the Hugging Face Hub, which {offline}, and the "
                f"local cache does not hold it; run once where the Hub is reachable, or evaluate tasks over "
                f"local files: task YAMLs with dataset_path: json in a directory passed as --include-path"
            ) from None
        top = loaded["groups"].get(name) or loaded["tasks"].get(name)
        built.extend([top] if top is not None else loaded["tasks"].values())  # a tag: its tasks
    return manager, built


def evaluate(args: argparse.Namespace, hf_dir: Path, manager, tasks) -> dict:
    """Run the harness's ``tasks`` (:func:`load_tasks`) on ``hf_dir``; returns its results dict."""
    import megatron_mhar.hf  # noqa: F401  (registers the MHAR classes with AutoModelForCausalLM)

    check_tokenizer(hf_dir)
    batch_size = args.batch_size if args.batch_size == "auto" else int(args.batch_size)
    return _harness().simple_evaluate(
        model="hf",
        model_args={"pretrained": str(hf_dir), "dtype": args.dtype, "trust_remote_code": args.trust_remote_code},
        tasks=tasks,
        num_fewshot=args.num_fewshot,
        batch_size=batch_size,
        device=args.device,
        limit=int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit,
        log_samples=args.log_samples,
        task_manager=manager,
    )


def check_tokenizer(hf_dir: Path) -> None:
    if not any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{hf_dir} has no tokenizer ({' / '.join(TOKENIZER_FILES)}); evaluate a Megatron checkpoint "
            f"with --hf-reference (the base model's directory) or --tokenizer (the directory holding the "
            f"tokenizer.json it was trained with)"
        )


def export_checkpoint(args: argparse.Namespace, out: Path) -> Path:
    """The HF export of the run or Megatron checkpoint ``args.model`` (written to ``out``)."""
    from megatron_mhar.conversion.convert import mcore_to_hf
    from megatron_mhar.inference import checkpoints_of

    return mcore_to_hf(checkpoints_of(args.model), out, hf_reference=args.hf_reference, tokenizer=args.tokenizer)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    with command_errors(parser.prog), tempfile.TemporaryDirectory(prefix="mhar_eval_") as scratch:
        if args.model.is_file() or not args.model.exists():
            raise FileNotFoundError(f"{args.model} is not a directory (a run, a Megatron checkpoint or a Hugging "
                                    f"Face model)")
        is_hf = (args.model / "config.json").is_file()
        if is_hf and (args.hf_reference or args.tokenizer or args.export_dir):
            raise ValueError(f"{args.model} is a Hugging Face directory already; --hf-reference, --tokenizer "
                             f"and --export-dir apply to Megatron checkpoints")
        if args.export_dir is not None and args.export_dir.exists():
            raise FileExistsError(f"--export-dir {args.export_dir} exists; give a new directory")
        try:
            if is_hf:
                check_tokenizer(args.model)
            offline = hub_unreachable()
            if offline is not None:  # before datasets and huggingface_hub read them: the local cache, no retries
                os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
            manager, tasks = load_tasks([name for name in args.tasks.split(",") if name], args.include_path, offline)
            hf_dir = args.model if is_hf else export_checkpoint(args, args.export_dir or Path(scratch) / "hf")
            results = evaluate(args, hf_dir, manager, tasks)
        except ImportError as err:  # the eval extra is missing: evaluate() names it
            raise UserError(str(err)) from err
        from lm_eval.utils import handle_non_serializable, make_table

        print(make_table(results))
        if args.output is not None:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(results, indent=1, default=handle_non_serializable)
            write_atomic(args.output, text + "\n")
            print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
