"""Bytes crossing each pipeline boundary per micro-batch, for the 1B and 8B recipes.

    python -m benchmarks.pipeline_bytes            # writes benchmarks/results/pipeline_bytes/analytic.json
    python -m benchmarks.pipeline_bytes --measure  # the same, and the bytes of a gloo run beside them

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

``--measure`` runs every MHAR case at PP4 x VPP2 and PP8 x VPP4 on 4 and 8 CPU ranks (gloo),
with and without the cache: the recipe's layers, layout and routing at :data:`MEASURED_SHAPE`
(narrow, short, fp32), one forward and backward of ``PP`` micro-batches through
``megatron_mhar.parallel.forward_backward``, counting the bytes each rank hands to gloo
(``LayoutP2PCommunicator.sent_bytes``). Each count, per micro-batch and times the recipe's
``s * b * h * 2`` over the measured ``s * b * h * 4``, goes beside the analytic figure
(``measured_bytes``, ``measured_cached_bytes`` of each boundary; the report's ``measured``
section gives the shape and the scale); the run fails where a raw count differs from the
model of the measured shape.

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
import os
from typing import Dict, List, Optional, Tuple

import torch

from benchmarks.common import check_out, command, commit, default_out, size_config, versions, write_json
from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.models.builder import make_transformer_config
from megatron_mhar.models.routing import make_layout

BYTES_PER_ELEMENT = 2  # bf16 pipeline_dtype

# The measured model: the recipe's depth, layout and routing, 16 wide (the routing's 8 heads
# of 2 channels), 8 tokens of one sequence, fp32 pipeline tensors.
MEASURED_SHAPE = dict(seq_length=8, micro_batch_size=1, hidden_size=16, bytes_per_element=4)
MEASURED_LAYOUTS = ("pp4-vpp2", "pp8-vpp4")


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
    # Imported here, after megatron_mhar has silenced Megatron's known import-time warnings
    # (the measuring ranks import this module first).
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    out = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        for rank in range(pp):
            offset = get_transformer_layer_offset(config, stage, rank)
            out.append((rank, vp_stage, offset, get_num_layers_to_build(config, stage, rank)))
    return out


def layout_config(model, mhar: MHARConfig, layout: LayoutCase, **overrides):
    """The TransformerConfig of ``model`` (a GPTModelConfig) under ``layout``."""
    return make_transformer_config(
        model, mhar,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        num_layers_in_first_pipeline_stage=layout.first,
        num_layers_in_last_pipeline_stage=layout.last,
        **overrides,
    )


def boundaries(model, micro_batch: int, layout: LayoutCase, mhar: MHARConfig,
               bytes_per_element: int = BYTES_PER_ELEMENT) -> List[dict]:
    """Every boundary of ``model`` (a GPTModelConfig) under ``layout``, first to last: sender,
    receiver, width and bytes; with interleaving and ``mhar.pipeline_cache``, also the width
    and bytes the cross-stage cache leaves to send."""
    config = layout_config(model, mhar, layout, pipeline_dtype=torch.bfloat16, bf16=True)
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


def measured_boundary_bytes(rank_results: List[dict], num_microbatches: int) -> Dict[Tuple[str, str], float]:
    """{(``forward`` | ``backward``, ``pp{rank}/vp{chunk}``): bytes per micro-batch} of one run from
    each rank's ``pp_rank`` and ``sent_bytes`` (:class:`LayoutP2PCommunicator`'s): activations by
    their sender, gradients by the receiver of the activation, as :func:`boundaries` names them."""
    measured = {}
    for result in rank_results:
        for (direction, chunk), nbytes in result["sent_bytes"].items():
            measured[(direction, f"pp{result['pp_rank']}/vp{chunk}")] = nbytes / num_microbatches
    return measured


def measured_model(model):
    """``model`` (a GPTModelConfig) at :data:`MEASURED_SHAPE`: its layers and routing, narrow."""
    return dataclasses.replace(
        model, hidden_size=MEASURED_SHAPE["hidden_size"], num_attention_heads=2, num_query_groups=1,
        kv_channels=None, ffn_hidden_size=32, vocab_size=64, make_vocab_size_divisible_by=32,
        seq_length=MEASURED_SHAPE["seq_length"], fused_kernels=False,
    )


def _loss(loss_mask, output_tensor):
    loss = torch.sum(output_tensor.float().view(-1) * loss_mask.view(-1))
    return loss, loss_mask.sum().to(torch.int), {}


def _forward_step(data_iterator, model):
    from functools import partial

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"])


def _measure_rank(rank: int, world: int, port: int, jobs, queue) -> None:
    """One gloo rank of every ``(model, mhar, layout)`` job (all of ``world`` = PP ranks and one
    VPP size); rank 0 puts each job's ``[{pp_rank, sent_bytes}]`` of every rank on ``queue``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # the ranks share the machine's cores
    from megatron.core import parallel_state

    from megatron_mhar.models.builder import build_gpt_model
    from megatron_mhar.parallel import forward_backward
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    _, _, first = jobs[0]
    initialize_model_parallel_from_env(pp=first.pp, vpp=first.vpp, device="cpu", create_gloo_process_groups=False)
    try:
        for model, mhar, layout in jobs:
            assert (layout.pp, layout.vpp) == (first.pp, first.vpp)
            config = layout_config(model, mhar, layout, pipeline_dtype=torch.float32, calculate_per_token_loss=True,
                                   batch_p2p_comm=False,  # gloo has no batch_isend_irecv
                                   use_cpu_initialization=True)
            chunks = [
                build_gpt_model(
                    model, mhar, config,
                    pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                    post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                    vp_stage=vp,
                )
                for vp in range(layout.vpp)
            ]
            s, b = model.seq_length, MEASURED_SHAPE["micro_batch_size"]
            tokens = torch.randint(0, model.vocab_size, (layout.pp, b, s), generator=torch.Generator().manual_seed(0))
            batches = [dict(tokens=t, labels=t.roll(-1, dims=1), loss_mask=torch.ones(b, s),
                            position_ids=torch.arange(s).expand(b, s)) for t in tokens]
            sent_bytes = {}
            forward_backward(forward_step_func=_forward_step, data_iterator=[iter(batches) for _ in chunks],
                             model=chunks, num_microbatches=layout.pp, seq_length=s, micro_batch_size=b,
                             sent_bytes=sent_bytes)
            results = [None] * world
            torch.distributed.all_gather_object(
                results, dict(pp_rank=parallel_state.get_pipeline_model_parallel_rank(), sent_bytes=sent_bytes))
            if rank == 0:
                queue.put(results)
    finally:
        destroy()


def measure(jobs) -> List[List[dict]]:
    """Each ``(model, mhar, layout)`` job's per-rank results (:func:`_measure_rank`), one process
    group per world size."""
    import multiprocessing

    from megatron_mhar.runtime import free_port

    out: Dict[int, List[dict]] = {}
    worlds = sorted({layout.pp for _, _, layout in jobs})
    for world in worlds:
        mine = [(i, job) for i, job in enumerate(jobs) if job[2].pp == world]
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_measure_rank, args=(rank, world, port, [job for _, job in mine], queue))
                 for rank in range(world)]
        for proc in procs:
            proc.start()
        try:
            for i, (_, mhar, layout) in mine:
                out[i] = _next_result(queue, procs)
                print(f"measured {layout.name} {mhar.variant} cache={mhar.pipeline_cache}", flush=True)
        finally:
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
    return [out[i] for i in range(len(jobs))]


def _next_result(queue, procs):
    """The next item of ``queue``; raises as soon as a rank has failed (the others would wait)."""
    import queue as queues

    while True:
        try:
            return queue.get(timeout=5)
        except queues.Empty:
            failed = [proc.exitcode for proc in procs if proc.exitcode]
            if failed:
                raise RuntimeError(f"a measuring rank failed (exit codes {failed})") from None


def add_measured(cases: List[dict]) -> dict:
    """Measure every MHAR case of :data:`MEASURED_LAYOUTS`, cached and uncached, on gloo; add
    ``measured_bytes`` (and ``measured_cached_bytes``) beside each boundary's analytic bytes.
    Returns the report's ``measured`` section."""
    recipes = {recipe.size: recipe for recipe in RECIPES}
    targets, jobs = [], []
    for case in cases:
        if case["layout"]["name"] not in MEASURED_LAYOUTS or case["mhar"]["variant"] == "none":
            continue
        recipe = recipes[case["recipe"]]
        model = measured_model(size_config(recipe.size).model)
        layout = LayoutCase(**case["layout"])
        mhar = recipe.variants[case["variant"]]
        for cached in (False, True):
            targets.append((case, cached))
            jobs.append((model, dataclasses.replace(mhar, pipeline_cache=cached), layout))
    shape = MEASURED_SHAPE
    measured_slice = shape["seq_length"] * shape["micro_batch_size"] * shape["hidden_size"] * shape["bytes_per_element"]
    scales = {}
    for (case, cached), (model, mhar, layout), results in zip(targets, jobs, measure(jobs)):
        rows = boundaries(model, shape["micro_batch_size"], layout, mhar, bytes_per_element=shape["bytes_per_element"])
        counted = measured_boundary_bytes(results, layout.pp)
        scale = scales.setdefault(case["recipe"], case_slice_bytes(case) / measured_slice)
        key = "measured_cached_bytes" if cached else "measured_bytes"
        for row, target in zip(rows, case["boundaries"]):
            expected = row.get("cached_bytes", row["bytes"])
            got = (counted[("forward", row["sender"])], counted[("backward", row["receiver"])])
            if got != (expected, expected):
                raise RuntimeError(f"{case['recipe']} {layout.name} {case['variant']} cache={cached}: "
                                   f"{row['sender']} -> {row['receiver']} sent {got}, the model says {expected}")
            target[key] = round(got[0] * scale)  # whole rows: an integer
        total = sum(row[key] for row in case["boundaries"])
        case["measured_cached_forward_bytes_per_microbatch" if cached else "measured_forward_bytes_per_microbatch"] = total
    return dict(
        description="Bytes each rank handed to gloo per micro-batch and boundary (forward "
                    "activations by their sender; the backward gradients, counted by the "
                    "activation's receiver, are the same) in one forward and backward of PP "
                    "micro-batches with the recipe's layers, layout and routing at the shape below, "
                    "fp32, times the scale to the recipe's s*b*h in bf16; equal to the analytic "
                    "model of that shape boundary by boundary (the run checks it).",
        shape=shape,
        num_microbatches="PP",
        backend="gloo (CPU)",
        layouts=list(MEASURED_LAYOUTS),
        scale={recipe: dict(factor=factor, recipe_slice_bytes=int(factor * measured_slice),
                            measured_slice_bytes=measured_slice) for recipe, factor in scales.items()},
    )


def case_slice_bytes(case: dict) -> int:
    """``s * b * h * 2`` of a case's recipe: the bytes of one history row."""
    cfg = size_config(case["recipe"])
    return cfg.model.seq_length * cfg.training.micro_batch_size * cfg.model.hidden_size * BYTES_PER_ELEMENT


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=default_out("pipeline_bytes", "analytic"),
                        help="JSON report (default: %(default)s)")
    parser.add_argument("--measure", action="store_true",
                        help="also count the bytes of a gloo run at PP4 x VPP2 and PP8 x VPP4 (4 and 8 CPU "
                             "processes, minutes) and record them beside the analytic figures")
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
    measured = add_measured(cases) if args.measure else None
    result = dict(
        description="Bytes per micro-batch crossing each pipeline boundary (forward "
                    "activations; the backward gradient has the same shape), per pipeline "
                    "link at TP=1, bf16, without and with cross-stage caching (mhar.pipeline_cache). "
                    "Analytic from the routing layout and Megatron's layer offsets; the widths "
                    "are those a gloo run sends (test_pipeline_cache_sends_what_the_byte_model_says).",
        recipes=recipes,
        bytes_per_element=BYTES_PER_ELEMENT,
        commit=commit(),
        command=command("benchmarks.pipeline_bytes"),
        versions=versions(),
        cases=cases,
    )
    if measured is not None:
        result["measured"] = measured
    write_json(args.out, result, indent=2)


if __name__ == "__main__":
    main()
