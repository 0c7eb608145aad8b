"""Logits of the random-weight MHAR models routed by the reference and by the fused kernels.

    TRITON_INTERPRET=1 python -m tests.hf.route_with_kernels OUT_PT

Without CUDA the fused kernels run in Triton's interpreter, which must be chosen before
``mhar_kernels`` is first imported (hence a process of its own), and ``depth_route``'s
``auto`` is told the kernels are available for CPU tensors. Writes ``{name: {"reference",
"fused", "calls"}}``. Run by ``tests/hf/test_modeling.py``.
"""

import importlib
import sys

import torch

from tests.helpers import RANDOM_MODELS, export_token_batch, random_model


def main(out: str) -> None:
    op = importlib.import_module("megatron_mhar.ops.depth_route")
    import mhar_kernels.depth_route as kernels

    fused_route, calls = kernels.fused_depth_route, []

    def counted(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        return fused_route(*args, **kwargs)

    available = op.triton_available
    results = {}
    for name in RANDOM_MODELS:
        model, tokens = random_model(name), export_token_batch(3, seq=10)
        with torch.no_grad():
            reference = model(tokens).logits
            op.triton_available, kernels.fused_depth_route = (lambda device: True), counted
            try:
                fused = model(tokens).logits
            finally:
                op.triton_available, kernels.fused_depth_route = available, fused_route
        results[name] = {"reference": reference, "fused": fused, "calls": len(calls)}
        calls.clear()
    torch.save(results, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
