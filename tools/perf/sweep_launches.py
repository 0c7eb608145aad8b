"""Launch sweeps of the routing kernels around their launch rules (mhar_kernels.launch).

    python -m tools.perf.sweep_launches --sweep site --out /tmp/sweep.json
    python -m tools.perf.sweep_launches --sweep lookahead --kernels group_bwd,row_grads

``site``: the per-site forward and history backward at the paper shapes (the routing
cases of ``benchmarks.common``): tiles, warps, pipeline stages, L2 hints and programs per SM.
``lookahead``: the lookahead kernels at each model's deepest group (tools/perf/groups.py):
phase 1 forward and backward on both kernel families, the merges, a new row's gradient
and the deferred row gradients. Every variant is timed from a CUDA graph (the kernels
without launch cost), with its fraction of the copy bandwidth measured in the same run;
the default launch comes first in each list. A launch rule changes only with a sweep that
shows the new choice faster at every model shape it moves.
"""

import argparse
import time

import torch

from benchmarks.common import (
    EPS,
    SiteCase,
    bench,
    check_out,
    copy_bandwidth,
    environment,
    site_cases,
    step_cases,
    write_json,
)
from mhar_kernels import depth_route as K
from mhar_kernels import launch
from mhar_kernels import lookahead as LA
from tools.perf.groups import OWING_GROUPS, deepest_group

HEADS = 8
"""Routing heads of every case (``--heads``)."""
STEP_CASES = step_cases()
SITE_CASES = site_cases(STEP_CASES)
SWEEP_CASES = SITE_CASES[:4] + SITE_CASES[5:] + [
    # Same tokens and depth as 1B-final at a power-of-two width: isolates the cost of
    # padding 1280 (head width 160) to a 2048-wide register tile.
    SiteCase("probe-D1024-N73", 1024, 73, 2 * 1024),
]


def launched(call, **kernels):
    """``call`` with the named kernels' launches overridden (``launch.overridden``) while it
    runs: the settings hold when the kernels are captured into the timing's CUDA graph."""

    def run():
        with launch.overridden(**kernels):
            return call()

    return run


def run_sweep(copy_gbps):
    """Forward and history backward around the default launch configs, timed from CUDA
    graphs (the kernels' own time): tiles, warps, pipeline stages, the L2 eviction hints
    and, backward, programs per SM."""
    rows = []
    for case in SWEEP_CASES:
        sources, query, norm_weight, grad_out = case.inputs(HEADS, 1.0)
        width = launch.tile_width(case.d, HEADS)
        view = sources.transpose(0, 1)
        gsrc = torch.zeros(sources.shape, device="cuda").transpose(0, 1)
        nb = case.bytes(HEADS)
        _, lse = K.route_forward(view, None, query, norm_weight, HEADS, EPS, 1.0)
        _, bh, bhd = launch.tile(case.d, HEADS)
        fwd, bwd = launch.route_fwd_config(width), launch.route_bwd_config(bh * bhd, HEADS == 1)
        # The default first, then one change at a time, then the tiles of twice and half
        # the tokens, and two neighbours: forward at 2 warps and three stages (it differs
        # at the 1B width only), backward 2K fp32 per tile at 4 warps and 4 programs per
        # SM. Repeats are timed once.
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
                     launch.LoopConfig(max(1, 2048 // (bh * bhd)), 4, 2)]  # fmt: skip
        fwd_loops, bwd_loops = list(dict.fromkeys(fwd_loops)), list(dict.fromkeys(bwd_loops))
        variants = [("fwd", "fwd", loop, launched(lambda: K.route_forward(
            view, None, query, norm_weight, HEADS, EPS, 1.0), route_fwd=loop._asdict()))
            for loop in fwd_loops]  # fmt: skip
        variants += [("bwd_history", "bwd_history", loop, launched(lambda: K.route_backward(
            grad_out, view, None, query, norm_weight, lse, HEADS, EPS, 1.0, gsrc), route_bwd=loop._asdict()))
            for loop in bwd_loops]  # fmt: skip
        for mode, key, loop, call in variants:
            t = bench(call, graph=True)
            frac = nb[key]["moved"] / t["ms"] / 1e6 / copy_gbps
            rows.append({"case": case.name, "mode": mode, **loop._asdict(), **t,
                         "frac_copy_moved": frac})  # fmt: skip
            print(f"  sweep {case.name:15s} {mode:11s} {tuple(loop)} {t['ms']:8.3f} ms {frac:5.2f}",
                  flush=True)  # fmt: skip
    return rows


LOOKAHEAD_SWEEP_MODES = ("group_fwd", "group_bwd", "merge_fwd", "merge_bwd", "merge_row_grad", "row_grads")


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
        group, n0, buf, gbuf, qs, ws, grad_outs = deepest_group(case, HEADS)
        m, l, acc = LA.group_forward(buf, qs, ws, HEADS, EPS, 1.0, lookahead_kernels="row_loop")
        lse = (m + l.log()).contiguous()
        seeded = torch.Generator(device="cuda").manual_seed(1)
        deltas = torch.randn(group, case.t, HEADS, device="cuda", generator=seeded)
        _, bh, bhd = launch.tile(case.d, HEADS)
        spp, fwd = launch.group_fwd_config(bh * bhd, group)
        bwd_spp, bwd = launch.group_bwd_config(bh * bhd, group, bh)
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
        dots = launch.group_fwd_dots_config(bh, case.d // HEADS)
        dots_fwd = [] if dots is None else [
            {}, dict(num_warps=12 - dots.num_warps), dict(stages=2), dict(stages=3),
            dict(programs_per_sm=1), dict(programs_per_sm=4), dict(programs_per_sm=8)]  # fmt: skip
        # The row-loop backward around its launch config, then the tensor-core kernels at
        # 4 and 8 warps. The tile halved or doubled with its warps keeps the fp32 per thread.
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
        fwd_variants = [(k, {"lookahead_kernels": "row_loop", **o}) for k, o in fwd_variants]
        bwd_variants = [{"lookahead_kernels": "row_loop", **o} for o in bwd_variants]
        fwd_variants += [(None, dict(lookahead_kernels="tensor_cores", **o)) for o in dots_fwd]
        bwd_variants += [dict(lookahead_kernels="tensor_cores", num_warps=k) for k in (4, 8)]
        variants = [("group_fwd", fwd_bytes, dict(sites_per_program=k, **o), launched(
            lambda o=o: LA.group_forward(buf, qs, ws, HEADS, EPS, 1.0, lookahead_kernels=o["lookahead_kernels"]),
            group_fwd=dict(sites_per_program=k, **_launch_fields(o)))) for k, o in fwd_variants]  # fmt: skip
        variants += [("group_bwd", bwd_bytes, o, launched(
            lambda o=o: group_backward(grad_outs, buf, qs, ws, lse, deltas, gbuf, o["lookahead_kernels"]),
            group_bwd=_launch_fields(o))) for o in bwd_variants]  # fmt: skip
        variants += merge_sweep_variants(case, buf, qs, ws, m, l, acc, grad_outs, bh * bhd, group)
        variants += row_grads_sweep_variants(case, buf, gbuf, qs, ws, lse, deltas, grad_outs, group)
        for mode, nbytes, cfg, call in variants:
            if mode not in modes:
                continue
            t = bench(call, graph=True)
            frac = nbytes / t["ms"] / 1e6 / copy_gbps
            rows.append({"case": case.name, "mode": mode, "group": group, "n0": n0, "config": cfg,
                         **t, "bytes": nbytes, "frac_copy": frac})  # fmt: skip
            print(f"  la-sweep {case.name:5s} {mode:9s} {cfg} {t['ms']:8.3f} ms {frac:5.2f}", flush=True)
    return rows


def _launch_fields(variant):
    """A variant's launch fields (all but its kernel family)."""
    return {k: v for k, v in variant.items() if k != "lookahead_kernels"}


def group_backward(grad_outs, buf, qs, ws, lse, deltas, gbuf, lookahead_kernels):
    """Phase 1's backward of one group with its rows' gradients added at once."""
    _, _, deferred = LA.group_backward_deferred(grad_outs, buf, qs, ws, lse, deltas, HEADS, EPS, 1.0, gbuf,
                                                lookahead_kernels=lookahead_kernels)  # fmt: skip
    LA.add_row_grads([(deferred, buf.shape[1])], buf, gbuf, 0)


def row_grads_sweep_variants(case, buf, gbuf, qs, ws, lse, deltas, grad_outs, group):
    """The deferred phase-1 backward's row-gradient kernel (``add_row_grads``) adding
    OWING_GROUPS groups' factors to the top block of ``group`` rows, around its launch
    config (warps x stages, then the token programs per SM), where the tensor-core
    backward runs. Each entry has its own factors and output gradients, as in a training
    step: one entry repeated would find its operands in cache, which flatters the launches
    that hide the least latency."""
    n0, es = buf.shape[1], buf.element_size()
    owed = []
    for entry in range(OWING_GROUPS):
        _, _, deferred = LA.group_backward_deferred((1 + entry) * grad_outs, buf, qs, ws, lse, deltas, HEADS, EPS,
                                                    1.0, gbuf, lookahead_kernels="auto")  # fmt: skip
        if not deferred:
            return []
        owed.append((deferred, n0))
    start = n0 - group
    # Per entry: its factors of the block's rows and its sites' output gradients; the rows
    # once and their fp32 gradient read and written once.
    factor_cols = deferred[0].z.shape[-1]  # 2 x SLOTS per head
    nbytes = (OWING_GROUPS * len(deferred) * case.t * (group * (HEADS * factor_cols + 1) * 4 + group * case.d * es)
              + group * case.t * case.d * (es + 8))  # fmt: skip
    configs = [dict(num_warps=w, stages=s) for s in (2, 1, 3) for w in (4, 8, 2)] + [
        dict(programs_per_sm=p) for p in (2, 6, 8, 12)]  # fmt: skip
    return [("row_grads", nbytes, cfg, launched(lambda: LA.add_row_grads(owed, buf, gbuf, start), add_row_grads=cfg))
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
        return launch.LoopConfig(max(1, elements // padded_d), warps, stages, **extra)

    mf, mb = launch.merge_fwd_config(padded_d), launch.merge_bwd_config(padded_d)
    # The default, 8K at 4 warps unpipelined, then tiles around them.
    fwd_loops = [mf, mf.override(stages=2), mf.override(stages=4), tile(8192, 4, 1), tile(8192, 4, 3),
                 tile(8192, 8, 3), tile(4096, 4, 3), tile(4096, 2, 1), tile(4096, 2, 3),
                 launch.route_fwd_config(padded_d)]  # fmt: skip
    # Twice the default's warps on its tile: half the registers per thread for the
    # register-bound programs.
    bwd_loops = [mb, mb.override(stages=2), mb.override(stages=2, programs_per_sm=8),
                 mb.override(num_warps=2 * mb.num_warps), mb.override(num_warps=2 * mb.num_warps, programs_per_sm=8),
                 mb.override(num_warps=2, stages=2), tile(1024, 2, 2, programs_per_sm=8),
                 tile(1024, 2, 1, programs_per_sm=8), tile(4096, 8, 2, programs_per_sm=2),
                 launch.route_bwd_config(padded_d)]  # fmt: skip

    def merges_fwd():
        for k in range(group):
            LA.merge_forward(m[k], l[k], acc[k], new[:, :k], qs[k], ws[k], HEADS, EPS, 1.0, lse[k])

    mr = launch.merge_row_grad_config(padded_d)
    row_grad_loops = [mr, mr.override(stages=2), mr.override(stages=3), tile(8192, 4, 2), tile(8192, 8, 2),
                      tile(2048, 4, 2), tile(2048, 2, 2), tile(16384, 8, 2)]  # fmt: skip

    def merges_bwd():
        for k in range(group):
            LA.merge_backward(grad_outs[k], outs[k], new[:, :k], qs[k], ws[k], lse[k], HEADS, EPS, 1.0,
                              (factors[k, :, :k], kv[k, :, :k]))  # fmt: skip

    def row_grads():
        for i in reversed(range(group - 1)):
            LA.merge_row_grad(new[:, i], gnew[:, i], gnew[:, i], grad_outs, qs, ws, factors, kv, i, (i + 1, group),
                              HEADS)  # fmt: skip

    variants = [("merge_fwd", fwd_bytes, loop._asdict(), launched(merges_fwd, merge_fwd=loop._asdict()))
                for loop in dict.fromkeys(fwd_loops)]  # fmt: skip
    variants += [("merge_bwd", bwd_bytes, loop._asdict(), launched(merges_bwd, merge_bwd=loop._asdict()))
                 for loop in dict.fromkeys(bwd_loops)]  # fmt: skip
    variants += [("merge_row_grad", row_grad_bytes, loop._asdict(), launched(row_grads, merge_row_grad=loop._asdict()))
                 for loop in dict.fromkeys(row_grad_loops)]  # fmt: skip
    return variants


def main(argv=None):
    global HEADS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", required=True, choices=("site", "lookahead"))
    parser.add_argument("--kernels", default=",".join(LOOKAHEAD_SWEEP_MODES),
                        help=f"--sweep lookahead: comma list of {', '.join(LOOKAHEAD_SWEEP_MODES)}")
    parser.add_argument("--heads", type=int, default=HEADS, help="routing heads H of every case (1 = AttnRes)")
    parser.add_argument("--out", help="JSON report")
    args = parser.parse_args(argv)
    kernels = args.kernels.split(",")
    unknown = sorted(set(kernels) - set(LOOKAHEAD_SWEEP_MODES))
    if unknown:
        parser.error(f"--kernels: unknown {unknown}; the kernels are {', '.join(LOOKAHEAD_SWEEP_MODES)}")
    widths = sorted({c.d for c in SWEEP_CASES + STEP_CASES})
    if args.heads < 1 or any(d % args.heads for d in widths):
        parser.error(f"--heads {args.heads} must divide every case's width {widths}")
    check_out(parser, args.out)
    if not torch.cuda.is_available():
        parser.error("tools.perf.sweep_launches times CUDA kernels: run it on a GPU")
    HEADS = args.heads
    report = {"environment": environment(), "heads": args.heads, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "copy": copy_bandwidth()}  # fmt: skip
    copy_gbps = report["copy"]["gbps"]
    if args.sweep == "site":
        report["sweep"] = run_sweep(copy_gbps)
    else:
        report["lookahead_sweep"] = run_lookahead_sweep(copy_gbps, kernels)
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
