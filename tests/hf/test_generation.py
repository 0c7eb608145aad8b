"""KV-cache generation of the MHAR models: greedy and sampling, batched with left padding.

The models have random weights drawn large (matrices N(0, 0.3^2), norm weights
1 + N(0, 0.2^2), queries, null sources and gates too), so that every token's logits
depend on its context and the greedy continuations vary: a cache that routed or attended
over the wrong sources would change them.
"""

from __future__ import annotations

import pytest
import torch

VOCAB = 512
NEW = 24
PROMPTS = (5, 11, 3)  # lengths; the batch is left-padded to 11
SHAPE = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             intermediate_size=64, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None)

MODELS = {
    # Qwen3, 8 heads, tau = 2, tied embeddings
    "qwen3-full": ("qwen3", dict(mhar_variant="full", mhar_num_heads=8, mhar_logit_scale=2.0, tie_word_embeddings=True)),
    # Llama, Attention Residuals (one head), untied
    "llama-full-h1": ("llama", dict(mhar_variant="full", mhar_num_heads=1, tie_word_embeddings=False)),
    # Llama, blocks of 3 sublayers (they straddle layers), partial read at the final site
    "llama-block": ("llama", dict(mhar_variant="block", mhar_num_heads=4, mhar_block_size=3, mhar_logit_scale=4.0)),
    # Qwen3 delta over blocks of one layer, nonzero gates and null sources
    "qwen3-delta": ("qwen3", dict(mhar_variant="delta", mhar_num_heads=8, mhar_delta_block_layers=1)),
}


def random_model(family: str, fields: dict, seed: int = 0):
    import megatron_mhar.hf as mhar_hf

    config_class, model_class = {
        "qwen3": (mhar_hf.MHARQwen3Config, mhar_hf.MHARQwen3ForCausalLM),
        "llama": (mhar_hf.MHARLlamaConfig, mhar_hf.MHARLlamaForCausalLM),
    }[family]
    model = model_class(config_class(**SHAPE, **fields))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            norm = "norm" in name.rsplit(".", 2)[-2] or name.endswith("norm_weight")
            param.copy_(1 + 0.2 * noise if norm else 0.3 * noise)
    return model.eval()


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    family, fields = MODELS[request.param]
    return random_model(family, fields)


def _prompts(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator) for n in PROMPTS]


def _left_padded(prompts, pad: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    return ids, mask


def _greedy_by_recomputation(model, prompt: torch.Tensor) -> torch.Tensor:
    """NEW tokens, each the argmax of a full forward over everything so far (no cache)."""
    ids = prompt[None]
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):]


def test_greedy_batched_generation_equals_recomputation_row_by_row(model):
    prompts = _prompts()
    ids, mask = _left_padded(prompts, pad=0)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert batched.shape == (len(prompts), ids.shape[1] + NEW)
    for row, prompt in enumerate(prompts):
        new = batched[row, ids.shape[1]:]
        alone = model.generate(prompt[None], max_new_tokens=NEW, do_sample=False)[0, len(prompt):]
        assert torch.equal(new, alone), row
        assert torch.equal(new, _greedy_by_recomputation(model, prompt)), row
        assert len(set(new.tolist())) >= 5  # a varied continuation: the comparison has teeth


def test_padding_leaks_into_nothing(model):
    """Other pad token ids give the same logits at real positions and the same generations;
    each padded row's logits equal the row's own."""
    prompts = _prompts(1)
    outputs = []
    for pad in (0, 7):
        ids, mask = _left_padded(prompts, pad)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, position_ids=positions).logits
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=pad)
        outputs.append((logits * mask[..., None], generated[:, ids.shape[1]:]))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    width = max(PROMPTS)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            alone = model(prompt[None]).logits[0]
        assert (outputs[0][0][row, width - len(prompt):] - alone).abs().max() <= 1e-5


def test_sampling_with_cache_draws_what_recomputation_draws(model):
    ids, mask = _left_padded(_prompts(2), pad=0)
    draws = []
    for use_cache in (True, False):
        torch.manual_seed(5)
        draws.append(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=0,
                                    pad_token_id=0, use_cache=use_cache))
    assert torch.equal(draws[0], draws[1])
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert not torch.equal(draws[0], greedy)  # sampling was on
