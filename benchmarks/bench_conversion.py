"""HF -> Megatron (delta) -> HF conversion at Llama-3.1-8B's size on a CPU machine: wall time, peak memory.

    python -m benchmarks.bench_conversion --work-dir /tmp/conversion --out benchmarks/results/conversion/cpu.json
    python -m benchmarks.bench_conversion --num-layers 4 --work-dir /tmp/conversion   # a smaller run

Each step runs as a process of its own and is measured from outside:

1. ``write``: a random checkpoint of Llama-3.1-8B's shape (d=4096, 32 layers, 32 heads /
   8 KV heads, FFN 14336, vocabulary 128256; ``--num-layers`` fewer), bf16, as Hugging
   Face ships it: safetensors shards of at most 5 GB and an index. The names and shapes
   are those of transformers' ``LlamaForCausalLM`` (built on the meta device).
2. ``hf-to-mcore``: ``mhar-convert hf-to-mcore --variant delta`` with the
   ``cpt_8b_mhar_delta`` recipe's routing (8 heads, blocks of 4 layers) and sequence length.
3. ``mcore-to-hf``: ``mhar-convert mcore-to-hf`` of that checkpoint.
4. ``verify``: every tensor of the export equals the source's bitwise; the routing
   tensors hold their identity values.
5. ``first-step``: :func:`check_first_step`, the recipe's first step on the converted
   checkpoint as far as a CPU allows.

Peak memory is reported twice: the largest sum of proportional set sizes (PSS) over the
step's process tree, sampled every 50 ms (Megatron's checkpoint writer forks processes
that share the parent's pages, which a sum of RSS would count twice), and the largest
peak RSS of a single process of the tree (``getrusage`` of the reaped step). Each comes
with its anonymous part (``Pss_Anon`` of ``smaps_rollup``, ``RssAnon`` of ``status``,
sampled): resident memory also holds file pages mapped into the processes (the source
safetensors a tensor still views, the libraries), which an idle machine keeps resident
and a loaded one drops and reads again; anonymous memory is what no file backs. The
target of both conversions is at most 1.3x the bf16 weights for the total figures (as an
idle machine sees them): tensors stream, no whole copy is made.
Results of several ``--num-layers`` go into one report, one entry per layer count (each
with its commit and command; the top level names the latest).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from benchmarks.common import ROOT, check_out, command, commit, machine, versions, write_json

LLAMA_31_8B = dict(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
    max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)
"""Llama-3.1-8B's config.json fields (Marin-8B, the start of ``cpt_8b_mhar_delta``, is one)."""

RECIPE = "cpt_8b_mhar_delta"
TARGET_RATIO = 1.3
"""Largest peak memory of a conversion, in bf16 weights."""
SHARD_BYTES = 5 * 10**9
"""Shards of the written checkpoint: at most 5 GB, as Hugging Face's Llama-3.1-8B."""
SAMPLE_S = 0.05
GIB = 2**30


# ---------------------------------------------------------------- the steps' work


def llama_config(num_layers: int, **fields):
    """Llama-3.1-8B's config with ``num_layers`` layers (``fields`` replace others)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**LLAMA_31_8B, "num_hidden_layers": num_layers, **fields}, dtype="bfloat16")


def write_checkpoint(config, out_dir: Path, max_shard_bytes: int = SHARD_BYTES, seed: int = 0) -> int:
    """A random bf16 checkpoint of ``config``'s LlamaForCausalLM in ``out_dir``, one tensor
    at a time (matrices N(0, 0.02^2), norms 1 + N(0, 0.02^2)); returns its bytes."""
    from transformers import LlamaForCausalLM

    from megatron_mhar.conversion.hf_io import ShardWriter

    with torch.device("meta"):
        shapes = [(name, tuple(p.shape)) for name, p in LlamaForCausalLM(config).named_parameters()]
    out_dir.mkdir(parents=True)
    config.save_pretrained(out_dir)
    generator = torch.Generator().manual_seed(seed)
    writer = ShardWriter(out_dir, max_shard_bytes)
    total = 0
    for name, shape in shapes:
        tensor = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=generator)
        if len(shape) == 1:
            tensor += 1
        writer.add(name, tensor)
        total += tensor.numel() * tensor.element_size()
    writer.close()
    return total


def delta_block_layers(num_layers: int) -> int:
    """The recipe's blocks of 4 layers, or fewer in a model of fewer layers."""
    return min(4, num_layers)


def verify_export(source: Path, export: Path) -> Dict:
    """Every tensor of ``export`` against ``source``, one at a time: the base weights
    bitwise equal, the routing tensors (which ``source`` lacks) at their identity values."""
    from megatron_mhar.conversion.hf_io import SafetensorsReader

    original, exported = SafetensorsReader(source), SafetensorsReader(export)
    missing = sorted(set(original.keys()) - set(exported.keys()))
    if missing:
        raise AssertionError(f"the export lacks {missing[:4]}")
    routing = 0
    for name in exported.keys():
        tensor = exported(name)
        if name in original:
            if not torch.equal(tensor, original(name)):
                raise AssertionError(f"{name} differs from the source")
            continue
        if "_router." not in name:
            raise AssertionError(f"the export holds {name}, which is neither in the source nor a routing tensor")
        identity = 1.0 if name.endswith("norm_weight") else 0.0  # queries, null sources, gates: 0
        if not bool((tensor == identity).all()):
            raise AssertionError(f"routing tensor {name} is not at its identity value {identity}")
        routing += 1
    return {"base_tensors_equal": len(original.keys()), "routing_tensors_at_identity": routing}


def check_first_step(checkpoint: Path, hf_dir: Path, recipe_overrides: List[str], tokens: int = 16) -> Dict:
    """The first step of the ``cpt_8b_mhar_delta`` recipe on ``checkpoint``, without the
    optimizer (whose fp32 state alone is 6x the bf16 weights):

    * the recipe (with ``recipe_overrides``) names ``checkpoint`` in ``checkpoint.load``
      with ``load_model_only``, and the driver's check of its model and mhar sections
      against the checkpoint's passes;
    * the checkpoint is of step 0 and holds no optimizer state, so the driver loads weights only;
    * the recipe's model, built as the driver builds it (at TP=1 on the CPU), loads every
      tensor of the checkpoint; they equal the source's (HF ``hf_dir``) and the routing
      parameters hold their identity values;
    * a forward pass of ``tokens`` tokens gives finite logits.

    The weights load in place one stored tensor at a time (``megatron_mhar.checkpoint.streaming.load_into``):
    Megatron's own whole-model load also holds every SwiGLU weight twice over, more than
    a 24 GB machine has at 8B.
    """
    import dataclasses

    from megatron.core import dist_checkpointing

    from megatron_mhar.checkpoint.format import check_config, find_checkpoint, reading
    from megatron_mhar.checkpoint.streaming import global_name, load_into
    from megatron_mhar.conversion import hf_io, mapping
    from megatron_mhar.models.builder import build_gpt_model
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env
    from megatron_mhar.training.model import transformer_config
    from megatron_mhar.training.recipes import load_config

    cfg = load_config(RECIPE, [f"checkpoint.load={checkpoint}", *recipe_overrides])
    if not cfg.checkpoint.load_model_only:
        raise AssertionError(f"{RECIPE} must set checkpoint.load_model_only: a converted checkpoint has no optimizer")
    found = find_checkpoint(Path(checkpoint))
    common = check_config(found, cfg.to_dict())
    with reading(found):
        stored = dist_checkpointing.load_tensors_metadata(str(found))
    optimizer = sorted(key for key in stored if key.startswith("optimizer"))
    if common["iteration"] != 0 or optimizer:
        raise AssertionError(f"{found}: iteration {common['iteration']}, optimizer state {optimizer[:4]}")

    initialize_model_parallel_from_env(tp=1, pp=1, device="cpu", create_gloo_process_groups=False)
    try:
        single = dataclasses.replace(cfg, parallel=dataclasses.replace(
            cfg.parallel, tensor_model_parallel_size=1, sequence_parallel=False))
        config = dataclasses.replace(transformer_config(single, on_cpu=True), perform_initialization=False)
        model = build_gpt_model(cfg.model, cfg.mhar, config).eval()
        start = time.perf_counter()
        load_into(model, found)
        load_s = time.perf_counter() - start
        reader, shapes = hf_io.SafetensorsReader(hf_dir), mapping.Shapes.of(cfg.model)
        for local, param in model.named_parameters():
            name = global_name(model, local)
            if mapping.is_mhar_param(name):
                identity = 1.0 if name.endswith("norm_weight") else 0.0
                equal = bool((param == identity).all())
            else:
                equal = torch.equal(param, mapping.megatron_tensor(name, reader, shapes).to(param.dtype))
            if not equal:
                raise AssertionError(f"{name} of the recipe's model differs from the source after loading")
        ids = torch.randint(0, cfg.model.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits = model(ids, torch.arange(tokens).unsqueeze(0), None)
        if not bool(torch.isfinite(logits).all()):
            raise AssertionError("the recipe's model gives non-finite logits on the converted weights")
        return {
            "recipe": RECIPE, "config_matches": True, "iteration": common["iteration"],
            "optimizer_state": False, "parameters": sum(p.numel() for p in model.parameters()),
            "load_s": round(load_s, 2), "weights_equal_source": True, "logits_finite": True,
        }
    finally:
        destroy()


# ---------------------------------------------------------------- measuring a step


def _kib_fields(path: str, names) -> Dict[str, int]:
    """The ``Name: <n> kB`` fields ``names`` of a /proc file (0 for a process that ended
    between listing and reading)."""
    found = dict.fromkeys(names, 0)
    try:
        with open(path) as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in found:
                    found[name] = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return found


class TreeMemory(threading.Thread):
    """Samples, until stopped, the summed PSS of a process and its descendants and its
    anonymous part, and the largest anonymous RSS of one of them."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        import psutil

        self.root = psutil.Process(pid)
        self.peak_kib = 0
        self.peak_anon_kib = 0
        self.peak_rss_anon_kib = 0
        self.samples = 0
        self._done = threading.Event()

    def run(self) -> None:
        import psutil

        while not self._done.is_set():
            try:
                pids = [self.root.pid] + [child.pid for child in self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            pss = [_kib_fields(f"/proc/{pid}/smaps_rollup", ("Pss", "Pss_Anon")) for pid in pids]
            self.peak_kib = max(self.peak_kib, sum(p["Pss"] for p in pss))
            self.peak_anon_kib = max(self.peak_anon_kib, sum(p["Pss_Anon"] for p in pss))
            self.peak_rss_anon_kib = max([self.peak_rss_anon_kib] + [
                _kib_fields(f"/proc/{pid}/status", ("RssAnon",))["RssAnon"] for pid in pids])
            self.samples += 1
            self._done.wait(SAMPLE_S)

    def stop(self) -> None:
        self._done.set()
        self.join()


def _shown(part: str) -> str:
    """A command's word as the report shows it (``python`` for this interpreter)."""
    return "python" if part == sys.executable else part


def measure(command: List[str], log: Path) -> Dict:
    """Run ``command`` (output to ``log``); its wall time and peak memory (the process tree's
    summed PSS, sampled, and the largest RSS of one of its processes, each with its
    anonymous part), or an error."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        sampler = TreeMemory(proc.pid)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.stop()
    result = {
        "command": " ".join(_shown(part) for part in command),
        "wall_s": round(time.perf_counter() - start, 2),
        "peak_tree_pss_gib": round(sampler.peak_kib / 2**20, 3),
        "peak_tree_anon_pss_gib": round(sampler.peak_anon_kib / 2**20, 3),
        "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3),
        "peak_rss_anon_gib": round(sampler.peak_rss_anon_kib / 2**20, 3),
        "memory_samples": sampler.samples,
    }
    if proc.returncode != 0:
        result["error"] = f"exit code {proc.returncode}; see {log}: " + log.read_text()[-2000:]
    return result


# ---------------------------------------------------------------- the run


def _phase_command(phase: str, args: argparse.Namespace) -> List[str]:
    return [sys.executable, "-m", "benchmarks.bench_conversion", "--phase", phase, "--work-dir",
            str(args.work_dir), "--num-layers", str(args.num_layers)]


def run(args: argparse.Namespace) -> Dict:
    """Every step at ``args.num_layers`` layers in ``args.work_dir``; the run's report entry."""
    work = Path(args.work_dir) / f"layers{args.num_layers}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    blocks = delta_block_layers(args.num_layers)
    convert = [sys.executable, "-m", "megatron_mhar.conversion.cli"]
    steps = {
        "write": _phase_command("write", args),
        "hf_to_mcore": convert + ["hf-to-mcore", "--hf-dir", str(work / "hf"), "--out", str(work / "mcore"),
                                  "--variant", "delta", "--num-heads", "8", "--delta-block-layers", str(blocks),
                                  "--seq-length", "4096"],
        "mcore_to_hf": convert + ["mcore-to-hf", "--ckpt", str(work / "mcore"), "--out", str(work / "hf_out")],
        "verify": _phase_command("verify", args),
        "first_step": _phase_command("first-step", args),
    }
    entry: Dict = {"num_layers": args.num_layers, "delta_block_layers": blocks, "steps": {}}
    for name, command in steps.items():
        print(f"[{args.num_layers} layers] {name}: {' '.join(command)}", flush=True)
        result = measure(command, work / f"{name}.log")
        result_file = work / f"{name}.json"
        if result_file.is_file():
            result["result"] = json.loads(result_file.read_text())
        entry["steps"][name] = result
        print(f"    {json.dumps({k: v for k, v in result.items() if k != 'command'})[:600]}", flush=True)
        if "error" in result:
            break
    weights = entry["steps"]["write"].get("result", {}).get("weights_bytes")
    if weights:
        entry["weights_gib"] = round(weights / GIB, 3)
        for name in ("hf_to_mcore", "mcore_to_hf"):
            step = entry["steps"].get(name)
            if step and "error" not in step:
                peak = max(step["peak_tree_pss_gib"], step["peak_rss_gib"])
                step["peak_over_weights"] = round(peak * GIB / weights, 3)
                anon = max(step["peak_tree_anon_pss_gib"], step["peak_rss_anon_gib"])
                step["anon_peak_over_weights"] = round(anon * GIB / weights, 3)
        ratios = [entry["steps"][n].get("peak_over_weights") for n in ("hf_to_mcore", "mcore_to_hf")
                  if n in entry["steps"]]
        entry["meets_target"] = len(ratios) == 2 and None not in ratios and max(ratios) <= TARGET_RATIO
    if not args.keep:
        for name in ("hf", "mcore", "hf_out"):
            shutil.rmtree(work / name, ignore_errors=True)
    return entry


def run_phase(phase: str, args: argparse.Namespace) -> None:
    """One step inside its own process; its result goes to ``<step>.json`` in the run's directory."""
    work = Path(args.work_dir) / f"layers{args.num_layers}"
    if phase == "write":
        result = {"weights_bytes": write_checkpoint(llama_config(args.num_layers), work / "hf")}
        result["shards"] = sorted(p.name for p in (work / "hf").glob("*.safetensors"))
    elif phase == "verify":
        result = verify_export(work / "hf", work / "hf_out")
    else:
        overrides = [f"model.num_layers={args.num_layers}",
                     f"mhar.delta_block_layers={delta_block_layers(args.num_layers)}"]
        result = check_first_step(work / "mcore", work / "hf", overrides)
    (work / f"{phase.replace('-', '_')}.json").write_text(json.dumps(result, indent=1))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, default=32, help="decoder layers (default 32, Llama-3.1-8B's)")
    parser.add_argument("--work-dir", type=Path, required=True,
                        help="where the checkpoints are written (three times the bf16 weights on disk)")
    parser.add_argument("--out", help="JSON report to write or add this run to")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints in --work-dir")
    parser.add_argument("--phase", choices=("write", "verify", "first-step"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.num_layers < 1:
        parser.error(f"--num-layers must be >= 1, got {args.num_layers}")
    if args.phase:
        run_phase(args.phase, args)
        return 0
    check_out(parser, args.out)
    entry = {"commit": commit(), "command": command("benchmarks.bench_conversion", argv), **run(args)}
    if args.out:
        report = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
        runs = [r for r in report.get("runs", []) if r.get("num_layers") != args.num_layers]
        report.update({
            "benchmark": "conversion", "commit": entry["commit"], "command": entry["command"],
            "machine": machine("cpu"), "versions": versions("safetensors", "transformers"),
            "target_peak_over_weights": TARGET_RATIO,
            "runs": sorted(runs + [entry], key=lambda r: r["num_layers"]),
        })
        write_json(args.out, report)
    failed = [name for name, step in entry["steps"].items() if "error" in step]
    return 1 if failed or not entry.get("meets_target") else 0


if __name__ == "__main__":
    sys.exit(main())
