"""TP / SP / DP / PP / interleaved PP on CPU (gloo) == the single-process run.

Every layout trains the same tiny model (4 layers, d=32; for PP4 x VPP2 8 layers, d=16) from
the same weights on the same global batch for 3 optimizer steps through Megatron's
schedules, DDP, ``finalize_model_grads`` and ``get_megatron_optimizer``, then runs one
forward-only pass. Losses must agree within 1e-5 relative, and every parameter's gradient
at step 1, gathered back to full shape (TP shards concatenated, pipeline chunks mapped to
global layer numbers), within fp32 tolerance. The interleaved pipelines with cross-stage
caching also equal the same layout without it.

All jobs of one world size run in one spawned process group (module-scoped), so the
grid costs two process starts. Each test waits for its own job's result only, as the
group streams them (``DistributedStream``): a test finishes every few seconds, and the
time limit is per job, which a loaded machine does not exhaust.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from tests.helpers import DistributedStream
from tests.parallel import harness as H

L = H.Layout
LAYOUTS = [
    # column/row-parallel shards; routing replicated, every rank sees the whole sequence
    pytest.param(L(tp=2), id="tp2"),
    # tokens sharded over TP: routing grads are partial sums until finalize sums them
    pytest.param(L(tp=2, sp=True), id="tp2-sp"),
    # DDP all-reduce; the 4 micro-batches split over 2 replicas
    pytest.param(L(dp=2), id="dp2"),
    # 1F1B, one boundary (adjust_tensor_shapes_fn); block: a partial crosses it
    pytest.param(L(pp=2), id="pp2"),
    # uneven stages (1 + 3 layers): the boundary moves to site 3
    pytest.param(L(pp=2, first=1, last=3), id="pp2-uneven-1-3"),
    # interleaved 1F1B: 3 boundaries of 3 widths over 2 ranks (LayoutP2PCommunicator); the
    # cross-stage cache on (the default): chunk 1 of each rank takes chunk 0's rows, and their
    # gradients go back through the cache
    pytest.param(L(pp=2, vpp=2), id="pp2-vpp2"),
    # interleaved with overlap_p2p_comm: receives posted asynchronously, same order
    pytest.param(L(pp=2, vpp=2, overlap_p2p=True), id="pp2-vpp2-overlap-p2p"),
    # 3 boundaries, 4 ranks
    pytest.param(L(pp=4), id="pp4"),
    pytest.param(L(tp=2, pp=2), id="tp2-pp2"),
    # p2p tensors are [s/tp, b, width*h]
    pytest.param(L(tp=2, pp=2, sp=True), id="tp2-sp-pp2"),
    # the cache over sequence-parallel shards: [s/tp, b, width*h] tensors
    pytest.param(L(tp=2, pp=2, vpp=2, sp=True), id="tp2-sp-pp2-vpp2"),
]
# Every layout with every variant, except the baseline on four ranks: the baseline is
# Megatron's own GPT, and its stage shapes are already checked at PP2 (uneven, interleaved)
# and TP2-SP; each four-rank job costs the CI machine's two cores tens of seconds.
GRID = [pytest.param(layout.values[0], v, id=f"{layout.id}-{v}") for layout in LAYOUTS for v in H.VARIANTS
        if not (layout.values[0].world == 4 and v == "none")]
ROUTED = ("full", "block", "delta")  # the variants the cache changes anything for

# Interleaved pipelines without the cache (variant none has no history to cache): what every
# boundary sent before it; compared with one process and with the cached run of the layout.
UNCACHED_LAYOUTS = [
    pytest.param(L(pp=2, vpp=2, pipeline_cache=False), id="pp2-vpp2-nocache"),
]

# PP4 x VPP2 needs 8 chunks: the 8-layer ``deep-*`` model, one layer per chunk. The last four
# chunks take their rank's first chunk's rows from the cache; block partials cross the
# boundaries inside a 3-sublayer block, delta's stream and block start every boundary.
DEEP_LAYOUTS = [
    pytest.param(L(pp=4, vpp=2), id="pp4-vpp2"),
]
DEEP_VARIANTS = [f"deep-{v}" for v in ("full", "block", "delta")]

# (cached layout, the same layout uncached, variant prefix): the cache changes what crosses
# the boundaries, and so the order of the gradients' sums, never the values.
CACHE_PAIRS = [
    pytest.param(L(pp=2, vpp=2), L(pp=2, vpp=2, pipeline_cache=False), "", id="pp2-vpp2"),
    # receives posted asynchronously: the cache is taken in the schedule's order all the same
    pytest.param(L(pp=2, vpp=2, overlap_p2p=True), L(pp=2, vpp=2, pipeline_cache=False), "",
                 id="pp2-vpp2-overlap-p2p"),
]
# (The four-rank layouts, TP2-SP x PP2 x VPP2 and PP4 x VPP2, are compared with one process
# only: each four-rank job costs the CI machine's two cores several seconds.)

# The lookahead schedule (groups of sites over the older rows, router gradients into
# main_grad once per group) where the layouts change what it sees: sequence-parallel shards
# (full, block, delta), a stage starting inside a block (its first group's first site reads a
# partial), the interleaved pipeline with the cache (a group's rows from the earlier chunk).
LOOKAHEAD_JOBS = [
    pytest.param(L(tp=2, sp=True), "lookahead-full", id="tp2-sp-full"),
    pytest.param(L(tp=2, sp=True), "lookahead-block", id="tp2-sp-block"),
    pytest.param(L(tp=2, sp=True), "lookahead-delta", id="tp2-sp-delta"),
    pytest.param(L(pp=2, first=1, last=3), "lookahead-block", id="pp2-uneven-1-3-block"),
    pytest.param(L(pp=2, vpp=2), "lookahead-full", id="pp2-vpp2-full"),
    pytest.param(L(pp=2, vpp=2), "lookahead-delta", id="pp2-vpp2-delta"),
]

# Routing parameters without their sequence_parallel marking (negative control).
UNMARKED = {v: L(tp=2, sp=True, unmark_routing_sp=True) for v in ("full", "block", "delta")}

# Seconds for one job (a few seconds on 2 idle cores; the first includes the process start;
# minutes while the CI machine's two cores also run the other test worker).
JOB_TIMEOUT_S = 600
LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-5  # atol relative to the tensor's largest reference grad
# (for a scalar, to its module's largest; see _assert_grads_close)


@pytest.fixture(scope="module")
def references():
    """Single-process run of each variant: (weights, losses, step-1 grads)."""
    return H.references(list(H.VARIANTS) + DEEP_VARIANTS + sorted({p.values[1] for p in LOOKAHEAD_JOBS}))


def _all_jobs() -> List[Tuple[H.Layout, str]]:
    jobs = [(p.values[0], v) for p in DEEP_LAYOUTS for v in DEEP_VARIANTS]
    jobs += [tuple(p.values) for p in GRID]
    jobs += [(p.values[0], v) for p in UNCACHED_LAYOUTS for v in ROUTED]
    jobs += [tuple(p.values) for p in LOOKAHEAD_JOBS]
    return jobs + [(layout, v) for v, layout in UNMARKED.items()]


@pytest.fixture(scope="module")
def parallel_runs(references):
    """(layout, variant) -> per-rank results; one process group per world size, started at
    the first job of its size and streaming every job of that size in order."""
    weights = {variant: ref[0] for variant, ref in references.items()}
    streams: Dict[int, Tuple[DistributedStream, List[Tuple[H.Layout, str]]]] = {}

    def get(layout: H.Layout, variant: str) -> List[dict]:
        if layout.world not in streams:
            jobs = [job for job in _all_jobs() if job[0].world == layout.world]
            stream = DistributedStream(H.parallel_worker, layout.world, jobs, weights,
                                       item_timeout=JOB_TIMEOUT_S)
            streams[layout.world] = (stream, jobs)
        stream, jobs = streams[layout.world]
        return stream.result(jobs.index((layout, variant)))

    try:
        yield get
    finally:
        for stream, _ in streams.values():
            stream.close()


def _assert_grads_close(grads: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]):
    tied = grads.pop("output_layer.weight", None)  # the last stage's tied copy
    assert grads.keys() == expected.keys()
    if tied is not None:
        grads["output_layer.weight (tied copy)"] = tied
        expected = dict(expected, **{"output_layer.weight (tied copy)":
                                     expected["embedding.word_embeddings.weight"]})
    for name, grad in grads.items():
        ref = expected[name]
        scale = ref.abs().max().item()
        if ref.numel() == 1:
            # A scalar's gradient (the delta gate's) is one sum over every token and channel
            # with heavy cancellation, so its rounding scales with its terms, not with the
            # small result (2.1e-5 relative on some CPUs): take the scale of its module's
            # other gradients, which sum the same products.
            module = name.rsplit(".", 1)[0] + "."
            scale = max([scale] + [t.abs().max().item() for k, t in expected.items()
                                   if k.startswith(module) and k != name])
        torch.testing.assert_close(
            grad, ref, rtol=GRAD_RTOL, atol=GRAD_ATOL * scale, msg=lambda m: f"{name}: {m}"
        )


def assert_runs_close(results: List[dict], baseline: List[dict]):
    """Two parallel runs of one model agree: the first step's loss bitwise (the same forward
    values), the later losses and every step-1 gradient to the tolerance of the single-process
    comparison."""
    for result, base in zip(results, baseline):
        assert result["losses"][0] == base["losses"][0]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(base["losses"]),
                                   rtol=LOSS_RTOL, atol=0)
    expected = H.gather_grads(baseline)
    expected.pop("output_layer.weight", None)  # the tied copy: checked against the embedding's
    _assert_grads_close(H.gather_grads(results), expected)


@pytest.mark.parametrize("layout,variant", GRID)
def test_matches_single_process(references, parallel_runs, layout, variant):
    _assert_matches(references[variant], parallel_runs(layout, variant))


@pytest.mark.parametrize("variant", ROUTED)
@pytest.mark.parametrize("layout", UNCACHED_LAYOUTS)
def test_uncached_interleaved_matches_single_process(references, parallel_runs, layout, variant):
    _assert_matches(references[variant], parallel_runs(layout, variant))


@pytest.mark.parametrize("layout,variant", LOOKAHEAD_JOBS)
def test_lookahead_matches_single_process(references, parallel_runs, layout, variant):
    """The lookahead schedule under the layout against its single-process run, and that run
    against the per-site schedule's (the same model; sums in other orders)."""
    _assert_matches(references[variant], parallel_runs(layout, variant))
    weights, losses, grads = references[variant]
    _, per_site_losses, per_site_grads = references[variant.removeprefix(H.LOOKAHEAD)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(per_site_losses), rtol=LOSS_RTOL, atol=0)
    _assert_grads_close(dict(grads), per_site_grads)


@pytest.mark.parametrize("variant", DEEP_VARIANTS)
@pytest.mark.parametrize("layout", DEEP_LAYOUTS)
def test_deep_interleaved_matches_single_process(references, parallel_runs, layout, variant):
    _assert_matches(references[variant], parallel_runs(layout, variant))


@pytest.mark.parametrize("variant", ["full", "block", "delta"])
@pytest.mark.parametrize("cached,uncached,prefix", CACHE_PAIRS)
def test_pipeline_cache_matches_the_uncached_schedule(parallel_runs, cached, uncached, prefix, variant):
    assert cached.pipeline_cache and not uncached.pipeline_cache
    assert_runs_close(parallel_runs(cached, prefix + variant), parallel_runs(uncached, prefix + variant))


def _assert_matches(reference, results: List[dict]):
    _, expected_losses, expected_grads = reference
    for result in results:  # every rank sees the global loss of every step
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(expected_losses), rtol=LOSS_RTOL, atol=0
        )
    _assert_grads_close(H.gather_grads(results), expected_grads)
    for name in H.replicated_names(results):  # TP replicas were reduced to one value
        scale = expected_grads.get(name, expected_grads["embedding.word_embeddings.weight"])
        assert H.replicated_grad_spread(results, name) <= GRAD_ATOL * scale.abs().max().item(), name


@pytest.mark.parametrize("variant", ["full", "block", "delta"])
def test_routing_grads_need_the_sequence_parallel_marking(references, parallel_runs, variant):
    """Without ``sequence_parallel`` on the routing parameters, finalize_model_grads does
    not sum their partial gradients over the TP group: they diverge from the reference
    (and between TP ranks), while every other gradient still matches."""
    _, _, expected = references[variant]
    results = parallel_runs(UNMARKED[variant], variant)
    grads = H.gather_grads(results)
    routing = sorted(name for name in expected if name.split(".")[-2].endswith("router"))
    assert routing
    for name in routing:
        scale = expected[name].abs().max().item()
        if scale == 0:  # site 1 routes over the embedding alone: nothing to learn
            assert name.startswith("decoder.layers.0.input_router."), name
            continue
        assert (grads[name] - expected[name]).abs().max().item() > 1e-2 * scale, name
        assert H.replicated_grad_spread(results, name) > 1e-2 * scale, name
    _assert_grads_close({n: g for n, g in grads.items() if n not in routing},
                        {n: g for n, g in expected.items() if n not in routing})


@pytest.mark.parametrize("variant", ["full", "block", "delta"])
@pytest.mark.parametrize("layout,prefix", [
    pytest.param(L(pp=2, vpp=2), "", id="pp2-vpp2"),
    pytest.param(L(pp=2, vpp=2, pipeline_cache=False), "", id="pp2-vpp2-nocache"),
    pytest.param(L(pp=4, vpp=2), "deep-", id="pp4-vpp2"),
])
def test_pipeline_cache_sends_what_the_byte_model_says(parallel_runs, layout, prefix, variant):
    """The bytes each rank hands to gloo per micro-batch, by boundary (activations by their
    sender, gradients by the receiver of the activation), are those of the analytic model of
    ``benchmarks/pipeline_bytes.py``; with the cache, less than without."""
    from benchmarks.pipeline_bytes import LayoutCase, boundaries, measured_boundary_bytes

    variant = prefix + variant
    mhar = H.mhar_config(variant, layout.pipeline_cache)
    rows = boundaries(H.model_config(variant), H.MBS, LayoutCase("", pp=layout.pp, vpp=layout.vpp), mhar,
                      bytes_per_element=4)  # fp32 pipeline_dtype
    expected = {}
    for row in rows:
        expected[("forward", row["sender"])] = expected[("backward", row["receiver"])] = (
            row.get("cached_bytes", row["bytes"]))
    assert measured_boundary_bytes(parallel_runs(layout, variant), H.NUM_MICROBATCHES) == expected
    cached = [row for row in rows if "cached_bytes" in row]
    assert bool(cached) == layout.pipeline_cache
    assert all(row["cached_bytes"] < row["bytes"] for row in cached)
