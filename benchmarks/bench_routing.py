"""Depth-routing benchmark: fused Triton kernels vs the eager and compiled reference.

    python -m benchmarks.bench_routing      # writes benchmarks/results/routing/<device>.json

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

Times are ``triton.testing.do_bench`` quantiles (median, 20%, 80%) in ms. ``bytes_min``
counts each input read once and each output written once; ``bytes_moved`` is what the
fused kernels move (the backward reads the sources twice). Fractions are of the copy
bandwidth measured in the same run.
"""

import argparse
import time

import torch

from benchmarks.common import (
    EPS,
    HEADS,
    SiteCase,
    bench,
    check_out,
    copy_bandwidth,
    default_out,
    device_name,
    environment,
    site_cases,
    step_cases,
    write_json,
)
from benchmarks.routing_bytes import lookahead as lookahead_bytes
from benchmarks.routing_bytes import per_site as per_site_bytes
from megatron_mhar.ops.depth_route import depth_route_reference, torch_route_backward, torch_route_forward
from megatron_mhar.ops.schedules import auto_group_size, group_ranges
from mhar_kernels import depth_route as K
from mhar_kernels import lookahead as LA

DTYPE = torch.bfloat16
STEP_CASES = step_cases()
SITE_CASES = site_cases(STEP_CASES)


def peak_bytes(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


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


def run_site(case, tau, impls, copy_gbps):
    sources, query, norm_weight, grad_out = case.inputs(HEADS, tau, DTYPE)
    nbytes = case.bytes(HEADS, DTYPE)
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
            m, l, acc = LA.group_forward(buf[:, :n0], qs, ws, HEADS, EPS, tau, lookahead_kernels="auto")
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
                                                        gbuf[:, :n0], lookahead_kernels="auto")  # fmt: skip
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


def run_host(calls=2000):
    """Host µs per backend call at a tiny 1B-width site (the GPU keeps up), next to one
    plain CUDA op: what a routing site costs the host in a host-bound training step."""
    case = SiteCase("host-1B-N9", 1280, 9, 64)
    sources, query, norm_weight, grad_out = case.inputs(HEADS, 1.0, DTYPE)
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


def main():
    global HEADS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=default_out("routing", device_name()), help="JSON report (default: %(default)s)")
    parser.add_argument("--logit-scale", type=float, default=1.0)
    parser.add_argument("--impls", default="triton,eager,compile")
    parser.add_argument("--sections", default="host,site,step", help="comma list of host, site, step")
    parser.add_argument("--heads", type=int, default=HEADS,
                        help="routing heads H of every case (1 = AttnRes)")
    parser.add_argument("--lookahead-groups", default="0",
                        help="comma list of lookahead group sizes for the step section (0 = auto)")
    args = parser.parse_args()
    HEADS = args.heads
    widths = sorted({c.d for c in SITE_CASES + STEP_CASES})
    if HEADS < 1 or any(d % HEADS for d in widths):
        parser.error(f"--heads {HEADS} must divide every case's width {widths}: use 1, 2, 4, 8, ... 256")
    unknown = [x for x in args.sections.split(",") if x and x not in ("host", "site", "step")]
    unknown += [x for x in args.impls.split(",") if x not in ("triton", "eager", "compile", "lookahead")]
    if unknown:
        parser.error(f"unknown sections/impls {unknown}: sections are host, site, step; "
                     "impls are triton, eager, compile, lookahead")
    if not all(g.isdigit() for g in args.lookahead_groups.split(",")):
        parser.error(f"--lookahead-groups {args.lookahead_groups!r} is not a comma list of group sizes >= 0 (0 = auto)")
    groups = [int(g) for g in args.lookahead_groups.split(",")]
    impls = args.impls.split(",")
    if groups != [0] and ("lookahead" not in impls or "step" not in args.sections.split(",")):
        parser.error("--lookahead-groups is timed by the step section's lookahead impl: "
                     "add step to --sections and lookahead to --impls")
    if not set(args.sections.split(",")) - {""}:
        parser.error("nothing to run: --sections is empty")
    check_out(parser, args.out)
    if not torch.cuda.is_available():
        parser.error("benchmarks.bench_routing times CUDA kernels: run it on a GPU")
    torch._dynamo.config.cache_size_limit = 256
    # Inductor's donated buffers forbid retain_graph, which the backward-only timing needs.
    torch._functorch.config.donated_buffer = False
    report = {
        "environment": environment(),
        "dtype": str(DTYPE),
        "heads": HEADS,
        "logit_scale": args.logit_scale,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }

    def save():
        write_json(args.out, report)

    report["copy"] = copy_bandwidth()
    copy_gbps = report["copy"]["gbps"]
    print(f"copy bandwidth {copy_gbps:.0f} GB/s on {report['environment']['gpu']}", flush=True)
    save()
    sections = args.sections.split(",")
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
