"""The HF Llama/Qwen3 <-> Megatron GPT weight map: one table, its reverse, named special cases.

Names on the Megatron side are the local-spec ``state_dict`` names of a single
(TP=1, PP=1) GPTModel, with global layer indices. The distributed checkpoint
stores the same tensors under Megatron's own sharded keys (``input_layernorm.``
is written as ``self_attention.linear_qkv.layer_norm_`` by the local spec's
``sharded_state_dict_keys_map``), so one checkpoint serves the local and the
Transformer Engine spec at any TP/PP layout.

``{}`` in a pattern is the 0-based layer index, the same on both sides; a second ``{}``
is the 0-based index of an expert (an MoE layer's routed experts, Qwen3-MoE's
``mlp.experts.{e}`` and Megatron's ``mlp.experts.local_experts.{e}`` at expert-parallel
size 1). A rule's ``layers`` says which decoder layers hold its tensors: all, those with a
dense MLP, or those with an MoE MLP (``GPTModelConfig.moe_layer_pattern``).

Special cases are named functions, each with its inverse:

* :func:`fuse_qkv` / :func:`split_qkv`: Megatron's ``linear_qkv`` holds, for each
  query group g in order, the g-th group's query heads, then its key head, then its
  value head (``[ng, (np/ng + 2) * hn, h]``). HF's GQA reads key head
  ``i // (np/ng)`` for query head ``i``, which is the same grouping. TP ranks hold
  contiguous runs of groups, so this layout is also the TP-concatenated one.
* :func:`fuse_gate_up` / :func:`split_gate_up`: ``linear_fc1 = cat[gate, up]``
  (Megatron's SwiGLU takes ``silu(first half) * second half``).
* :func:`pad_vocab` / :func:`strip_vocab`: Megatron pads the vocabulary to a
  multiple of ``make_vocab_size_divisible_by * TP``; the padded rows are zero.

MHAR routing parameters have a table of their own, :data:`ROUTING_RULES`, naming them
as the transformers models of :mod:`megatron_mhar.hf` do: the Megatron model's names under
transformers' prefixes (``decoder.layers.{}.input_router.query`` is
``model.layers.{}.input_router.query``);
it applies to MHAR models only, and its ``when`` conditions read the routing variant.

Every tensor on either side must be claimed by a rule; anything else raises.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from megatron_mhar.models.gpt_config import GPTModelConfig


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the special cases need to know about the model."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    """The tokenizer's vocabulary (HF rows)."""
    padded_vocab_size: int
    """Megatron's rows (``vocab_size`` rounded up)."""

    @classmethod
    def of(cls, model: GPTModelConfig, tensor_model_parallel_size: int = 1) -> "Shapes":
        heads = model.num_attention_heads
        return cls(
            num_attention_heads=heads,
            num_query_groups=model.num_query_groups or heads,
            head_dim=model.kv_channels or model.hidden_size // heads,
            vocab_size=model.vocab_size,
            padded_vocab_size=model.padded_vocab_size(tensor_model_parallel_size),
        )


# ---------------------------------------------------------------- special cases


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """HF q/k/v projections [np*hn, h], [ng*hn, h], [ng*hn, h] -> Megatron linear_qkv."""
    ng, hn = shapes.num_query_groups, shapes.head_dim
    per_group = shapes.num_attention_heads // ng
    _expect(q, (shapes.num_attention_heads * hn, None), "q_proj")
    _expect(k, (ng * hn, q.shape[1]), "k_proj")
    _expect(v, (ng * hn, q.shape[1]), "v_proj")
    hidden = q.shape[1]
    fused = torch.cat(
        [q.reshape(ng, per_group * hn, hidden), k.reshape(ng, hn, hidden), v.reshape(ng, hn, hidden)],
        dim=1,
    )
    return fused.reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, shapes: Shapes) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    ng, hn = shapes.num_query_groups, shapes.head_dim
    per_group = shapes.num_attention_heads // ng
    _expect(qkv, ((per_group + 2) * ng * hn, None), "linear_qkv")
    hidden = qkv.shape[1]
    q, k, v = qkv.reshape(ng, (per_group + 2) * hn, hidden).split([per_group * hn, hn, hn], dim=1)
    return (q.reshape(-1, hidden).contiguous(), k.reshape(-1, hidden).contiguous(),
            v.reshape(-1, hidden).contiguous())


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """HF gate_proj and up_proj [f, h] -> Megatron linear_fc1 [2f, h] = cat[gate, up]."""
    _expect(up, tuple(gate.shape), "up_proj")
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor, shapes: Shapes) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gate_up`."""
    gate, up = fc1.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def pad_vocab(weight: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    """[vocab, h] -> [padded vocab, h] with zero rows."""
    _expect(weight, (shapes.vocab_size, None), "embedding / lm_head")
    pad = shapes.padded_vocab_size - shapes.vocab_size
    return torch.cat([weight, weight.new_zeros(pad, weight.shape[1])]) if pad else weight


def strip_vocab(weight: torch.Tensor, shapes: Shapes) -> Tuple[torch.Tensor]:
    """Inverse of :func:`pad_vocab` (the padded rows are dropped)."""
    if weight.shape[0] < shapes.vocab_size:
        raise ValueError(
            f"embedding has {weight.shape[0]} rows, fewer than the vocabulary ({shapes.vocab_size})"
        )
    return (weight[: shapes.vocab_size].contiguous(),)


def _copy(tensor: torch.Tensor, shapes: Shapes) -> torch.Tensor:
    return tensor


def _uncopy(tensor: torch.Tensor, shapes: Shapes) -> Tuple[torch.Tensor]:
    return (tensor,)


def _expect(tensor: torch.Tensor, shape: Tuple[Optional[int], ...], what: str) -> None:
    if tensor.dim() != len(shape) or any(s is not None and s != t for s, t in zip(shape, tensor.shape)):
        wanted = "x".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{what}: shape {tuple(tensor.shape)} does not match the config ({wanted})")


# ---------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Megatron tensor made of one or more HF tensors."""

    megatron: str
    hf: Tuple[str, ...]
    to_megatron: Callable = _copy
    """``(*hf_tensors, shapes) -> megatron tensor``."""
    to_hf: Callable = _uncopy
    """``(megatron tensor, shapes) -> hf tensors`` in ``hf`` order."""
    when: Optional[str] = None
    """Only for models where this predicate of (GPTModelConfig, MHARConfig) holds (see
    :data:`CONDITIONS`)."""
    layers: str = "all"
    """The decoder layers holding the tensor: ``all``, ``dense`` (a dense MLP) or ``moe``."""


L = "model.layers.{}."
M = "decoder.layers.{}."
HF_EXPERT = L + "mlp.experts.{}."
EXPERT = M + "mlp.experts.local_experts.{}."

RULES: Tuple[Rule, ...] = (
    # Megatron (local spec)                            HF                                      special case
    Rule("embedding.word_embeddings.weight",           ("model.embed_tokens.weight",),        pad_vocab, strip_vocab),
    Rule(M + "input_layernorm.weight",                 (L + "input_layernorm.weight",)),
    Rule(M + "self_attention.linear_qkv.weight",       (L + "self_attn.q_proj.weight",
                                                        L + "self_attn.k_proj.weight",
                                                        L + "self_attn.v_proj.weight"),       fuse_qkv, split_qkv),
    Rule(M + "self_attention.q_layernorm.weight",      (L + "self_attn.q_norm.weight",),      when="qk_layernorm"),
    Rule(M + "self_attention.k_layernorm.weight",      (L + "self_attn.k_norm.weight",),      when="qk_layernorm"),
    Rule(M + "self_attention.linear_proj.weight",      (L + "self_attn.o_proj.weight",)),
    Rule(M + "pre_mlp_layernorm.weight",               (L + "post_attention_layernorm.weight",)),
    Rule(M + "mlp.linear_fc1.weight",                  (L + "mlp.gate_proj.weight",
                                                        L + "mlp.up_proj.weight"),            fuse_gate_up, split_gate_up,
         layers="dense"),
    Rule(M + "mlp.linear_fc2.weight",                  (L + "mlp.down_proj.weight",),         layers="dense"),
    # MoE layers (Qwen3-MoE): the router and each routed expert's SwiGLU MLP
    Rule(M + "mlp.router.weight",                      (L + "mlp.gate.weight",),              layers="moe"),
    Rule(EXPERT + "linear_fc1.weight",                 (HF_EXPERT + "gate_proj.weight",
                                                        HF_EXPERT + "up_proj.weight"),        fuse_gate_up, split_gate_up,
         layers="moe"),
    Rule(EXPERT + "linear_fc2.weight",                 (HF_EXPERT + "down_proj.weight",),     layers="moe"),
    Rule("decoder.final_layernorm.weight",             ("model.norm.weight",)),
    Rule("output_layer.weight",                        ("lm_head.weight",),                   pad_vocab, strip_vocab,
         when="untied"),
)

ROUTING_RULES: Tuple[Rule, ...] = (
    # Megatron (MHAR layers)                            HF (megatron_mhar.hf's MHAR models)
    Rule(M + "input_router.query",                      (L + "input_router.query",)),
    Rule(M + "input_router.norm_weight",                (L + "input_router.norm_weight",)),
    Rule(M + "input_router.null_source",                (L + "input_router.null_source",),      when="delta"),
    Rule(M + "input_router.gate",                       (L + "input_router.gate",),             when="delta"),
    Rule(M + "pre_mlp_router.query",                    (L + "pre_mlp_router.query",)),
    Rule(M + "pre_mlp_router.norm_weight",              (L + "pre_mlp_router.norm_weight",)),
    Rule(M + "pre_mlp_router.null_source",              (L + "pre_mlp_router.null_source",),    when="delta"),
    Rule(M + "pre_mlp_router.gate",                     (L + "pre_mlp_router.gate",),           when="delta"),
    Rule("decoder.final_router.query",                  ("model.final_router.query",),          when="final_site"),
    Rule("decoder.final_router.norm_weight",            ("model.final_router.norm_weight",),    when="final_site"),
)

# The Megatron names of every routing parameter. A plain HF model has none: on import they
# keep the values the model is built with (zero queries and gates, unit norms, zero null
# sources), unless the HF directory is an MHAR export (ROUTING_RULES).
MHAR_PARAMS: Tuple[str, ...] = (
    M + "input_router.query",
    M + "input_router.norm_weight",
    M + "input_router.null_source",
    M + "input_router.gate",
    M + "pre_mlp_router.query",
    M + "pre_mlp_router.norm_weight",
    M + "pre_mlp_router.null_source",
    M + "pre_mlp_router.gate",
    "decoder.final_router.query",
    "decoder.final_router.norm_weight",
)

# HF tensors some checkpoints carry that hold no weights (recomputed buffers).
HF_IGNORED: Tuple[str, ...] = (L + "self_attn.rotary_emb.inv_freq",)

CONDITIONS: Dict[str, Callable[[GPTModelConfig, Any], bool]] = {
    "qk_layernorm": lambda model, mhar: model.qk_layernorm,
    "untied": lambda model, mhar: not model.tie_embeddings,
    "delta": lambda model, mhar: mhar.variant == "delta",
    "final_site": lambda model, mhar: mhar.variant in ("full", "block"),
}


# How errors spell the conditions of the routing table.
_WHEN = {"delta": "mhar_variant is delta", "final_site": "mhar_variant is full or block (the final site)"}


def rules(mhar=None) -> Tuple[Rule, ...]:
    """The rules of a model: the base table, and the routing table when ``mhar`` routes."""
    return RULES + (ROUTING_RULES if mhar is not None and mhar.variant != "none" else ())


def _regex(pattern: str) -> "re.Pattern[str]":
    return re.compile("^" + re.escape(pattern).replace(r"\{\}", r"(\d+)") + "$")


# The reverse map, derived from the table: HF pattern -> (rule, position in rule.hf).
_MEGATRON_RE = [(_regex(rule.megatron), rule) for rule in RULES + ROUTING_RULES]
_HF_RE = [(_regex(pattern), rule, i) for rule in RULES + ROUTING_RULES for i, pattern in enumerate(rule.hf)]
_MHAR_RE = [_regex(pattern) for pattern in MHAR_PARAMS]
_IGNORED_RE = [_regex(pattern) for pattern in HF_IGNORED]


def _applies(rule: Rule, model: GPTModelConfig, mhar=None) -> bool:
    return rule.when is None or CONDITIONS[rule.when](model, mhar)


Index = Union[None, int, Tuple[int, int]]
"""Where a rule's tensor is: ``None`` (no index), the layer, or (layer, expert)."""


def _expand(pattern: str, index: Index) -> str:
    if index is None:
        return pattern
    return pattern.format(*index) if isinstance(index, tuple) else pattern.format(index)


def _instances(rule: Rule, model: GPTModelConfig) -> List[Index]:
    if "{}" not in rule.megatron:
        return [None]
    moe = model.moe_layer_pattern()
    layers = [layer for layer in range(model.num_layers)
              if rule.layers == "all" or moe[layer] == (rule.layers == "moe")]
    if rule.megatron.count("{}") == 2:
        return [(layer, expert) for layer in layers for expert in range(model.num_moe_experts)]
    return layers


def is_mhar_param(name: str) -> bool:
    """Whether a Megatron name is an MHAR routing parameter."""
    return any(r.match(name) for r in _MHAR_RE)


def rule_for_megatron(name: str) -> Tuple[Rule, Index]:
    """The rule producing Megatron tensor ``name`` and its index (the layer, or the layer and
    the expert); raises if none."""
    for regex, rule in _MEGATRON_RE:
        match = regex.match(name)
        if match:
            groups = tuple(int(g) for g in match.groups())
            return rule, groups[0] if len(groups) == 1 else (groups or None)
    raise KeyError(f"no conversion rule for Megatron tensor {name!r}")


def expected_hf_names(model: GPTModelConfig, mhar=None) -> List[str]:
    """Every HF tensor name a checkpoint of ``model`` must hold, in table order; with an
    MHAR ``mhar``, those of an MHAR export (the routing tensors too)."""
    return [
        _expand(pattern, layer)
        for rule in rules(mhar) if _applies(rule, model, mhar)
        for layer in _instances(rule, model)
        for pattern in rule.hf
    ]


def check_hf_names(names: Iterable[str], model: GPTModelConfig, where: str, mhar=None) -> List[str]:
    """Raise on missing or unexpected HF tensors; returns the names to ignore.

    A tied model may carry ``lm_head.weight`` as a copy of the embedding; the caller
    checks that copy (see :func:`check_tied_copy`) and it is then ignored. ``mhar``:
    the routing of an MHAR export, whose routing tensors are then expected.
    """
    names = set(names)
    expected = set(expected_hf_names(model, mhar))
    ignored = {n for n in names if any(r.match(n) for r in _IGNORED_RE)}
    if model.tie_embeddings and "lm_head.weight" in names:
        ignored.add("lm_head.weight")
    missing = sorted(expected - names)
    extra = sorted(names - expected - ignored)
    if missing or extra:
        lines = [f"{where} does not match the {_arch(model, mhar)} config:"]
        if missing:
            lines.append(f"  missing {len(missing)} tensors: {_head(missing)}")
        if extra:
            why = [f"{n} ({_explain_extra(n, model, mhar)})" for n in extra]
            lines.append(f"  unexpected {len(extra)} tensors: {_head(why)}")
        raise ValueError("\n".join(lines))
    return sorted(ignored)


def _arch(model: GPTModelConfig, mhar=None) -> str:
    routing = f", mhar_variant={mhar.variant}" if mhar is not None and mhar.variant != "none" else ""
    family = ("Qwen3" if model.qk_layernorm else "Llama") + ("-MoE" if model.is_moe else "")
    experts = f", {model.num_moe_experts} experts" if model.is_moe else ""
    return family + f" ({model.num_layers} layers{experts}{routing})"


def _explain_extra(name: str, model: GPTModelConfig, mhar=None) -> str:
    for regex, rule, _ in _HF_RE:
        match = regex.match(name)
        if match:
            if match.groups() and int(match.group(1)) >= model.num_layers:
                return f"layer {match.group(1)} >= num_hidden_layers={model.num_layers}"
            if len(match.groups()) == 2 and int(match.group(2)) >= (model.num_moe_experts or 0):
                return f"expert {match.group(2)} >= num_experts={model.num_moe_experts}"
            if rule.layers != "all" and match.groups():
                moe = model.moe_layer_pattern()[int(match.group(1))]
                if moe != (rule.layers == "moe"):
                    return f"layer {match.group(1)} has {'an MoE' if moe else 'a dense'} MLP in the config"
            if rule not in rules(mhar):
                return "a routing tensor, only expected in an MHAR export"
            if not _applies(rule, model, mhar):
                return f"only expected when {_WHEN.get(rule.when, rule.when)}"
    return "no conversion rule"


def _head(items: Sequence[str], n: int = 8) -> str:
    shown = ", ".join(items[:n])
    return shown + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def megatron_tensor(name: str, read_hf: Callable[[str], torch.Tensor], shapes: Shapes) -> torch.Tensor:
    """Megatron tensor ``name`` (global layer index) built from HF tensors read by ``read_hf``."""
    rule, index = rule_for_megatron(name)
    return rule.to_megatron(*(read_hf(_expand(p, index)) for p in rule.hf), shapes)


def hf_tensors(
    megatron: Mapping[str, torch.Tensor], model: GPTModelConfig, shapes: Shapes, mhar=None
) -> Dict[str, torch.Tensor]:
    """The HF tensors of a full Megatron state dict (with ``mhar``'s routing tensors).

    Raises on any Megatron tensor without a rule of the model, and on any tensor the
    model config requires but the state dict lacks.
    """
    return dict(hf_tensors_streamed(megatron.items(), model, shapes, mhar))


def hf_tensors_streamed(
    megatron: Iterable[Tuple[str, torch.Tensor]], model: GPTModelConfig, shapes: Shapes, mhar=None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """:func:`hf_tensors` of ``(name, tensor)`` pairs as they come: each Megatron tensor is
    converted when it arrives, so the caller can drop it (and write its HF tensors) before
    the next is read. A tensor without a rule raises when it arrives, a missing one at the end.
    """
    required: Dict[str, Tuple[Rule, Index]] = {
        _expand(rule.megatron, layer): (rule, layer)
        for rule in rules(mhar) if _applies(rule, model, mhar)
        for layer in _instances(rule, model)
    }
    seen = set()
    for name, tensor in megatron:
        if name not in required or name in seen:
            why = "given twice" if name in seen else "without a conversion rule"
            raise ValueError(f"Megatron tensors {why}: {name}")
        seen.add(name)
        rule, layer = required[name]
        for pattern, hf_tensor in zip(rule.hf, rule.to_hf(tensor, shapes), strict=True):
            yield _expand(pattern, layer), hf_tensor
    missing = [name for name in required if name not in seen]
    if missing:
        raise ValueError(f"Megatron checkpoint has no {missing[0]!r} (required by the model config)")
