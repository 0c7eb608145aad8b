"""Depth-routing benchmark: fused Triton kernels vs the eager and compiled reference.

    python benchmarks/bench_routing.py --out benchmarks/results/routing_h200.json

Sections (each written to the JSON as soon as it is measured):
  copy        device-to-device copy bandwidth (bytes read + written / time): the ceiling.
  site        one routing site at the paper shapes (H = 8, bf16), forward, backward and
              both, for ``triton`` (fused_depth_route autograd), ``triton_history`` (the
              backend interface: route_forward on a [T, R, D] buffer view, route_backward
              adding into an fp32 gradient buffer; ``triton_history_graph``: the same
              calls replayed from a CUDA graph, the kernels without host launch cost),
              ``eager`` (depth_route_reference) and ``compile`` (torch.compile of the
              reference, static shapes).
  step        the whole routing cost of one training step (forward + backward of every
              site) per model size: full variant sites j = 1..2L+1 with N = j sources;
              8B delta: 2L sites over null + embedding + completed blocks of 4 layers.
              ``lookahead`` (full variant only) times the two-phase schedule
              (mhar_kernels.lookahead, groups of G sites; --lookahead-groups, 0 = auto)
              on the same buffers, as the history runs it; its bytes come from
              benchmarks/routing_bytes.py.
  host        host time per call of route_forward / route_backward and of one torch op
              (launched back to back, no synchronisation; tiny shapes so the GPU keeps up).
  sweep       (--sweep) tiles, warps, register prefetch, pipeline stages, L2 hints and
              programs per SM of the fused kernels around the defaults (CUDA graphs).

Times are ``triton.testing.do_bench`` quantiles (median, 20%, 80%) in ms. ``bytes_min``
counts each input read once and each output written once; ``bytes_moved`` is what the
fused kernels move (the backward reads the sources twice). Fractions are of the copy
bandwidth measured in the same run.
"""

import argparse
import dataclasses
import os
import platform
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mhar.ops.depth_route import (  # noqa: E402
    depth_route_reference,
    torch_route_backward,
    torch_route_forward,
)
from benchmarks.json_out import check_out, write_json  # noqa: E402
from benchmarks.routing_bytes import lookahead as lookahead_bytes  # noqa: E402
from benchmarks.routing_bytes import per_site as per_site_bytes  # noqa: E402
from megatron_mhar.ops.lookahead import auto_group_size, group_ranges  # noqa: E402
from mhar_kernels import depth_route as K  # noqa: E402
from mhar_kernels import lookahead as LA  # noqa: E402

EPS = 1e-6
HEADS = 8
DTYPE = torch.bfloat16
QUANTILES = [0.5, 0.2, 0.8]


@dataclasses.dataclass
class SiteCase:
    name: str
    d: int
    n: int
    t: int  # tokens = micro-batch x sequence


SITE_CASES = [
    SiteCase("100M-final", 512, 25, 8 * 2048),
    SiteCase("350M-final", 1024, 49, 4 * 1024),
    SiteCase("1B-final", 1280, 73, 2 * 1024),
    SiteCase("8B-delta", 4096, 9, 2 * 4096),
    SiteCase("100M-N9", 512, 9, 8 * 2048),
    SiteCase("350M-N9", 1024, 9, 4 * 1024),
    SiteCase("1B-N9", 1280, 9, 2 * 1024),
]


@dataclasses.dataclass
class StepCase:
    name: str
    d: int
    layers: int
    t: int
    variant: str  # "full" or "delta"

    def site_sources(self):
        sites = 2 * self.layers
        if self.variant == "full":
            return list(range(1, sites + 2))
        # null + embedding + one source per completed block of 4 layers (8 sublayers).
        return [2 + (j - 1) // 8 for j in range(1, sites + 1)]


STEP_CASES = [
    StepCase("100M", 512, 12, 8 * 2048, "full"),
    StepCase("350M", 1024, 24, 4 * 1024, "full"),
    StepCase("1B", 1280, 36, 2 * 1024, "full"),
    StepCase("8B-delta", 4096, 32, 2 * 4096, "delta"),
]


def bench(fn, graph=False):
    """do_bench quantiles; with ``graph`` the calls replay from a CUDA graph, which times
    the kernels without the host's launch cost."""
    if graph:
        ms = triton.testing.do_bench_cudagraph(fn, rep=100, quantiles=QUANTILES)
    else:
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=QUANTILES)
    return {"ms": ms[0], "ms_p20": ms[1], "ms_p80": ms[2]}


def peak_bytes(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def copy_bandwidth():
    x = torch.randn(2**30 // 2, device="cuda", dtype=DTYPE)
    y = torch.empty_like(x)
    r = bench(lambda: y.copy_(x))
    r["bytes"] = 2 * x.numel() * x.element_size()
    r["gbps"] = r["bytes"] / r["ms"] / 1e6
    return r


def saved_bytes(fwd, inputs):
    """Bytes the autograd graph of one forward saves, beyond the inputs' own storage."""
    own = {t.untyped_storage().data_ptr() for t in inputs}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fwd()
    return sum(seen.values())


def compiled_reference(tau, dynamic):
    def ref(sources, query, norm_weight):
        return depth_route_reference(sources, query, norm_weight, HEADS, EPS, tau)

    return torch.compile(ref, dynamic=dynamic)


def site_inputs(case, tau):
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", generator=g)
    sources = torch.randn(case.n, case.t, case.d, **kw).to(DTYPE)
    query = (2.0 / (tau * (case.d // HEADS) ** 0.5) * torch.randn(case.d, **kw)).to(DTYPE)
    norm_weight = (1 + 0.3 * torch.randn(case.d, **kw)).to(DTYPE)
    grad_out = torch.randn(case.t, case.d, **kw).to(DTYPE)
    return sources, query, norm_weight, grad_out


def site_bytes(case):
    es = torch.tensor([], dtype=DTYPE).element_size()
    src, tok = case.n * case.t * case.d * es, case.t * case.d * es
    lse = case.t * HEADS * 4
    return {
        "fwd": {"min": src + tok, "moved": src + tok + lse},
        "bwd": {"min": src + tok + src, "moved": 2 * src + tok + lse + src},
        "fwd+bwd": {"min": 2 * src + 2 * tok, "moved": 4 * src + 2 * tok + 2 * lse},
        # route_backward reads and writes an fp32 gradient buffer (8 bytes per element).
        "bwd_history": {"min": src + tok + 4 * src, "moved": 2 * src + tok + lse + 4 * src},
    }


def run_site(case, tau, impls, copy_gbps):
    sources, query, norm_weight, grad_out = site_inputs(case, tau)
    nbytes = site_bytes(case)
    rows = []

    def record(impl, mode, timing, byte_key=None, **extra):
        b = nbytes[byte_key or mode]
        row = {"case": case.name, "d": case.d, "n": case.n, "t": case.t, "impl": impl, "mode": mode}
        row.update(timing)
        row["bytes_min"], row["bytes_moved"] = b["min"], b["moved"]
        row["gbps_min"] = b["min"] / timing["ms"] / 1e6
        row["frac_copy_min"] = row["gbps_min"] / copy_gbps
        if impl.startswith("triton"):
            row["gbps_moved"] = b["moved"] / timing["ms"] / 1e6
            row["frac_copy_moved"] = row["gbps_moved"] / copy_gbps
        row.update(extra)
        rows.append(row)
        print(
            f"  {case.name:11s} {impl:15s} {mode:8s} {timing['ms']:8.3f} ms "
            f"{row.get('gbps_moved', row['gbps_min']):7.0f} GB/s",
            flush=True,
        )

    fns = {
        "triton": lambda s, q, g: K.fused_depth_route(s, q, g, HEADS, EPS, tau),
        "eager": lambda s, q, g: depth_route_reference(s, q, g, HEADS, EPS, tau),
    }
    if "compile" in impls:
        fns["compile"] = compiled_reference(tau, dynamic=False)
    # "lookahead" routes whole groups of sites: the step section times it, not this one.
    for impl in [impl for impl in impls if impl != "lookahead"]:
        fn = fns[impl]
        leaves = [x.detach().requires_grad_(True) for x in (sources, query, norm_weight)]
        fwd = lambda: fn(*leaves)  # noqa: E731
        out = fwd()  # compiles, if compiled
        torch.autograd.grad(out, leaves, grad_out)
        mem = peak_bytes(lambda: torch.autograd.grad(fwd(), leaves, grad_out))
        saved = saved_bytes(fwd, leaves)
        record(impl, "fwd", bench(fwd), saved_bytes=saved)
        out = fwd()
        record(impl, "bwd", bench(lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)))
        del out
        record(impl, "fwd+bwd", bench(lambda: torch.autograd.grad(fwd(), leaves, grad_out)), peak_bytes=mem)

    # The backend interface the model uses: a [T, R, D] history buffer and an fp32 gradient
    # buffer that accumulates over sites.
    buf = torch.empty(case.t, case.n + 3, case.d, device="cuda", dtype=DTYPE)
    buf[:, : case.n] = sources.transpose(0, 1)
    view = buf[:, : case.n]
    gbuf = torch.zeros(case.t, case.n + 3, case.d, device="cuda")
    out, lse = K.route_forward(view, None, query, norm_weight, HEADS, EPS, tau)

    def fwd():
        K.route_forward(view, None, query, norm_weight, HEADS, EPS, tau)

    def bwd():
        K.route_backward(grad_out, view, None, query, norm_weight, lse, HEADS, EPS, tau, gbuf[:, : case.n])

    # Launched from the host, as the model does, and replayed from a CUDA graph: the
    # kernels' own time (a small site's launch cost on a slow host exceeds its kernel).
    for impl, graph in (("triton_history", False), ("triton_history_graph", True)):
        record(impl, "fwd", bench(fwd, graph))
        record(impl, "bwd", bench(bwd, graph), byte_key="bwd_history")
    return rows


def lookahead_step(buf, gbuf, queries, norms, grad_out, tau, group):
    """One step of the two-phase schedule over sites j = 1..S reading rows [0, j), as
    LookaheadHistory runs it: per group, phase 1 then the merges; backward in reverse.
    Where the tensor-core backward runs, a group's phase-1 backward defers its old rows'
    gradients, and every owing group's are added at once when the rows of a group fall
    due (``add_row_grads``). The merges leave their new rows' gradients as factors; each
    new row's is formed (``merge_row_grad``) after the last merge reading it, in the
    rows' dtype, as the history hands it to its sublayer."""
    sites = len(queries)
    plan = []
    for sites_of_group in group_ranges(1, sites, group):
        idx = [j - 1 for j in sites_of_group]
        plan.append((sites_of_group.start, torch.stack([queries[i] for i in idx]),
                     torch.stack([norms[i] for i in idx])))  # fmt: skip
    t, _, d = buf.shape

    def step():
        saved = []
        for n0, qs, ws in plan:
            m, l, acc = LA.group_forward(buf[:, :n0], qs, ws, HEADS, EPS, tau, tensor_cores=None)
            lse = torch.empty((len(qs), t, HEADS), device=buf.device)
            outs = [LA.merge_forward(m[k], l[k], acc[k], buf[:, n0 : n0 + k], qs[k], ws[k], HEADS, EPS, tau,
                                     lse[k]) for k in range(len(qs))]  # fmt: skip
            del m, l, acc
            saved.append((n0, qs, ws, lse, outs))
        owed = []
        for n0, qs, ws, lse, outs in reversed(saved):
            g = len(qs)
            LA.add_row_grads(owed, buf, gbuf, n0)  # the group's new rows are due
            owed = [(deferred, min(rows, n0)) for deferred, rows in owed]
            grad_outs = torch.empty((g, t, d), dtype=buf.dtype, device=buf.device)
            deltas = torch.empty((g, t, HEADS), device=buf.device)
            factors = torch.empty((g, t, g - 1, HEADS, 2), device=buf.device)
            kv = torch.empty((g, t, g - 1), device=buf.device)
            for k in reversed(range(g)):
                LA.merge_backward(grad_out, outs[k], buf[:, n0 : n0 + k], qs[k], ws[k], lse[k], HEADS, EPS, tau,
                                  (factors[k, :, :k], kv[k, :, :k]), deltas[k], grad_outs[k])  # fmt: skip
                if k > 0:
                    row = n0 + k - 1
                    LA.merge_row_grad(buf[:, row], gbuf[:, row], torch.empty_like(grad_out), grad_outs, qs, ws,
                                      factors, kv, k - 1, (k, g), HEADS)  # fmt: skip
            _, _, deferred = LA.group_backward_deferred(grad_outs, buf[:, :n0], qs, ws, lse, deltas, HEADS, EPS, tau,
                                                        gbuf[:, :n0], tensor_cores=None)  # fmt: skip
            if deferred:
                owed.append((deferred, n0))
        LA.add_row_grads(owed, buf, gbuf, 0)

    return step


def run_step(case, tau, impls, lookahead_groups=(0,)):
    ns = case.site_sources()
    r = max(ns)
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", generator=g)
    buf = torch.randn(case.t, r, case.d, **kw).to(DTYPE)
    gbuf = torch.zeros(case.t, r, case.d, device="cuda")
    scale = 2.0 / (tau * (case.d // HEADS) ** 0.5)
    queries = [(scale * torch.randn(case.d, **kw)).to(DTYPE) for _ in ns]
    norms = [(1 + 0.3 * torch.randn(case.d, **kw)).to(DTYPE) for _ in ns]
    grad_out = torch.randn(case.t, case.d, **kw).to(DTYPE)
    es = buf.element_size()
    reads = sum(ns) * case.t * case.d
    result = {
        "case": case.name, "variant": case.variant, "d": case.d, "layers": case.layers,
        "t": case.t, "sites": len(ns), "source_reads": sum(ns),
        "bytes_min": 2 * reads * es + 2 * len(ns) * case.t * case.d * es,
        "bytes_moved_triton": (3 * es + 8) * reads + 2 * len(ns) * case.t * case.d * es,
        "saved_bytes_triton": len(ns) * case.t * HEADS * 4,
    }  # fmt: skip

    def step_backend(fwd_fn, bwd_fn):
        def step():
            saved = [fwd_fn(buf[:, :n], None, q, w, HEADS, EPS, tau)[1] for n, q, w in zip(ns, queries, norms)]
            for n, q, w, s in reversed(list(zip(ns, queries, norms, saved))):
                bwd_fn(grad_out, buf[:, :n], None, q, w, s, HEADS, EPS, tau, gbuf[:, :n])

        return step

    compiled = compiled_reference(tau, dynamic=True) if "compile" in impls else None

    def step_compiled():
        graphs = []
        for n, q, w in zip(ns, queries, norms):
            leaves = [buf[:, :n].detach().requires_grad_(True), q.detach().requires_grad_(True),
                      w.detach().requires_grad_(True)]  # fmt: skip
            graphs.append((n, leaves, compiled(leaves[0].transpose(0, 1), leaves[1], leaves[2])))
        for n, leaves, out in reversed(graphs):
            grads = torch.autograd.grad(out, leaves, grad_out)
            gbuf[:, :n].add_(grads[0])

    steps = {
        "triton": step_backend(K.route_forward, K.route_backward),
        "eager": step_backend(torch_route_forward, torch_route_backward),
        "compile": step_compiled,
    }
    names = [impl for impl in impls if impl != "lookahead"]
    if "lookahead" in impls and case.variant == "full":
        result["bytes_per_site"] = per_site_bytes(len(ns), case.t, case.d, HEADS)
        for g in lookahead_groups:
            group = g or auto_group_size(len(ns))
            name = "lookahead" if g == 0 else f"lookahead_G{group}"
            steps[name] = lookahead_step(buf, gbuf, queries, norms, grad_out, tau, group)
            result[f"bytes_{name}"] = lookahead_bytes(len(ns), case.t, case.d, HEADS, group)
            names.append(name)
    for impl in names:
        try:
            steps[impl]()  # warm-up and compilation
            timing = bench(steps[impl])
            timing["peak_bytes"] = peak_bytes(steps[impl])
        except torch.cuda.OutOfMemoryError as err:
            timing = {"error": f"out of memory: {str(err).splitlines()[0]}"}
        torch.cuda.empty_cache()
        result[impl] = timing
        print(f"  step {case.name:9s} {impl:8s} {timing.get('ms', float('nan')):9.2f} ms", flush=True)
    if "ms" in result.get("triton", {}):
        for impl in names:
            if "ms" in result.get(impl, {}):
                result[f"speedup_vs_{impl}"] = result[impl]["ms"] / result["triton"]["ms"]
    return result


SWEEP_CASES = SITE_CASES[:4] + SITE_CASES[5:] + [
    # Same tokens and depth as 1B-final at a power-of-two width: isolates the cost of
    # padding 1280 (head width 160) to a 2048-wide register tile.
    SiteCase("probe-D1024-N73", 1024, 73, 2 * 1024),
]


def run_host(calls=2000):
    """Host µs per backend call at a tiny 1B-width site (the GPU keeps up), next to one
    plain CUDA op: what a routing site costs the host in a host-bound training step."""
    case = SiteCase("host-1B-N9", 1280, 9, 64)
    sources, query, norm_weight, grad_out = site_inputs(case, 1.0)
    view = sources.transpose(0, 1)
    grad = torch.zeros(sources.shape, device="cuda").transpose(0, 1)
    _, lse = K.route_forward(view, None, query, norm_weight, HEADS, EPS, 1.0)
    calls_by_name = {
        "route_forward": lambda: K.route_forward(view, None, query, norm_weight, HEADS, EPS, 1.0),
        "route_backward": lambda: K.route_backward(
            grad_out, view, None, query, norm_weight, lse, HEADS, EPS, 1.0, grad),
        "torch_add": lambda: grad_out + grad_out,
    }  # fmt: skip
    rows = []
    for name, fn in calls_by_name.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host_us = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
        rows.append({"call": name, "host_us": host_us})
        print(f"  host {name:15s} {host_us:7.1f} us", flush=True)
    return rows


def run_sweep(copy_gbps):
    """Forward and history backward around the default launch configs, timed from CUDA
    graphs (the kernels' own time): tiles, warps, register prefetch, pipeline stages, the
    L2 eviction hints and, backward, programs per SM."""
    rows = []
    for case in SWEEP_CASES:
        sources, query, norm_weight, grad_out = site_inputs(case, 1.0)
        width = K._tile_width(case.d, HEADS)
        view = sources.transpose(0, 1)
        gsrc = torch.zeros(sources.shape, device="cuda").transpose(0, 1)
        nb = site_bytes(case)
        _, lse = K.route_forward(view, None, query, norm_weight, HEADS, EPS, 1.0)
        _, bh, bhd = K._tile(case.d, HEADS)
        fwd, bwd = K._fwd_config(width), K._bwd_config(bh * bhd, HEADS == 1)
        # The default first, then one change at a time, then the tiles of twice and half
        # the tokens, and the former defaults: forward 2 warps and three stages (it
        # differs at the 1B width only), backward 2K fp32 per tile at 4 warps and 4
        # programs per SM. Repeats are timed once.
        fwd_loops = [fwd, fwd.override(stages=1), fwd.override(stages=2),
                     fwd.override(stages=3), fwd.override(stages=4),
                     fwd.override(l2_reuse=not fwd.l2_reuse),
                     fwd.override(block_t=max(1, fwd.block_t // 2), num_warps=2),
                     fwd.override(block_t=2 * fwd.block_t),
                     fwd.override(block_t=2 * fwd.block_t, num_warps=8),
                     fwd.override(num_warps=2, stages=3)]  # fmt: skip
        bwd_loops = [bwd, bwd.override(stages=1),
                     bwd.override(stages=3), bwd.override(l2_reuse=not bwd.l2_reuse),
                     bwd.override(programs_per_sm=2), bwd.override(programs_per_sm=4),
                     bwd.override(programs_per_sm=8),
                     bwd.override(block_t=max(1, bwd.block_t // 2)),
                     bwd.override(block_t=2 * bwd.block_t), bwd.override(num_warps=4),
                     K.LoopConfig(max(1, 2048 // (bh * bhd)), 4, 2)]  # fmt: skip
        fwd_loops, bwd_loops = list(dict.fromkeys(fwd_loops)), list(dict.fromkeys(bwd_loops))
        variants = [("fwd", "fwd", loop, lambda loop: K._launch_fwd(
            view, None, query, norm_weight, HEADS, EPS, 1.0, **loop._asdict()))
            for loop in fwd_loops]  # fmt: skip
        variants += [("bwd_history", "bwd_history", loop, lambda loop: K._launch_bwd(
            grad_out, view, None, query, norm_weight, lse, HEADS, EPS, 1.0, gsrc, True,
            **loop._asdict())) for loop in bwd_loops]  # fmt: skip
        for mode, key, loop, launch in variants:
            t = bench(lambda: launch(loop), graph=True)
            frac = nb[key]["moved"] / t["ms"] / 1e6 / copy_gbps
            rows.append({"case": case.name, "mode": mode, **loop._asdict(), **t,
                         "frac_copy_moved": frac})  # fmt: skip
            print(f"  sweep {case.name:15s} {mode:11s} {tuple(loop)} {t['ms']:8.3f} ms {frac:5.2f}",
                  flush=True)  # fmt: skip
    return rows


LOOKAHEAD_SWEEP_MODES = ("group_fwd", "group_bwd", "merge_fwd", "merge_bwd", "merge_row_grad", "row_grads")
ROW_GRADS_ENTRIES = 5  # groups owing a block of rows in the middle of the 1B stack


def deepest_group(case, heads=None, device="cuda", dtype=DTYPE):
    """(G, n0, rows [T, n0, D], their fp32 gradients (zeros), queries, norm weights [G, D],
    output gradients [G, T, D]) of a model's deepest lookahead group with the auto group
    size, random in ``dtype`` (seeded); the queries scaled for ``heads`` (default HEADS)."""
    sites = len(case.site_sources())
    group = auto_group_size(sites)
    n0 = sites - group + 1
    head_dim = case.d // (HEADS if heads is None else heads)
    kw = dict(device=device, generator=torch.Generator(device=device).manual_seed(0))
    buf = torch.randn(case.t, n0, case.d, **kw).to(dtype)
    gbuf = torch.zeros(case.t, n0, case.d, device=device)
    qs = (2.0 / head_dim**0.5 * torch.randn(group, case.d, **kw)).to(dtype)
    ws = (1 + 0.3 * torch.randn(group, case.d, **kw)).to(dtype)
    grad_outs = torch.randn(group, case.t, case.d, **kw).to(dtype)
    return group, n0, buf, gbuf, qs, ws, grad_outs


def run_lookahead_sweep(copy_gbps, modes=LOOKAHEAD_SWEEP_MODES):
    """Phase 1 of the lookahead schedule at each model's deepest group (the largest n0),
    around the default launch configs, timed from CUDA graphs: the forward's sites per
    program, tokens, warps and stages; the backward's row-loop kernel's sites per launch,
    tokens, warps, stages and programs per SM, and its tensor-core kernels at 4 and 8 warps;
    then the merges of that group (0 .. G - 1 new rows, one site after another as a step
    runs them) around their launch configs, the per-site kernels' tiles among them.
    ``modes``: the kernels to time, of LOOKAHEAD_SWEEP_MODES."""
    rows = []
    for case in STEP_CASES:
        if case.variant != "full":
            continue
        group, n0, buf, gbuf, qs, ws, grad_outs = deepest_group(case)
        m, l, acc = LA.group_forward(buf, qs, ws, HEADS, EPS, 1.0)
        lse = (m + l.log()).contiguous()
        seeded = torch.Generator(device="cuda").manual_seed(1)
        deltas = torch.randn(group, case.t, HEADS, device="cuda", generator=seeded)
        _, bh, bhd = K._tile(case.d, HEADS)
        spp, fwd = LA._group_fwd_config(bh * bhd, group)
        bwd_spp, bwd = LA._group_bwd_config(bh * bhd, group, bh)
        es = buf.element_size()
        read = n0 * case.t * case.d * es
        partials = group * case.t * (case.d + 2 * HEADS) * 4
        fwd_bytes = read + partials
        # rows, their fp32 gradient read and written, the grad outputs (one launch's bytes).
        bwd_bytes = read + 8 * n0 * case.t * case.d + group * case.t * case.d * es
        fwd_variants = [(spp, {})] + [(k, {}) for k in (1, 2, 4, 8) if k != spp and k <= group] + [
            (spp, dict(num_warps=4)), (spp, dict(num_warps=8)), (spp, dict(stages=2)),
            (spp, dict(stages=4)), (spp, dict(block_t=2 * fwd.block_t, num_warps=4)),
            (spp, dict(num_warps=1)), (spp, dict(num_warps=1, stages=4)), (1, dict(num_warps=1))]  # fmt: skip
        # The tensor-core forward around its launch config (none where it does not fit).
        dots = LA._group_fwd_dots_config(bh, case.d // HEADS)
        dots_fwd = [] if dots is None else [
            {}, dict(num_warps=12 - dots.num_warps), dict(stages=2), dict(stages=3),
            dict(programs_per_sm=1), dict(programs_per_sm=4), dict(programs_per_sm=8)]  # fmt: skip
        # The row-loop backward around its launch config, then the tensor-core kernels at
        # 4 and 8 warps. The tile halved or doubled with its warps keeps the fp32 per thread
        # (one token of 512 at 2 warps beat two at 4 by a fifth at 100M: mhar_kernels/README.md).
        bwd_variants = [{}, dict(num_warps=12 - bwd.num_warps), dict(num_warps=2), dict(num_warps=16),
                        dict(programs_per_sm=1), dict(programs_per_sm=2), dict(programs_per_sm=8),
                        dict(block_t=2 * bwd.block_t), dict(sites_per_program=group, num_warps=16),
                        dict(block_t=2 * bwd.block_t, num_warps=min(16, 2 * bwd.num_warps)),
                        dict(sites_per_program=group, num_warps=16, stages=2)]  # fmt: skip
        if bwd.block_t > 1 and bwd.num_warps > 1:
            bwd_variants.append(dict(block_t=bwd.block_t // 2, num_warps=bwd.num_warps // 2))
        bwd_variants += [dict(stages=k) for k in (1, 2, 4) if k != bwd.stages]
        bwd_variants += [dict(sites_per_program=k) for k in (1, 2, 4, 8) if k != bwd_spp and k <= group]  # fmt: skip
        # Row-loop variants name the family: the default picks the kernels by group size.
        fwd_variants = [(k, {"tensor_cores": False, **o}) for k, o in fwd_variants]
        bwd_variants = [{"tensor_cores": False, **o} for o in bwd_variants]
        fwd_variants += [(None, dict(tensor_cores=True, **o)) for o in dots_fwd]
        bwd_variants += [dict(tensor_cores=True, num_warps=k) for k in (4, 8)]
        variants = [("group_fwd", fwd_bytes, dict(sites_per_program=k, **o), lambda k=k, o=o: LA.group_forward(
            buf, qs, ws, HEADS, EPS, 1.0, sites_per_program=k, **o)) for k, o in fwd_variants]  # fmt: skip
        variants += [("group_bwd", bwd_bytes, o, lambda o=o: group_backward(
            grad_outs, buf, qs, ws, lse, deltas, gbuf, **o)) for o in bwd_variants]  # fmt: skip
        variants += merge_sweep_variants(case, buf, qs, ws, m, l, acc, grad_outs, bh * bhd, group)
        variants += row_grads_sweep_variants(case, buf, gbuf, qs, ws, lse, deltas, grad_outs, group)
        for mode, nbytes, cfg, launch in variants:
            if mode not in modes:
                continue
            t = bench(launch, graph=True)
            frac = nbytes / t["ms"] / 1e6 / copy_gbps
            rows.append({"case": case.name, "mode": mode, "group": group, "n0": n0, "config": cfg,
                         **t, "bytes": nbytes, "frac_copy": frac})  # fmt: skip
            print(f"  la-sweep {case.name:5s} {mode:9s} {cfg} {t['ms']:8.3f} ms {frac:5.2f}", flush=True)
    return rows


def group_backward(grad_outs, buf, qs, ws, lse, deltas, gbuf, **options):
    """Phase 1's backward of one group with its rows' gradients added at once."""
    _, _, deferred = LA.group_backward_deferred(grad_outs, buf, qs, ws, lse, deltas, HEADS, EPS, 1.0, gbuf, **options)
    LA.add_row_grads([(deferred, buf.shape[1])], buf, gbuf, 0)


def row_grads_sweep_variants(case, buf, gbuf, qs, ws, lse, deltas, grad_outs, group):
    """The deferred phase-1 backward's row-gradient kernel (``add_row_grads``) adding
    ROW_GRADS_ENTRIES groups' factors to the top block of ``group`` rows, around its launch
    config (warps x stages, then the token programs per SM), where the tensor-core
    backward runs. Each entry has its own factors and output gradients, as in a training
    step: one entry repeated finds its operands in cache, and there an unpipelined launch
    measured 0.230 against 0.263 ms while it lost 50 -> 68 ms per 1B training step."""
    n0, es = buf.shape[1], buf.element_size()
    owed = []
    for entry in range(ROW_GRADS_ENTRIES):
        _, _, deferred = LA.group_backward_deferred((1 + entry) * grad_outs, buf, qs, ws, lse, deltas, HEADS, EPS,
                                                    1.0, gbuf, tensor_cores=None)  # fmt: skip
        if not deferred:
            return []
        owed.append((deferred, n0))
    start = n0 - group
    # Per entry: its factors of the block's rows and its sites' output gradients; the rows
    # once and their fp32 gradient read and written once.
    factor_cols = deferred[0].z.shape[-1]  # 2 x SLOTS per head
    nbytes = (ROW_GRADS_ENTRIES * len(deferred) * case.t * (group * (HEADS * factor_cols + 1) * 4 + group * case.d * es)
              + group * case.t * case.d * (es + 8))  # fmt: skip
    configs = [dict(num_warps=w, stages=s) for s in (2, 1, 3) for w in (4, 8, 2)] + [
        dict(programs_per_sm=p) for p in (2, 6, 8, 12)]  # fmt: skip
    return [("row_grads", nbytes, cfg, lambda cfg=cfg: LA.add_row_grads(owed, buf, gbuf, start, **cfg))
            for cfg in configs]


def merge_sweep_variants(case, buf, qs, ws, m, l, acc, grad_outs, padded_d, group):
    """(mode, bytes, config, launch) of the G merges of one group, forward and backward,
    with the group's first rows of ``buf`` standing in for its new rows. Configs as fp32
    elements per tile at a warp count and pipeline depth: the defaults first, then tiles
    around them and the per-site kernels' launch configs at this width."""
    t, d, es = case.t, case.d, buf.element_size()
    new = buf[:, : group - 1]
    gnew = torch.zeros(new.shape, device="cuda")
    factors = torch.zeros((group, t, group - 1, HEADS, 2), device="cuda")
    kv = torch.zeros((group, t, group - 1), device="cuda")
    lse = torch.empty((group, t, HEADS), device="cuda")
    outs = [LA.merge_forward(m[k], l[k], acc[k], new[:, :k], qs[k], ws[k], HEADS, EPS, 1.0, lse[k])
            for k in range(group)]  # fmt: skip
    rows = sum(range(group))  # (site, new row) pairs
    fwd_bytes = group * t * (4 * d + 8 * HEADS + es * d + 4 * HEADS) + rows * t * d * es
    # A pair's factors: (p, tau r ds) per head and tau r c, fp32.
    pair_factors = t * (8 * HEADS + 4)
    bwd_bytes = group * t * (2 * es * d + 8 * HEADS) + rows * (t * d * es + pair_factors)
    # Each new row: its fp32 gradient read, the row read and its gradient written in the
    # rows' dtype; per pair the site's output gradient and the pair's factors.
    row_grad_bytes = (group - 1) * t * d * (4 + 2 * es) + rows * (t * d * es + pair_factors)

    def tile(elements, warps, stages, **extra):
        return K.LoopConfig(max(1, elements // padded_d), warps, stages, **extra)

    mf, mb = LA._merge_fwd_config(padded_d), LA._merge_bwd_config(padded_d)
    # The default, the former default (8K at 4 warps, unpipelined), then tiles around them.
    fwd_loops = [mf, mf.override(stages=2), mf.override(stages=4), tile(8192, 4, 1), tile(8192, 4, 3),
                 tile(8192, 8, 3), tile(4096, 4, 3), tile(4096, 2, 1), tile(4096, 2, 3),
                 K._fwd_config(padded_d)]  # fmt: skip
    # Twice the default's warps on its tile: half the registers per thread for the
    # register-bound programs (not in the joint sweep, which moved stages and programs).
    bwd_loops = [mb, mb.override(stages=2), mb.override(stages=2, programs_per_sm=8),
                 mb.override(num_warps=2 * mb.num_warps), mb.override(num_warps=2 * mb.num_warps, programs_per_sm=8),
                 mb.override(num_warps=2, stages=2), tile(1024, 2, 2, programs_per_sm=8),
                 tile(1024, 2, 1, programs_per_sm=8), tile(4096, 8, 2, programs_per_sm=2),
                 K._bwd_config(padded_d)]  # fmt: skip

    def merges_fwd(loop):
        for k in range(group):
            LA.merge_forward(m[k], l[k], acc[k], new[:, :k], qs[k], ws[k], HEADS, EPS, 1.0, lse[k],
                             **loop._asdict())  # fmt: skip

    mr = LA._merge_row_grad_config(padded_d)
    row_grad_loops = [mr, mr.override(stages=2), mr.override(stages=3), tile(8192, 4, 2), tile(8192, 8, 2),
                      tile(2048, 4, 2), tile(2048, 2, 2), tile(16384, 8, 2)]  # fmt: skip

    def merges_bwd(loop):
        for k in range(group):
            LA.merge_backward(grad_outs[k], outs[k], new[:, :k], qs[k], ws[k], lse[k], HEADS, EPS, 1.0,
                              (factors[k, :, :k], kv[k, :, :k]), **loop._asdict())  # fmt: skip

    def row_grads(loop):
        for i in reversed(range(group - 1)):
            LA.merge_row_grad(new[:, i], gnew[:, i], gnew[:, i], grad_outs, qs, ws, factors, kv, i, (i + 1, group),
                              HEADS, **loop._asdict())  # fmt: skip

    variants = [("merge_fwd", fwd_bytes, loop._asdict(), lambda loop=loop: merges_fwd(loop))
                for loop in dict.fromkeys(fwd_loops)]  # fmt: skip
    variants += [("merge_bwd", bwd_bytes, loop._asdict(), lambda loop=loop: merges_bwd(loop))
                 for loop in dict.fromkeys(bwd_loops)]  # fmt: skip
    variants += [("merge_row_grad", row_grad_bytes, loop._asdict(), lambda loop=loop: row_grads(loop))
                 for loop in dict.fromkeys(row_grad_loops)]  # fmt: skip
    return variants


def main():
    global HEADS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/routing_h200.json")
    parser.add_argument("--logit-scale", type=float, default=1.0)
    parser.add_argument("--impls", default="triton,eager,compile")
    parser.add_argument("--sections", default="host,site,step",
                        help="comma list of host, site, step (empty: only the sweeps)")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep the kernels' launch configs (CUDA graphs)")
    parser.add_argument("--sweep-lookahead", nargs="?", const=",".join(LOOKAHEAD_SWEEP_MODES),
                        help="also sweep the lookahead kernels' launch configs; optional comma "
                             f"list of the kernels ({', '.join(LOOKAHEAD_SWEEP_MODES)}; default all)")
    parser.add_argument("--heads", type=int, default=HEADS,
                        help="routing heads H of every case (1 = AttnRes)")
    parser.add_argument("--lookahead-groups", default="0",
                        help="comma list of lookahead group sizes for the step section (0 = auto)")
    args = parser.parse_args()
    HEADS = args.heads
    widths = sorted({c.d for c in SITE_CASES + STEP_CASES + SWEEP_CASES})
    if HEADS < 1 or any(d % HEADS for d in widths):
        parser.error(f"--heads {HEADS} must divide every case's width {widths}: use 1, 2, 4, 8, ... 256")
    unknown = [x for x in args.sections.split(",") if x and x not in ("host", "site", "step")]
    unknown += [x for x in args.impls.split(",") if x not in ("triton", "eager", "compile", "lookahead")]
    if args.sweep_lookahead:
        unknown += [x for x in args.sweep_lookahead.split(",") if x not in LOOKAHEAD_SWEEP_MODES]
    if unknown:
        parser.error(f"unknown sections/impls/sweep kernels {unknown}: sections are host, site, step; "
                     "impls are triton, eager, compile, lookahead; sweep kernels are "
                     + ", ".join(LOOKAHEAD_SWEEP_MODES))
    if not all(g.isdigit() for g in args.lookahead_groups.split(",")):
        parser.error(f"--lookahead-groups {args.lookahead_groups!r} is not a comma list of group sizes >= 0 (0 = auto)")
    groups = [int(g) for g in args.lookahead_groups.split(",")]
    impls = args.impls.split(",")
    if groups != [0] and ("lookahead" not in impls or "step" not in args.sections.split(",")):
        parser.error("--lookahead-groups is timed by the step section's lookahead impl: "
                     "add step to --sections and lookahead to --impls")
    if not (set(args.sections.split(",")) - {""} or args.sweep or args.sweep_lookahead):
        parser.error("nothing to run: --sections is empty and neither --sweep nor --sweep-lookahead is given")
    check_out(parser, args.out)
    if not torch.cuda.is_available():
        parser.error("bench_routing.py times CUDA kernels: run it on a GPU")
    torch._dynamo.config.cache_size_limit = 256
    # Inductor's donated buffers forbid retain_graph, which the backward-only timing needs.
    torch._functorch.config.donated_buffer = False
    props = torch.cuda.get_device_properties(0)
    report = {
        "gpu": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dtype": str(DTYPE),
        "heads": HEADS,
        "logit_scale": args.logit_scale,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }

    def save():
        write_json(args.out, report)

    report["copy"] = copy_bandwidth()
    copy_gbps = report["copy"]["gbps"]
    print(f"copy bandwidth {copy_gbps:.0f} GB/s on {report['gpu']}", flush=True)
    save()
    sections = args.sections.split(",")
    if args.sweep:
        report["sweep"] = run_sweep(copy_gbps)
        save()
    if args.sweep_lookahead:
        report["lookahead_sweep"] = run_lookahead_sweep(copy_gbps, args.sweep_lookahead.split(","))
        save()
    if "host" in sections:
        report["host"] = run_host()
        save()
    if "site" in sections:
        report["site"] = []
        for case in SITE_CASES:
            report["site"] += run_site(case, args.logit_scale, impls, copy_gbps)
            save()
    if "step" in sections:
        report["step"] = []
        for case in STEP_CASES:
            report["step"].append(run_step(case, args.logit_scale, impls, groups))
            save()
    summarize(report)
    save()


def summarize(report):
    """Print the headline table: fraction of copy bandwidth and speed-up over compile."""
    rows = report.get("site", [])
    index = {(r["case"], r["impl"], r["mode"]): r for r in rows}
    print(f"\n{'case':11s} {'mode':8s} {'triton ms':>9s} {'frac':>5s} {'eager x':>8s} {'compile x':>9s}")
    for case in SITE_CASES:
        for mode in ("fwd", "bwd", "fwd+bwd"):
            tri = index.get((case.name, "triton", mode))
            if tri is None:
                continue
            ratios = []
            for impl in ("eager", "compile"):
                other = index.get((case.name, impl, mode))
                ratios.append(other["ms"] / tri["ms"] if other else float("nan"))
            print(f"{case.name:11s} {mode:8s} {tri['ms']:9.3f} {tri['frac_copy_moved']:5.2f} "
                  f"{ratios[0]:8.2f} {ratios[1]:9.2f}")  # fmt: skip
        for impl, label in (("triton_history", "hist"), ("triton_history_graph", "graph")):
            for mode in ("fwd", "bwd"):
                hist = index.get((case.name, impl, mode))
                if hist:
                    print(f"{case.name:11s} {mode + '_' + label:8s} {hist['ms']:9.3f} "
                          f"{hist['frac_copy_moved']:5.2f}")
    for step in report.get("step", []):
        impls = ["triton"] + sorted(k for k in step if k.startswith("lookahead")) + ["eager", "compile"]
        cells = " ".join(
            f"{impl} {step[impl]['ms']:.2f} ms" if "ms" in step.get(impl, {}) else f"{impl} -"
            for impl in impls
        )
        print(f"step {step['case']:9s} {cells}")


if __name__ == "__main__":
    main()
