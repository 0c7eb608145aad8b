"""Routing maps: the analytic case, the files, the command and the TensorBoard images."""

from __future__ import annotations

import json
import math

import numpy
import pytest
import torch

from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.diagnostics.maps import JSON_FILE, PNG_FILE, RoutingMaps, SiteMap, save_routing_maps
from tests.helpers import LAUNCHER_ENV, TINY, build_gpt, tiny_gpt_config

HIDDEN, LAYERS, SHARPNESS = 8, 2, 2.0
"""Width (two routing heads of 4), decoder layers, and the scale of the hand-set queries."""


def _constant_source_model():
    """A 2-layer full-MHAR GPT whose every source is one known vector at every token.

    All token embeddings are ``emb = [1, 1, 1, 1, 0, 0, 0, 0]``; every linear weight is 0,
    so sublayer ``j`` outputs its bias ``e_{4 + j - 1}`` (the j-th unit vector of head 1's
    half). Head 0 of each site's query is ``SHARPNESS`` on head 0's half (only the
    embedding has a key there): it routes to the embedding. Head 1's query at site ``j`` is
    ``SHARPNESS`` times the unit vector of sublayer ``j - 1``'s output: it routes to the
    newest source.
    """
    model = build_gpt(
        tiny_gpt_config(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=2, num_query_groups=2,
                        ffn_hidden_size=16, add_bias_linear=True, qk_layernorm=False),
        MHARConfig(variant="full", num_heads=2),
    )
    emb = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0])
    outputs = {j: torch.eye(HIDDEN)[3 + j] for j in range(1, 2 * LAYERS + 1)}  # e_4 .. e_7
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".weight") and "linear_" in name:
                param.zero_()
            elif name.endswith(".bias"):
                param.zero_()
        model.embedding.word_embeddings.weight.copy_(emb.expand_as(model.embedding.word_embeddings.weight))
        for layer in model.decoder.layers:
            site = layer.attention_site
            layer.self_attention.linear_proj.bias.copy_(outputs[site])
            layer.mlp.linear_fc2.bias.copy_(outputs[site + 1])
        for site, router in model.decoder.site_routers().items():
            query = torch.zeros(HIDDEN)
            query[:4] = SHARPNESS
            if site > 1:
                query[4:] = SHARPNESS * outputs[site - 1][4:]
            router.query.copy_(query)
    sources = [emb] + [outputs[j] for j in range(1, 2 * LAYERS + 1)]
    return model, sources


def _analytic_weights(sources, query, eps):
    """``[N, 2]`` softmax over the sources of ``query . RMSNorm(source)``, per head, in fp64."""
    stacked = torch.stack(sources).double()
    keys = stacked * torch.rsqrt(stacked.pow(2).mean(-1, keepdim=True) + eps)
    logits = (keys.view(len(sources), 2, HIDDEN // 2) * query.double().view(2, HIDDEN // 2)).sum(-1)
    return torch.softmax(logits, dim=0)


def test_hand_set_queries_route_where_the_maps_say(megatron_world1):
    """Head 0 reads the embedding, head 1 the newest source, with the analytic softmax's weights."""
    from megatron_mhar.analyze import routing_maps

    model, sources = _constant_source_model()
    tokens = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(0))
    maps = routing_maps(model, [tokens[:2], tokens[2:]])  # two batches: sums over both
    routers = model.decoder.site_routers()

    assert maps.tokens == tokens.numel() and maps.num_heads == 2
    assert [s.site for s in maps.sites] == list(range(1, 2 * LAYERS + 2))
    for site in maps.sites:
        read = sources[: site.site]
        assert site.sources == ["emb"] + [f"s{j}" for j in range(1, site.site)]
        expected = _analytic_weights(read, routers[site.site].query.detach(), model.decoder.routing_eps)
        assert numpy.abs(numpy.array(site.weights) - expected.numpy()).max() < 1e-6
        entropy = -(expected * expected.log()).sum(0)
        assert numpy.abs(numpy.array(site.entropy) - entropy.numpy()).max() < 1e-5
        if site.site > 1:
            weights = numpy.array(site.weights)
            assert weights[:, 0].argmax() == 0 and weights[0, 0] > 0.99  # head 0: the embedding
            assert weights[:, 1].argmax() == site.site - 1 and weights[-1, 1] > 0.98  # head 1: the newest
            assert site.normalised_entropy[0] < 0.01 and site.normalised_entropy[1] < 0.1
    head0, head1 = maps.matrix(0), maps.matrix(1)
    assert numpy.isnan(head0[0, 1:]).all()  # site 1 reads the embedding only
    assert (numpy.nanargmax(head1[1:], axis=1) == numpy.arange(1, 2 * LAYERS + 1)).all()  # the diagonal


def test_a_plain_gpt_has_no_routing_to_map(megatron_world1):
    from megatron_mhar.analyze import routing_maps

    model = build_gpt(tiny_gpt_config(), MHARConfig(variant="none"))
    with pytest.raises(ValueError, match=r"plain GPT \(mhar.variant=none\): it routes nothing to map"):
        routing_maps(model, [torch.zeros(1, 8, dtype=torch.long)])


def _maps(variant_sources):
    """Uniform maps over the given per-site source lists (2 heads)."""
    sites = [SiteMap(site=j + 1, sources=names, weights=[[1 / len(names)] * 2 for _ in names],
                     entropy=[math.log(len(names))] * 2) for j, names in enumerate(variant_sources)]
    return RoutingMaps(sites=sites, tokens=16)


@pytest.mark.parametrize(
    "site_sources, columns",
    [
        # full: sublayer outputs in depth order (s10 after s9, not after s1)
        pytest.param([["emb"]] + [["emb"] + [f"s{k}" for k in range(1, j)] for j in range(2, 12)],
                     ["emb"] + [f"s{k}" for k in range(1, 11)], id="full"),
        # block: completed blocks, then the partial last
        pytest.param([["emb"], ["emb", "partial"], ["emb", "b1"], ["emb", "b1", "partial"]],
                     ["emb", "b1", "partial"], id="block"),
        # delta: block deltas, then the null source last
        pytest.param([["emb", "null"], ["emb", "d1", "null"]], ["emb", "d1", "null"], id="delta"),
    ],
)
def test_map_columns_follow_depth(site_sources, columns, tmp_path):
    maps = _maps(site_sources)
    assert maps.columns == columns
    matrix = maps.matrix(1)
    assert matrix.shape == (len(site_sources), len(columns))
    assert numpy.isnan(matrix).sum() == matrix.size - sum(len(s) for s in site_sources)  # unread cells
    assert json.loads(json.dumps(maps.to_json()))["sites"][-1]["normalised_entropy"] == [1.0, 1.0]


def test_maps_are_written_atomically(tmp_path, monkeypatch):
    """Whole files or the previous ones: a failed write leaves the old maps and no temporary file."""
    from PIL import Image

    from megatron_mhar import files

    first = _maps([["emb"], ["emb", "s1"]])
    image = save_routing_maps(first, tmp_path, "first", step=1)
    written = json.loads((tmp_path / JSON_FILE).read_text())
    assert written["title"] == "first" and written["step"] == 1
    assert written["sites"][1]["weights"] == [[0.5, 0.5], [0.5, 0.5]]
    assert numpy.array_equal(numpy.asarray(Image.open(tmp_path / PNG_FILE)), image)
    before = {name: (tmp_path / name).read_bytes() for name in (JSON_FILE, PNG_FILE)}

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_routing_maps(_maps([["emb"], ["emb", "s1"], ["emb", "s1", "s2"]]), tmp_path, "second")
    assert {name: (tmp_path / name).read_bytes() for name in (JSON_FILE, PNG_FILE)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([JSON_FILE, PNG_FILE])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, embedded_dir):
    """A tiny MHAR run of 3 steps (routing maps in TensorBoard every 2) and its config."""
    from megatron_mhar.training.loop import run
    from megatron_mhar.training.recipes import load_config

    out = tmp_path_factory.mktemp("runs")
    cfg = load_config("smoke_cpu", TINY + [
        f"run.output_dir={out}", "run.name=maps", f"data.embedded_dir={embedded_dir}",
        "training.train_iters=3", "eval.interval=0", "logging.routing_interval=2",
    ])
    with pytest.MonkeyPatch.context() as patch:
        for name in LAUNCHER_ENV:  # a world of one
            patch.delenv(name, raising=False)
        run(cfg)
    return cfg


def test_training_logs_routing_maps_to_tensorboard(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained.run.dir / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert [event.step for event in events.Images("routing/maps")] == [2, 3]  # the interval, then the end
    maps = json.loads((trained.run.dir / JSON_FILE).read_text())
    assert maps["step"] == 3 and len(maps["sites"]) == 2 * trained.model.num_layers + 1


def test_analyze_command_writes_the_maps(trained, tmp_path, capsys):
    from megatron_mhar.analyze import main
    from megatron_mhar.data.corpus import prepare_embedded

    prefix = prepare_embedded(trained.data.embedded_dir, trained.data.embedded_vocab_size,
                              trained.data.embedded_max_bytes).prefix
    out = tmp_path / "maps"
    assert main([str(trained.checkpoint_dir), "--data", prefix, "--out", str(out), "--sequences", "3",
                 "--batch-size", "2"]) == 0
    assert str(out / PNG_FILE) in capsys.readouterr().out
    written = json.loads((out / JSON_FILE).read_text())
    length = trained.model.seq_length
    assert written["tokens"] == 3 * length and written["sequences"] == 3 and written["variant"] == "full"
    assert [s["site"] for s in written["sites"]] == list(range(1, 2 * trained.model.num_layers + 2))
    for site in written["sites"]:
        sums = numpy.array(site["weights"]).sum(0)
        assert numpy.abs(sums - 1).max() < 1e-5 and len(site["weights"]) == site["site"]
        assert all(0 <= h <= 1 + 1e-6 for h in site["normalised_entropy"])
    assert (out / PNG_FILE).stat().st_size > 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        pytest.param(["--sequences", "0"], "--sequences must be >= 1", id="sequences"),
        pytest.param(["--seq-length", "100000000"], "fewer than one window of --seq-length=100000000", id="short-data"),
    ],
)
def test_analyze_refuses_bad_arguments(trained, tmp_path, overrides, message, capsys):
    from megatron_mhar.analyze import main
    from megatron_mhar.data.corpus import prepare_embedded

    prefix = prepare_embedded(trained.data.embedded_dir, trained.data.embedded_vocab_size,
                              trained.data.embedded_max_bytes).prefix
    with pytest.raises(SystemExit) as exit_:
        main([str(trained.checkpoint_dir), "--data", prefix, "--out", str(tmp_path), *overrides])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
