"""The CPU runtime runs unmodified Megatron-Core: schedules, DDP, optimizer, TP/SP/PP.

Every multi-rank run is compared with a single-process run of the same model
(same initial weights, sliced per rank) on the same data.
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List, Optional

import pytest
import torch

from tests.helpers import LAUNCHER_ENV, lm_batches, run_distributed

SEQ, MBS, VOCAB, HIDDEN, HEADS = 16, 2, 128, 64, 4
NUM_MICROBATCHES = 2


# --------------------------------------------------------------------------- helpers
# Module level so that spawned ranks can unpickle the worker functions.


def _config(num_layers: int, tp: int = 1, pp: int = 1, vpp: Optional[int] = None, **overrides):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,  # required on CPU (see megatron_mhar/runtime/cpu.py)
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _layer_spec(config, vp_stage: Optional[int]):
    """Megatron's local GPT spec; with sequence parallelism its norms (and the
    block's final norm) become SequenceParallelTorchNorm."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from megatron_mhar.models.norms import SequenceParallelTorchNorm

    spec = get_gpt_layer_local_spec()
    if not config.sequence_parallel:
        return spec
    spec.submodules.input_layernorm = SequenceParallelTorchNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=SequenceParallelTorchNorm,
    )


def _build_chunks(config) -> List[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage of this rank (one without VPP)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp in range(vpp) if vpp else [None]:
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        chunks.append(
            GPTModel(
                config,
                _layer_spec(config, vp),
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                pre_process=first,
                post_process=last,
                vp_stage=vp,
            )
        )
    return chunks


def _load_full_weights(chunk: torch.nn.Module, full: Dict[str, torch.Tensor]) -> None:
    """Copy a single-process GPTModel's parameters into a TP/PP chunk.

    Layer ``i`` of the chunk is global layer ``layer.layer_number - 1``; a
    tensor-parallel parameter takes its rank's slice along ``partition_dim``; the
    last stage's untied ``output_layer.weight`` is the shared word embedding.
    """
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    layer_names = {
        f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
        for i, layer in enumerate(chunk.decoder.layers)
    }
    for name, param in chunk.named_parameters():
        global_name = name
        for local, glob in layer_names.items():
            if name.startswith(local):
                global_name = glob + name[len(local) :]
        if global_name == "output_layer.weight" and global_name not in full:
            global_name = "embedding.word_embeddings.weight"
        value = full[global_name]
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            value = value.chunk(tp_size, dim=param.partition_dim)[tp_rank]
        assert value.shape == param.shape, (name, value.shape, param.shape)
        with torch.no_grad():
            param.copy_(value)


def _batches(seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    return lm_batches(NUM_MICROBATCHES, MBS, SEQ, VOCAB, seed)


def _loss_func(loss_mask, output_tensor):
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _train(
    config,
    chunks,
    steps: int,
    optimizer: str = "sgd",
    lr: float = 0.1,
    use_distributed_optimizer: bool = False,
    batches: Optional[List[Dict[str, torch.Tensor]]] = None,
    overlap: bool = False,
) -> Dict[str, List[float]]:
    """Megatron DDP + get_megatron_optimizer + get_forward_backward_func over
    ``batches`` (default: all of ``_batches()``) as the micro-batches of every
    step. Returns per step ``loss`` (the sum of the micro-batch losses, which
    the schedule already divided by the number of micro-batches; NaN on
    non-last pipeline stages) and ``grad_norm`` (the optimizer's global norm,
    reduced over all model-parallel ranks)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap and use_distributed_optimizer,
    )
    model = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=optimizer,
            lr=lr,
            weight_decay=0.0,
            clip_grad=1e9,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        model,
    )
    forward_backward = get_forward_backward_func()
    batches = _batches() if batches is None else batches
    losses, grad_norms = [], []
    for _ in range(steps):
        for m in model:
            m.zero_grad_buffer()
        opt.zero_grad()
        data = [iter(batches) for _ in model]
        reduced = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=data if len(model) > 1 else data[0],
            model=model if len(model) > 1 else model[0],
            num_microbatches=len(batches),
            seq_length=SEQ,
            micro_batch_size=MBS,
            forward_only=False,
        )
        success, grad_norm, _ = opt.step()
        assert success
        grad_norms.append(grad_norm)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            losses.append(sum(r["lm loss"].item() for r in reduced))
        else:
            losses.append(float("nan"))
    return {"loss": losses, "grad_norm": grad_norms}


def _parallel_worker(
    full: Dict[str, torch.Tensor],
    num_layers: int,
    steps: int,
    tp: int,
    pp: int,
    vpp: Optional[int],
    use_distributed_optimizer: bool = False,
    optimizer: str = "sgd",
    overlap: bool = False,
):
    from megatron.core import parallel_state

    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    initialize_model_parallel_from_env(tp=tp, pp=pp, vpp=vpp, seed=1234, device="cpu")
    try:
        config = _config(num_layers, tp=tp, pp=pp, vpp=vpp)
        chunks = _build_chunks(config)
        for chunk in chunks:
            _load_full_weights(chunk, full)
        # Data parallel ranks split the single-process run's micro-batches.
        dp_rank = parallel_state.get_data_parallel_rank()
        dp_size = parallel_state.get_data_parallel_world_size()
        batches = _batches()[dp_rank::dp_size]
        return _train(
            config,
            chunks,
            steps,
            optimizer=optimizer,
            use_distributed_optimizer=use_distributed_optimizer,
            batches=batches,
            overlap=overlap,
        )
    finally:
        destroy()


def _reference(num_layers: int, steps: int, optimizer: str = "sgd"):
    """Single-process run (needs megatron_world1): initial weights and losses."""
    config = _config(num_layers)
    (model,) = _build_chunks(config)
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    return full, _train(config, [model], steps, optimizer=optimizer)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "use_distributed_optimizer",
    [
        pytest.param(False, id="ddp"),  # Float32Optimizer over DDP's contiguous grad buffer
        pytest.param(True, id="distopt"),  # DistributedOptimizer: reduce-scatter/all-gather on gloo
    ],
)
def test_gpt_trains_through_megatron_schedule(megatron_world1, use_distributed_optimizer):
    config = _config(num_layers=2)
    (model,) = _build_chunks(config)
    assert next(model.parameters()).device.type == "cpu"
    losses = _train(
        config,
        [model],
        steps=4,
        optimizer="adam",
        lr=1e-2,
        use_distributed_optimizer=use_distributed_optimizer,
    )["loss"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1, losses


def test_rng_tracker_forks_a_separate_stream(megatron_world1):
    """``get_cuda_rng_tracker().fork()`` switches to the model-parallel stream and
    back: the default stream continues as if the fork had not happened."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(3, force_reset_rng=True)
    expected = torch.rand(4)
    tensor_parallel.model_parallel_cuda_manual_seed(3, force_reset_rng=True)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with tracker.fork():
        forked_1 = torch.rand(4)
    with tracker.fork():
        forked_2 = torch.rand(4)  # the forked stream advances between forks
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)
    assert not torch.equal(forked_1, expected)
    assert not torch.equal(forked_1, forked_2)


def test_activation_recompute_restores_rng(megatron_world1):
    """Full recompute with dropout gives bitwise the same loss and gradients: the
    recompute restores the (CPU-backed) CUDA RNG and the tracker's states."""
    from megatron.core import tensor_parallel

    batch = _batches()[0]
    losses, grads = {}, {}
    for case in ("no-dropout", "plain", "recompute"):
        overrides = {}
        if case != "no-dropout":
            overrides.update(hidden_dropout=0.2, attention_dropout=0.2)
        if case == "recompute":
            overrides.update(
                recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            )
        config = _config(num_layers=2, **overrides)
        tensor_parallel.model_parallel_cuda_manual_seed(7, force_reset_rng=True)
        (model,) = _build_chunks(config)
        tensor_parallel.model_parallel_cuda_manual_seed(8, force_reset_rng=True)
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).mean()
        loss.backward()
        losses[case] = loss.item()
        grads[case] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert losses["plain"] != losses["no-dropout"]  # dropout is active
    assert losses["recompute"] == losses["plain"]
    for name, grad in grads["plain"].items():
        torch.testing.assert_close(grads["recompute"][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "tp, pp, vpp, num_layers, use_distributed_optimizer",
    [
        pytest.param(1, 2, None, 2, False, id="pp2-1f1b"),  # non-interleaved 1F1B, p2p on gloo
        pytest.param(1, 2, 2, 4, False, id="pp2-vpp2"),  # interleaved 1F1B, 2 chunks per rank
        pytest.param(2, 1, None, 2, False, id="tp2-sp"),  # tensor + sequence parallel, SP norms
        # data parallel, distributed optimizer (Adam only), overlapped (async) grad
        # reduce-scatter and param all-gather on gloo
        pytest.param(1, 1, None, 2, True, id="dp2-distopt-overlap"),
    ],
)
def test_parallel_layout_matches_single_process(
    megatron_world1, tp, pp, vpp, num_layers, use_distributed_optimizer
):
    """Losses and gradient norms of 3 optimizer steps at a 2-rank layout equal
    the single-process run's (the norm catches a gradient that is not reduced,
    e.g. a sequence-parallel norm weight that is not marked)."""
    steps = 3
    optimizer = "adam" if use_distributed_optimizer else "sgd"
    full, expected = _reference(num_layers, steps, optimizer)
    per_rank = run_distributed(
        _parallel_worker,
        2,
        full,
        num_layers,
        steps,
        tp,
        pp,
        vpp,
        use_distributed_optimizer,
        optimizer,
        use_distributed_optimizer,  # overlap
        timeout=120,
    )
    if tp * pp == 1:  # data parallel: each rank saw half the micro-batches
        loss = torch.tensor([r["loss"] for r in per_rank]).mean(dim=0)
    else:  # the last pipeline stage reports the loss
        loss = torch.tensor(per_rank[-1]["loss"])
    torch.testing.assert_close(loss, torch.tensor(expected["loss"]), rtol=1e-5, atol=0)
    for rank, result in enumerate(per_rank):
        torch.testing.assert_close(
            torch.tensor(result["grad_norm"]),
            torch.tensor(expected["grad_norm"]),
            rtol=1e-5,
            atol=0,
            msg=lambda m: f"grad norm on rank {rank}: {m}",
        )


def test_disable_restores_torch_cuda():
    from megatron.core.tensor_parallel import random as mcore_random

    from megatron_mhar.runtime import cpu

    def patched_functions():
        return (
            torch.cuda.current_device,
            torch.cuda.synchronize,
            torch.cuda.get_rng_state,
            torch.cuda.random.get_rng_state,
            torch.cuda.set_rng_state,
            torch.cuda.manual_seed,
            mcore_random._set_cuda_rng_state,
        )

    originals = patched_functions()
    with cpu.cpu_runtime():
        with cpu.cpu_runtime():  # nested: the inner exit keeps it enabled
            pass
        assert cpu.is_cpu_runtime_enabled()
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).to("cuda:0").device.type == "cpu"
        assert torch.ones(2).type() == "torch.cuda.FloatTensor"
        cpu.enable_cpu_runtime()  # idempotent
    assert not cpu.is_cpu_runtime_enabled()
    restored = patched_functions()
    assert all(a is b for a, b in zip(originals, restored))
    assert torch.overrides._get_current_function_mode_stack() == []
    assert torch.ones(2).type() == "torch.FloatTensor"
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(2, device="cuda")


INIT_ERRORS = [
    pytest.param(dict(device="gpu"), {}, "device must be 'auto', 'cuda' or 'cpu'", id="unknown-device"),
    pytest.param(dict(tp=0), {}, "tp must be a positive integer", id="zero-tp"),  # was ZeroDivisionError
    pytest.param(dict(pp=-1), {}, "pp must be a positive integer", id="negative-pp"),  # was accepted
    pytest.param(dict(vpp=2), {}, r"vpp=2 \(interleaved pipeline\) needs pp > 1", id="vpp-without-pp"),
    pytest.param(dict(tp=2), {}, r"WORLD_SIZE=1 is not a multiple of tp\*pp\*cp", id="tp-over-world"),
    pytest.param({}, dict(RANK="3"), "RANK=3 and WORLD_SIZE=1", id="rank-outside-world"),  # was accepted
    pytest.param({}, dict(WORLD_SIZE="2"), "MASTER_ADDR is not set", id="no-rendezvous"),
]


@pytest.mark.parametrize("kwargs,env,message", INIT_ERRORS)
def test_initialize_errors_leave_nothing_initialised(monkeypatch, kwargs, env, message):
    from megatron.core import parallel_state

    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env
    from megatron_mhar.runtime.cpu import is_cpu_runtime_enabled

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        with pytest.raises((ValueError, RuntimeError), match=message):
            initialize_model_parallel_from_env(**{"device": "cpu", **kwargs})
        # Checked before anything starts: a corrected call works without destroy().
        assert not torch.distributed.is_initialized()
        assert not parallel_state.model_parallel_is_initialized()
        assert not is_cpu_runtime_enabled()
    finally:
        destroy()
