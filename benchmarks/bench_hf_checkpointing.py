"""Memory of one training step of the transformers MHAR models, with and without activation checkpointing.

    python -m benchmarks.bench_hf_checkpointing --out benchmarks/results/hf_checkpointing/cpu.json

Each model has the paper's 100M shape (Qwen3 with q/k norms: 12 layers, width 512, 8 heads
/ 4 KV heads, FFN 1536, the Qwen3 vocabulary of 151,936), random weights, fp32, plain
(``Qwen3ForCausalLM``, the reference) or MHAR (``MHARQwen3ForCausalLM``: full H = 8, block
of 8 sublayers, delta over blocks of 4 layers). One training step is the forward and
backward pass of a causal-LM loss on one sequence of ``--seq`` tokens, in train mode, with
transformers' ``gradient_checkpointing_enable`` off or on (``use_reentrant`` as given).
Each model and mode runs in a process of its own, so that no allocation of another run
is counted.

Reported per model and mode:

* ``saved_for_backward_mib``: the bytes of the distinct tensors autograd holds for the
  backward pass when the forward ends (counted by a ``saved_tensors_hooks`` pair around the
  step, storages counted once): the activation memory checkpointing trades for
  recomputation. Parameters are left out (they are held anyway).
* ``peak_rss_increase_mib``: the process's peak resident memory (``ru_maxrss``) during
  the step less its resident memory before it (model built, gradients not yet allocated):
  what the step costs the machine, allocator included.
* ``step_s``: the step's wall time (recomputation costs one more forward of each layer).

and, per model, the ratio of each figure with checkpointing to the one without.
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

from benchmarks.common import ROOT, check_out, command, write_json
from megatron_mhar.checkpoint.format import code_provenance

ARCHITECTURE = dict(hidden_size=512, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=64, intermediate_size=1536, vocab_size=151936, rms_norm_eps=1e-6,
                    tie_word_embeddings=True, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                    attention_dropout=0.0)
MODELS = {
    "plain": None,
    "mhar_full": dict(mhar_variant="full", mhar_num_heads=8),
    "mhar_block": dict(mhar_variant="block", mhar_num_heads=8, mhar_block_size=8),
    "mhar_delta": dict(mhar_variant="delta", mhar_num_heads=8, mhar_delta_block_layers=4),
}
MODES = ("off", "checkpointing")
MIB = 2**20


def build(name: str, architecture: dict):
    """A model of ``MODELS[name]`` with random weights (its routing parameters included)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_mhar.hf import MHARQwen3Config, MHARQwen3ForCausalLM

    fields = MODELS[name]
    torch.manual_seed(0)
    if fields is None:
        model = Qwen3ForCausalLM(Qwen3Config(**architecture))
    else:
        model = MHARQwen3ForCausalLM(MHARQwen3Config(**architecture, **fields))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model.train()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_step(name: str, mode: str, seq: int, reentrant: bool, architecture: dict) -> dict:
    """One model's training step in this process: the figures the module docstring lists."""
    model = build(name, architecture)
    if mode == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, architecture["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    before, wall = _rss_bytes(), time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens, labels=tokens, use_cache=False).loss
    held = sum(saved.values())
    loss.backward()
    wall = time.perf_counter() - wall
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"saved_for_backward_mib": held / MIB, "peak_rss_increase_mib": (peak - before) / MIB,
            "step_s": wall, "loss": loss.item(),
            "grad_norm": torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--seq", type=int, default=1024, help="tokens of the training sequence")
    parser.add_argument("--layers", type=int, default=ARCHITECTURE["num_hidden_layers"], help="decoder layers")
    parser.add_argument("--hidden", type=int, default=ARCHITECTURE["hidden_size"],
                        help="width (heads and FFN keep the 100M shape's)")
    parser.add_argument("--vocab", type=int, default=ARCHITECTURE["vocab_size"], help="vocabulary size")
    parser.add_argument("--reentrant", action="store_true", help="use_reentrant=True (default: False)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--out", help="JSON report path")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    architecture = dict(ARCHITECTURE, num_hidden_layers=args.layers, hidden_size=args.hidden,
                        head_dim=args.hidden // ARCHITECTURE["num_attention_heads"], vocab_size=args.vocab)
    torch.set_num_threads(args.threads)
    if args.child:  # one model and mode, in a process of its own
        print(json.dumps(one_step(*args.child, args.seq, args.reentrant, architecture)))
        return 0
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")

    import transformers

    child = [sys.executable, "-m", "benchmarks.bench_hf_checkpointing", "--seq", str(args.seq), "--layers", str(args.layers),
               "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--threads", str(args.threads)]
    child += ["--reentrant"] * args.reentrant
    report = {
        "commit": code_provenance()["commit"] or "unknown",
        "command": command("benchmarks.bench_hf_checkpointing", argv),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "cpu": platform.processor() or platform.machine(),
                        "threads": args.threads},
        "args": vars(args),
        "architecture": architecture,
        "models": {name: MODELS[name] for name in models},
        "results": {},
    }
    for name in models:
        entry = {}
        for mode in MODES:
            done = subprocess.run(child + ["--child", name, mode], capture_output=True, text=True, check=True,
                                  cwd=ROOT)
            entry[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        for figure in ("saved_for_backward_mib", "peak_rss_increase_mib", "step_s"):
            entry[f"{figure}_ratio"] = entry["checkpointing"][figure] / entry["off"][figure]
        report["results"][name] = entry
        print(f"{name:11s} saved for backward {entry['off']['saved_for_backward_mib']:8.1f} -> "
              f"{entry['checkpointing']['saved_for_backward_mib']:7.1f} MiB | peak RSS +"
              f"{entry['off']['peak_rss_increase_mib']:8.1f} -> +{entry['checkpointing']['peak_rss_increase_mib']:7.1f} "
              f"MiB | step {entry['off']['step_s']:6.1f} -> {entry['checkpointing']['step_s']:6.1f} s")
        if args.out:  # after each model: a run cut short keeps what it measured
            write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
