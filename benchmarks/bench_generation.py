"""Generation speed of the transformers MHAR models on CPU: KV cache vs full recomputation.

    python -m benchmarks.bench_generation --out benchmarks/results/generation/cpu.json

Each model is the smoke recipe's architecture (Qwen3 with q/k norms: 4 layers, width
128, 4 heads / 2 KV heads, FFN 384, vocabulary 4096) with random weights, plain
(``Qwen3ForCausalLM``) or MHAR (``MHARQwen3ForCausalLM``: full H = 8, block of 4
sublayers, delta over blocks of 1 layer). Each generates ``--new-tokens`` greedy tokens
after a ``--prompt``-token prompt, batch 1, with transformers' dynamic KV cache
(``kv_cache``) and with ``use_cache=False`` (``recompute``: every step reruns the whole
sequence). Rounds interleave the models and modes, so load on the machine falls on all
of them alike; each figure is the median over rounds of new tokens per second (prefill
included), by the process's CPU time (one thread: the work done, which other processes
on a shared machine barely change) and by the wall clock.

Reported: tokens per CPU second and per wall second for each model and mode, and from the
CPU-time figures the cache's speed-up over recomputation and the MHAR-vs-plain decode
overhead (the plain model's KV-cache tokens/s over the MHAR model's).
"""

import argparse
import os
import statistics
import sys
import time

import torch

from benchmarks.common import check_out, command, commit, machine, versions, write_json

ARCHITECTURE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, intermediate_size=384, vocab_size=4096, rms_norm_eps=1e-6,
                    tie_word_embeddings=True, max_position_embeddings=4096, bos_token_id=None,
                    eos_token_id=None)
MODELS = {
    "plain": None,
    "mhar_full": dict(mhar_variant="full", mhar_num_heads=8),
    "mhar_block": dict(mhar_variant="block", mhar_num_heads=8, mhar_block_size=4),
    "mhar_delta": dict(mhar_variant="delta", mhar_num_heads=8, mhar_delta_block_layers=1),
}
MODES = ("kv_cache", "recompute")


def build(name: str, seed: int = 0):
    """A model of ``MODELS[name]`` with random weights (routing parameters included)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_mhar.hf import MHARQwen3Config, MHARQwen3ForCausalLM

    fields = MODELS[name]
    if fields is None:
        model = Qwen3ForCausalLM(Qwen3Config(**ARCHITECTURE))
    else:
        model = MHARQwen3ForCausalLM(MHARQwen3Config(**ARCHITECTURE, **fields))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model.eval()


def tokens_per_second(model, prompt: torch.Tensor, new_tokens: int, mode: str):
    """(new tokens per CPU second of this process, per wall second) of one generation."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         use_cache=mode == "kv_cache", pad_token_id=0)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return new_tokens / cpu, new_tokens / wall


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per run")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", help="JSON report path")
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    if "plain" not in models:
        parser.error("--models must include plain (the overhead is measured against it)")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    built = {name: build(name) for name in models}
    prompt = torch.randint(1, ARCHITECTURE["vocab_size"], (1, args.prompt))
    for name, model in built.items():  # warm-up round
        for mode in MODES:
            tokens_per_second(model, prompt, min(args.new_tokens, 16), mode)
    timings = {name: {mode: [] for mode in MODES} for name in models}
    for _ in range(args.rounds):
        for name, model in built.items():
            for mode in MODES:
                timings[name][mode].append(tokens_per_second(model, prompt, args.new_tokens, mode))

    results = {}
    cpu = {name: {mode: [c for c, _ in timings[name][mode]] for mode in MODES} for name in models}
    wall = {name: {mode: [w for _, w in timings[name][mode]] for mode in MODES} for name in models}
    plain = statistics.median(cpu["plain"]["kv_cache"])
    for name in models:
        median = {mode: statistics.median(cpu[name][mode]) for mode in MODES}
        results[name] = {
            **{f"{mode}_tokens_per_cpu_s": median[mode] for mode in MODES},
            **{f"{mode}_tokens_per_cpu_s_all": cpu[name][mode] for mode in MODES},
            **{f"{mode}_tokens_per_s": statistics.median(wall[name][mode]) for mode in MODES},
            **{f"{mode}_tokens_per_s_all": wall[name][mode] for mode in MODES},
            "cache_speedup": median["kv_cache"] / median["recompute"],
            "decode_overhead_vs_plain": plain / median["kv_cache"],
        }
        print(f"{name:11s} kv_cache {median['kv_cache']:8.1f} tok/cpu-s | recompute {median['recompute']:7.1f} "
              f"tok/cpu-s | cache x{results[name]['cache_speedup']:.2f} | overhead vs plain "
              f"x{results[name]['decode_overhead_vs_plain']:.2f}")
    report = {
        "commit": commit(),
        "command": command("benchmarks.bench_generation", argv),
        "environment": {
            **versions("transformers"), **machine("cpu"), "threads": torch.get_num_threads(),
            "load_average_at_end": list(os.getloadavg()),
        },
        "args": vars(args),
        "architecture": ARCHITECTURE,
        "models": {name: MODELS[name] for name in models},
        "results": results,
    }
    if args.out:
        write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
