"""Each lookahead kernel launched once at each model's deepest group, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis -o lookahead \
        python -m tools.perf.profile_lookahead [--sizes 100M,350M,1B]
    ncu --import lookahead.ncu-rep --page details

The launches are those of a training step with the default (``auto``) kernels: phase 1
forward and backward (row loops at 100M, dots at 350M forward and at 1B), the deferred
row gradients with five owing groups (as in the middle of the 1B stack), a merge forward
and backward of half the group's new rows and one new row's gradient. Everything runs
once before the profiler starts (Triton compiles on first launch), so the profiled range
holds one launch of each.
"""

import argparse

import torch

from benchmarks.common import EPS, HEADS, step_cases
from mhar_kernels import lookahead as LA
from tools.perf.groups import OWING_GROUPS, deepest_group


def group_launches(case):
    """A function launching each kernel of the case's deepest group once (inputs built here)."""
    group, n0, buf, gbuf, qs, ws, grad_outs = deepest_group(case, HEADS)
    t = case.t
    m, l, acc = LA.group_forward(buf, qs, ws, HEADS, EPS, 1.0, lookahead_kernels="auto")
    # lse and delta of the whole group for the backward: from the row-loop partials (fp32).
    m32, l32, _ = LA.group_forward(buf, qs, ws, HEADS, EPS, 1.0, lookahead_kernels="row_loop")
    lse = (m32 + l32.log()).contiguous()
    delta = torch.randn(group, t, HEADS, device="cuda")
    _, _, deferred = LA.group_backward_deferred(grad_outs, buf, qs, ws, lse, delta, HEADS, EPS, 1.0, gbuf,
                                                lookahead_kernels="auto")  # fmt: skip
    k = group // 2  # the merged site: k new rows
    new = buf[:, : group - 1]
    grad_new = torch.zeros(new.shape, device="cuda")
    factors = torch.zeros((group, t, group - 1, HEADS, 2), device="cuda")
    kv = torch.zeros((group, t, group - 1), device="cuda")
    site_lse = torch.empty((t, HEADS), device="cuda")
    out = LA.merge_forward(m[k], l[k], acc[k], new[:, :k], qs[k], ws[k], HEADS, EPS, 1.0, site_lse)

    def launches():
        LA.group_forward(buf, qs, ws, HEADS, EPS, 1.0, lookahead_kernels="auto")
        LA.group_backward_deferred(grad_outs, buf, qs, ws, lse, delta, HEADS, EPS, 1.0, gbuf, lookahead_kernels="auto")
        if deferred:  # the tensor-core backward leaves the rows' gradients as factors
            LA.add_row_grads([(deferred, n0)] * OWING_GROUPS, buf, gbuf, n0 - group)
        LA.merge_forward(m[k], l[k], acc[k], new[:, :k], qs[k], ws[k], HEADS, EPS, 1.0, site_lse)
        LA.merge_backward(grad_outs[k], out, new[:, :k], qs[k], ws[k], site_lse, HEADS, EPS, 1.0,
                          (factors[k, :, :k], kv[k, :, :k]))  # fmt: skip
        LA.merge_row_grad(new[:, k - 1], grad_new[:, k - 1], grad_new[:, k - 1], grad_outs, qs, ws, factors, kv,
                          k - 1, (k, group), HEADS)  # fmt: skip

    return launches


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100M,350M,1B", help="comma list of 100M, 350M, 1B")
    args = parser.parse_args()
    cases = {case.name: case for case in step_cases() if case.variant == "full"}
    unknown = sorted(set(args.sizes.split(",")) - set(cases))
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {sorted(cases)}")
    if not torch.cuda.is_available():
        parser.error("tools.perf.profile_lookahead launches CUDA kernels: run it on a GPU (under ncu)")
    runs = [(name, group_launches(cases[name])) for name in args.sizes.split(",")]
    for _, launches in runs:
        launches()  # compile outside the profiled range
    torch.cuda.synchronize()
    for name, launches in runs:
        print(f"profiling {name}", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        launches()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
