"""KV-cache generation of the MHAR models: greedy and sampling, batched with left padding.

The models (``RANDOM_MODELS``) have random weights drawn large, so that every token's
logits depend on its context and the greedy continuations vary: a cache that routed or
attended over the wrong sources would change them. On CUDA the routing runs the fused
kernels.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import EMBEDDED_VOCAB, RANDOM_MODELS, random_model

NEW = 24
PROMPTS = (5, 11, 3)  # lengths; the batch is left-padded to 11
# every model on CPU (the torch reference routes) and on CUDA (the fused kernels route)
MODELS = [pytest.param((name, "cpu"), id=f"{name}-cpu") for name in RANDOM_MODELS] + [
    pytest.param((name, "cuda"), id=f"{name}-cuda", marks=pytest.mark.gpu) for name in RANDOM_MODELS]


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    name, device = request.param
    return random_model(name).to(device)


def _prompts(model, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EMBEDDED_VOCAB, (n,), generator=generator).to(model.device) for n in PROMPTS]


def _left_padded(prompts, pad: int):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, device=prompts[0].device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=prompts[0].device)
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
    prompts = _prompts(model)
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
    prompts = _prompts(model, 1)
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
    ids, mask = _left_padded(_prompts(model, 2), pad=0)
    draws = []
    for use_cache in (True, False):
        torch.manual_seed(5)
        draws.append(model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=0,
                                    pad_token_id=0, use_cache=use_cache))
    assert torch.equal(draws[0], draws[1])
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert not torch.equal(draws[0], greedy)  # sampling was on
