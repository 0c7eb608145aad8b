"""End-to-end training throughput: plain Megatron GPT vs AttnRes (H=1) vs MHAR (H=8).

    python benchmarks/bench_training.py      # writes benchmarks/results/training/<device>.json
    python benchmarks/bench_training.py --sizes tiny --steps 2 --out /tmp/tiny.json   # CPU smoke

One process, one run, one GPU: every model of a size is built with the same builder,
trained with the same Megatron components (bf16 params, Megatron DDP with fp32 grad
buffers, Megatron's optimizer with fp32 main weights, Adam (0.9, 0.95), clip 1.0, the
non-pipelined forward/backward schedule) at the paper's per-GPU micro-batch and
gradient-accumulation counts (the paper's configurations), on random tokens. ``--spec``
picks the layers of every model: ``transformer_engine`` (the default where TE imports on a
GPU: TE's fused norm+linear layers and attention, with gradient-accumulation fusion, fused
cross-entropy, RoPE and SwiGLU, as Megatron-LM runs them) or ``local`` (Megatron's torch
layers, attention through torch SDPA's flash backend). ``--precision fp8`` runs TE's FP8
linear layers; the routing and its history stay bf16.

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
the host and as completed: ``micro_batch_host_split``) and one profiled step that splits
CUDA time into the routing kernels' forward and backward and everything else, next to the
step's wall time (their ratio shows how far the host, not the GPU, bounds the step),
and one profiled micro-batch's host time by operator and CUDA runtime call
(``host_profile``).
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.json_out import check_out, default_out, device_name, write_json  # noqa: E402
from megatron_mhar.models.mhar_config import MHARConfig  # noqa: E402
from megatron_mhar.models.builder import build_gpt_model, fused_kernel_fields, make_transformer_config  # noqa: E402
from megatron_mhar.models.gpt_config import GPTModelConfig  # noqa: E402
from megatron_mhar.models.specs import resolve_spec  # noqa: E402
from megatron_mhar.training.cuda_graphs import (  # noqa: E402
    CUDA_GRAPH_MODES,
    FullIterationGraph,
    capture_stream,
    reset_static_inputs,
)

QWEN3_VOCAB = 151936
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}


@dataclasses.dataclass
class SizeCase:
    name: str
    model: GPTModelConfig
    micro_batch: int
    num_microbatches: int  # global batch / micro-batch on one GPU


def _qwen3(d, layers, heads, kv, ffn, seq, vocab=QWEN3_VOCAB):
    return GPTModelConfig(num_layers=layers, hidden_size=d, num_attention_heads=heads,
                          num_query_groups=kv, ffn_hidden_size=ffn, vocab_size=vocab,
                          seq_length=seq, qk_layernorm=True, attention_backend="sdpa")


SIZES = {
    "100m": SizeCase("100m", _qwen3(512, 12, 8, 4, 1536, 2048), 8, 8),
    "350m": SizeCase("350m", _qwen3(1024, 24, 16, 8, 4096, 1024), 4, 8),
    "1b": SizeCase("1b", _qwen3(1280, 36, 16, 8, 5120, 1024), 2, 16),
    "tiny": SizeCase("tiny", _qwen3(64, 2, 4, 2, 128, 32, vocab=256), 2, 2),
}

MODELS = {
    "baseline": MHARConfig(variant="none"),
    "attnres": MHARConfig(variant="full", num_heads=1),
    "mhar": MHARConfig(variant="full", num_heads=8),
    "mhar_lookahead": MHARConfig(variant="full", num_heads=8, routing_schedule="lookahead"),
    # The same schedule with phase 1 on one kernel family each (the default, ``auto``,
    # picks per group and direction), and AttnRes on the lookahead schedule.
    "mhar_lookahead_row_loop": MHARConfig(variant="full", num_heads=8, routing_schedule="lookahead",
                                          lookahead_kernels="row_loop"),
    "mhar_lookahead_tensor_cores": MHARConfig(variant="full", num_heads=8, routing_schedule="lookahead",
                                              lookahead_kernels="tensor_cores"),
    "attnres_lookahead": MHARConfig(variant="full", num_heads=1, routing_schedule="lookahead"),
    # Blocks of 8 sublayers (4 decoder layers): the variant the Attention Residuals paper
    # reports under 4% overhead for.
    "mhar_block": MHARConfig(variant="block", num_heads=8, block_size=8),
}

SPECS = ("local", "transformer_engine")  # the resolved values of model.spec
PRECISIONS = ("bf16", "fp8")


def speed_overrides(spec: str, fusions: bool, precision: str) -> dict:
    """TransformerConfig fields of the baseline a Megatron-LM user runs, as the training
    driver builds it: with Transformer Engine, its fused kernels
    (:func:`~megatron_mhar.models.builder.fused_kernel_fields`); with ``fp8``, the driver's
    FP8 formats and scaling (``training.precision: fp8``)."""
    from megatron_mhar.training.model import FP8_FORMAT, FP8_RECIPE

    overrides = fused_kernel_fields(GPTModelConfig(spec=spec)) if fusions else {}
    if precision == "fp8":
        overrides.update(fp8=FP8_FORMAT, fp8_recipe=FP8_RECIPE)
    return overrides


def parse_model(spec: str) -> MHARConfig:
    """A ``--models`` entry: a name of MODELS, optionally followed by ``@field=value``
    overrides of its MHARConfig (``mhar_lookahead@lookahead_group=8``), so that variants of
    one schedule can be timed in the same run. Unknown names, fields or values raise
    ValueError naming them."""
    name, *overrides = spec.split("@")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {list(MODELS)}")
    fields = {f.name: f for f in dataclasses.fields(MHARConfig)}
    changes = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"model {spec!r}: override {item!r} is not field=value with a field "
                             f"of MHARConfig ({', '.join(fields)})")
        default = getattr(MODELS[name], key)
        if isinstance(default, bool):
            if value not in ("true", "false"):
                raise ValueError(f"model {spec!r}: {key} takes true or false, got {value!r}")
            changes[key] = value == "true"
        elif isinstance(default, (int, float)):
            try:
                changes[key] = type(default)(value)
            except ValueError:
                kind = "an integer" if isinstance(default, int) else "a number"
                raise ValueError(f"model {spec!r}: {key} takes {kind}, got {value!r}") from None
        else:
            changes[key] = value
    return dataclasses.replace(MODELS[name], **changes)  # MHARConfig validates the values


def flops_per_token(model: GPTModelConfig, vocab: int) -> float:
    """Training FLOPs per token: 6 x matmul params + causal attention (fwd + bwd)."""
    d, layers, seq = model.hidden_size, model.num_layers, model.seq_length
    kv_dim = d // model.num_attention_heads * (model.num_query_groups or model.num_attention_heads)
    ffn = model.ffn_hidden_size
    per_layer = d * (d + 2 * kv_dim) + d * d + d * ffn * (3 if model.swiglu else 2)
    matmul_params = layers * per_layer + vocab * d
    attention = 6 * layers * seq * d  # 12 L s d for QK^T and AV, halved by the causal mask
    return 6 * matmul_params + attention


def _train_setup(case: SizeCase, mhar: MHARConfig, device: str, overrides=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = device == "cuda"
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = make_transformer_config(case.model, mhar, bf16=bf16, params_dtype=dtype,
                                     pipeline_dtype=dtype, use_cpu_initialization=not bf16,
                                     **(overrides or {}))
    model = build_gpt_model(case.model, mhar, config)
    if bf16:
        model = model.cuda()
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=5e-4, weight_decay=0.1, adam_beta1=0.9,
                        adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, bf16=bf16,
                        params_dtype=dtype),
        [ddp],
    )
    return ddp, optimizer


def _batches(case: SizeCase, device: str, vocab: int):
    generator = torch.Generator(device="cpu").manual_seed(0)
    seq, mb = case.model.seq_length, case.micro_batch
    tokens = torch.randint(0, vocab, (case.num_microbatches, mb, seq + 1), generator=generator)
    tokens = tokens.to(device)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(mb, seq)
    # Dicts: Megatron's full-iteration CUDA graph copies each micro-batch's dict of
    # tensors into static buffers.
    return [{"tokens": t[:, :-1], "labels": t[:, 1:], "positions": positions} for t in tokens]


def _micro_batch_loss(ddp, batch):
    return ddp(batch["tokens"], batch["positions"], None, labels=batch["labels"])


def _step(trainer, case: SizeCase, schedule=None):
    """Loss of one optimizer step with the trainer's schedule (or ``schedule``)."""
    def forward_step(data_iterator, model):
        losses = _micro_batch_loss(model, next(data_iterator))
        return losses, lambda out: (out.float().mean(), {"loss": out.float().mean().detach()})

    ddp, optimizer, batches = trainer.ddp, trainer.optimizer, trainer.batches
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    with trainer.context():
        result = (schedule or trainer.schedule)(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
            num_microbatches=case.num_microbatches, seq_length=case.model.seq_length,
            micro_batch_size=case.micro_batch, forward_only=False,
        )
    optimizer.step()
    return sum(r["loss"].item() for r in result) / len(result)


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


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


def _profile_step(trainer, case, top_other: int = 40):
    """CUDA time of one step (ms): routing kernels forward and backward, everything else,
    and the step's wall time (CUDA busy time / wall time < 1 means the host is the bound).
    Launched eagerly under graphs too: the kernels are the same, and each is profiled."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from torch.profiler import ProfilerActivity, profile

    phases = routing_kernel_phases()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        _step(trainer, case, get_forward_backward_func())
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


def _host_split(trainer, device: str, repeats: int = 3):
    """Median ms of one micro-batch's forward and of its backward, as issued (when the
    host returns) and as completed (after synchronising). Issued close to completed means
    the host bounds that phase; their difference between two models is host time."""
    batch = trainer.batches[0]
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        with trainer.context():
            loss = _micro_batch_loss(trainer.ddp, batch).float().mean()
            issued = time.perf_counter()
            _sync(device)
            done = time.perf_counter()
            loss.backward()
            back_issued = time.perf_counter()
        _sync(device)
        times.append((issued - start, done - start, back_issued - done, time.perf_counter() - done))
    trainer.ddp.zero_grad_buffer()  # the next step starts from zero gradients anyway
    names = ("forward_issued_ms", "forward_ms", "backward_issued_ms", "backward_ms")
    return {name: statistics.median(column) * 1e3 for name, column in zip(names, zip(*times))}


def _host_profile(trainer, top: int = 40):
    """Host time of one micro-batch's forward and backward by operator (profiler CPU
    events, inflated alike for every model by the profiler's per-op cost): the ops with
    the most self CPU time, and the CUDA runtime / driver calls (launches, allocations,
    synchronisations) with their counts. Where one model's host time goes beyond another's."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, trainer.context():
        _micro_batch_loss(trainer.ddp, trainer.batches[0]).float().mean().backward()
        torch.cuda.synchronize()
    trainer.ddp.zero_grad_buffer()
    rows = [{"name": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "cpu_total_ms": e.cpu_time_total / 1e3} for e in prof.key_averages()]
    rows.sort(key=lambda r: -r["self_cpu_ms"])
    runtime = [r for r in rows if r["name"].startswith(("cuda", "cu"))]
    return {"self_cpu_ms": sum(r["self_cpu_ms"] for r in rows),
            "ops": sum(r["count"] for r in rows if r["name"].startswith("aten::")),
            "top_self_cpu": rows[:top], "runtime_calls": runtime}


@dataclasses.dataclass
class _Trainer:
    ddp: object
    optimizer: object
    batches: list
    schedule: object  # Megatron's forward/backward function, or a FullIterationGraph
    # Entered around everything that runs the model (run_size's ``contexts``).
    context: object = contextlib.nullcontext


def _timed_step(trainer: _Trainer, case: SizeCase, device: str):
    """(wall seconds, loss) of one optimizer step."""
    _sync(device)
    start = time.perf_counter()
    loss = _step(trainer, case)
    _sync(device)
    return time.perf_counter() - start, loss


def _prime_cublas():
    """One bf16 linear forward and backward before any memory reading: cuBLAS takes its
    workspaces (per handle and stream, and backward runs on autograd's own thread, hence
    handle) from the caching allocator on first use and keeps them, which would charge them
    all to the first model built."""
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.zeros(64, device="cuda", dtype=torch.bfloat16)
    (torch.nn.functional.linear(x, x, bias) @ x).sum().backward()
    torch.cuda.synchronize()


def _schedule(cuda_graph: str):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if cuda_graph == "full_iteration":
        return FullIterationGraph(get_forward_backward_func(), warmup_steps=1)
    return get_forward_backward_func()


def _build_and_warm(case: SizeCase, mhar: MHARConfig, device: str, warmup: int,
                    cuda_graph: str = "none", context=contextlib.nullcontext, overrides=None):
    """Builds one model and runs its warmup steps: (trainer, warmup losses, own peak GiB
    or None on CPU). The models built before stay idle, so the peak over this phase minus
    the bytes allocated before it is this model's own."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    trainer = _Trainer(*_train_setup(case, mhar, device, overrides),
                       _batches(case, device, case.model.padded_vocab_size()),
                       _schedule(cuda_graph), context)
    losses = [_timed_step(trainer, case, device)[1] for _ in range(warmup)]
    if device != "cuda":
        return trainer, losses, None
    torch.cuda.synchronize()
    return trainer, losses, (torch.cuda.max_memory_allocated() - before) / 2**30


def _timed_rounds(trainers: dict, case: SizeCase, device: str, steps: int):
    """{name: step times}, {name: losses} over ``steps`` rounds of one step per model;
    round r starts at model r % M so that no model always follows the same one."""
    names = list(trainers)
    times = {name: [] for name in names}
    losses = {name: [] for name in names}
    for r in range(steps):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            seconds, loss = _timed_step(trainers[name], case, device)
            times[name].append(seconds)
            losses[name].append(loss)
    return times, losses


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


def run_size(case: SizeCase, models, steps: int, warmup: int, device: str, profile: bool,
             cuda_graph: str = "none", contexts=None, overrides=None):
    """Trains ``models`` ({name: MHARConfig}) of one size; ``contexts`` ({name: context
    manager factory}) is entered around everything that runs that model; ``overrides``
    are TransformerConfig fields for every model (:func:`speed_overrides`)."""
    contexts = contexts or {}
    vocab = case.model.padded_vocab_size()
    if cuda_graph != "none":
        reset_static_inputs()
    tokens = case.micro_batch * case.model.seq_length * case.num_microbatches
    trainers, warm_losses, peaks = {}, {}, {}
    for name, mhar in models.items():
        trainers[name], warm_losses[name], peaks[name] = _build_and_warm(
            case, mhar, device, warmup, cuda_graph, contexts.get(name, contextlib.nullcontext), overrides)
    times, losses = _timed_rounds(trainers, case, device, steps)
    results = {}
    for name, trainer in trainers.items():
        entry = {
            "tokens_per_s": tokens / statistics.median(times[name]),
            "step_s_median": statistics.median(times[name]),
            "step_s_all": times[name],
            "losses": warm_losses[name] + losses[name],
            "params": sum(p.numel() for p in trainer.ddp.module.parameters()),
        }
        if peaks[name] is not None:
            entry["peak_memory_gib"] = peaks[name]
        entry["micro_batch_host_split"] = _host_split(trainer, device)
        if profile and device == "cuda":
            entry["profile"] = _profile_step(trainer, case)
            entry["host_profile"] = _host_profile(trainer)
        results[name] = entry
        print(f"[{case.name}] {name}: {entry['tokens_per_s']:.0f} tok/s, "
              f"peak {entry.get('peak_memory_gib', 0):.1f} GiB, loss {entry['losses'][-1]:.3f}",
              flush=True)
    # Free this size's models before the next size is built, so its memory readings start
    # from the same empty state (the loop variable holds the last model too).
    del trainers, trainer
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    _add_ratios(results, times)
    base = results.get("baseline")
    peak = _peak_flops()
    if base and peak:
        base["mfu"] = flops_per_token(case.model, vocab) * base["tokens_per_s"] / peak
    return {"case": dataclasses.asdict(case), "flops_per_token": flops_per_token(case.model, vocab),
            "models": results}


def _peak_flops():
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def environment():
    import megatron.core

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "megatron_core": megatron.core.__version__}
    if torch.cuda.is_available():
        import triton

        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   triton=triton.__version__, peak_bf16_flops=_peak_flops())
        try:
            import transformer_engine

            env["transformer_engine"] = transformer_engine.__version__
        except ImportError:
            pass
    return env


def build_parser(description=None) -> argparse.ArgumentParser:
    """The benchmark's options (tools/perf/ab_training.py adds its own to them)."""
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100m,350m,1b", help="comma list of " + ",".join(SIZES))
    parser.add_argument("--models", default="baseline,attnres,mhar",
                        help="comma list of " + ",".join(MODELS) + "; a name may carry "
                             "MHARConfig overrides: mhar_lookahead@lookahead_group=8")
    parser.add_argument("--steps", type=int, default=8,
                        help="timed rounds (one optimizer step per model each)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps per model (compilation, autotune, optimizer states); "
                             "the peak memory is taken over them")
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
    parser.add_argument("--out", default=default_out("training", device_name()),
                        help="JSON report (default: %(default)s)")
    return parser


def check_args(parser, args):
    """The sizes to run; ``parser.error`` for options that cannot run (the models are
    parsed by the caller: :func:`parse_model`)."""
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; choose from {list(SIZES)}")
    if len(set(sizes)) < len(sizes):
        parser.error(f"--sizes {args.sizes} names a size twice; give each once")
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
    check_out(parser, args.out)
    return sizes


def run(args, sizes, models, contexts=None, annotate=None, extra=None):
    """Trains ``models`` ({name: MHARConfig}) at each size and returns the report, written
    to ``args.out`` after every size. ``contexts``: :func:`run_size`'s; ``annotate(entry)``
    is called on each size's report before it is written; ``extra``: more report fields."""
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    device = "cuda" if torch.cuda.is_available() else "cpu"
    initialize_model_parallel_from_env(seed=1234, device=device,
                                       cuda_graph_rng=args.cuda_graph != "none")
    models = {m: dataclasses.replace(mhar, kernel_impl=args.kernel_impl) if mhar.enabled else mhar
              for m, mhar in models.items()}
    overrides = speed_overrides(args.spec, not args.no_fusions, args.precision)
    report = {"environment": environment(), "args": vars(args), **(extra or {}), "sizes": {}}
    try:
        with capture_stream(args.cuda_graph):
            if device == "cuda":  # on the stream the models run on: cuBLAS keys its workspaces by stream
                _prime_cublas()
            for size in sizes:
                case = dataclasses.replace(SIZES[size], model=dataclasses.replace(
                    SIZES[size].model, spec=args.spec))
                entry = run_size(case, models, args.steps, args.warmup, device,
                                 profile=not args.no_profile, cuda_graph=args.cuda_graph,
                                 contexts=contexts, overrides=overrides)
                if annotate is not None:
                    annotate(entry)
                report["sizes"][size] = entry
                if args.out:
                    write_json(args.out, report)
    finally:
        destroy()
    return report


SUMMARY_KEYS = ("tokens_per_s", "throughput_ratio", "throughput_ratio_round_median", "throughput_vs_mhar",
                "throughput_vs_mhar_round_median", "memory_ratio", "mfu", "peak_memory_gib")


def print_summary(report, keys=SUMMARY_KEYS):
    print(json.dumps({s: {m: {k: round(v, 3) for k, v in e.items() if k in keys}
                          for m, e in r["models"].items()} for s, r in report["sizes"].items()}, indent=1))


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    sizes = check_args(parser, args)
    try:
        models = {spec: parse_model(spec) for spec in args.models.split(",")}
    except ValueError as err:
        parser.error(str(err))
    print_summary(run(args, sizes, models))


if __name__ == "__main__":
    main()
