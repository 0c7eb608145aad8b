"""Load a converted or trained checkpoint for inference: ``input_ids [b, s] -> logits [b, s, vocab]``,
and text to text with the checkpoint's tokenizer.

    import megatron_mhar
    model = megatron_mhar.load_model("runs/smoke_cpu", device="cpu")   # a run directory
    logits = model(input_ids)            # [b, s, vocab] over the tokenizer's vocabulary
    ids = model.tokenizer.tokenize("def main():")   # the tokenizer saved with the checkpoint
    text = model.generate("def main():", max_new_tokens=32)          # greedy, text to text

The forward is full-sequence (MHAR decoders do not run Megatron's inference path);
:meth:`CausalLM.generate` decodes with the KV cache of the model's transformers form
(:mod:`megatron_mhar.hf`, built in memory by :meth:`CausalLM.to_hf`). Forwards run under
``torch.no_grad()`` unless ``load_model(..., grad=True)``. The model is built at TP=PP=1 whatever layout wrote the
checkpoint. Megatron needs its parallel state even for one process: when
``torch.distributed`` is not initialised, :func:`load_model` starts a
single-process group (gloo on CPU with the CPU runtime of
:mod:`megatron_mhar.runtime.cpu`, NCCL on CUDA); ``megatron_mhar.runtime.destroy()``
tears it down.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch
import yaml

from megatron_mhar.models.mhar_config import MHARConfig
from megatron_mhar.models.gpt_config import GPTModelConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from megatron_mhar.data.tokenizer import Tokenizer

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RUN_CONFIG_FILE = "config.yaml"
"""What marks a run directory (the driver writes the resolved config there first)."""
DEVICE_TYPES = ("cpu", "cuda")


class CausalLM(torch.nn.Module):
    """A Megatron GPT (plain or MHAR) seen as ``input_ids [b, s] -> logits [b, s, vocab]``.

    Logits are returned over the real vocabulary (``config.vocab_size``); Megatron's
    padded rows are cut off. With ``grad=False`` forwards build no autograd graph.
    ``tokenizer`` is the checkpoint's (``None`` when it carries none).
    """

    def __init__(
        self,
        gpt: torch.nn.Module,
        config: GPTModelConfig,
        mhar: MHARConfig,
        tokenizer: Optional["Tokenizer"] = None,
        grad: bool = False,
    ):
        super().__init__()
        self.gpt = gpt
        self.config = config
        self.mhar = mhar
        self.tokenizer = tokenizer
        self.grad = grad
        self._hf = None  # the transformers form that generate() decodes with, built once

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``input_ids [b, s]`` token ids in ``[0, vocab_size)`` -> ``[b, s, vocab_size]`` logits.

        ``position_ids`` may only restate the default ``0 .. s-1``: Megatron's RoPE
        ignores them and always rotates by the position within the sequence.
        """
        self._check_input_ids(input_ids)
        default = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if position_ids is not None and not (
            torch.is_tensor(position_ids)
            and position_ids.shape == input_ids.shape
            and torch.equal(position_ids.to(default), default)
        ):
            raise ValueError(
                "position_ids other than 0 .. seq-1 per row are not supported: Megatron's RoPE "
                "ignores them, so the logits would be those of positions 0 .. seq-1. Pass "
                "position_ids=None (and split packed sequences into separate rows)"
            )
        with torch.set_grad_enabled(self.grad and torch.is_grad_enabled()):
            logits = self.gpt(input_ids, default, None)
        return logits[..., : self.config.vocab_size]

    def to_hf(self) -> "PreTrainedModel":
        """The same network as a transformers model, on this model's device and dtype, from a
        copy of the current weights: ``MHARLlamaForCausalLM`` / ``MHARQwen3ForCausalLM``
        (:mod:`megatron_mhar.hf`), or a plain Llama / Qwen3 for ``variant: none``. It has
        transformers' KV cache and ``generate``. An MTP model's depths are left out: it is
        the main model, whose logits :meth:`forward` returns."""
        try:
            import transformers

            import megatron_mhar.hf  # noqa: F401  (registers the MHAR classes with the Auto classes)
        except ImportError as err:
            raise ImportError(
                f"{err}; the transformers form of the model needs transformers (the eval extra: "
                f"pip install -e '.[eval]')"
            ) from None
        from megatron_mhar.checkpoint.streaming import full_state_dict
        from megatron_mhar.conversion import hf_config, mapping
        from megatron_mhar.models.mtp import MTP_PREFIX, without_mtp

        if self.config.is_moe:
            raise ValueError(
                "an MoE model has no in-memory transformers form here (transformers holds the experts "
                "of a layer fused); export the checkpoint with mhar-convert mcore-to-hf and load the "
                "directory with AutoModelForCausalLM.from_pretrained, which generates with the KV cache"
            )
        dtype = next(self.gpt.parameters()).dtype
        # transformers models run no MTP depth: the main model alone, as an export holds it
        main = without_mtp(self.config)
        state = {k: v for k, v in full_state_dict(self.gpt).items() if not k.startswith(MTP_PREFIX)}
        tensors = mapping.hf_tensors(state, main, mapping.Shapes.of(main), self.mhar)
        config = hf_config.hf_config_from_model(main, str(dtype).removeprefix("torch."))
        if self.tokenizer is not None:
            config["eos_token_id"] = self.tokenizer.eod
        if self.mhar.enabled:
            config = hf_config.mhar_hf_config(config, self.mhar)
        fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "auto_map")}
        hf_cfg = transformers.AutoConfig.for_model(config["model_type"], **fields)
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        tied = {"lm_head.weight"} if hf_cfg.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"the transformers model does not take these weights: missing "
                               f"{sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
        model.tie_weights()
        return model.to(next(self.gpt.parameters()).device).eval()

    @torch.no_grad()
    def generate(self, prompt: str, max_new_tokens: int = 32) -> str:
        """The greedy continuation of ``prompt`` (text in, text out; the prompt is not repeated).

        Encodes with the checkpoint's tokenizer, decodes greedily with the KV cache of the
        transformers form of the model (:meth:`to_hf`, built at the first call from the
        weights as they are then), stops after ``max_new_tokens`` tokens or at the
        end-of-document token, and decodes the new tokens.
        """
        if self.tokenizer is None:
            raise ValueError(
                "this checkpoint carries no tokenizer (a trained checkpoint holds one in tokenizer/, a "
                "converted one in hf/); pass load_model(..., tokenizer=DIR), the directory of the "
                "tokenizer.json the model was trained with"
            )
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        ids = self.tokenizer.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty (no tokens); give some text to continue")
        if len(ids) + max_new_tokens > self.config.seq_length:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) plus max_new_tokens={max_new_tokens} exceeds the "
                f"{self.config.seq_length} tokens the model was trained on (model.seq_length); "
                f"shorten the prompt or ask for fewer tokens"
            )
        if self._hf is None:
            self._hf = self.to_hf()
        device = next(self.gpt.parameters()).device
        input_ids = torch.tensor([ids], device=device)
        out = self._hf.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=self.tokenizer.eod,
            pad_token_id=self.tokenizer.eod,
        )
        new = out[0, len(ids) :].tolist()
        if self.tokenizer.eod in new:
            new = new[: new.index(self.tokenizer.eod)]
        return self.tokenizer.detokenize(new)

    def _check_input_ids(self, input_ids) -> None:
        if not torch.is_tensor(input_ids) or input_ids.dtype not in (torch.int64, torch.int32):
            what = f"a tensor of {input_ids.dtype}" if torch.is_tensor(input_ids) else type(input_ids).__name__
            raise ValueError(
                f"input_ids must be a torch.long (or int32) tensor of token ids, got {what}; "
                f"e.g. torch.tensor(ids, dtype=torch.long)"
            )
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.numel() == 0:
            raise ValueError(
                f"input_ids is empty (shape {tuple(input_ids.shape)}); pass at least one token per row"
            )
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(
                f"input_ids must lie in [0, {self.config.vocab_size}) (model.vocab_size), got values "
                f"in [{low}, {high}]; was the text tokenized with this model's tokenizer?"
            )


def load_model(
    path: Union[str, Path],
    device: Union[str, torch.device] = "cpu",
    dtype: Optional[torch.dtype] = None,
    grad: bool = False,
    tokenizer: Optional[Union[str, Path]] = None,
) -> CausalLM:
    """Build the checkpoint's model and load its weights; returns it in eval mode.

    Args:
        path: a run directory (``run.output_dir``/``run.name``: its checkpoints), a
            directory with a ``latest`` file (a run's ``checkpoints/``, the output of
            ``mhar-convert hf-to-mcore``), or one checkpoint (``iter_*``).
        device: ``cpu`` or a CUDA device.
        dtype: parameter dtype; ``None`` keeps the dtype the checkpoint stores.
        grad: build autograd graphs in forwards (gradients of the logits, fine-tuning);
            by default forwards run under ``torch.no_grad()``.
        tokenizer: a tokenizer directory (``tokenizer.json``) to use instead of the one
            the checkpoint carries (``model.tokenizer``; ``None`` if it carries none).
    """
    from megatron.core import parallel_state

    from megatron_mhar.checkpoint.format import read_configs, require_checkpoint, stored_dtype
    from megatron_mhar.checkpoint.model import build_model
    from megatron_mhar.checkpoint.streaming import load_into
    from megatron_mhar.runtime import initialize_model_parallel_from_env

    device = _check_device(device)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(
            f"dtype must be None (the checkpoint's) or one of {DTYPES}, got {dtype!r}; "
            f"pass a torch.dtype such as torch.bfloat16, not a string"
        )
    found = require_checkpoint(checkpoints_of(Path(path)))
    model_cfg, mhar, common = read_configs(found)
    if not torch.distributed.is_initialized():
        initialize_model_parallel_from_env(
            device="cpu" if device.type == "cpu" else "cuda", create_gloo_process_groups=False
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if tp != 1 or pp != 1:
        raise ValueError(f"load_model builds a TP=PP=1 model; Megatron is initialised with TP={tp}, PP={pp}")
    gpt = build_model(
        model_cfg, mhar, dtype or stored_dtype(found), device="cpu" if device.type == "cpu" else "cuda"
    )
    load_into(gpt, found)
    eod_token = (common.get("config", {}).get("data") or {}).get("eod_token")
    if tokenizer is not None:
        loaded = _read_tokenizer(Path(os.path.expanduser(str(tokenizer))), eod_token, model_cfg.vocab_size)
    else:
        loaded = checkpoint_tokenizer(found, eod_token, model_cfg.vocab_size)
    return CausalLM(gpt.to(device), model_cfg, mhar, loaded, grad).eval()


def checkpoints_of(path: Path) -> Path:
    """``path``, or where a run directory keeps its checkpoints (``checkpoint.dir`` of its
    ``config.yaml``, by default ``checkpoints/``)."""
    from megatron_mhar.checkpoint.format import LATEST, is_complete

    run_config = path / RUN_CONFIG_FILE
    if (path / LATEST).is_file() or is_complete(path) or not run_config.is_file():
        return path
    with open(run_config, encoding="utf-8") as f:
        saved = yaml.safe_load(f) or {}
    configured = (saved.get("checkpoint") or {}).get("dir") if isinstance(saved, dict) else None
    checkpoints = Path(os.path.expandvars(os.path.expanduser(configured))) if configured else path / "checkpoints"
    if not checkpoints.is_dir():
        raise FileNotFoundError(
            f"{path} is a run directory without checkpoints ({checkpoints} does not exist); a run "
            f"saves one at its end (checkpoint.save_at_end) or every checkpoint.interval steps"
        )
    return checkpoints


def checkpoint_tokenizer(
    checkpoint: Path, eod_token: Optional[str] = None, vocab_size: Optional[int] = None
) -> Optional["Tokenizer"]:
    """The tokenizer a checkpoint carries: a trained one's ``tokenizer/``, a converted
    one's ``hf/``; ``None`` when it has neither, or (with a warning that says why) when
    that one cannot serve: the model's logits do not need it."""
    from megatron_mhar.checkpoint.format import HF_SUBDIR, TOKENIZER_DIR
    from megatron_mhar.data.tokenizer import TOKENIZER_FILE

    for directory in (Path(checkpoint) / TOKENIZER_DIR, Path(checkpoint) / HF_SUBDIR):
        if (directory / TOKENIZER_FILE).is_file():
            try:
                return _read_tokenizer(directory, eod_token, vocab_size)
            except ValueError as err:
                warnings.warn(
                    f"the checkpoint's tokenizer is not used: {err}. model.tokenizer is None; pass "
                    f"load_model(..., tokenizer=DIR) for text in and out",
                    stacklevel=3,
                )
                return None
    return None


def _read_tokenizer(directory: Path, eod_token: Optional[str], vocab_size: Optional[int]) -> "Tokenizer":
    """The tokenizer in ``directory``; raises if it has more tokens than the model."""
    from megatron_mhar.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(str(directory), eod_token)
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer {directory} has {tokenizer.vocab_size} tokens, more than the model's "
            f"{vocab_size} (model.vocab_size): it is not the one the model was trained with"
        )
    return tokenizer


def _check_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` as a torch.device, or a ValueError naming the devices :func:`load_model` runs on."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in DEVICE_TYPES:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<index>', got {device!r}")
    return parsed
