"""Bytes crossing each pipeline boundary per micro-batch, for the 1B recipe (analytic).

    python -m benchmarks.pipeline_bytes      # writes benchmarks/results/pipeline_bytes/analytic.json

An MHAR chunk sends its depth history packed along the hidden dimension,
``[s, b, width * h]``, and receives the gradient of the same shape back. The width of
each boundary is what the model itself uses (``DepthLayout.boundary_width`` at the
global sublayer the next chunk starts with); the chunk offsets come from Megatron's own
``get_transformer_layer_offset`` / ``get_num_layers_to_build``, so the numbers follow
the layout the training run builds. Nothing runs on a GPU: the bytes are exact,
``s * b * width * h * 2`` (bf16 ``pipeline_dtype``), per pipeline link at TP = 1 (with
sequence parallelism each of the TP links carries ``1 / TP`` of it).

Cases (registry below): the 1B recipe (d = 1280, L = 36, seq 1024, micro-batch 2) at
PP = 4 for ``none`` (the plain residual stream), ``full`` (MHAR / AttnRes) and ``block``
(block_size 8 sublayers), without interleaving and with VPP = 2 (36 layers do not split
into 8 equal chunks: first/last stages hold 8 layers, the middle ones 10, as Megatron's
``num_layers_in_first/last_pipeline_stage`` allow) and VPP = 3 (12 chunks of 3 layers).

``cached_bytes`` is an analytic bound for Kimi's cross-stage caching (Attention Residuals, arXiv 2603.15031), which
this project does *not* implement: under interleaving a rank could keep the completed
sources its previous chunk already held (its input rows plus the rows it completed)
and receive only rows completed since, plus the running partial. It is reported so the
gain can be weighed against its cost (cached rows stay alive across chunks and their
gradients must be routed back to the earlier chunk outside Megatron's schedule).
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
_RECIPE_1B = size_config("1b")
MICRO_BATCH = _RECIPE_1B.training.micro_batch_size
MODEL_1B = _RECIPE_1B.model
VARIANTS = {
    "none": MHARConfig(variant="none"),
    "full": MHARConfig(variant="full", num_heads=8),
    "block8": MHARConfig(variant="block", block_size=8, num_heads=8),
}


@dataclasses.dataclass
class LayoutCase:
    name: str
    pp: int
    vpp: Optional[int] = None
    first: Optional[int] = None
    last: Optional[int] = None


LAYOUTS = [
    LayoutCase("pp4", pp=4),
    LayoutCase("pp4-vpp2", pp=4, vpp=2, first=8, last=8),
    LayoutCase("pp4-vpp3", pp=4, vpp=3),
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


def boundaries(layout: LayoutCase, mhar: MHARConfig) -> List[dict]:
    config = make_transformer_config(
        MODEL_1B, mhar,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        num_layers_in_first_pipeline_stage=layout.first,
        num_layers_in_last_pipeline_stage=layout.last,
        pipeline_dtype=torch.bfloat16, bf16=True,
    )
    depth = make_layout(mhar, MODEL_1B.num_layers)
    slice_bytes = MODEL_1B.seq_length * MICRO_BATCH * MODEL_1B.hidden_size * BYTES_PER_ELEMENT
    chunks = chunks_in_pipeline_order(config, layout.pp, layout.vpp)
    assert sum(n for *_, n in chunks) == MODEL_1B.num_layers
    last_output_site = {}  # pp rank -> site its previous chunk handed on (for caching)
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
        if mhar.enabled and previous is not None:
            new_rows = depth.rows_read(site) - depth.rows_read(previous)
            cached_width = new_rows + int(depth.reads_partial(site))
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

    cases = []
    for layout in LAYOUTS:
        for variant, mhar in VARIANTS.items():
            rows = boundaries(layout, mhar)
            total = sum(r["bytes"] for r in rows)
            case = dict(
                layout=dataclasses.asdict(layout), variant=variant,
                mhar=dataclasses.asdict(mhar), boundaries=rows,
                forward_bytes_per_microbatch=total,
                forward_plus_backward_bytes_per_microbatch=2 * total,
                max_boundary_bytes=max(r["bytes"] for r in rows),
            )
            if layout.vpp and mhar.enabled:
                cached = sum(r.get("cached_bytes", r["bytes"]) for r in rows)
                case["cached_forward_bytes_per_microbatch"] = cached
                case["cached_reduction"] = 1 - cached / total
            cases.append(case)
            print(f"{layout.name:9s} {variant:7s} widths "
                  f"{[r['width'] for r in rows]}  fwd {total / 2**20:8.1f} MiB/micro-batch"
                  + (f"  cached {case['cached_forward_bytes_per_microbatch'] / 2**20:7.1f} MiB"
                     if "cached_forward_bytes_per_microbatch" in case else ""))
    result = dict(
        description="Bytes per micro-batch crossing each pipeline boundary (forward "
                    "activations; the backward gradient has the same shape), per pipeline "
                    "link at TP=1, bf16. Analytic from DepthLayout and Megatron's layer offsets.",
        recipe=dict(model=dataclasses.asdict(MODEL_1B), micro_batch_size=MICRO_BATCH,
                    bytes_per_element=BYTES_PER_ELEMENT),
        slice_bytes=MODEL_1B.seq_length * MICRO_BATCH * MODEL_1B.hidden_size * BYTES_PER_ELEMENT,
        cross_stage_caching="analytic bound only; not implemented",
        versions=versions(),
        cases=cases,
    )
    write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
