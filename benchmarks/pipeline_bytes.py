"""Bytes crossing each pipeline boundary per micro-batch, for the 1B and 8B recipes (analytic).

    python -m benchmarks.pipeline_bytes      # writes benchmarks/results/pipeline_bytes/analytic.json

An MHAR chunk sends its depth history packed along the hidden dimension,
``[s, b, width * h]``, and receives the gradient of the same shape back. The width of
each boundary is what the model itself uses (``boundary_width`` of the routing layout at
the global sublayer the next chunk starts with); the chunk offsets come from Megatron's own
``get_transformer_layer_offset`` / ``get_num_layers_to_build``, so the numbers follow
the layout the training run builds. Nothing runs on a GPU: the bytes are exact,
``s * b * width * h * 2`` (bf16 ``pipeline_dtype``), per pipeline link at TP = 1 (with
sequence parallelism each of the TP links carries ``1 / TP`` of it).

Under interleaving, cross-stage caching (``mhar.pipeline_cache``, the default) leaves out
the rows the receiving rank's previous chunk held (its input rows and the rows it
completed): ``cached_width`` is what such a boundary sends. The same counts are measured
on the real communication of a gloo run (``tests/parallel/test_equivalence.py``,
``test_pipeline_cache_sends_what_the_byte_model_says``), where the model's layer count and
layout fix the widths and ``s * b * h`` only scales them.

Cases (registry below): the 1B recipe (d = 1280, L = 36, seq 1024, micro-batch 2) for
``none`` (the plain residual stream), ``full`` (MHAR / AttnRes) and ``block`` (block_size 8
sublayers); the 8B recipe (d = 4096, L = 32, seq 4096, micro-batch 1) for ``none``, its own
``delta`` (blocks of 4 layers), ``full`` and ``block``. Layouts: PP = 4 without interleaving,
PP = 4 x VPP = 2 and PP = 8 x VPP = 4 (36 layers do not split evenly into those chunks:
the first and last stages take fewer or more, as Megatron's
``num_layers_in_first/last_pipeline_stage`` allow).
"""

import argparse
import dataclasses
from typing import List, Optional

import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from benchmarks.common import check_out, default_out, size_config, versions, write_json
from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.models.builder import make_transformer_config
from megatron_mhar.models.routing import make_layout

BYTES_PER_ELEMENT = 2  # bf16 pipeline_dtype


@dataclasses.dataclass
class LayoutCase:
    name: str
    pp: int
    vpp: Optional[int] = None
    first: Optional[int] = None
    last: Optional[int] = None


@dataclasses.dataclass
class RecipeCase:
    size: str
    variants: dict
    layouts: List[LayoutCase]


RECIPES = [
    RecipeCase("1b", {
        "none": MHARConfig(variant="none"),
        "full": MHARConfig(variant="full", num_heads=8),
        "block8": MHARConfig(variant="block", block_size=8, num_heads=8),
    }, [
        LayoutCase("pp4", pp=4),
        LayoutCase("pp4-vpp2", pp=4, vpp=2, first=8, last=8),  # 8 | 5 5 5 5 | 8
        LayoutCase("pp8-vpp4", pp=8, vpp=4, first=4, last=8),  # 1 per chunk, 2 on the last stage
    ]),
    RecipeCase("8b", {
        "none": MHARConfig(variant="none"),
        "delta4": MHARConfig(variant="delta", delta_block_layers=4, num_heads=8),  # the recipe's
        "full": MHARConfig(variant="full", num_heads=8),
        "block8": MHARConfig(variant="block", block_size=8, num_heads=8),
    }, [
        LayoutCase("pp4", pp=4),
        LayoutCase("pp4-vpp2", pp=4, vpp=2),
        LayoutCase("pp8-vpp4", pp=8, vpp=4),
    ]),
]


def chunks_in_pipeline_order(config, pp: int, vpp: Optional[int]):
    """(pp rank, vp stage, global layer offset, layers) of every chunk, first to last."""
    out = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        for rank in range(pp):
            offset = get_transformer_layer_offset(config, stage, rank)
            out.append((rank, vp_stage, offset, get_num_layers_to_build(config, stage, rank)))
    return out


def boundaries(model, micro_batch: int, layout: LayoutCase, mhar: MHARConfig,
               bytes_per_element: int = BYTES_PER_ELEMENT) -> List[dict]:
    """Every boundary of ``model`` (a GPTModelConfig) under ``layout``, first to last: sender,
    receiver, width and bytes; with interleaving and ``mhar.pipeline_cache``, also the width
    and bytes the cross-stage cache leaves to send."""
    config = make_transformer_config(
        model, mhar,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        num_layers_in_first_pipeline_stage=layout.first,
        num_layers_in_last_pipeline_stage=layout.last,
        pipeline_dtype=torch.bfloat16, bf16=True,
    )
    depth = make_layout(mhar, model.num_layers)
    slice_bytes = model.seq_length * micro_batch * model.hidden_size * bytes_per_element
    chunks = chunks_in_pipeline_order(config, layout.pp, layout.vpp)
    assert sum(n for *_, n in chunks) == model.num_layers
    last_output_site = {}  # pp rank -> site its previous chunk handed on (what it holds)
    rows = []
    for (rank, vp, offset, n), (next_rank, next_vp, next_offset, _) in zip(chunks, chunks[1:]):
        site = 2 * (offset + n) + 1
        assert next_offset == offset + n
        width = depth.boundary_width(site) if mhar.enabled else 1
        row = dict(
            sender=f"pp{rank}/vp{vp}", receiver=f"pp{next_rank}/vp{next_vp}",
            layers_before=offset + n, next_site=site, width=width, bytes=width * slice_bytes,
        )
        previous = last_output_site.get(next_rank)
        if mhar.enabled and layout.vpp and mhar.pipeline_cache and previous is not None:
            cached_width = width - depth.rows_read(previous)
            row.update(cached_width=cached_width, cached_bytes=cached_width * slice_bytes)
        last_output_site[rank] = site
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=default_out("pipeline_bytes", "analytic"),
                        help="JSON report (default: %(default)s)")
    args = parser.parse_args()
    check_out(parser, args.out)

    recipes, cases = {}, []
    for recipe in RECIPES:
        cfg = size_config(recipe.size)
        model, micro_batch = cfg.model, cfg.training.micro_batch_size
        recipes[recipe.size] = dict(model=dataclasses.asdict(model), micro_batch_size=micro_batch,
                                    slice_bytes=model.seq_length * micro_batch * model.hidden_size * BYTES_PER_ELEMENT)
        for layout in recipe.layouts:
            for variant, mhar in recipe.variants.items():
                rows = boundaries(model, micro_batch, layout, mhar)
                total = sum(r["bytes"] for r in rows)
                case = dict(
                    recipe=recipe.size, layout=dataclasses.asdict(layout), variant=variant,
                    mhar=dataclasses.asdict(mhar), boundaries=rows,
                    forward_bytes_per_microbatch=total,
                    forward_plus_backward_bytes_per_microbatch=2 * total,
                    max_boundary_bytes=max(r["bytes"] for r in rows),
                )
                if layout.vpp and mhar.enabled:
                    cached = sum(r.get("cached_bytes", r["bytes"]) for r in rows)
                    case["cached_forward_bytes_per_microbatch"] = cached
                    case["cached_max_boundary_bytes"] = max(r.get("cached_bytes", r["bytes"]) for r in rows)
                    case["cached_reduction"] = 1 - cached / total
                cases.append(case)
                print(f"{recipe.size:3s} {layout.name:9s} {variant:7s} fwd {total / 2**20:8.1f} MiB/micro-batch"
                      + (f"  cached {case['cached_forward_bytes_per_microbatch'] / 2**20:7.1f} MiB"
                         f" (-{100 * case['cached_reduction']:.0f}%)"
                         if "cached_forward_bytes_per_microbatch" in case else ""))
    result = dict(
        description="Bytes per micro-batch crossing each pipeline boundary (forward "
                    "activations; the backward gradient has the same shape), per pipeline "
                    "link at TP=1, bf16, without and with cross-stage caching (mhar.pipeline_cache). "
                    "Analytic from the routing layout and Megatron's layer offsets; the widths "
                    "are those a gloo run sends (test_pipeline_cache_sends_what_the_byte_model_says).",
        recipes=recipes,
        bytes_per_element=BYTES_PER_ELEMENT,
        versions=versions(),
        cases=cases,
    )
    write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
