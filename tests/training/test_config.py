"""Recipe loading: strict keys and types, includes, overrides, launch checks.

Every failure must happen before a process group exists, name the key path and say
what to change.
"""

from __future__ import annotations

import itertools
import re
import sys
import textwrap

import pytest
import torch

from megatron_mhar.training.launch_checks import validate_launch
from megatron_mhar.training.recipes import RECIPES_DIR, apply_overrides, load_config
from megatron_mhar.training.schema import TrainConfig, from_dict


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_are_the_smoke_recipe():
    cfg = load_config()
    assert cfg.run.name == "smoke_cpu" and cfg.data.embedded and cfg.data.tokenizer == "builtin"


@pytest.mark.parametrize(
    "override, message",
    [
        # a typo in a known section names the closest valid key
        pytest.param("model.hiden_size=64", "unknown config key 'model.hiden_size'; did you mean 'model.hidden_size'?", id="typo"),
        # the right leaf in the wrong section
        pytest.param("training.lr=1e-3", "did you mean 'optimizer.lr'?", id="wrong-section"),
        # an unknown section
        pytest.param("modle.num_layers=2", "did you mean 'model.num_layers'?", id="section-typo"),
        # wrong scalar types name the expected type
        pytest.param("model.num_layers=two", "model.num_layers: expected int, got str 'two'", id="int"),
        pytest.param("model.num_layers=2.5", "model.num_layers: expected int, got float 2.5", id="float-for-int"),
        pytest.param("parallel.sequence_parallel=1", "parallel.sequence_parallel: expected bool", id="bool"),
        pytest.param("optimizer.lr=fast", "optimizer.lr: expected float, got str 'fast'", id="float"),
        pytest.param("data.paths={a: 1}", "data.paths: expected a list, got dict {'a': 1}; write a list as [a, b] in YAML, data.paths=[a,b] on the command line (one item: data.paths=a)", id="list"),
        pytest.param("data.weights=[1, x]", "data.weights[1]: expected float", id="list-item"),
        # YAML's .inf / .nan are floats, but no knob takes them
        pytest.param("optimizer.lr=.inf", "optimizer.lr: expected a finite float, got inf", id="inf"),
        pytest.param("optimizer.weight_decay=.nan", "optimizer.weight_decay: expected a finite float, got nan", id="nan"),
        # numpy seeds only in [0, 2**32)
        pytest.param("run.seed=-1", "run.seed must be in [0, 2**32), got -1", id="seed"),
        # sizes that null derives are still never zero or negative
        pytest.param("model.ffn_hidden_size=0", "model.ffn_hidden_size must be positive, or null to derive it", id="ffn-zero"),
        pytest.param("model.kv_channels=-1", "model.kv_channels must be positive, or null to derive it", id="kv-channels"),
        pytest.param("model.num_query_groups=0", "model.num_query_groups must be positive, or null to derive it", id="groups-zero"),
        # values checked by each section
        pytest.param("mhar.num_heads=5", "mhar.num_heads=5 does not divide hidden_size=128", id="mhar-heads"),
        pytest.param("model.num_attention_heads=5", "num_attention_heads=5 does not divide hidden_size=128", id="attn-heads"),
        pytest.param("mhar.variant=fancy", "mhar.variant must be one of", id="variant"),
        pytest.param(["mhar.variant=delta", "mhar.delta_block_layers=5"],
                     "mhar.delta_block_layers=5 decoder layers exceeds the model's 4", id="delta-blocks"),
        pytest.param(["mhar.routing_schedule=lookahead", "mhar.lookahead_group=10"],
                     "mhar.lookahead_group=10 exceeds the model's 9 routing sites", id="lookahead-group"),
        pytest.param(["mhar.variant=none", "mhar.routing_schedule=lookahead"],
                     "use routing_schedule='per_site' with variant 'none'", id="lookahead-baseline"),
        pytest.param("training.micro_batch_size=3", "global_batch_size=16 is not a multiple of training.micro_batch_size=3", id="micro"),
        pytest.param("parallel.tensor_model_parallel_size=3", "tensor_model_parallel_size=3 must divide model.num_attention_heads=4", id="tp-heads"),
        pytest.param("parallel.pipeline_model_parallel_size=3", "model.num_layers=4 must be a multiple of the pipeline chunks", id="pp-layers"),
        pytest.param("parallel.sequence_parallel=true", "needs tensor_model_parallel_size > 1", id="sp"),
        pytest.param("optimizer.lr_warmup_iters=500", "optimizer.lr_warmup_iters=500 must be shorter than the decay (training.train_iters=150)", id="warmup"),
        pytest.param("data.weights=[1.0]", "data.weights has 1 entries for 0 data.paths", id="weights"),
        pytest.param("training.cuda_graph=partial", "training.cuda_graph must be one of ['none', 'full_iteration']", id="graph-mode"),
        pytest.param("checkpoint.verify=sha", "checkpoint.verify must be one of full, size, off, got 'sha'", id="verify-level"),
        # what the full-iteration graph does not cover, each with its fix
        pytest.param("training.cuda_graph=full_iteration",
                     "set logging.routing_entropy=false and logging.routing_interval=0 or set training.cuda_graph=none", id="graph-entropy"),
        pytest.param(["training.cuda_graph=full_iteration", "logging.routing_entropy=false", "logging.routing_interval=10"],
                     "the routing diagnostics are recorded by Python on the steps they log", id="graph-routing-maps"),
        pytest.param("logging.routing_interval=-1", "logging.routing_interval must be >= 0, got -1", id="routing-interval"),
        pytest.param(["training.cuda_graph=full_iteration", "parallel.pipeline_model_parallel_size=2"],
                     "not supported with pipeline parallelism (pipeline_model_parallel_size=2)", id="graph-pp"),
        pytest.param(["training.cuda_graph=full_iteration", "logging.routing_entropy=false", "training.recompute_granularity=selective"],
                     "set training.recompute_granularity=null or set training.cuda_graph=none", id="graph-recompute"),
        pytest.param(["training.cuda_graph=full_iteration", "logging.routing_entropy=false", "parallel.overlap_grad_reduce=true"],
                     "set parallel.overlap_grad_reduce=false", id="graph-overlap"),
        pytest.param("training.precision=fp16", "training.precision must be one of fp32, bf16, fp8, got 'fp16'", id="precision"),
        pytest.param("model.spec=te", "model.spec must be one of ('local', 'transformer_engine', 'auto')", id="spec"),
        # FP8 GEMMs take dimensions that are multiples of 16, named with their fix
        pytest.param(["training.precision=fp8", "model.hidden_size=120"],
                     "FP8 GEMMs need every linear layer's widths and the tokens per micro-batch to be multiples of "
                     "16, and model.hidden_size is 120; change the model or batch shape, or use training.precision=bf16",
                     id="fp8-width"),
        pytest.param(["training.precision=fp8", "model.ffn_hidden_size=392"],
                     "the MLP width per tensor-parallel rank (ffn_hidden_size / TP) is 392", id="fp8-mlp"),
        pytest.param(["training.precision=fp8", "model.kv_channels=18"],
                     "the query width per tensor-parallel rank (num_attention_heads x head width / TP) is 72",
                     id="fp8-query"),
        pytest.param(["training.precision=fp8", "training.micro_batch_size=1", "model.seq_length=120"],
                     "the tokens per micro-batch and rank (micro_batch_size x seq_length) is 120", id="fp8-tokens"),
        pytest.param(["training.precision=fp8", "training.recompute_granularity=full", "training.recompute_method=uniform",
                      "training.recompute_num_layers=1"],
                     "use training.recompute_granularity=selective or null", id="fp8-full-recompute"),
    ],
)
def test_bad_values_fail_at_load(override, message):
    overrides = override if isinstance(override, list) else [override]
    with pytest.raises(ValueError) as err:
        load_config("smoke_cpu", overrides)
    assert message in str(err.value)
    # names overrides that caused it (all given here are needed), not the recipe
    assert any(str(err.value).startswith(f"command line override{'s' * (n > 1)} {' '.join(named)}: ")
               for n in range(1, len(overrides) + 1) for named in itertools.combinations(overrides, n)), str(err.value)


@pytest.mark.parametrize("overrides, named", [
    # a value checked by its section
    pytest.param(["run.name=x", "optimizer.lr=-1"], "override optimizer.lr=-1", id="one-value"),
    # a check across fields that the recipe passes, failed by one override
    pytest.param(["training.micro_batch_size=3", "run.seed=7"], "override training.micro_batch_size=3", id="cross-field"),
    # the same key twice: the last one is what runs
    pytest.param(["optimizer.lr=-1", "optimizer.lr=-2"], "override optimizer.lr=-2", id="last-wins"),
    # two overrides each valid alone, failing together
    pytest.param(["optimizer.lr_warmup_iters=100", "training.train_iters=50", "run.name=x"],
                 "overrides optimizer.lr_warmup_iters=100 training.train_iters=50", id="together"),
    # an override that changes a value the failed check names is not what failed it
    pytest.param(["optimizer.lr=-1", "optimizer.min_lr=0"], "override optimizer.lr=-1", id="other-value"),
    # an unknown key and a value that does not parse are the override's as well
    pytest.param(["optimizer.lrr=1"], "override optimizer.lrr=1", id="unknown-key"),
    pytest.param(["model.num_layers"], "override model.num_layers", id="no-value"),
])
def test_override_errors_name_the_override(overrides, named):
    with pytest.raises(ValueError) as err:
        load_config("smoke_cpu", overrides)
    assert str(err.value).startswith(f"command line {named}: "), str(err.value)
    assert "smoke_cpu.yaml" not in str(err.value)


def test_a_recipe_error_names_the_recipe_despite_overrides(tmp_path):
    recipe = _write(tmp_path / "mine.yaml", "include: smoke_cpu\noptimizer: {lr: -1.0}\n")
    with pytest.raises(ValueError) as err:
        load_config(str(recipe), ["run.name=x", "optimizer.min_lr=0"])
    assert str(err.value).startswith(f"{recipe}: optimizer.lr must be positive"), str(err.value)


def test_mhar_train_names_the_override(capsys):
    from megatron_mhar.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["smoke_cpu", "optimizer.lr=-1"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(
        "mhar-train: error: command line override optimizer.lr=-1: optimizer.lr must be positive")


@pytest.mark.parametrize("override, key", [
    pytest.param('data.paths=["${MHAR_TEST_UNSET_VAR}/x"]', "data.paths[0]", id="data-path"),
    pytest.param("data.tokenizer=${MHAR_TEST_UNSET_VAR}/tok", "data.tokenizer", id="tokenizer"),
    pytest.param("checkpoint.load=${MHAR_TEST_UNSET_VAR}/ckpt", "checkpoint.load", id="load"),
    pytest.param("run.output_dir=${MHAR_TEST_UNSET_VAR}/runs", "run.output_dir", id="output-dir"),
])
def test_unset_variables_in_paths_fail_at_launch(override, key, monkeypatch):
    """A path's unset variable stays as written when the configuration loads (a recipe for
    another machine loads), and the launch checks name it."""
    monkeypatch.delenv("MHAR_TEST_UNSET_VAR", raising=False)
    cfg = load_config("smoke_cpu", [override])
    with pytest.raises(ValueError, match=rf"environment variables not set: MHAR_TEST_UNSET_VAR \(used by {re.escape(key)}="):
        validate_launch(cfg, 1)


def test_paths_are_expanded_when_the_config_loads(monkeypatch, tmp_path):
    """``~`` and ``${VAR}`` in every path are expanded in the loaded configuration, which the
    launch checks and the driver then read as they are."""
    monkeypatch.setenv("MHAR_TEST_DIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config("smoke_cpu", ['data.paths=["${MHAR_TEST_DIR}/a", "~/b"]', "data.cache_dir=~/cache",
                                    "checkpoint.dir=${MHAR_TEST_DIR}/ckpt", "run.output_dir=~/runs"])
    assert cfg.data.paths == [f"{tmp_path}/a", f"{tmp_path}/home/b"]
    assert cfg.data.cache_dir == f"{tmp_path}/home/cache"
    assert cfg.checkpoint_dir == tmp_path / "ckpt" and cfg.run.dir == tmp_path / "home" / "runs" / cfg.run.name


def test_baseline_ignores_the_routing_shape_fields():
    """The baseline routes nothing: routing heads that do not divide the width, or blocks
    longer than the model, are no error there (they are where the routing runs)."""
    cfg = load_config("smoke_cpu", ["mhar.variant=none", "mhar.num_heads=5", "mhar.delta_block_layers=9"])
    assert not cfg.mhar.enabled and cfg.mhar.num_heads == 5


def test_recipe_file_errors(tmp_path):
    bad = _write(tmp_path / "bad.yaml", "model:\n  hidden_sise: 64\n")
    with pytest.raises(ValueError, match="did you mean 'model.hidden_size'"):
        load_config(str(bad))
    with pytest.raises(ValueError, match="did you mean 'smoke_cpu'"):
        load_config("smoke_cpuu")
    a = _write(tmp_path / "a.yaml", "include: b.yaml\n")
    _write(tmp_path / "b.yaml", "include: a.yaml\n")
    with pytest.raises(ValueError, match="include cycle: a.yaml -> b.yaml -> a.yaml"):
        load_config(str(a))
    with pytest.raises(ValueError, match="must look like dotted.key=value"):
        load_config("smoke_cpu", ["model.num_layers"])
    with pytest.raises(ValueError, match="names a whole section"):
        load_config("smoke_cpu", ["model=3"])


@pytest.mark.parametrize(
    "text, message",
    [
        # a syntax error names the file and the line
        pytest.param("model:\n  num_layers: [2\n", "not valid YAML", id="syntax"),
        # PyYAML keeps the last of two equal keys: the first section's keys would vanish
        pytest.param("training:\n  train_iters: 5\nmodel: {}\ntraining:\n  micro_batch_size: 2\n",
                     "key 'training' appears twice in one mapping", id="duplicate-section"),
        pytest.param("model:\n  num_layers: 2\n  num_layers: 4\n", "key 'num_layers' appears twice", id="duplicate-key"),
    ],
)
def test_recipe_yaml_errors(tmp_path, text, message):
    bad = _write(tmp_path / "bad.yaml", text)
    with pytest.raises(ValueError) as err:
        load_config(str(bad))
    assert message in str(err.value) and "bad.yaml" in str(err.value)


def test_yaml_merge_keys_may_override():
    """Only keys written twice are refused, not a merge key's values overridden."""
    import yaml

    from megatron_mhar.training.recipes import _RecipeLoader

    assert yaml.load("a: &x {b: 1, c: 2}\nd:\n  <<: *x\n  b: 3\n", Loader=_RecipeLoader)["d"] == {"b": 3, "c": 2}


def test_includes_merge_and_overrides_win(tmp_path):
    _write(
        tmp_path / "base.yaml",
        """
        model: {num_layers: 4, hidden_size: 64, num_attention_heads: 4}
        optimizer: {lr: 1.0e-3, min_lr: 0.0}
        data: {paths: [x, y], weights: [1, 2]}
        """,
    )
    _write(tmp_path / "variant.yaml", "mhar: {variant: none}\nmodel: {num_layers: 6}\n")
    top = _write(
        tmp_path / "top.yaml",
        """
        include: [base.yaml, variant.yaml]
        run: {name: top}
        optimizer: {lr: 5e-4}          # YAML 1.1 reads this as a string; a float field takes it
        """,
    )
    cfg = load_config(str(top), ["data.paths=[p]", "data.weights=null", "run.name=123"])
    assert cfg.model.num_layers == 6  # later include wins
    assert cfg.model.hidden_size == 64  # mappings merge key by key
    assert cfg.mhar.variant == "none"
    assert cfg.optimizer.lr == 5e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.min_lr == 0.0
    assert cfg.data.paths == ["p"] and cfg.data.weights is None  # lists replace
    assert cfg.run.name == "123"  # string fields take the text verbatim


def test_a_list_field_takes_a_single_value(tmp_path):
    """``data.paths=/data/corpus`` is the list of that one path; the list syntax still works,
    and a recipe file writes a list as YAML (the error says how)."""
    cfg = load_config("smoke_cpu", ["data.paths=/data/corpus_text_document", "data.weights=1"])
    assert cfg.data.paths == ["/data/corpus_text_document"] and cfg.data.weights == [1.0]
    cfg = load_config("smoke_cpu", ["data.paths=[/data/a, /data/b]", "data.weights=null"])
    assert cfg.data.paths == ["/data/a", "/data/b"] and cfg.data.weights is None
    recipe = _write(tmp_path / "one.yaml", "include: " + str(RECIPES_DIR / "smoke_cpu.yaml") + "\ndata: {paths: corpus}\n")
    with pytest.raises(ValueError, match=r"data.paths: expected a list, got str 'corpus'; write a list as \[a, b\] in YAML"):
        load_config(str(recipe))


def test_a_field_of_a_scalar_or_a_list_keeps_a_single_value_scalar():
    """``model.moe_layer_freq`` takes an int or a list of flags: ``=1`` is the int (every
    layer), so a dense model with the default written out (as a checkpoint's config is)
    loads, and ``=[1,0]`` is the list."""
    assert load_config("smoke_cpu", ["model.moe_layer_freq=1"]).model.moe_layer_freq == 1
    cfg = load_config("smoke_cpu", ["model.num_layers=2", "model.num_moe_experts=4", "model.moe_layer_freq=[1,0]"])
    assert cfg.model.moe_layer_freq == [1, 0]


def test_round_trip_through_dict():
    cfg = load_config("smoke_cpu", ["model.num_layers=2"])
    assert from_dict(cfg.to_dict()) == cfg
    assert isinstance(from_dict({}), TrainConfig)


def test_apply_overrides_does_not_mutate():
    raw = {"model": {"num_layers": 2}}
    out = apply_overrides(raw, ["model.num_layers=3", "optimizer.lr=0.1"])
    assert raw == {"model": {"num_layers": 2}} and out["model"]["num_layers"] == 3


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        # global batch not divisible by micro-batch x data-parallel size
        pytest.param([], 3, "global_batch_size=16 is not a multiple of training.micro_batch_size x data-parallel size = 16 x 3", id="dp-batch"),
        # world size not a multiple of tp x pp
        pytest.param(["parallel.tensor_model_parallel_size=2"], 3, "world size 3 is not a multiple of tensor_model_parallel_size x pipeline_model_parallel_size = 2", id="world"),
        # interleaved schedule needs micro-batches divisible by pp
        pytest.param(
            ["mhar.variant=none", "parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2", "training.global_batch_size=24",
             "training.micro_batch_size=8"],
            2, "micro-batches per step (3) to be a multiple of pipeline_model_parallel_size=2", id="vpp-micro",
        ),
        pytest.param(["data.paths=[/nonexistent/corpus]"], 1, "/nonexistent/corpus.bin and /nonexistent/corpus.idx not found", id="data-path"),
        pytest.param(["data.paths=[\"${MHAR_TEST_UNSET_VAR}/x\"]"], 1, "environment variables not set: MHAR_TEST_UNSET_VAR", id="env-var"),
        pytest.param(["data.tokenizer=/nonexistent/tok"], 1, "no tokenizer.json in /nonexistent/tok", id="tokenizer"),
        pytest.param(["model.vocab_size=1000"], 1, "the model has 1000 embedding rows (model.vocab_size) but the builtin tokenizer", id="vocab"),
        pytest.param(["mhar.kernel_impl=triton", "run.device=cpu"], 1, "on CPU set mhar.kernel_impl=auto or torch", id="triton-cpu"),
        pytest.param(["checkpoint.load=/nonexistent/ckpt"], 1, "checkpoint.load='/nonexistent/ckpt': no such directory", id="load"),
        pytest.param(["training.cuda_graph=full_iteration", "logging.routing_entropy=false", "run.device=cpu"], 1,
                     "needs a GPU; on CPU set training.cuda_graph=none", id="graph-cpu"),
        pytest.param(["training.precision=fp8"], 1,
                     "training.precision=fp8 runs the linear layers in Transformer Engine's FP8 on a GPU; on CPU use "
                     "training.precision=bf16 or fp32", id="fp8-cpu"),
        pytest.param(["model.spec=transformer_engine"], 1,
                     "model.spec=transformer_engine runs Transformer Engine's layers, which need a GPU; on CPU set "
                     "model.spec=local (or auto)", id="te-cpu"),
    ],
)
def test_launch_checks(overrides, world, message, monkeypatch):
    monkeypatch.delenv("MHAR_TEST_UNSET_VAR", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = load_config("smoke_cpu", overrides)
    with pytest.raises(ValueError) as err:
        validate_launch(cfg, world)
    assert message in str(err.value)


@pytest.fixture
def gpu_without_transformer_engine(monkeypatch):
    """validate_launch on a machine that says it has a GPU (nothing runs on it) and where
    ``import transformer_engine`` fails."""
    from megatron_mhar.training import launch_checks

    monkeypatch.setattr(launch_checks, "_cuda_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)


@pytest.mark.parametrize(
    "overrides, message",
    [
        # FP8 runs in Transformer Engine's linear layers: the local spec, named or chosen by auto, has none
        pytest.param(["training.precision=fp8"],
                     "training.precision=fp8 runs the linear layers in Transformer Engine's FP8, but model.spec=local "
                     "resolves to local here (set in model.spec): install Transformer Engine (pip install "
                     "'megatron_mhar[te]') and set model.spec=auto or transformer_engine, or use training.precision=bf16",
                     id="fp8-local"),
        pytest.param(["training.precision=fp8", "model.spec=auto"],
                     "model.spec=auto resolves to local here (Transformer Engine not importable: ", id="fp8-auto"),
        pytest.param(["model.spec=transformer_engine"],
                     "model.spec=transformer_engine: Transformer Engine not importable: ", id="te-missing"),
        pytest.param(["model.spec=transformer_engine"],
                     "install it (pip install 'megatron_mhar[te]') or set model.spec=local (or auto)", id="te-missing-fix"),
    ],
)
def test_transformer_engine_and_fp8_need_transformer_engine(gpu_without_transformer_engine, overrides, message):
    cfg = load_config("smoke_cpu", ["run.device=auto", *overrides])
    with pytest.raises(ValueError) as err:
        validate_launch(cfg, 1)
    assert message in str(err.value)


def test_distributed_optimizer_checkpoints_need_a_fused_adam(monkeypatch):
    """megatron-core checkpoints the distributed optimizer over a fused Adam only (TE's, which
    it picks where TE imports, or apex's): refused before any process group without one,
    with the fixes; with one, or when nothing is saved, the run goes ahead."""
    from megatron.core.optimizer import distrib_optimizer

    distributed = ["parallel.use_distributed_optimizer=true"]
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    with pytest.raises(ValueError) as err:
        validate_launch(load_config("smoke_cpu", distributed), 1)
    for text in ("megatron-core cannot save and resume this optimizer's state",
                 "Install Transformer Engine (pip install 'megatron_mhar[te]'; model.spec=auto then also runs "
                 "its layers)", "parallel.use_distributed_optimizer=false",
                 "checkpoint.interval=0 checkpoint.save_at_end=false"):
        assert text in str(err.value)
    validate_launch(load_config("smoke_cpu", [*distributed, "checkpoint.save_at_end=false"]), 1)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    validate_launch(load_config("smoke_cpu", distributed), 1)


def test_spec_auto_is_resolved_and_said(monkeypatch, capsys):
    """``with_resolved_spec``: one line on rank 0 saying which spec and why; the config then
    names the spec that runs. A named spec is left as it is, silently."""
    from megatron_mhar.models import specs
    from megatron_mhar.training.launch_checks import with_resolved_spec

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # nothing runs on it
    monkeypatch.setattr(specs, "transformer_engine_version", lambda: "2.12.0")
    resolved = with_resolved_spec(load_config("smoke_cpu", ["run.device=auto", "model.spec=auto"]))
    assert resolved.model.spec == "transformer_engine"
    assert capsys.readouterr().out == "model.spec auto -> transformer_engine (Transformer Engine 2.12.0)\n"

    resolved = with_resolved_spec(load_config("smoke_cpu", ["model.spec=auto"]))  # run.device=cpu
    assert resolved.model.spec == "local"
    assert capsys.readouterr().out == (
        "model.spec auto -> local (the model runs on CPU; Transformer Engine layers run on GPUs)\n"
    )
    monkeypatch.setenv("RANK", "1")
    with_resolved_spec(load_config("smoke_cpu", ["model.spec=auto"]))
    named = load_config("smoke_cpu", ["model.spec=transformer_engine"])
    assert with_resolved_spec(named) is named
    assert capsys.readouterr().out == ""  # other ranks, and named specs, say nothing


def test_a_damaged_data_pair_fails_at_launch(tmp_path):
    """Checked before any process group starts, not when the datasets are built."""
    (tmp_path / "corpus.bin").write_bytes(b"\0" * 64)
    (tmp_path / "corpus.idx").write_bytes(b"not an index")
    cfg = load_config("smoke_cpu", [f"data.paths=[{tmp_path / 'corpus'}]"])
    with pytest.raises(ValueError, match=r"data.paths\[0\]=.*corpus.idx is not a Megatron index file"):
        validate_launch(cfg, 1)


def test_data_of_another_vocabulary_fails_at_launch(tmp_path):
    """Token ids past model.vocab_size (data written with another tokenizer) are found in a
    sample of the .bin at launch, not as an index error inside a step."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    for largest, fails in ((4095, False), (4096, True)):  # smoke_cpu: model.vocab_size=4096
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
        builder.add_document(torch.tensor([1, 2, largest, 3]), [4])
        builder.finalize(prefix + ".idx")
        cfg = load_config("smoke_cpu", [f"data.paths=[{prefix}]"])
        if fails:
            with pytest.raises(ValueError, match=r"holds token id 4096, beyond model.vocab_size=4096 \(the model's embedding rows\): it was "
                               r"written with another tokenizer than data.tokenizer \(builtin, 4096 tokens\)"):
                validate_launch(cfg, 1)
        else:
            validate_launch(cfg, 1)


@pytest.mark.parametrize("key", ["checkpoint.dir", "run.output_dir"])
def test_output_dirs_that_are_files_fail_at_launch(tmp_path, key):
    """Checked before the run, not at its first save (after the training it would lose)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for path in (afile, afile / "sub"):  # the file itself, or a folder under it
        cfg = load_config("smoke_cpu", [f"run.output_dir={tmp_path}", f"{key}={path}"])
        with pytest.raises(ValueError, match=f"{afile} is a file; change {key}"):
            validate_launch(cfg, 1)


def test_launch_checks_pass_for_valid_layouts():
    validate_launch(load_config("smoke_cpu"), 1)
    validate_launch(load_config("smoke_cpu", ["training.micro_batch_size=8"]), 2)  # dp=2: 16 = 8 x 2
    validate_launch(
        load_config("smoke_cpu", ["parallel.tensor_model_parallel_size=2", "training.micro_batch_size=4"]), 4
    )
