"""This checkout's lookahead kernels against another revision's, in one process: times and bits.

    python -m tools.perf.base_kernels HEAD~1 /tmp/mhar_base      # in the git checkout
    python -m tools.perf.compare_kernels /tmp/mhar_base --out /tmp/kernels_ab.json

At each model's deepest lookahead group (``tools/perf/groups.py``: the auto group size,
random bf16 rows), every entry point of ``mhar_kernels.lookahead`` that a training
step calls runs at its default launch on both trees, the checkout's and the base's in
turn, ``--rounds`` times each, timed from CUDA graphs; the reported time is each tree's
fastest round. The two trees' outputs on the same inputs are compared: ``bitwise`` (every
output tensor ``torch.equal``) and the largest absolute difference. A kernel change that
is meant to move only time should come out bitwise; one that reorders sums shows its
rounding here before it reaches a training run (``benchmarks.bench_training
--base-kernels``, the measure of record).

Kernels (``--kernels``), each as a training step runs it over one group of G sites:
  group_forward    phase 1 over the group's old rows (``lookahead_kernels="auto"``)
  group_backward   phase 1's backward, row gradients stored (deferred ones added at once)
  merges_forward   the G merges of the group's new rows into the sites' partials
  merges_backward  the G merge backwards as the model calls them: delta, a copy of the
                   output gradient and the dL/dw partials into the group's workspaces,
                   the new rows' factors
  new_row_grads    the G - 1 new rows' gradients from those factors (``merge_row_grad``)
  row_grads        ``add_row_grads`` of OWING_GROUPS groups' deferred factors to the
                   group's block of rows (only where the auto pick defers: 1B)
The inputs every kernel gets (partials, lse, delta, factors) come from the checkout's
kernels, so both trees see the same bits. A kernel whose signature differs between the
trees is reported with the error and skipped.
"""

import argparse
import json
import time
from typing import Callable, Dict, List, Sequence

import torch
import triton

from benchmarks.common import EPS, check_out, environment, step_cases, write_json
from mhar_kernels import lookahead as LA
from tools.perf import base_kernels
from tools.perf.groups import OWING_GROUPS, deepest_group

KERNELS = ("group_forward", "group_backward", "merges_forward", "merges_backward", "new_row_grads", "row_grads")


def group_inputs(case, heads: int, device, dtype) -> Dict[str, object]:
    """A model's deepest group and what each kernel consumes, from the checkout's kernels."""
    group, n0, buf, _, qs, ws, grad_outs = deepest_group(case, heads, device, dtype)
    t, d = case.t, case.d
    seeded = torch.Generator(device=device).manual_seed(1)
    m, l, acc = LA.group_forward(buf, qs, ws, heads, EPS, 1.0, lookahead_kernels="row_loop")
    lse = (m + l.log()).contiguous()
    deltas = torch.randn(group, t, heads, device=device, generator=seeded)
    new = buf[:, : group - 1]  # the group's first rows stand in for its new rows
    merge_lse = torch.empty((group, t, heads), device=device)
    outs = [LA.merge_forward(m[k], l[k], acc[k], new[:, :k], qs[k], ws[k], heads, EPS, 1.0, merge_lse[k])
            for k in range(group)]  # fmt: skip
    factors = torch.zeros((group, t, group - 1, heads, 2), device=device)
    kv = torch.zeros((group, t, group - 1), device=device)
    for k in range(group):
        LA.merge_backward(grad_outs[k], outs[k], new[:, :k], qs[k], ws[k], merge_lse[k], heads, EPS, 1.0,
                          (factors[k, :, :k], kv[k, :, :k]))  # fmt: skip
    owed = []
    for entry in range(OWING_GROUPS):
        _, _, deferred = LA.group_backward_deferred(
            (1 + entry) * grad_outs, buf, qs, ws, lse, deltas, heads, EPS, 1.0,
            torch.zeros(buf.shape, device=device), lookahead_kernels="auto")  # fmt: skip
        if deferred:
            owed.append((deferred, n0))
    new_grad = torch.randn(new.shape, device=device, generator=seeded)  # their other reads' share
    return dict(heads=heads, group=group, n0=n0, buf=buf, qs=qs, ws=ws, grad_outs=grad_outs, m=m, l=l, acc=acc,
                lse=lse, deltas=deltas, new=new, merge_lse=merge_lse, outs=outs, factors=factors, kv=kv,
                owed=owed, new_grad=new_grad)  # fmt: skip


def launches(la, x) -> Dict[str, Callable[[], Sequence[torch.Tensor]]]:
    """{kernel: a call of ``la``'s entry points on the inputs ``x`` that allocates its
    outputs and returns them}; row_grads only where the auto pick defers."""
    h, g, buf, qs, ws, grad_outs, new = x["heads"], x["group"], x["buf"], x["qs"], x["ws"], x["grad_outs"], x["new"]
    fp32 = dict(dtype=torch.float32, device=buf.device)

    def group_forward():
        return la.group_forward(buf, qs, ws, h, EPS, 1.0, lookahead_kernels="auto")

    def group_backward():
        grad = torch.empty(buf.shape, **fp32)
        dq, dg, deferred = la.group_backward_deferred(grad_outs, buf, qs, ws, x["lse"], x["deltas"], h, EPS, 1.0,
                                                      grad, lookahead_kernels="auto", accumulate=False)  # fmt: skip
        la.add_row_grads([(deferred, buf.shape[1])], buf, grad, 0, accumulate=False)
        return dq, dg, grad

    def merges_forward():
        lse = torch.empty((g, buf.shape[0], h), **fp32)
        outs = [la.merge_forward(x["m"][k], x["l"][k], x["acc"][k], new[:, :k], qs[k], ws[k], h, EPS, 1.0, lse[k])
                for k in range(g)]  # fmt: skip
        return (*outs, lse)

    def merges_backward():
        # As the model calls them: delta, a copy of the output gradient and the dL/dw
        # partials go into the group's workspaces (RoutingGroup.workspace).
        t, d = grad_outs.shape[1:]
        factors, kv = torch.zeros_like(x["factors"]), torch.zeros_like(x["kv"])
        deltas, copies = torch.empty((g, t, h), **fp32), torch.empty_like(grad_outs)
        dw = torch.empty((la.merge_dw_partials(t, d, h, buf.device), g, d), **fp32)
        for k in range(g):
            la.merge_backward(grad_outs[k], x["outs"][k], new[:, :k], qs[k], ws[k], x["merge_lse"][k], h, EPS, 1.0,
                              (factors[k, :, :k], kv[k, :, :k]), deltas[k], copies[k], dw[:, k])  # fmt: skip
        return deltas, copies, dw, factors, kv

    def new_row_grads():
        rows = torch.empty(new.shape, dtype=buf.dtype, device=buf.device)
        for i in reversed(range(g - 1)):
            la.merge_row_grad(new[:, i], x["new_grad"][:, i], rows[:, i], grad_outs, qs, ws, x["factors"], x["kv"],
                              i, (i + 1, g), h)  # fmt: skip
        return (rows,)

    def row_grads():
        grad = torch.empty(buf.shape, **fp32)
        start = x["n0"] - g
        la.add_row_grads(x["owed"], buf, grad, start, accumulate=False)
        return (grad[:, start:],)

    calls = dict(group_forward=group_forward, group_backward=group_backward, merges_forward=merges_forward,
                 merges_backward=merges_backward, new_row_grads=new_row_grads, row_grads=row_grads)  # fmt: skip
    if not x["owed"]:
        del calls["row_grads"]
    return calls


def graph_ms(fn) -> float:
    """Milliseconds of ``fn`` replayed from a CUDA graph (the kernels without launch cost)."""
    return triton.testing.do_bench_cudagraph(fn, rep=100)


def wall_ms(fn) -> float:
    """One call's wall milliseconds: the interpreter's, which only exercises the comparison."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def compare(base, cases, heads_list, kernels, device, dtype, timer, rounds: int = 2) -> List[dict]:
    """Rows of (case, heads, kernel): each tree's fastest of ``rounds`` timings, their
    ratio and whether the outputs agree; ``base`` the other tree's ``mhar_kernels.lookahead``."""
    rows = []
    for case in cases:
        for heads in heads_list:
            x = group_inputs(case, heads, device, dtype)
            trees = {"checkout": launches(LA, x), "base": launches(base, x)}
            for kernel in [k for k in kernels if k in trees["checkout"]]:
                row = dict(case=case.name, heads=heads, kernel=kernel, group=x["group"], n0=x["n0"])
                try:
                    outputs = {name: [o.clone() for o in calls[kernel]()] for name, calls in trees.items()}
                    times = {name: [] for name in trees}
                    for _ in range(rounds):
                        for name, calls in trees.items():
                            times[name].append(timer(calls[kernel]))
                except (TypeError, AttributeError, ValueError) as err:  # the trees' entry points differ
                    row["error"] = f"{type(err).__name__}: {err}"
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    continue
                mine, theirs = outputs["checkout"], outputs["base"]
                same_shapes = len(mine) == len(theirs) and all(a.shape == b.shape for a, b in zip(mine, theirs))
                row.update(
                    ms_checkout=min(times["checkout"]), ms_base=min(times["base"]),
                    rounds={name: ms for name, ms in times.items()},
                    speedup=min(times["base"]) / min(times["checkout"]),
                    bitwise=same_shapes and all(torch.equal(a, b) for a, b in zip(mine, theirs)),
                    max_abs_diff=max((a.float() - b.float()).abs().max().item() for a, b in zip(mine, theirs))
                    if same_shapes else None,
                )  # fmt: skip
                print(f"  {case.name:5s} H={heads} {kernel:15s} {row['ms_checkout']:8.4f} ms against "
                      f"{row['ms_base']:8.4f} ({row['speedup']:.3f}x) bitwise={row['bitwise']}", flush=True)  # fmt: skip
                rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", metavar="DIR", help="the other revision's kernels (python -m tools.perf.base_kernels REV DIR)")
    parser.add_argument("--cases", default="100M,350M,1B", help="comma list of the full-variant cases")
    parser.add_argument("--heads", default="8,1", help="comma list of routing head counts")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of {', '.join(KERNELS)}")
    parser.add_argument("--rounds", type=int, default=2, help="timings per tree, interleaved")
    parser.add_argument("--out", help="JSON report")
    args = parser.parse_args(argv)
    full = {c.name: c for c in step_cases() if c.variant == "full"}
    cases = [full.get(name) for name in args.cases.split(",")]
    if None in cases:
        parser.error(f"--cases {args.cases}: the cases are {', '.join(full)}")
    kernels = args.kernels.split(",")
    if set(kernels) - set(KERNELS):
        parser.error(f"--kernels: unknown {sorted(set(kernels) - set(KERNELS))}; the kernels are {', '.join(KERNELS)}")
    try:
        heads = [int(h) for h in args.heads.split(",")]
    except ValueError:
        parser.error(f"--heads {args.heads!r} is not a comma list of integers")
    if any(h < 1 or c.d % h for h in heads for c in cases):
        parser.error(f"--heads {args.heads}: each must divide every case's width {sorted({c.d for c in cases})}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    check_out(parser, args.out)
    try:
        base = base_kernels.load(args.base)["mhar_kernels.lookahead"]
    except ValueError as err:
        parser.error(str(err))
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (tests/benchmarks/test_compare_kernels.py runs compare() in the interpreter)")
    report = {
        "note": "this checkout's lookahead kernels against --base's at each model's deepest group, default launches, "
                "CUDA graphs; speedup = base ms / checkout ms; bitwise: every output equal",
        "environment": environment(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "trees": {"checkout": base_kernels.describe(base_kernels.ROOT), "base": base_kernels.describe(args.base)},
        "rows": compare(base, cases, heads, kernels, "cuda", torch.bfloat16, graph_ms, args.rounds),
    }  # fmt: skip
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
