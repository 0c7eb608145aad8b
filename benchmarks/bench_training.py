"""End-to-end training throughput of the training driver: plain Megatron GPT vs AttnRes (H=1) vs MHAR (H=8).

    python -m benchmarks.bench_training      # writes benchmarks/results/training/<device>.json
    python -m benchmarks.bench_training --sizes tiny --steps 2 --out /tmp/tiny.json   # CPU smoke
    python -m benchmarks.bench_training --sizes 350m_moe --models baseline,mhar,mhar_block   # MoE
    python -m tools.perf.base_kernels HEAD~1 /tmp/mhar_base    # another revision's kernels, then:
    python -m benchmarks.bench_training --base-kernels /tmp/mhar_base --cuda-graph full_iteration \\
        --models baseline,mhar_lookahead,mhar_lookahead@kernels=base --out /tmp/ab.json

Every model is the training driver's, built and stepped by it: the size's recipe
(``benchmarks.common.SIZE_RECIPES``: the paper's configurations, ``recipes/base/scale_*.yaml``;
``tiny`` is ``smoke_cpu``; ``350m_moe`` is the 350M recipe with every MLP Megatron's MoE
layer of 8 experts top-2, each expert half the dense MLP's width, so a token's MLP FLOPs are
the dense model's; ``tiny_moe`` is ``smoke_cpu_moe``) with the model's routing as its ``mhar`` section, loaded by
``megatron_mhar.training.recipes`` and checked by its launch checks; one
``megatron_mhar.training.loop.Trainer`` per model (the TransformerConfig, model chunks and
DDP of ``training/model.py``, Megatron's optimizer with fp32 main weights and its
scheduler, the data path, the schedule and, with ``--cuda-graph``, its full-iteration
graph); a timed step is ``Trainer.train_step``. The models train on one GPU at the paper's
per-GPU micro-batch and gradient-accumulation counts (the recipes' global batch on one
rank), on random ids written with the project's indexed writer (``benchmarks.common``'s
stand-in tokenizer). ``--spec`` picks the layers of every model (``model.spec``:
``transformer_engine``, the default where TE imports on a GPU, with the fused kernels
Megatron-LM trains with, or ``local``); ``--no-fusions`` leaves those kernels out
(``model.fused_kernels``); ``--precision fp8`` is ``training.precision: fp8``. On CPU the
models train in fp32.

Timing is interleaved, because the steps are host-bound and the host's speed drifts
(~10% over a run on the H200): timing the models one after another would fold that
drift into their ratios. All models of a size are built and stay resident; then, in
each of ``--steps`` rounds, one step of every model is timed, round r starting at model
r % M so that no model always runs first. Reported per model: tokens/s and
``throughput_ratio`` from the median step time, and ``throughput_ratio_rounds``, the
baseline's step time over the model's in each round (with its median), which cancels
drift slower than a round; for AttnRes the same two against MHAR.

Peak memory is per model although all are resident: before building a model the
allocated bytes are read and the peak counter is reset; the model is built and runs its
warmup steps (the first step creates the optimizer states) while the models built before
it sit idle at constant size, so the peak minus the reading is this model's own:
parameters, grad buffers, optimizer states, activations. cuBLAS workspaces are created
before the first reading so that no model is charged for them.

Also reported: the baseline's MFU, memory ratios to the baseline, and, after the timed
rounds, per model the forward and backward of one micro-batch timed apart (as issued by
the host and as completed: ``micro_batch_host_split``) and one profiled step, run eagerly
also under graphs, that splits CUDA time into the routing kernels' forward and backward
and everything else, next to the step's wall time (their ratio shows how far the host, not
the GPU, bounds the step), and one profiled micro-batch's host time by operator and CUDA
runtime call (``host_profile``).

A model marked ``@kernels=base`` trains on the ``mhar_kernels`` tree of ``--base-kernels``
(``tools/perf/base_kernels.py`` writes one from a git revision) beside the same model on
this checkout's kernels, which reports ``throughput_vs_base_kernels`` (above 1: this
checkout's kernels are faster) and its median over the rounds. The report names both
trees (revision and a hash of their files); such a run is no report of record.
"""

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import common

SIZES = {**{size: common.SIZE_RECIPES[size] for size in common.PAPER_SIZES}, "tiny": "smoke_cpu",
         "350m_moe": common.SIZE_RECIPES["350m"], "tiny_moe": "smoke_cpu_moe",
         "8b_delta": common.SIZE_RECIPES["8b"]}
"""The sizes this benchmark trains: the paper's three, ``smoke_cpu``'s tiny model (CPU smoke),
the MoE cases (``350m_moe``, ``smoke_cpu_moe``) and the continued-pretraining case
``8b_delta`` (:data:`SIZE_OVERRIDES`)."""
SIZE_OVERRIDES = {
    "350m_moe": ["model.num_moe_experts=8", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=2048",
                 "model.moe_aux_loss_coeff=1.0e-2", "model.moe_router_dtype=fp32"],
    # Llama-3.1-8B's layer shape, sequence length and the recipe's routing on one GPU: no
    # tensor parallelism, no converted checkpoint, 8 sequences of 4096 per step (the 1B
    # case's 32,768 tokens), no recomputation and no overlapped gradient reduction (one GPU
    # has nothing to overlap, and full-iteration graphs refuse both); the depth is what
    # fits (``layers_that_fit``).
    "8b_delta": ["checkpoint.load=null", "checkpoint.load_model_only=false", "parallel.tensor_model_parallel_size=1",
                 "parallel.sequence_parallel=false", "parallel.overlap_grad_reduce=false",
                 "parallel.overlap_param_gather=false", "training.global_batch_size=8",
                 "training.recompute_granularity=null", "data.paths=[unset]", "data.tokenizer=unset"],
}
"""The recipe overrides that make a size's case (every model of the size): an MoE model of
the 350M recipe, the 8B recipe on one GPU."""
GPU_ONLY_SIZES = ("350m_moe", "8b_delta")
ONE_AT_A_TIME = ("8b_delta",)
"""Sizes whose models are built, timed and freed one after another (two 8B-shape models
side by side would halve the depth that fits); their ratios then fold in the host's drift
between the models (small: the graphed step is GPU-bound)."""
MEMORY_SHARE = 0.85
"""Share of the GPU's memory the resident models of ``8b_delta`` may take by the driver's
memory estimate (the rest: allocator fragmentation, cuBLAS and NCCL workspaces, graphs)."""


def size_recipe(size: str, overrides=()):
    """The TrainConfig of ``size``: its recipe with :data:`SIZE_OVERRIDES`, then ``overrides``."""
    from megatron_mhar.training.recipes import load_config

    return load_config(SIZES[size], [*SIZE_OVERRIDES.get(size, []), *overrides])


def layers_that_fit(size: str, models: int, memory_bytes: float) -> int:
    """The most decoder layers (whole delta blocks, at most the recipe's) for which ``models``
    resident models of ``size`` take at most :data:`MEMORY_SHARE` of ``memory_bytes`` by the
    driver's memory estimate (``training.memory``, the delta model's: its history is the
    larger)."""
    from megatron_mhar.training.memory import estimate_memory

    cfg = size_recipe(size)
    step = cfg.mhar.delta_block_layers
    fits = 0
    for layers in range(step, cfg.model.num_layers + 1, step):
        trial = size_recipe(size, [f"model.num_layers={layers}"])
        if models * estimate_memory(trial, 1).total > MEMORY_SHARE * memory_bytes:
            break
        fits = layers
    if not fits:
        raise ValueError(f"{models} models of {size} with {step} layers do not fit "
                         f"{memory_bytes / 2**30:.0f} GiB; train fewer models at once")  # fmt: skip
    return fits

SPECS = ("local", "transformer_engine")  # the resolved values of model.spec
PRECISIONS = ("bf16", "fp8")
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}
BASE_KERNELS = "kernels=base"
"""A ``--models`` entry's token that runs the model with ``--base-kernels``' tree."""
EXTRA_STEPS = 4
"""Data beyond the warmup and timed steps: the micro-batches of the host split, the profiled
step and the host profile."""


def flops_per_token(model, vocab: int) -> float:
    """Training FLOPs per token: 6 x matmul params + causal attention (fwd + bwd); an MoE
    layer counts the router and the ``moe_router_topk`` experts a token passes through."""
    d, layers, seq = model.hidden_size, model.num_layers, model.seq_length
    kv_dim = d // model.num_attention_heads * (model.num_query_groups or model.num_attention_heads)
    ffn = model.ffn_hidden_size
    glu = 3 if model.swiglu else 2
    attention_params = d * (d + 2 * kv_dim) + d * d
    moe = sum(model.moe_layer_pattern())
    expert = (model.moe_ffn_hidden_size or ffn) if model.is_moe else 0
    mlp_params = ((layers - moe) * d * ffn * glu
                  + moe * (model.moe_router_topk * d * expert * glu + d * (model.num_moe_experts or 0)))
    matmul_params = layers * attention_params + mlp_params + vocab * d
    attention = 6 * layers * seq * d  # 12 L s d for QK^T and AV, halved by the causal mask
    return 6 * matmul_params + attention


# ------------------------------------------------------------------ the runs' configurations


def split_kernels(spec: str):
    """(the ``--models`` entry without its ``@kernels=base`` token, whether it had one)."""
    name, *tokens = spec.split("@")
    bad = [t for t in tokens if t.startswith("kernels=") and t != BASE_KERNELS]
    if bad:
        raise ValueError(f"model {spec!r}: {bad[0]!r}: the kernels token takes only base "
                         f"(the --base-kernels tree)")  # fmt: skip
    kept = [t for t in tokens if t != BASE_KERNELS]
    return "@".join([name, *kept]), len(kept) != len(tokens)


def size_overrides(args, size: str, device: str, work: Path, data: dict) -> list:
    """The recipe overrides every model of ``size`` shares: the device, layers, precision and
    graphs asked for, the random data and its stand-in tokenizer, steps enough for the
    benchmark (the recipe's learning-rate schedule kept: these are its first steps), no
    evaluation or event file."""
    precision = args.precision if device == "cuda" else "fp32"
    steps = args.warmup + args.steps + EXTRA_STEPS
    case = list(SIZE_OVERRIDES.get(size, []))
    if size in ("350m_moe", "tiny_moe"):  # all-to-all on GPUs, Megatron-LM's choice; CPUs all-gather
        case.append(f"model.moe_token_dispatcher_type={'alltoall' if device == 'cuda' else 'allgather'}")
    if size == "8b_delta":
        memory = torch.cuda.get_device_properties(0).total_memory
        resident = 1 if size in ONE_AT_A_TIME else len(args.models.split(","))
        case.append(f"model.num_layers={layers_that_fit(size, resident, memory)}")
    if args.micro_batch:
        case.append(f"training.micro_batch_size={args.micro_batch}")
    return [*case,
        f"run.device={device}", f"run.output_dir={work / 'runs'}", f"model.spec={args.spec}",
        f"model.fused_kernels={str(not args.no_fusions).lower()}", f"training.precision={precision}",
        f"training.cuda_graph={args.cuda_graph}", f"training.train_iters={steps}",
        f"optimizer.lr_decay_iters={size_recipe(size).lr_decay_iters}",
        f"data.paths=[{data['prefix']}]", f"data.tokenizer={data['tokenizer']}",
        f"data.eod_token={common.STAND_IN_EOD}", "eval.interval=0", "eval.iters=1",
        "logging.tensorboard=false", "logging.routing_entropy=false", "logging.routing_interval=0",
    ]


def model_config(size: str, name: str, mhar, overrides: list):
    """The driver's configuration of model ``name`` (routing ``mhar``) at ``size``, resolved
    and checked as ``mhar-train`` does before a launch."""
    from megatron_mhar.training.launch_checks import validate_launch, with_resolved_spec

    run_name = f"{size}_{name}".replace("@", "_").replace("=", "_")
    cfg = size_recipe(size, [*overrides, f"run.name={run_name}"])
    cfg = with_resolved_spec(dataclasses.replace(cfg, mhar=mhar))
    validate_launch(cfg, 1)
    return cfg


def write_data(size: str, work: Path, args) -> dict:
    """Random ids for every model of ``size``, written once: enough for the warmup, timed
    and extra steps and the validation split the driver builds, below the vocabulary of the
    tokenizer the recipe names (Qwen3's; a tiny model's own)."""
    cfg = size_recipe(size)
    tr, model = cfg.training, cfg.model
    vocab = min(model.vocab_size, common.QWEN3_TOKENIZER_VOCAB)
    steps = args.warmup + args.steps + EXTRA_STEPS
    tokens = int(1.1 * (steps + 1) * tr.global_batch_size * (model.seq_length + 1))
    directory = work / f"data_{size}"
    directory.mkdir(parents=True)
    written = common.write_dataset(str(directory / "random"), common.StandInTokenizer(vocab), tokens,
                                   model.seq_length, seed=0, min_documents=100)  # fmt: skip
    return {"prefix": str(directory / "random"), "tokenizer": common.stand_in_tokenizer_dir(directory, vocab),
            "documents": written["documents"], "tokens": written["tokens"], "vocab": vocab}


# ------------------------------------------------------------------ building and stepping


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _prime_cublas():
    """One bf16 linear forward and backward before any memory reading: cuBLAS takes its
    workspaces (per handle and stream, and backward runs on autograd's own thread, hence
    handle) from the caching allocator on first use and keeps them, which would charge them
    all to the first model built."""
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(64, device="cuda", dtype=torch.bfloat16)
    (torch.nn.functional.linear(x, x, bias) @ x).sum().backward()
    torch.cuda.synchronize()


def _reset_graph_inputs() -> None:
    """Drop the static input buffers of Megatron's full-iteration graphs (shared by every
    graph of the process) before graphs of other input shapes, the next size's, are captured."""
    from megatron.core.full_cuda_graph import StaticBufferLoader

    StaticBufferLoader.static_buffers = {"training": [], "validation": []}


def _timed_step(trainer, device: str):
    """(wall seconds, loss) of one optimizer step of the driver."""
    _sync(device)
    start = time.perf_counter()
    loss, _, _ = trainer.train_step()
    _sync(device)
    return time.perf_counter() - start, loss


def _build_and_warm(cfg, ctx, device: str, warmup: int, context):
    """Builds one model's Trainer and runs its warmup steps: (trainer, warmup losses, own
    peak GiB or None on CPU). The models built before stay idle, so the peak over this
    phase minus the bytes allocated before it is this model's own."""
    from megatron_mhar.training.loop import Trainer

    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with context():
        trainer = Trainer(cfg, ctx)
        losses = [_timed_step(trainer, device)[1] for _ in range(warmup)]
    if device != "cuda":
        return trainer, losses, None
    torch.cuda.synchronize()
    return trainer, losses, (torch.cuda.max_memory_allocated() - before) / 2**30


def _timed_rounds(trainers: dict, contexts: dict, device: str, steps: int):
    """{name: step times}, {name: losses} over ``steps`` rounds of one step per model;
    round r starts at model r % M so that no model always follows the same one."""
    names = list(trainers)
    times = {name: [] for name in names}
    losses = {name: [] for name in names}
    for r in range(steps):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            with contexts[name]():
                seconds, loss = _timed_step(trainers[name], device)
            times[name].append(seconds)
            losses[name].append(loss)
    return times, losses


def _micro_batch_loss(trainer, batch):
    """One micro-batch's summed token loss through the trainer's first model chunk (the
    driver's forward step without the schedule around it)."""
    model = trainer.model[0]
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return (losses.float() * batch["loss_mask"]).sum()


def _host_split(trainer, device: str, repeats: int = 3):
    """Median ms of one micro-batch's forward and of its backward, as issued (when the
    host returns) and as completed (after synchronising). Issued close to completed means
    the host bounds that phase; their difference between two models is host time."""
    batch = next(trainer.train_iterators[0])
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        loss = _micro_batch_loss(trainer, batch)
        issued = time.perf_counter()
        _sync(device)
        done = time.perf_counter()
        loss.backward()
        back_issued = time.perf_counter()
        _sync(device)
        times.append((issued - start, done - start, back_issued - done, time.perf_counter() - done))
    trainer.model[0].zero_grad_buffer()  # the next step starts from zero gradients anyway
    names = ("forward_issued_ms", "forward_ms", "backward_issued_ms", "backward_ms")
    return {name: statistics.median(column) * 1e3 for name, column in zip(names, zip(*times))}


def routing_kernel_phases():
    """{Triton kernel name of mhar_kernels: "fwd" or "bwd"} (backward: the names with
    ``bwd`` and the dquery/dnorm reductions)."""
    import importlib
    import pkgutil

    import triton

    import mhar_kernels

    phases = {}
    for info in pkgutil.walk_packages(mhar_kernels.__path__, "mhar_kernels."):
        for name, obj in vars(importlib.import_module(info.name)).items():
            if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel"):
                phases[name] = "bwd" if ("bwd" in name or "dw_reduce" in name) else "fwd"
    return phases


@contextlib.contextmanager
def _eager(trainer):
    """The trainer's steps launched eagerly (Megatron's schedule, not its graph) inside."""
    from megatron_mhar.parallel import pipeline

    graph, trainer.train_schedule = trainer.train_schedule, pipeline.forward_backward
    try:
        yield
    finally:
        trainer.train_schedule = graph


def _profile_step(trainer, top_other: int = 40):
    """CUDA time of one step (ms): routing kernels forward and backward, everything else,
    and the step's wall time (CUDA busy time / wall time < 1 means the host is the bound).
    Launched eagerly under graphs too: the kernels are the same, and each is profiled."""
    from torch.profiler import ProfilerActivity, profile

    phases = routing_kernel_phases()
    torch.cuda.synchronize()
    with _eager(trainer), profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        trainer.train_step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    totals = {"fwd": 0.0, "bwd": 0.0, "other": 0.0}
    per_kernel, other_kernels = {}, {}
    for event in prof.key_averages():
        total = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        if total <= 0 or event.key.startswith("ProfilerStep"):
            continue
        phase = phases.get(event.key, "other")
        totals[phase] += total / 1e3
        (per_kernel if phase != "other" else other_kernels)[event.key] = {"ms": total / 1e3,
                                                                          "launches": event.count}
    routing = totals["fwd"] + totals["bwd"]
    cuda = routing + totals["other"]
    return {"routing_fwd_ms": totals["fwd"], "routing_bwd_ms": totals["bwd"], "routing_ms": routing,
            "other_ms": totals["other"], "cuda_ms": cuda, "wall_ms": wall * 1e3,
            "routing_fraction": routing / max(cuda, 1e-9), "cuda_busy_fraction": cuda / (wall * 1e3),
            "routing_kernels": _by_time(per_kernel),
            # The rest's costliest kernels: what a model adds outside routing shows against the baseline's.
            "other_kernels": _by_time(other_kernels, top_other)}


def _by_time(kernels, top=None):
    return dict(sorted(kernels.items(), key=lambda kv: -kv[1]["ms"])[:top])


def _host_profile(trainer, top: int = 40):
    """Host time of one micro-batch's forward and backward by operator (profiler CPU
    events, inflated alike for every model by the profiler's per-op cost): the ops with
    the most self CPU time, and the CUDA runtime / driver calls (launches, allocations,
    synchronisations) with their counts. Where one model's host time goes beyond another's."""
    from torch.profiler import ProfilerActivity, profile

    batch = next(trainer.train_iterators[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _micro_batch_loss(trainer, batch).backward()
        torch.cuda.synchronize()
    trainer.model[0].zero_grad_buffer()
    rows = [{"name": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "cpu_total_ms": e.cpu_time_total / 1e3} for e in prof.key_averages()]
    rows.sort(key=lambda r: -r["self_cpu_ms"])
    runtime = [r for r in rows if r["name"].startswith(("cuda", "cu"))]
    return {"self_cpu_ms": sum(r["self_cpu_ms"] for r in rows),
            "ops": sum(r["count"] for r in rows if r["name"].startswith("aten::")),
            "top_self_cpu": rows[:top], "runtime_calls": runtime}


# ------------------------------------------------------------------ one size, the report


def round_ratios(reference, times):
    """Per round, reference step time / step time: a throughput ratio that cancels drift
    slower than a round, since both steps ran back to back."""
    return [ref / t for ref, t in zip(reference, times)]


def _add_ratios(results: dict, times: dict):
    base = results.get("baseline")
    if base:
        for name, entry in results.items():
            entry["throughput_ratio"] = base["step_s_median"] / entry["step_s_median"]
            rounds = round_ratios(times["baseline"], times[name])
            entry["throughput_ratio_rounds"] = rounds
            entry["throughput_ratio_round_median"] = statistics.median(rounds)
            if "peak_memory_gib" in entry:
                entry["memory_ratio"] = entry["peak_memory_gib"] / base["peak_memory_gib"]
    # AttnRes against MHAR on the same schedule ("the heads must be free").
    for attnres_name, mhar_name in (("attnres", "mhar"), ("attnres_lookahead", "mhar_lookahead")):
        if attnres_name in results and mhar_name in results:
            attnres = results[attnres_name]
            attnres["throughput_vs_mhar"] = results[mhar_name]["step_s_median"] / attnres["step_s_median"]
            attnres["throughput_vs_mhar_round_median"] = statistics.median(
                round_ratios(times[mhar_name], times[attnres_name]))
    # A model on this checkout's kernels against its twin on the base tree's.
    for name, entry in results.items():
        twin, on_base = split_kernels(name)
        if on_base and twin in results:
            mine = results[twin]
            mine["throughput_vs_base_kernels"] = entry["step_s_median"] / mine["step_s_median"]
            mine["throughput_vs_base_kernels_round_median"] = statistics.median(
                round_ratios(times[name], times[twin]))


def run_size(size: str, configs: dict, contexts: dict, ctx, args, device: str, data: dict):
    """Trains the models ``configs`` ({name: TrainConfig}) of one size, each inside its
    ``contexts`` entry; the size's report."""
    any_cfg = next(iter(configs.values()))
    model, tr = any_cfg.model, any_cfg.training
    vocab, tokens = model.padded_vocab_size(), tr.global_batch_size * model.seq_length
    results, times = {}, {}
    # The 8B-shape models are trained one at a time (each as deep as one fits alone); the
    # others stay resident and are timed interleaved.
    groups = [[name] for name in configs] if size in ONE_AT_A_TIME else [list(configs)]
    for group in groups:
        group_results, group_times = _train_group(size, {n: configs[n] for n in group}, contexts, ctx, args,
                                                  device, tokens)  # fmt: skip
        results.update(group_results)
        times.update(group_times)
    _add_ratios(results, times)
    base = results.get("baseline")
    peak = _peak_flops()
    if base and peak:
        base["mfu"] = flops_per_token(model, vocab) * base["tokens_per_s"] / peak
    case = {"name": size, "recipe": SIZES[size], "model": dataclasses.asdict(model),
            "micro_batch": tr.micro_batch_size, "num_microbatches": tr.global_batch_size // tr.micro_batch_size,
            "timing": "one model at a time" if size in ONE_AT_A_TIME else "interleaved rounds",
            "data": {k: data[k] for k in ("documents", "tokens", "vocab")}}  # fmt: skip
    return {"case": case, "flops_per_token": flops_per_token(model, vocab), "models": results}


def _train_group(size: str, configs: dict, contexts: dict, ctx, args, device: str, tokens: int):
    """Builds the models ``configs``, times them in interleaved rounds, profiles each and
    frees them: ({name: report entry}, {name: step times})."""
    if args.cuda_graph != "none":
        _reset_graph_inputs()
    trainers, warm_losses, peaks = {}, {}, {}
    for name, cfg in configs.items():
        trainers[name], warm_losses[name], peaks[name] = _build_and_warm(cfg, ctx, device, args.warmup, contexts[name])
    times, losses = _timed_rounds(trainers, contexts, device, args.steps)
    results = {}
    for name, trainer in trainers.items():
        entry = {
            "tokens_per_s": tokens / statistics.median(times[name]),
            "step_s_median": statistics.median(times[name]),
            "step_s_all": times[name],
            "losses": warm_losses[name] + losses[name],
            "params": sum(p.numel() for p in trainer.model[0].module.parameters()),
        }
        if peaks[name] is not None:
            entry["peak_memory_gib"] = peaks[name]
        with contexts[name]():
            entry["micro_batch_host_split"] = _host_split(trainer, device)
            if not args.no_profile and device == "cuda":
                entry["profile"] = _profile_step(trainer)
                entry["host_profile"] = _host_profile(trainer)
        results[name] = entry
        print(f"[{size}] {name}: {entry['tokens_per_s']:.0f} tok/s, "
              f"peak {entry.get('peak_memory_gib', 0):.1f} GiB, loss {entry['losses'][-1]:.3f}",
              flush=True)
    # Free these models before the next ones are built, so their memory readings start from
    # the same empty state (the loop variable holds the last model too).
    del trainers, trainer
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return results, times


def _peak_flops():
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def build_parser() -> argparse.ArgumentParser:
    from megatron_mhar.training.schema import CUDA_GRAPH_MODES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100m,350m,1b", help="comma list of " + ",".join(SIZES))
    parser.add_argument("--models", default="baseline,attnres,mhar",
                        help="comma list of " + ",".join(common.MODELS) + "; a name may carry "
                             "MHARConfig overrides: mhar_lookahead@lookahead_group=8, and "
                             f"@{BASE_KERNELS} to train on --base-kernels' tree")
    parser.add_argument("--steps", type=int, default=8,
                        help="timed rounds (one optimizer step per model each)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps per model (compilation, autotune, optimizer states); "
                             "the peak memory is taken over them")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="sequences per micro-batch of every model (training.micro_batch_size; "
                             "default the recipe's); the global batch stays the recipe's")
    parser.add_argument("--kernel-impl", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--logit-scale", type=float, default=1.0)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--cuda-graph", default="none", choices=CUDA_GRAPH_MODES,
                        help="full_iteration: every model's forward/backward schedule (all "
                             "micro-batches) captured once by Megatron's FullCudaGraphWrapper "
                             "and replayed, which removes the host's launch cost (CUDA only)")
    parser.add_argument("--spec", choices=SPECS, default=None,
                        help="layer spec of every model (default: transformer_engine where it "
                             "imports on a GPU, local otherwise)")
    parser.add_argument("--no-fusions", action="store_true",
                        help="with the TE spec, leave out gradient-accumulation fusion, fused "
                             "cross-entropy, RoPE and SwiGLU (to measure what they bring)")
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16",
                        help="fp8: TE's FP8 linear layers (TE spec, CUDA); the routing and "
                             "its history stay bf16")
    parser.add_argument("--base-kernels", metavar="DIR",
                        help="another revision's mhar_kernels (python -m tools.perf.base_kernels REV DIR) "
                             f"for the models marked @{BASE_KERNELS}")  # fmt: skip
    parser.add_argument("--out", default=None,
                        help="JSON report (default: benchmarks/results/training/<device>.json; "
                             "none with --base-kernels)")
    return parser


def check_args(parser, args):
    """(sizes, {entry: (MHARConfig, on the base tree)}); ``parser.error`` for options that
    cannot run."""
    from megatron_mhar.models.specs import resolve_spec

    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; choose from {list(SIZES)}")
    if len(set(sizes)) < len(sizes):
        parser.error(f"--sizes {args.sizes} names a size twice; give each once")
    gpu_only = [s for s in sizes if s in GPU_ONLY_SIZES]
    if gpu_only and not torch.cuda.is_available():
        parser.error(f"--sizes {','.join(gpu_only)} train on a GPU only; on CPU use tiny or tiny_moe")
    if args.micro_batch is not None and args.micro_batch < 1:
        parser.error(f"--micro-batch must be >= 1, got {args.micro_batch}")
    if args.cuda_graph != "none" and (not torch.cuda.is_available() or args.warmup < 2):
        parser.error("--cuda-graph needs CUDA and --warmup >= 2 (one eager step, then the "
                     "capture, both inside the warmup whose peak memory is reported)")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1: the first step creates the optimizer states, "
                     "which the peak memory (taken over the warmup) must include")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1 (the timed rounds), got {args.steps}")
    if args.spec is None:
        args.spec = resolve_spec("auto").spec
    if args.spec == "transformer_engine" and not torch.cuda.is_available():
        parser.error("--spec transformer_engine needs CUDA (Transformer Engine's layers run on "
                     "the GPU); use --spec local on CPU")
    if args.precision == "fp8" and args.spec != "transformer_engine":
        parser.error("--precision fp8 needs --spec transformer_engine (FP8 GEMMs are TE's)")
    try:
        models = {}
        for entry in args.models.split(","):
            spec, on_base = split_kernels(entry)
            models[entry] = (common.parse_model(spec), on_base)
    except ValueError as err:
        parser.error(str(err))
    on_base = [entry for entry, (_, base) in models.items() if base]
    if on_base and not args.base_kernels:
        parser.error(f"the models {on_base} are marked @{BASE_KERNELS}: give --base-kernels DIR")
    if args.base_kernels and not on_base:
        parser.error(f"--base-kernels is given but no model is marked @{BASE_KERNELS}: mark the ones to "
                     "run on its tree")
    if args.out is None and not args.base_kernels:  # an A/B is no report of record
        args.out = common.default_out("training", common.device_name())
    common.check_out(parser, args.out)
    return sizes, models


def kernel_contexts(parser, args, models: dict):
    """{entry: context factory}: the base tree's kernels for the models marked for it."""
    contexts = {entry: contextlib.nullcontext for entry in models}
    if not args.base_kernels:
        return contexts, {}
    from tools.perf import base_kernels

    try:
        tree = base_kernels.load(args.base_kernels)
    except ValueError as err:
        parser.error(str(err))
    for entry, (_, on_base) in models.items():
        if on_base:
            contexts[entry] = functools.partial(base_kernels.active, tree)
    trees = {"base": base_kernels.describe(args.base_kernels), "checkout": base_kernels.describe(common.ROOT)}
    return contexts, {"kernel_trees": trees}


def run(parser, args, sizes, models, contexts, extra=None):
    """Trains ``models`` ({entry: (MHARConfig, _)}) at each size and returns the report,
    written to ``args.out`` after every size. A configuration the driver refuses ends the
    run with its message (exit 2), as ``mhar-train`` does."""
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env
    from megatron_mhar.training import cuda_graphs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx = initialize_model_parallel_from_env(seed=1234, device=device, create_gloo_process_groups=device == "cuda",
                                             cuda_graph_rng=args.cuda_graph != "none")  # fmt: skip
    mhars = {entry: dataclasses.replace(mhar, kernel_impl=args.kernel_impl, logit_scale=args.logit_scale)
             if mhar.enabled else mhar for entry, (mhar, _) in models.items()}  # fmt: skip
    report = {"commit": common.commit(), "command": common.command("benchmarks.bench_training"),
              "args": vars(args), **(extra or {}), "sizes": {}}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="bench_training_"))
    try:
        # With CUDA graphs everything from model construction on runs on the capture stream
        # (megatron_mhar.training.cuda_graphs says why), as in the driver.
        with cuda_graphs.capture_stream(args.cuda_graph):
            if device == "cuda":  # on the stream the models run on: cuBLAS keys its workspaces by stream
                _prime_cublas()
            for size in sizes:
                data = write_data(size, work, args)
                overrides = size_overrides(args, size, device, work, data)
                try:
                    configs = {entry: model_config(size, entry, mhar, overrides) for entry, mhar in mhars.items()}
                except ValueError as err:
                    parser.exit(2, f"config error: {err}\n")
                report["sizes"][size] = run_size(size, configs, contexts, ctx, args, device, data)
                # After the first models: the packages they imported (Transformer Engine) are named.
                report["environment"] = {**common.environment(device), "peak_bf16_flops": _peak_flops()}
                if args.out:
                    common.write_json(args.out, report)
    finally:
        destroy()
        shutil.rmtree(work, ignore_errors=True)
    return report


SUMMARY_KEYS = ("tokens_per_s", "throughput_ratio", "throughput_ratio_round_median", "throughput_vs_mhar",
                "throughput_vs_mhar_round_median", "memory_ratio", "mfu", "peak_memory_gib",
                "throughput_vs_base_kernels", "throughput_vs_base_kernels_round_median")


def print_summary(report, keys=SUMMARY_KEYS):
    print(json.dumps({s: {m: {k: round(v, 3) for k, v in e.items() if k in keys}
                          for m, e in r["models"].items()} for s, r in report["sizes"].items()}, indent=1))


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    sizes, models = check_args(parser, args)
    contexts, extra = kernel_contexts(parser, args, models)
    if args.base_kernels:
        from megatron_mhar.ops.depth_route import resolve_impl

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if resolve_impl(args.kernel_impl, device) == "torch":
            print("the routing runs the torch reference here, so both trees' models run the same code", flush=True)
    print_summary(run(parser, args, sizes, models, contexts, extra))


if __name__ == "__main__":
    main()
