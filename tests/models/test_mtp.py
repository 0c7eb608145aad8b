"""Multi-token prediction (Megatron-Core's MTP block) on the model builder's GPTs.

* ``variant: none`` with MTP is Megatron's own MTP GPT: parameters, every logit of the
  main head and of each MTP depth, the MTP losses and every gradient bitwise.
* MHAR decoders: the MTP block reads the decoder's final routed (and normed) output, its
  layers are Megatron's plain ones, and its losses reach the routing parameters.
* A forward without labels (inference, ``load_model``) returns the main head's logits and
  runs no MTP depth; ``to_hf`` (what ``generate`` decodes with) is the main model.
* The MTP layers' distributed-checkpoint keys are ``mtp.layers.{k}.transformer_layer.*``
  whatever megatron-core names the layer in the module, so an MTP checkpoint written under
  megatron-core 0.16 resumes under 0.19.
* The MTP fields are checked with the field named.
"""

from __future__ import annotations

import pytest
import torch

from megatron_mhar.models.mhar_config import MHARConfig
from tests.helpers import GPT_SEQ, build_gpt, gpt_batch, megatron_tiny_gpt_config, randomize_routers, tiny_gpt_config

MTP_LAYERS, MTP_SCALE = 2, 0.3


@pytest.fixture(autouse=True)
def mtp_loss_scale():
    """Megatron's schedules set the MTP losses' gradient scale as a class attribute; these
    tests call backward themselves, at scale 1 (the value outside a schedule)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    MTPLossAutoScaler.set_loss_scale(torch.ones(1))
    MTPLossLoggingHelper.tracker.clear()
    yield
    MTPLossAutoScaler.set_loss_scale(torch.ones(1))
    MTPLossLoggingHelper.tracker.clear()


def _megatron_mtp_gpt():
    """Megatron's own GPTModel with its MTP block: the decoder and MTP block specs from its
    TransformerConfig (local spec), the architecture stated field by field."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    config = megatron_tiny_gpt_config(
        mtp_num_layers=MTP_LAYERS, mtp_loss_scaling_factor=MTP_SCALE,
    )  # fmt: skip
    torch.manual_seed(7)
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(
        config=config, transformer_layer_spec=block,
        vocab_size=128, max_sequence_length=GPT_SEQ, share_embeddings_and_output_weights=True,
        position_embedding_type="rope", rotary_base=10000,
        mtp_block_spec=get_gpt_mtp_block_spec(config, block, use_transformer_engine=False),
    )


def _mtp_layer_name(model) -> str:
    """The attribute, and state-dict name, under which each MTP depth holds its transformer
    layer, as megatron-core built it: ``transformer_layer`` in 0.16, ``mtp_model_layer`` in 0.19."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    (name,) = [name for name, child in model.mtp.layers[0].named_children() if isinstance(child, TransformerLayer)]
    return name


def _run(model, tokens, positions):
    """Every output-layer logit (each MTP depth's, then the main head's), the per-token loss
    and the MTP losses Megatron tracks, after a backward of the summed loss."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_mhar.models.mtp import tracked_mtp_losses

    logits = []
    hook = model.output_layer.register_forward_hook(lambda module, args, output: logits.append(output[0].detach()))
    MTPLossLoggingHelper.tracker.clear()
    loss = model(tokens, positions, None, labels=tokens)
    hook.remove()
    loss.sum().backward()
    return logits, loss.detach(), tracked_mtp_losses().clone()


def test_variant_none_is_megatron_mtp_gpt(megatron_world1):
    """``none`` with MTP through the builder == Megatron's MTP GPT: parameters, logits of
    every head, per-token loss, MTP losses and every gradient bitwise (the MTP losses reach
    the gradients through Megatron's MTPLossAutoScaler)."""
    from megatron.core.models.gpt import GPTModel

    ours = build_gpt(tiny_gpt_config(attention_backend="megatron", mtp_num_layers=MTP_LAYERS,
                                     mtp_loss_scaling_factor=MTP_SCALE), MHARConfig(variant="none"))
    theirs = _megatron_mtp_gpt()
    assert isinstance(ours, GPTModel) and len(ours.mtp.layers) == MTP_LAYERS
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert [k for k, v in ours_sd.items() if torch.is_tensor(v)] == [k for k, v in theirs_sd.items() if torch.is_tensor(v)]
    assert any(k.startswith(f"mtp.layers.1.{_mtp_layer_name(ours)}.") for k in ours_sd)
    for key, value in theirs_sd.items():
        if torch.is_tensor(value):
            assert torch.equal(ours_sd[key], value), key
    tokens, positions = gpt_batch()
    (our_logits, our_loss, our_mtp), (their_logits, their_loss, their_mtp) = (
        _run(model, tokens, positions) for model in (ours, theirs))
    assert len(our_logits) == MTP_LAYERS + 1
    for mine, reference in zip(our_logits, their_logits, strict=True):
        assert torch.equal(mine, reference)
    assert torch.equal(our_loss, their_loss)
    assert torch.equal(our_mtp, their_mtp) and bool((our_mtp > 0).all())
    grads = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        assert param.grad is not None and torch.equal(param.grad, grads[name].grad), name


@pytest.mark.parametrize("variant", [
    pytest.param(dict(variant="full"), id="full"),  # final routing site over every source
    pytest.param(dict(variant="block", block_size=2), id="block"),  # final site over block sums
    pytest.param(dict(variant="delta", delta_block_layers=1), id="delta"),  # no final site: the stream
])
def test_mhar_mtp_reads_the_final_routed_output(megatron_world1, variant):
    """The MTP block's input is the decoder's output (final site, final norm), the tensor the
    output layer reads; its layers are Megatron's TransformerLayer; its losses reach the
    routing parameters (their gradients change with the MTP weight)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_mhar.models.layer import MHARTransformerLayer

    mhar = MHARConfig(**variant)
    model = build_gpt(tiny_gpt_config(mtp_num_layers=1), mhar)
    randomize_routers(model)
    assert all(isinstance(layer, MHARTransformerLayer) for layer in model.decoder.layers)
    assert type(getattr(model.mtp.layers[0], _mtp_layer_name(model))) is TransformerLayer
    seen = {}

    def decoder_output(module, args, output):
        seen["decoder"] = output

    def mtp_input(module, args, kwargs):
        seen["mtp"] = kwargs["hidden_states"]

    hooks = [model.decoder.register_forward_hook(decoder_output),
             model.mtp.register_forward_pre_hook(mtp_input, with_kwargs=True)]
    tokens, positions = gpt_batch()
    _run(model, tokens, positions)
    for hook in hooks:
        hook.remove()
    assert seen["mtp"] is seen["decoder"]
    with_mtp = {n: p.grad.clone() for n, p in model.named_parameters() if "router" in n}
    assert with_mtp
    model.zero_grad()
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    MTPLossAutoScaler.set_loss_scale(torch.zeros(1))  # the MTP losses' gradient switched off
    _run(model, tokens, positions)
    assert any(not torch.equal(p.grad, with_mtp[n]) for n, p in model.named_parameters() if "router" in n)


def test_mtp_checkpoint_keys_are_megatrons_on_every_version(megatron_world1):
    """The sharded (distributed-checkpoint) key of every MTP tensor is its state-dict name
    with the layer named ``transformer_layer``: megatron-core 0.19 renamed the module
    ``mtp_model_layer`` and maps its checkpoint keys back, so a checkpoint written under 0.16
    loads its MTP weights under 0.19."""
    model = build_gpt(tiny_gpt_config(mtp_num_layers=MTP_LAYERS), MHARConfig(variant="full"))
    name = _mtp_layer_name(model)
    keys = {key: entry.key for key, entry in model.sharded_state_dict().items() if key.startswith("mtp.")}
    for key, sharded in keys.items():  # beyond the layer, local norms take TE's key names
        depth = key.split(".")[2]
        layer = f"mtp.layers.{depth}.{name}."
        assert sharded.startswith(f"mtp.layers.{depth}.transformer_layer." if key.startswith(layer) else key), key
    assert {f"mtp.layers.{k}.transformer_layer.self_attention.linear_qkv.weight"
            for k in range(MTP_LAYERS)} <= set(keys.values())


@pytest.mark.parametrize("variant", [
    pytest.param(dict(variant="none"), id="none"),  # Megatron's GPT with MTP
    pytest.param(dict(variant="full"), id="full"),  # MHAR decoder with MTP
])
def test_logits_without_labels_are_the_main_heads(megatron_world1, variant):
    """``model(tokens, positions, None)`` of an MTP model: ``[b, s, vocab]`` logits bitwise
    those of the main head in a forward with labels, no MTP layer run, nothing tracked, and
    a backward of the logits reaches no MTP weight (megatron-core 0.16 fails on
    ``labels.clone()`` without labels)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    model = build_gpt(tiny_gpt_config(mtp_num_layers=MTP_LAYERS, mtp_loss_scaling_factor=MTP_SCALE),
                      MHARConfig(**variant))
    heads, depths = [], []
    # cloned: Megatron's cross-entropy overwrites the logits it reads
    hooks = [model.output_layer.register_forward_hook(lambda module, args, output: heads.append(output[0].detach().clone())),
             model.mtp.register_forward_hook(lambda module, args, output: depths.append(output))]
    tokens, positions = gpt_batch()
    model(tokens, positions, None, labels=tokens)
    main = heads[-1].transpose(0, 1)  # the depths' heads run first
    heads.clear(), depths.clear(), MTPLossLoggingHelper.tracker.clear()
    logits = model(tokens, positions, None)
    for hook in hooks:
        hook.remove()
    assert logits.shape == main.shape and logits.shape[:2] == tokens.shape
    assert torch.equal(logits, main) and len(heads) == 1 and not depths and not MTPLossLoggingHelper.tracker
    assert model.config.mtp_num_layers == MTP_LAYERS
    logits.float().pow(2).mean().backward()
    assert all(p.grad is None for p in model.mtp.parameters())
    assert all(p.grad is not None for p in model.decoder.parameters())


def test_an_mtp_checkpoint_loads_for_inference(megatron_world1, tmp_path):
    """``load_model`` of an MTP checkpoint: its forward gives logits, and its transformers
    form (``to_hf``, what ``generate`` decodes with) is the main model with those logits."""
    import megatron_mhar
    from tests.test_inference import SEQ, VOCAB, _save_model

    model = megatron_mhar.load_model(_save_model(tmp_path, MHARConfig(variant="full", num_heads=4),
                                                 mtp_num_layers=MTP_LAYERS))
    assert model.config.mtp_num_layers == MTP_LAYERS
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert logits.shape == (2, SEQ, VOCAB)
    hf = model.to_hf()
    assert not any("mtp" in name for name in hf.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fields, message", [
    (dict(mtp_num_layers=0), "model.mtp_num_layers must be positive"),
    (dict(mtp_num_layers=1.5), "model.mtp_num_layers must be an integer"),
    (dict(mtp_loss_scaling_factor=0.5), "model.mtp_loss_scaling_factor is set but model.mtp_num_layers is null"),
    (dict(mtp_num_layers=1, mtp_loss_scaling_factor=-1.0), "model.mtp_loss_scaling_factor must be non-negative"),
])
def test_mtp_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_gpt_config(**fields)
