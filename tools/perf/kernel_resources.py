"""Shared memory of the tensor-core phase-1 kernels and the deferred backward's row-gradient
kernel, compiled for sm_90 on any machine.

    python -m tools.perf.kernel_resources [--out FILE]

Triton's CUDA backend compiles without a GPU. Each kernel is compiled as its JIT would
compile a launch with the given sizes: an integer argument of value 1 becomes a constant and
one divisible by 16 gets that alignment, unless the kernel does not specialise it. A size of
1 compiled as a constant once gave the rows kernel a variant that needed 319 KB of shared
memory at the 1B width (the first group's N = 1), and a 1B training run failed on the H200.
Prints one JSON row per (shape, launch, kernel); tests/benchmarks/test_kernel_resources.py
checks every row against the H200's limit.
"""

import argparse
import json
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("tools.perf.kernel_resources compiles kernels: unset TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from benchmarks.common import check_out, write_json  # noqa: E402
from mhar_kernels import launch  # noqa: E402
from mhar_kernels.lookahead import phase1_dots, row_grads  # noqa: E402

H200_SHARED_BYTES = 232448  # the most shared memory one program may use on sm_90 (227 KiB)
# Pointers to tensors in the rows' dtype (W_ptr: the rows kernel's folded queries, bf16 pairs
# or fp32 as phase1_dots.folded_operand leaves them).
ROWS = ("V_ptr", "DO_ptr", "Q_ptr", "G_ptr", "W_ptr")
HALF_ROWS = ("A_ptr",)
ELEMENT_SIZE = {"bf16": 2, "fp32": 4}  # ... where the rows are bf16 (phase 1's normalised accumulators)

# (width, heads, rows dtype): the 1B and 350M widths in bf16, one head at the 1B width (as
# eight dot heads), and in fp32 (twice the tiles) the 1B width and the kernel tests' width.
SHAPES = [(1280, 8, "bf16"), (1024, 8, "bf16"), (1280, 1, "bf16"), (1280, 8, "fp32"), (768, 8, "fp32")]
LAUNCHES = {
    "first-group": dict(T=2048, N=1, NG=8, chunk_lo=0, chunk_hi=8),  # one old row, a full group
    "one-site": dict(T=2051, N=1, NG=1, chunk_lo=0, chunk_hi=1),  # a group of one site over one row
    "deep-group": dict(T=2048, N=65, NG=8, chunk_lo=0, chunk_hi=8),
}


# The row-gradient kernel's per-entry tuples: (element type, the launch size each element takes);
# the folded queries W come in the rows' dtype (bf16 pairs, or fp32: phase1_dots.folded_operand).
ENTRY_TUPLES = {"Z": ("*fp32", None), "KV": ("*fp32", None), "W": ("rows", None), "DO": ("rows", None),
                "N": ("i32", "N"), "OWED": ("i32", "N"), "CHUNK_LO": ("i32", "chunk_lo"),
                "CHUNK_HI": ("i32", "chunk_hi")}  # fmt: skip


def shared_bytes(kernel, sizes, constexprs, rows_dtype, num_warps, num_stages=None):
    """Compile ``kernel`` for sm_90 as launched with the integer arguments ``sizes`` (other
    integers: strides, divisible by 16); the shared memory it needs, in bytes. A tuple
    argument of ENTRY_TUPLES has ``constexprs["J"]`` elements, each specialised as the JIT
    specialises tuple elements (all of them: ``do_not_specialize`` does not reach into
    tuples)."""
    names = kernel.arg_names
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    if missing:  # compiled as runtime integers they would measure another variant
        raise ValueError(f"{kernel.fn.__name__}: no value for the constexpr arguments {missing}")
    signature, attrs, values = {}, {}, dict(constexprs)
    tuple_constexprs = {}
    for i, (name, param) in enumerate(zip(names, kernel.params)):
        if "J" in constexprs and name in ENTRY_TUPLES:
            kind, size = ENTRY_TUPLES[name]
            elements = []
            for j in range(constexprs["J"]):
                if kind != "i32":
                    elements.append("*" + (rows_dtype if kind == "rows" else kind.lstrip("*")))
                    attrs[(i, j)] = [["tt.divisibility", 16]]
                elif sizes[size] == 1:
                    elements.append("constexpr")
                    tuple_constexprs[(i, j)] = 1
                else:
                    elements.append("i32")
                    if sizes[size] % 16 == 0:
                        attrs[(i, j)] = [["tt.divisibility", 16]]
            signature[name] = tuple(elements)
        elif name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            in_rows_dtype = name in ROWS or (name in HALF_ROWS and rows_dtype != "fp32")
            signature[name] = "*" + (rows_dtype if in_rows_dtype else "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("eps", "scale"):
            signature[name] = "fp32"
        else:
            value = sizes.get(name, 16)
            if not param.do_not_specialize and value == 1:
                signature[name], values[name] = "constexpr", 1
            else:
                signature[name] = "i32"
                if not param.do_not_specialize and value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(
        fn=kernel, signature=signature, attrs=attrs,
        constexprs={**{(names.index(k),): v for k, v in values.items()}, **tuple_constexprs},
    )  # fmt: skip
    options = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled.metadata.shared


def shape_rows(d, model_heads, dtype, launch_name, sizes):
    """One row per tensor-core kernel of a shape and launch, with its launch config."""
    split, heads, head_dim, padded_heads = launch.dot_heads(d, model_heads)
    ka, kb = launch.head_chunks(head_dim)
    chunks = dict(D=d, H=heads, HD=head_dim, BH=padded_heads, KA=ka, KB=kb, BR=16, GH=split)
    head_tile = dict(D=d, H=heads, HD=head_dim, BR=16, BHD=triton.next_power_of_2(head_dim))
    forward = launch.group_fwd_dots_config(padded_heads, head_dim)
    rows, per_head = launch.group_bwd_dots_config(padded_heads, head_dim)
    kernels = [
        (phase1_dots.group_fwd_dots_kernel, dict(chunks, STAGES=forward.stages, NORMALISED=dtype != "fp32",
                                                 QUERIES_LEFT=launch.queries_left(padded_heads, head_dim,
                                                                                  ELEMENT_SIZE[dtype])),
         forward.num_warps),
        (phase1_dots.group_bwd_rows_kernel, dict(chunks, STAGES=rows.stages), rows.num_warps),
        (phase1_dots.group_bwd_heads_kernel, dict(head_tile, STAGES=per_head.stages), per_head.num_warps),
    ]
    kernels = [(kernel, constexprs, warps, None) for kernel, constexprs, warps in kernels]
    # The row-gradient kernel with a launch's most entries, at its launch rule's,
    # adding into the gradients (the variant that also loads them).
    row_launch = launch.row_grads_config()
    kernels.append((row_grads.group_bwd_row_grads_kernel,
                    dict(D=d, H=heads, HD=head_dim, BR=row_launch.block_t, KA=ka, KB=kb,
                         J=launch.ROW_GRADS_ENTRIES, ACCUMULATE=True),
                    row_launch.num_warps, row_launch.stages))  # fmt: skip
    for kernel, constexprs, warps, stages in kernels:
        yield {"width": d, "heads": model_heads, "dot_heads": heads, "dtype": dtype, "launch": launch_name,
               "kernel": kernel.fn.__name__, "num_warps": warps, "num_stages": stages,
               "shared_bytes": shared_bytes(kernel, sizes, constexprs, dtype, warps, stages),
               "limit_bytes": H200_SHARED_BYTES}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the rows as a JSON list")
    args = parser.parse_args()
    check_out(parser, args.out)
    rows = []
    for d, heads, dtype in SHAPES:
        for launch_name, sizes in LAUNCHES.items():
            for row in shape_rows(d, heads, dtype, launch_name, sizes):
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        write_json(args.out, rows)


if __name__ == "__main__":
    main()
