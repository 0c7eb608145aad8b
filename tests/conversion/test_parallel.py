"""TP=2 and PP=2 conversions: the same checkpoint as TP=1, and the same logits at any layout.

The conversions run as 2 spawned gloo ranks (what ``--tp 2`` / ``--pp 2`` do).
``make_vocab_size_divisible_by=48`` pads the vocabulary (100) to 144 rows at TP=1
and 192 at TP=2, so loading across layouts exercises Megatron's vocab resharding.
"""

import pytest
import torch

from tests.helpers import run_distributed, token_batch

CASES = {
    # TP=2: GQA groups, SwiGLU fc1 halves and the untied output layer split over ranks
    "tp2": dict(name="llama", variant="delta", tp=2, pp=1, mhar=dict(delta_block_layers=2)),
    # PP=2: tied embeddings across stages; delta block rows cross the stage boundary
    "pp2": dict(name="qwen3_tied", variant="delta", tp=1, pp=2, mhar=dict(delta_block_layers=1)),
}


def _forward(chunk, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [b, s, v] on every rank, for TP=2 or PP=2 (2 ranks)."""
    from megatron.core import parallel_state

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        local = chunk(tokens, positions, None)
        parts = [torch.empty_like(local) for _ in range(2)]
        torch.distributed.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=-1)
    hidden = chunk.config.hidden_size
    if parallel_state.is_pipeline_first_stage():
        torch.distributed.send(chunk(tokens, positions, None).contiguous(), dst=1)
        sizes = torch.empty(3, dtype=torch.long)
        torch.distributed.recv(sizes, src=1)
        logits = torch.empty(*sizes.tolist())
        torch.distributed.recv(logits, src=1)
        return logits
    width = chunk.decoder.input_width()
    received = torch.empty(tokens.shape[1], tokens.shape[0], width * hidden)
    torch.distributed.recv(received, src=0)
    chunk.set_input_tensor(received)
    logits = chunk(tokens, positions, None).contiguous()
    torch.distributed.send(torch.tensor(logits.shape), dst=0)
    torch.distributed.send(logits, dst=0)
    return logits


def _worker(tp: int, pp: int, checkpoint_dir: str, tokens: torch.Tensor):
    from megatron_mhar.checkpoint.format import read_configs, require_checkpoint
    from megatron_mhar.checkpoint.model import build_model
    from megatron_mhar.checkpoint.streaming import load_into
    from megatron_mhar.runtime import destroy, initialize_model_parallel_from_env

    initialize_model_parallel_from_env(tp=tp, pp=pp, device="cpu", create_gloo_process_groups=False)
    try:
        found = require_checkpoint(checkpoint_dir)
        model_cfg, mhar, _ = read_configs(found)
        chunk = build_model(model_cfg, mhar, torch.float32).eval()
        load_into(chunk, found)
        with torch.no_grad():
            return _forward(chunk, tokens)[..., : model_cfg.vocab_size]
    finally:
        destroy()


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_conversion_matches_tp1(hf_dirs, convert, case):
    import megatron_mhar
    from megatron_mhar.runtime import destroy

    spec = CASES[case]
    single = convert(spec["name"], spec["variant"], **spec["mhar"], divisible_by=48)
    parallel = convert(spec["name"], spec["variant"], tp=spec["tp"], pp=spec["pp"], **spec["mhar"],
                       divisible_by=48)
    tokens = token_batch(2)
    try:
        reference = megatron_mhar.load_model(single)
        loaded = megatron_mhar.load_model(parallel)  # a TP/PP=2 conversion loaded at TP=PP=1
        ref_state, state = reference.gpt.state_dict(), loaded.gpt.state_dict()
        tensors = [k for k, v in ref_state.items() if torch.is_tensor(v) and "_extra_state" not in k]
        assert tensors and all(torch.equal(state[k], ref_state[k]) for k in tensors)
        with torch.no_grad():
            reference_logits = reference(tokens)
    finally:
        destroy()

    ranks = run_distributed(_worker, 2, spec["tp"], spec["pp"], str(parallel), tokens, timeout=240)
    for logits in ranks:
        assert logits.shape == reference_logits.shape
        if spec["tp"] > 1:  # row-parallel layers sum partial products in another order
            torch.testing.assert_close(logits, reference_logits, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(logits, reference_logits)
