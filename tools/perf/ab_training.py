"""Training throughput of this checkout's kernels against another revision's, in one run.

    python tools/perf/base_kernels.py HEAD~1 /tmp/mhar_base      # in the git checkout
    python tools/perf/ab_training.py --base-kernels /tmp/mhar_base --cuda-graph full_iteration \\
        --models baseline,mhar_lookahead,mhar_lookahead@kernels=base --out /tmp/ab.json

benchmarks/bench_training.py's run (its options, models and report), where a model marked
``@kernels=base`` trains on the ``mhar_kernels`` tree given by ``--base-kernels``
(tools/perf/base_kernels.py writes one from a git revision), interleaved with the same
model on this checkout's kernels. That model reports ``throughput_vs_base_kernels`` (above
1: this checkout's kernels are faster) and its median over the rounds, which cancels the
host's drift slower than a round. The report names both trees (revision and a hash of
their files).
"""

import functools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import bench_training  # noqa: E402
from tools.perf import base_kernels  # noqa: E402

# A --models entry's token that runs the model with --base-kernels' tree.
BASE_KERNELS = "kernels=base"


def split_kernels(spec: str):
    """(the entry without its ``@kernels=base`` token, whether it had one): such an entry
    trains the same model with another revision's kernels (``--base-kernels``)."""
    name, *tokens = spec.split("@")
    bad = [t for t in tokens if t.startswith("kernels=") and t != BASE_KERNELS]
    if bad:
        raise ValueError(f"model {spec!r}: {bad[0]!r}: the kernels token takes only base "
                         f"(the --base-kernels tree)")  # fmt: skip
    kept = [t for t in tokens if t != BASE_KERNELS]
    return "@".join([name, *kept]), len(kept) != len(tokens)


def add_base_ratios(size_report: dict) -> None:
    """Per model on this checkout's kernels whose twin ran on the base tree: the base's
    median step time over its own, and the median of the same ratio per round."""
    models = size_report["models"]
    for name, entry in models.items():
        twin, on_base = split_kernels(name)
        if on_base and twin in models:
            mine = models[twin]
            mine["throughput_vs_base_kernels"] = entry["step_s_median"] / mine["step_s_median"]
            mine["throughput_vs_base_kernels_round_median"] = statistics.median(
                bench_training.round_ratios(entry["step_s_all"], mine["step_s_all"]))  # fmt: skip


def main(argv=None):
    parser = bench_training.build_parser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-kernels", metavar="DIR", required=True,
                        help="another revision's mhar_kernels (python tools/perf/base_kernels.py REV DIR) "
                             f"for the models marked @{BASE_KERNELS}")  # fmt: skip
    parser.set_defaults(out=None)  # an A/B is no report of record
    args = parser.parse_args(argv)
    sizes = bench_training.check_args(parser, args)
    try:
        specs = {spec: split_kernels(spec) for spec in args.models.split(",")}
        models = {spec: bench_training.parse_model(config) for spec, (config, _) in specs.items()}
    except ValueError as err:
        parser.error(str(err))
    on_base = [spec for spec, (_, base) in specs.items() if base]
    if not on_base:
        parser.error(f"no model is marked @{BASE_KERNELS}: mark the ones to run on --base-kernels' tree")
    try:
        tree = base_kernels.load(args.base_kernels)
    except ValueError as err:
        parser.error(str(err))
    from megatron_mhar.ops.depth_route import resolve_impl

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if resolve_impl(args.kernel_impl, device) == "torch":
        print("the routing runs the torch reference here, so both trees' models run the same code", flush=True)
    trees = {"base": base_kernels.describe(args.base_kernels), "checkout": base_kernels.describe(base_kernels.ROOT)}
    report = bench_training.run(
        args, sizes, models, contexts={spec: functools.partial(base_kernels.active, tree) for spec in on_base},
        annotate=add_base_ratios, extra={"kernel_trees": trees},
    )  # fmt: skip
    bench_training.print_summary(
        report, bench_training.SUMMARY_KEYS + ("throughput_vs_base_kernels", "throughput_vs_base_kernels_round_median")
    )


if __name__ == "__main__":
    main()
