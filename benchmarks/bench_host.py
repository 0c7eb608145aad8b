"""Host cost of MHAR's routing around its kernels, measured on a CPU machine.

    python -m benchmarks.bench_host      # writes benchmarks/results/host/cpu.json

On one H200 the 350M and 1B training steps are host-bound (``benchmarks.bench_training``,
``micro_batch_host_split``): what MHAR adds to a step there is the host time of its
routing sites, not their kernels. This benchmark isolates that host time without a GPU.
Every model is built at a size's depth (12 / 24 / 36 layers) with a tiny width, on CPU,
and the routing backends, per-site and lookahead, are replaced by stubs that only
allocate their outputs. What remains is the Python, autograd and torch-op cost of the
source history, the routing modules and the model around them.

Reported per model: the median milliseconds of one micro-batch's forward and backward,
the torch (aten) ops it dispatches, how many times each stub ran, and, against the
baseline, the extra milliseconds and ops per routing site with the op kinds that make
them up. The CPU runtime adds its own cost per op, so these are not H200 host figures:
compare the models of one run, and their op counts, which carry over.
"""

import argparse
import collections
import dataclasses
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import MODELS, PAPER_SIZES, check_out, default_out, environment, size_config, write_json
from megatron_mhar.models.builder import build_gpt_model, make_transformer_config
from megatron_mhar.models.gpt_config import GPTModelConfig
from megatron_mhar.ops.history import RoutingBackend
from megatron_mhar.ops.lookahead import LookaheadBackend

HOST_MODELS = ("baseline", "mhar", "mhar_lookahead")


class StubBackends:
    """Routing backends with the kernels' signatures that allocate their outputs and count
    their calls; they compute nothing."""

    def __init__(self):
        self.calls = collections.Counter()

    def routing(self) -> RoutingBackend:
        def forward(sources, extra, query, norm_weight, heads, eps, tau):
            self.calls["route_forward"] += 1
            t, _, d = sources.shape
            return sources.new_empty(t, d), sources.new_empty(t, heads, dtype=torch.float32)

        def backward(grad_out, sources, extra, query, norm_weight, saved, heads, eps, tau, grad_sources):
            self.calls["route_backward"] += 1
            t, _, d = sources.shape
            grad_extra = sources.new_empty(t, d) if extra is not None else None
            return grad_extra, torch.empty_like(query), torch.empty_like(norm_weight)

        return RoutingBackend(forward, backward)

    def lookahead(self) -> LookaheadBackend:
        def group_forward(sources, queries, norms, heads, eps, tau, first_out=None):
            self.calls["group_forward"] += 1
            t, _, d = sources.shape
            g = queries.shape[0]
            kw = dict(dtype=torch.float32, device=sources.device)
            return torch.empty(g, t, heads, **kw), torch.empty(g, t, heads, **kw), torch.empty(g, t, d, **kw)

        def merge_forward(m, l, acc, sources, query, norm_weight, heads, eps, tau, lse):
            self.calls["merge_forward"] += 1
            return sources.new_empty(sources.shape[0], sources.shape[2])

        def merge_backward(grad_out, out, sources, query, norm_weight, lse, heads, eps, tau,
                           row_factors, delta_out=None, grad_out_copy=None, dw_out=None, row_grads=None):  # fmt: skip
            self.calls["merge_backward"] += 1
            kw = dict(dtype=torch.float32, device=grad_out.device)
            return torch.empty(grad_out.shape[0], heads, **kw), torch.empty(query.shape, **kw), torch.empty(query.shape, **kw)

        def group_backward_deferred(grad_outs, sources, queries, norms, lse, delta, heads, eps, tau,
                                    grad_sources, site_range=None, merge_dw=None, accumulate=True):  # fmt: skip
            self.calls["group_backward_deferred"] += 1
            lo, hi = site_range or (0, queries.shape[0])
            # Nothing deferred: the rows' gradients are the row loop's, added in place.
            return torch.empty(hi - lo, queries.shape[1]), torch.empty(hi - lo, queries.shape[1]), ()

        def add_row_grads(deferred, sources, grad_sources, start, accumulate=True):
            self.calls["add_row_grads"] += 1

        def merge_row_grad(row, row_grad, out, *factors, accumulate=True):
            self.calls["merge_row_grad"] += 1

        def merge_dw_partials(num_tokens, d, heads, device):
            return 1

        return LookaheadBackend(group_forward, merge_forward, merge_backward, group_backward_deferred,
                                add_row_grads, merge_row_grad, merge_dw_partials)  # fmt: skip


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _model_config(layers: int) -> GPTModelConfig:
    return GPTModelConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=128, vocab_size=256, seq_length=32, qk_layernorm=True)  # fmt: skip


def _time_model(name, model_cfg, tokens, positions, stubs, steps, warmup) -> dict:
    mhar = dataclasses.replace(MODELS[name], kernel_impl="torch") if MODELS[name].enabled else MODELS[name]
    config = make_transformer_config(model_cfg, mhar, use_cpu_initialization=True)
    model = build_gpt_model(model_cfg, mhar, config)

    def micro_batch():
        model(tokens, positions, None, labels=tokens).float().mean().backward()

    for _ in range(warmup):
        micro_batch()
    stubs.calls.clear()
    with CountOps() as counter:
        micro_batch()
    calls = dict(stubs.calls)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        micro_batch()
        times.append(time.perf_counter() - start)
    return {
        "ms_median": 1e3 * statistics.median(times),
        "ms_all": [1e3 * t for t in times],
        "aten_ops": sum(counter.ops.values()),
        "ops_by_kind": dict(counter.ops),
        "stub_calls": calls,
    }


def run_size(size: str, models, steps: int, warmup: int) -> dict:
    import megatron_mhar.models.routing as routing

    layers = size_config(size).model.num_layers
    model_cfg = _model_config(layers)
    tokens = torch.randint(0, model_cfg.vocab_size, (2, model_cfg.seq_length))
    positions = torch.arange(model_cfg.seq_length).unsqueeze(0).expand_as(tokens)
    stubs = StubBackends()
    result = {"layers": layers, "sites": 2 * layers + 1, "models": {}}
    # The routing modules look their backends up by name when a forward starts.
    saved = routing.get_backend, routing.get_lookahead_backend
    routing.get_backend = lambda impl, device: stubs.routing()
    routing.get_lookahead_backend = lambda impl, device, lookahead_kernels="auto": stubs.lookahead()
    try:
        for name in models:
            result["models"][name] = _time_model(name, model_cfg, tokens, positions, stubs, steps, warmup)
            entry = result["models"][name]
            print(f"  {size:5s} {name:15s} {entry['ms_median']:8.2f} ms {entry['aten_ops']:6d} ops  "
                  f"stubs {entry['stub_calls']}", flush=True)  # fmt: skip
    finally:
        routing.get_backend, routing.get_lookahead_backend = saved
    base = result["models"].get("baseline")
    if base:
        for name, entry in result["models"].items():
            if name == "baseline":
                continue
            extra = collections.Counter(entry["ops_by_kind"])
            extra.subtract(base["ops_by_kind"])
            entry["extra_ms_per_site"] = (entry["ms_median"] - base["ms_median"]) / result["sites"]
            entry["extra_ops_per_site"] = (entry["aten_ops"] - base["aten_ops"]) / result["sites"]
            entry["extra_ops_by_kind"] = {k: v for k, v in extra.most_common() if v}
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=",".join(PAPER_SIZES), help=f"comma list of {', '.join(PAPER_SIZES)} (their depths)")
    parser.add_argument("--models", default=",".join(HOST_MODELS), help="comma list of " + ",".join(HOST_MODELS))
    parser.add_argument("--steps", type=int, default=30, help="timed micro-batches per model")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=default_out("host", "cpu"), help="JSON report (default: %(default)s)")
    args = parser.parse_args(argv)
    sizes, models = args.sizes.split(","), args.models.split(",")
    unknown = [s for s in sizes if s not in PAPER_SIZES]
    unknown += [m for m in models if m not in HOST_MODELS]
    if unknown:
        parser.error(f"unknown sizes/models {unknown}; sizes are {', '.join(PAPER_SIZES)} and models "
                     f"{', '.join(HOST_MODELS)}")  # fmt: skip
    twice = sorted({name for names in (sizes, models) for name in names if names.count(name) > 1})
    if twice:
        parser.error(f"--sizes/--models name {twice} twice; give each once")
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1")
    check_out(parser, args.out)

    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    torch.set_num_threads(1)  # the host path is single-threaded Python; keep the ops so too
    initialize_model_parallel_from_env(tp=1, pp=1, seed=1234, device="cpu")
    report = {
        "environment": environment("cpu"),
        "args": vars(args),
        "sizes": {},
    }  # fmt: skip
    try:
        for size in sizes:
            report["sizes"][size] = run_size(size, models, args.steps, args.warmup)
            if args.out:
                write_json(args.out, report)
    finally:
        destroy()
    for size, entry in report["sizes"].items():
        for name, m in entry["models"].items():
            if "extra_ms_per_site" in m:
                print(f"{size:5s} {name:15s} +{1e3 * m['extra_ms_per_site']:7.1f} us "
                      f"+{m['extra_ops_per_site']:5.1f} ops per site")  # fmt: skip


if __name__ == "__main__":
    main()
