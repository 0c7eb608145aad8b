"""``benchmarks.bench_training`` on CPU: the training driver's models, the report a GPU run
fills, at the tiny size."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_throughput_bench_reports_every_model(tmp_path):
    out = tmp_path / "training.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_training", "--sizes", "tiny",
         "--models", "baseline,attnres,mhar,attnres_lookahead,mhar_lookahead", "--steps", "2", "--warmup", "1",
         "--out", str(out)],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    models = json.loads(out.read_text())["sizes"]["tiny"]["models"]
    assert set(models) == {"baseline", "attnres", "mhar", "attnres_lookahead", "mhar_lookahead"}
    assert models["baseline"]["throughput_ratio"] == 1.0
    for name, entry in models.items():
        assert entry["tokens_per_s"] > 0 and len(entry["step_s_all"]) == 2
        assert len(entry["losses"]) == 3  # one warmup step and two timed ones
        split = entry["micro_batch_host_split"]
        # Completed is never earlier than issued, and both phases took time.
        assert split["forward_ms"] >= split["forward_issued_ms"] > 0
        assert split["backward_ms"] >= split["backward_issued_ms"] > 0
    # AttnRes and MHAR are other models than the baseline: their parameters and losses differ.
    assert models["mhar"]["params"] > models["baseline"]["params"]
    assert models["mhar"]["losses"] != models["baseline"]["losses"]
    # The models are the driver's: the recipe's, built by its functions, and so their
    # parameters (the smoke recipe's MHAR model here).
    report = json.loads(out.read_text())["sizes"]["tiny"]
    assert report["case"]["recipe"] == "smoke_cpu"
    assert models["mhar"]["params"] == _driver_parameters("smoke_cpu")
    # Each AttnRes is compared with MHAR on its own schedule.
    assert 0 < models["attnres"]["throughput_vs_mhar"]
    assert 0 < models["attnres_lookahead"]["throughput_vs_mhar"]
    assert "throughput_vs_mhar" not in models["mhar_lookahead"]


def _driver_parameters(recipe: str) -> int:
    """Parameters of the model the training driver builds from ``recipe`` on CPU."""
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env
    from megatron_mhar.training.launch_checks import with_resolved_spec
    from megatron_mhar.training.model import build_model_chunks, transformer_config
    from megatron_mhar.training.recipes import load_config

    cfg = with_resolved_spec(load_config(recipe, ["run.device=cpu"]))
    initialize_model_parallel_from_env(device="cpu")
    try:
        (chunk,) = build_model_chunks(cfg, transformer_config(cfg, on_cpu=True), on_cpu=True)
        return sum(p.numel() for p in chunk.module.parameters())
    finally:
        destroy()


def _bench_losses(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_training", "--sizes", "tiny",
         "--models", "baseline,mhar,mhar_lookahead", "--steps", "2", "--warmup", "3",
         "--no-profile", "--out", str(out), *extra],
        check=True, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    models = json.loads(out.read_text())["sizes"]["tiny"]["models"]
    return {name: entry["losses"] for name, entry in models.items()}


@pytest.mark.gpu
def test_full_iteration_graph_replays_the_eager_steps(tmp_path):
    """Under Megatron's full-iteration CUDA graph (captured on the second step, replayed
    after) every model trains as it does eagerly: the same losses, step for step, from
    the same initialisation and batches."""
    eager = _bench_losses(tmp_path, "eager")
    graphed = _bench_losses(tmp_path, "graphed", "--cuda-graph", "full_iteration")
    for name, losses in eager.items():
        assert len(graphed[name]) == len(losses) == 5
        assert graphed[name][0] == losses[0]  # the first step runs eagerly in both
        torch.testing.assert_close(graphed[name], losses, rtol=2e-3, atol=0, msg=name)
    # The steps changed the model: a replay that did nothing would repeat one loss.
    assert len(set(graphed["mhar"])) == 5


def _bench(*args, env=None):
    return subprocess.run([sys.executable, "-m", "benchmarks.bench_training", "--sizes", "tiny",
                           "--steps", "2", "--warmup", "1", "--no-profile", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)  # fmt: skip


@pytest.mark.parametrize("args, message", [
    # timed rounds: none would leave no step time to take a median of (after every warmup)
    (("--steps", "0"), "--steps must be >= 1"),
    (("--steps", "-1"), "--steps must be >= 1"),
    # one size twice would be trained twice and its first report replaced
    (("--sizes", "tiny,tiny"), "names a size twice"),
    # --out paths that no report can be written to: refused before the run, not after it
    (("--out", "{tmp}"), "is a directory"),
    (("--out", "{tmp}/file/training.json"), "is a file, not a directory"),
    # FP8 GEMMs are Transformer Engine's: the local spec has none to run
    (("--precision", "fp8", "--spec", "local"), "--precision fp8 needs --spec transformer_engine"),
])  # fmt: skip
def test_arguments_name_their_errors(args, message, tmp_path):
    (tmp_path / "file").write_text("")
    run = _bench(*[a.format(tmp=tmp_path) for a in args])
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_transformer_engine_spec_needs_cuda():
    run = _bench("--spec", "transformer_engine")
    assert run.returncode == 2 and "--spec transformer_engine needs CUDA" in run.stderr, run.stderr[-2000:]


def test_te_baseline_overrides_are_megatron_fields(tmp_path):
    """The strong baseline's fusions and FP8 reach the driver's configuration as recipe
    fields; its fused kernels are TransformerConfig fields Megatron accepts, only with the TE
    spec (the local spec's gradient-accumulation fusion needs apex)."""
    import dataclasses as dc
    
    from megatron.core.transformer.transformer_config import TransformerConfig

    from benchmarks.bench_training import SIZES, build_parser, size_overrides
    from megatron_mhar.models.builder import fused_kernel_fields
    from megatron_mhar.training.recipes import load_config

    data = {"prefix": str(tmp_path / "ids"), "tokenizer": str(tmp_path / "tokenizer")}

    def model_of(argv):
        args = build_parser().parse_args(["--sizes", "tiny", *argv])
        return load_config(SIZES["tiny"], size_overrides(args, "tiny", "cuda", tmp_path, data))

    fields = {f.name for f in dc.fields(TransformerConfig)}
    cfg = model_of(["--spec", "transformer_engine", "--precision", "fp8"])
    assert cfg.training.precision == "fp8" and cfg.model.fused_kernels
    te = fused_kernel_fields(cfg.model)
    assert te["cross_entropy_loss_fusion"] and te["apply_rope_fusion"] and te["bias_activation_fusion"]
    # TE's linears fuse the weight-gradient accumulation themselves (apex or not); TE's
    # cross-entropy cannot be captured by the full-iteration graph.
    assert te["gradient_accumulation_fusion"] and te["cross_entropy_fusion_impl"] == "native"
    assert set(te) <= fields
    assert fused_kernel_fields(model_of(["--spec", "transformer_engine", "--no-fusions"]).model) == {}
    assert fused_kernel_fields(model_of(["--spec", "local"]).model) == {}


def test_default_report_is_the_file_of_record():
    """Without --out the report goes to benchmarks/results/training/<device>.json (an A/B
    against --base-kernels writes none unless asked)."""
    from benchmarks.bench_training import build_parser, check_args

    parser = build_parser()
    args = parser.parse_args(["--sizes", "tiny"])
    check_args(parser, args)
    out = Path(args.out)
    device = "cpu" if not torch.cuda.is_available() else out.stem
    assert out == ROOT / "benchmarks" / "results" / "training" / f"{device}.json"



def test_moe_case_is_the_350m_recipe_with_experts(tmp_path):
    """``350m_moe``: every MLP of the 350M recipe an MoE layer of 8 experts top-2 at half the
    dense width (a token's MLP FLOPs are the dense model's), all-to-all on GPUs and
    all-gather on CPU, the TE spec's fused permutation with the fused kernels. (The tiny
    MoE case runs on CPU: python -m benchmarks.bench_training --sizes tiny_moe.)"""
    from benchmarks.bench_training import SIZES, build_parser, flops_per_token, size_overrides
    from megatron_mhar.models.builder import fused_kernel_fields
    from megatron_mhar.training.recipes import load_config

    data = {"prefix": str(tmp_path / "ids"), "tokenizer": str(tmp_path / "tokenizer")}
    args = build_parser().parse_args(["--sizes", "350m_moe", "--spec", "transformer_engine"])
    gpu = load_config(SIZES["350m_moe"], size_overrides(args, "350m_moe", "cuda", tmp_path, data)).model
    cpu = load_config(SIZES["350m_moe"], size_overrides(args, "350m_moe", "cpu", tmp_path, data)).model
    dense = load_config(SIZES["350m"]).model
    assert (gpu.num_moe_experts, gpu.moe_router_topk, 2 * gpu.moe_ffn_hidden_size) == (8, 2, dense.ffn_hidden_size)
    assert (gpu.moe_token_dispatcher_type, cpu.moe_token_dispatcher_type) == ("alltoall", "allgather")
    assert fused_kernel_fields(gpu)["moe_permute_fusion"]
    # the same MLP FLOPs per token, plus the router's
    assert flops_per_token(gpu, 151936) - flops_per_token(dense, 151936) == 6 * 24 * 1024 * 8
    tiny_args = build_parser().parse_args(["--sizes", "tiny_moe", "--spec", "local"])
    tiny = load_config(SIZES["tiny_moe"], size_overrides(tiny_args, "tiny_moe", "cpu", tmp_path, data)).model
    assert (tiny.num_moe_experts, tiny.moe_token_dispatcher_type) == (8, "allgather")


def test_8b_delta_case_is_the_cpt_recipe_on_one_gpu():
    """``8b_delta``: the cpt_8b_mhar_delta recipe's layer shape, sequence length and routing on
    one GPU (no tensor parallelism, no checkpoint to load, no recomputation, which the
    full-iteration graph refuses), as deep as the driver's memory estimate fits, in whole
    delta blocks; GPU only."""
    from benchmarks.bench_training import SIZE_OVERRIDES, SIZES, build_parser, check_args, layers_that_fit, size_recipe
    from benchmarks.common import MODELS
    from megatron_mhar.training.recipes import load_config

    case = size_recipe("8b_delta")
    recipe = load_config("cpt_8b_mhar_delta", ["data.paths=[unset]", "data.tokenizer=unset"])
    for field in ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "vocab_size",
                  "seq_length", "rope_scaling", "tie_embeddings"):
        assert getattr(case.model, field) == getattr(recipe.model, field), field
    assert case.mhar == recipe.mhar == MODELS["mhar_delta"]
    assert case.checkpoint.load is None and case.parallel.tensor_model_parallel_size == 1
    assert case.training.recompute_granularity is None and case.training.global_batch_size == 8
    # The benchmark's full-iteration graph is a valid configuration of the case (the recipe
    # overlaps its gradient reduction, which the graph refuses).
    graphed = load_config(SIZES["8b_delta"], [*SIZE_OVERRIDES["8b_delta"], "training.cuda_graph=full_iteration",
                                              "logging.routing_entropy=false", "logging.routing_interval=0"])
    assert not graphed.parallel.overlap_grad_reduce
    gib = 2**30
    depths = [layers_that_fit("8b_delta", 1, memory * gib) for memory in (79, 139, 400)]
    assert depths == sorted(depths) and all(d % recipe.mhar.delta_block_layers == 0 for d in depths)
    assert depths[-1] == recipe.model.num_layers  # never deeper than the recipe
    with pytest.raises(ValueError, match="do not fit"):
        layers_that_fit("8b_delta", 2, 40 * gib)
    if not torch.cuda.is_available():
        parser = build_parser()
        with pytest.raises(SystemExit):
            check_args(parser, parser.parse_args(["--sizes", "8b_delta", "--models", "baseline,mhar_delta"]))
