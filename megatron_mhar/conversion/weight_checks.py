"""Checks of the weights a conversion reads, each naming the tensor at fault.

* :func:`check_hf_headers`, before any tensor is read: every HF tensor's shape against the
  one its model config implies (so a wrongly shaped ``gate_proj`` is named, not the
  ``up_proj`` it is fused with), and one dtype for all of them unless ``--dtype`` chooses
  the stored one (a mixed checkpoint would otherwise be cast to the embedding's dtype).
* :class:`FiniteReader` and :func:`check_finite`: NaN or Inf in a weight refuses the
  conversion unless ``--allow-nonfinite`` asks to convert it as it is.

Shapes and dtypes come from the safetensors headers (no tensor data is read).
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path
from typing import Callable, Dict, Tuple

import torch

from megatron_mhar.conversion.hf_io import INDEX_FILE, SINGLE_FILE
from megatron_mhar.models.gpt_config import GPTModelConfig

ALLOW_NONFINITE_FLAG = "--allow-nonfinite"


def tensor_headers(hf_dir: Path) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """``{name: (shape, safetensors dtype)}`` of an HF directory's weights (one file or an index)."""
    from safetensors import safe_open

    hf_dir = Path(hf_dir)
    index = hf_dir / INDEX_FILE
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [SINGLE_FILE]
    headers = {}
    for name in files:
        with safe_open(str(hf_dir / name), framework="pt") as handle:
            for key in handle.keys():
                part = handle.get_slice(key)
                headers[key] = (tuple(part.get_shape()), part.get_dtype())
    return headers


def expected_shapes(model: GPTModelConfig) -> Dict[str, Tuple[int, ...]]:
    """Leaf name pattern (``{}``: the layer index) -> the HF shape the config implies."""
    hidden, heads = model.hidden_size, model.num_attention_heads
    head_dim = model.kv_channels or hidden // heads
    groups = model.num_query_groups or heads
    ffn = model.ffn_hidden_size or 4 * hidden
    layer = "model.layers.{}."
    moe = {}
    if model.is_moe:  # Qwen3-MoE: the router, and each expert's SwiGLU MLP ({}: the expert)
        width = model.moe_ffn_hidden_size or ffn
        moe = {layer + "mlp.gate.weight": (model.num_moe_experts, hidden),
               layer + "mlp.experts.{}.gate_proj.weight": (width, hidden),
               layer + "mlp.experts.{}.up_proj.weight": (width, hidden),
               layer + "mlp.experts.{}.down_proj.weight": (hidden, width)}
    return moe | {
        "model.embed_tokens.weight": (model.vocab_size, hidden),
        "lm_head.weight": (model.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        layer + "input_layernorm.weight": (hidden,),
        layer + "post_attention_layernorm.weight": (hidden,),
        layer + "self_attn.q_proj.weight": (heads * head_dim, hidden),
        layer + "self_attn.k_proj.weight": (groups * head_dim, hidden),
        layer + "self_attn.v_proj.weight": (groups * head_dim, hidden),
        layer + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        layer + "self_attn.q_norm.weight": (head_dim,),
        layer + "self_attn.k_norm.weight": (head_dim,),
        layer + "mlp.gate_proj.weight": (ffn, hidden),
        layer + "mlp.up_proj.weight": (ffn, hidden),
        layer + "mlp.down_proj.weight": (hidden, ffn),
    }


def check_hf_headers(hf_dir: Path, model: GPTModelConfig, dtype_chosen: bool) -> None:
    """Raise a ``ValueError`` naming every tensor whose shape differs from the config's,
    and, unless ``dtype_chosen``, the tensors of a dtype other than the most common one."""
    headers = tensor_headers(hf_dir)
    patterns = [(re.compile("^" + re.escape(p).replace(r"\{\}", r"\d+") + "$"), shape)
                for p, shape in expected_shapes(model).items()]
    wrong = []
    for name, (shape, _) in sorted(headers.items()):
        expected = next((want for regex, want in patterns if regex.match(name)), None)
        if expected is not None and shape != expected:
            wrong.append(f"{name} has shape {shape}, the config implies {expected}")
    if wrong:
        raise ValueError(
            f"{hf_dir}: {len(wrong)} tensors do not have the shapes of its config.json:\n  "
            + "\n  ".join(wrong[:8]) + ("\n  ..." if len(wrong) > 8 else "")
            + "\nthe weights and config.json come from different models; fix or replace the file"
        )
    dtypes = collections.Counter(dtype for _, dtype in headers.values())
    if len(dtypes) > 1 and not dtype_chosen:
        common = dtypes.most_common(1)[0][0]
        odd = sorted(f"{name} ({dtype})" for name, (_, dtype) in headers.items() if dtype != common)
        raise ValueError(
            f"{hf_dir} mixes tensor dtypes ({dict(dtypes)}): {', '.join(odd[:8])}"
            + (", ..." if len(odd) > 8 else "")
            + "; pass --dtype float32, bfloat16 or float16 to choose the stored dtype"
        )


FINITE_CHECK_ELEMENTS = 2**24
"""Elements checked at once: ``isfinite``'s temporaries over a whole 8B vocabulary matrix
(525M elements) come to twice its size, the conversion's peak (docs/performance.md)."""


def count_nonfinite(tensor: torch.Tensor) -> int:
    """NaN and Inf values in ``tensor``, counted piece by piece (at most
    :data:`FINITE_CHECK_ELEMENTS` at once)."""
    flat = tensor.reshape(-1)  # a view of a contiguous tensor, as read from safetensors
    return sum(int((~torch.isfinite(piece)).sum()) for piece in flat.split(FINITE_CHECK_ELEMENTS))


def check_finite(name: str, tensor: torch.Tensor, where: str, allow: bool) -> None:
    """Raise (or, with ``allow``, warn) if ``tensor`` holds NaN or Inf."""
    if not tensor.is_floating_point():
        return
    bad = count_nonfinite(tensor)
    if not bad:
        return
    message = f"{where}: {name} holds {bad} non-finite values (NaN/Inf) of {tensor.numel()}"
    if allow:
        print(f"warning: {message}; converted as it is ({ALLOW_NONFINITE_FLAG})", flush=True)
        return
    raise ValueError(
        f"{message}: the source is damaged or its training diverged. Convert another checkpoint, "
        f"or pass {ALLOW_NONFINITE_FLAG} to convert it as it is"
    )


class FiniteReader:
    """An HF tensor reader (``reader(name)``, ``name in reader``) whose every tensor is
    checked with :func:`check_finite` as it is read."""

    def __init__(self, reader: Callable[[str], torch.Tensor], where: str, allow: bool):
        self._reader, self._where, self._allow = reader, where, allow

    def __contains__(self, name: str) -> bool:
        return name in self._reader

    def __call__(self, name: str) -> torch.Tensor:
        tensor = self._reader(name)
        check_finite(name, tensor, self._where, self._allow)
        return tensor

