"""RMSNorm forward and backward on the GPU: Transformer Engine's kernels against torch's fused
``rms_norm``, at the widths of the models' norms, with the CUDA time of each kernel.

    python -m tools.perf.norm_kernels --out benchmarks/results/norm_kernels/<gpu>.json

Rows and widths: the 1B model's pre-norms (hidden 1280, 2,048 and 4,096 tokens: micro-batches
of 2 and 4 sequences of 1,024) and its q / k norms (head width 128 over 16 and 8 heads), the
8B pre-norm (4,096, a width TE has tuned kernels for), the 350M pre-norm (1,024, tuned) and q/k
norm (64), the 100M pre-norm (512, tuned). TE picks its "tuned" kernels only for some widths
and its "general" ones elsewhere; the general backward ends in a separate dgamma finalize
kernel. The wall times (``*_us``) of one call are bounded by the host's launch cost (TE's
module calls especially); the kernels' CUDA times (``*_kernels``, from one profiled forward
and backward) are what a CUDA-graphed training step pays. Errors are against an fp32 norm.
"""

import argparse

import torch

from benchmarks.common import check_out, environment, write_json

SHAPES = [(2048, 1280), (4096, 1280), (2048 * 16, 128), (2048 * 8, 128), (4096, 4096), (2048, 1024),
          (2048 * 16, 64), (2048, 512)]
IMPLEMENTATIONS = ("te", "te_zero_centered", "torch")


def _time_us(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1000


def _norm(name, width, x):
    """(forward function, weight) of implementation ``name``."""
    import transformer_engine.pytorch as te

    if name.startswith("te"):
        module = te.RMSNorm(width, eps=1e-6, params_dtype=torch.bfloat16,
                            zero_centered_gamma=name == "te_zero_centered").cuda()
        return (lambda: module(x)), module.weight
    weight = torch.ones(width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return (lambda: torch.nn.functional.rms_norm(x, (width,), weight, 1e-6)), weight


def measure(rows, width):
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    row = {"rows": rows, "width": width}
    for name in IMPLEMENTATIONS:
        forward, weight = _norm(name, width, x)

        def step():
            forward().backward(dy)

        row[name + "_fwd_us"] = _time_us(lambda: forward().detach())
        row[name + "_fwdbwd_us"] = _time_us(step)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        row[name + "_kernels"] = {e.key[:90]: round(e.device_time_total, 1)
                                  for e in prof.key_averages() if e.device_time_total > 0}
        x32 = x.detach().float().requires_grad_()
        w32 = (weight.detach().float() + (1 if name == "te_zero_centered" else 0)).requires_grad_()
        torch.nn.functional.rms_norm(x32, (width,), w32, 1e-6).backward(dy.float())
        x.grad = weight.grad = None
        forward().backward(dy)
        row[name + "_dx_err"] = (x.grad.float() - x32.grad).abs().max().item()
        row[name + "_dw_rel_err"] = ((weight.grad.float() - w32.grad).abs().max() / w32.grad.abs().max()).item()
        x.grad = None
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON report")
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    if not torch.cuda.is_available():
        parser.error("the norm kernels run on a GPU")
    torch.manual_seed(0)
    report = {"environment": environment("cuda"), "shapes": []}
    for rows, width in SHAPES:
        report["shapes"].append(measure(rows, width))
        write_json(args.out, report)


if __name__ == "__main__":
    main()
