"""Plain helpers shared by the test modules (fixtures live in the conftest.py files).

* Processes: :data:`LAUNCHER_ENV`, :func:`run_distributed` (a test function on several
  gloo ranks) and :class:`DistributedTestError`.
* Models: the tiny GPT of the model tests (:func:`tiny_gpt_config`, :func:`build_gpt`,
  :func:`gpt_batch`, :func:`randomize_routers`, :func:`capture_sublayers`) and
  :func:`lm_batches`, the micro-batches of the schedule tests.
* Training driver: :data:`TINY`, the smoke recipe shrunk to seconds, over the embedded
  corpus of :data:`EMBEDDED_VOCAB` tokens; :func:`metric_records` of a run.
* Conversion: the tiny HF models' :data:`HF_VOCAB` and :data:`HF_SEQ`,
  :func:`redraw_hf_weights`, :func:`edited_hf_dir`, :func:`plan_hf_import`, :func:`token_batch`,
  :func:`hf_logits`, :func:`read_safetensors`.
* Hugging Face export: :data:`EXPORT_CASES` (every family and variant trained a few steps,
  exported and loaded elsewhere by tests/hf), :func:`export_token_batch`, and
  :func:`random_model` (untrained models with large random weights).
* Kernels: :func:`use_interpreter_without_cuda`.

No CUDA calls and no Megatron import at import time.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import torch
import torch.multiprocessing as mp

from megatron_mhar.runtime.distributed import free_port

# Variables a launcher (torchrun, srun wrappers) may leave in a CI job's environment;
# single-process tests must not try to rendezvous with them.
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


# ---------------------------------------------------------------- processes

# Seconds the parent waits for the other ranks after the first failure, so that
# a secondary error (e.g. a peer seeing the connection close) is also reported.
_GRACE_AFTER_FAILURE_S = 3.0


class DistributedTestError(RuntimeError):
    """One or more ranks failed or did not finish in time."""


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Iterator[Any]],
    args: tuple,
    kwargs: dict,
    env: Dict[str, str],
    results: "mp.Queue",
) -> None:
    """One rank: each value ``fn`` yields goes to the parent as ``(rank, index, status, payload)``."""
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    index = 0
    try:
        for value in fn(*args, **kwargs):
            results.put((rank, index, "ok", _dumps(value)))
            index += 1
    except BaseException:  # report everything, including KeyboardInterrupt/SystemExit
        results.put((rank, index, "error", traceback.format_exc()))


def _yield_result(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[Any]:
    yield fn(*args, **kwargs)


class DistributedStream:
    """A generator function run on ``world_size`` spawned ranks; its values as they come.

    ``fn(*args, **kwargs)`` yields one value per item on every rank;
    :meth:`result` returns item ``i``'s values, indexed by rank, as soon as every rank
    yielded it, while the ranks go on with the next items. A module's tests can then each
    wait for their own item instead of all waiting for the whole batch (no long silence
    under ``pytest -q``). ``item_timeout`` bounds the wait for each item, counted from
    when the previous one arrived; ``first_timeout`` (default ``item_timeout``) that for
    the first, start-up included. The ranks, failures and timeouts are
    :func:`run_distributed`'s. Close it (or use ``with``) to stop the ranks.
    """

    def __init__(
        self,
        fn: Callable[..., Iterator[Any]],
        world_size: int,
        *args: Any,
        item_timeout: float = 120.0,
        first_timeout: float | None = None,
        env: Dict[str, str] | None = None,
        name: str | None = None,
        **kwargs: Any,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.item_timeout = world_size, item_timeout
        self._timeout = first_timeout if first_timeout is not None else item_timeout
        self.name = name or fn.__name__
        ctx = mp.get_context("spawn")
        self._queue = ctx.Queue()
        port = free_port()
        env = dict(env or {})
        # Each rank gets one intra-op thread: ranks share the machine's cores.
        env.setdefault("OMP_NUM_THREADS", "1")
        self._procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, port, fn, args, kwargs, env, self._queue),
                name=f"rank{rank}",
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._values: Dict[int, Dict[int, bytes]] = {}  # item -> rank -> payload
        self._errors: Dict[int, tuple] = {}  # rank -> (status, traceback or reason)
        self._failed_at: float | None = None
        self._failure: DistributedTestError | None = None
        self._progress_at = time.monotonic()

    def result(self, index: int) -> List[Any]:
        """Item ``index``'s value on every rank (waits for it; raises if a rank failed or
        timed out before every rank yielded it)."""
        while self._failure is None and len(self._values.get(index, {})) < self.world_size:
            try:
                rank, item, status, payload = self._queue.get(timeout=0.2)
            except queue_module.Empty:
                # Timeouts are judged only on an empty queue: items that arrived while the
                # caller was busy elsewhere (other tests of the module) are progress, not a hang.
                now = time.monotonic()
                if now > self._progress_at + self._timeout:
                    break
                if self._failed_at is not None and now > self._failed_at + _GRACE_AFTER_FAILURE_S:
                    break
                # A rank that died without reporting (segfault, os._exit, OOM kill).
                dead = [
                    r for r, p in enumerate(self._procs)
                    if r not in self._errors and p.exitcode is not None and self._queue.empty()
                    and r not in self._values.get(index, {})
                ]
                for r in dead:
                    self._errors[r] = ("died", f"exited with code {self._procs[r].exitcode} without a result")
                if dead and self._failed_at is None:
                    self._failed_at = time.monotonic()
                continue
            if status == "ok":
                self._values.setdefault(item, {})[rank] = payload
                if len(self._values[item]) == self.world_size:
                    self._progress_at, self._timeout = time.monotonic(), self.item_timeout
                continue
            self._errors[rank] = (status, payload)  # kept: a later item reports it
            if self._failed_at is None:
                self._failed_at = time.monotonic()
        values = self._values.get(index, {})
        if len(values) < self.world_size:
            if self._failure is None:
                self._failure = self._error(index)
                self.close()
            raise self._failure
        return [torch.load(io.BytesIO(values[r]), weights_only=False) for r in range(self.world_size)]

    def _error(self, index: int) -> DistributedTestError:
        lines = [f"{self.name} on {self.world_size} ranks failed:"]
        for r in sorted(self._errors):
            lines.append(f"--- rank {r} ({self._errors[r][0]}) ---\n{self._errors[r][1].rstrip()}")
        missing = [r for r in range(self.world_size) if r not in self._errors and r not in self._values.get(index, {})]
        if missing:
            reason = "timed out" if self._failed_at is None else "stopped after a failure"
            lines.append(f"--- ranks {missing}: no result ({reason}, timeout={self._timeout}s) ---")
        return DistributedTestError("\n".join(lines))

    def close(self) -> None:
        """Stop the ranks (those still running are terminated)."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def __enter__(self) -> "DistributedStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: Dict[str, str] | None = None,
    **kwargs: Any,
) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` spawned processes::

        def _worker(tp):                       # module level: spawn pickles it by name
            ctx = initialize_model_parallel_from_env(tp=tp, device="cpu")
            try:
                return compute_something()
            finally:
                destroy()

        results = run_distributed(_worker, 2, 2, timeout=120)   # [rank0_result, rank1_result]

    Each rank is a fresh ``spawn`` process with torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1`` and a free
    ``MASTER_PORT``), so the worker initialises the process group exactly like the
    training driver does. Return values travel back through ``torch.save`` bytes (no
    shared-memory tensor handles that die with the child). If any rank raises, the
    others are stopped (they would hang in a collective) and the parent raises
    :class:`DistributedTestError` with every failing rank's traceback. A run that does
    not finish within ``timeout`` seconds is killed and reported the same way.
    (:class:`DistributedStream` returns the values of a generator item by item.)

    Args:
        fn: a picklable (module-level) function. It sees torchrun's environment
            variables and must initialise (and destroy) the process group itself,
            e.g. with ``megatron_mhar.runtime.initialize_model_parallel_from_env``.
        world_size: number of processes (ranks).
        *args, **kwargs: passed to ``fn`` on every rank; must be picklable.
        timeout: seconds for the whole run (start-up included).
        env: extra environment variables for every rank.

    Returns:
        ``fn``'s return value on each rank, indexed by rank. Values must be
        serialisable with ``torch.save`` (tensors, numbers, lists, dicts).

    Raises:
        DistributedTestError: a rank raised (its traceback is in the message),
            died without reporting (exit code given), or the run timed out.
    """
    with DistributedStream(
        _yield_result, world_size, fn, *args, item_timeout=timeout, env=env, name=fn.__name__, **kwargs
    ) as stream:
        return stream.result(0)


# ---------------------------------------------------------------- models

GPT_SEQ, GPT_BATCH, GPT_VOCAB = 8, 2, 64
"""Sequence length, batch size and vocabulary of :func:`tiny_gpt_config` and :func:`gpt_batch`."""


def tiny_gpt_config(**overrides):
    """A 3-layer GPT (d=32, GQA, q/k norms) for CPU model tests; ``overrides`` replace fields."""
    from megatron_mhar.models.gpt_config import GPTModelConfig

    fields = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, vocab_size=GPT_VOCAB, seq_length=GPT_SEQ, qk_layernorm=True)
    fields.update(overrides)
    return GPTModelConfig(**fields)


def megatron_tiny_gpt_config(**fields):
    """Megatron's own TransformerConfig of :func:`tiny_gpt_config`'s architecture, stated field
    by field (nothing from this package): the reference side of the bitwise tests against
    Megatron's models; ``fields`` add to it (experts, MTP depths)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, qk_layernorm=True, add_bias_linear=False, init_method_std=0.02,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, use_cpu_initialization=True,
        **fields,
    )  # fmt: skip


def build_gpt(model_cfg, mhar, seed=7, **config_overrides):
    """The model of ``model_cfg`` and ``mhar``, initialised from ``seed`` (Megatron must be up)."""
    from megatron.core import tensor_parallel

    from megatron_mhar.models.builder import build_gpt_model, make_transformer_config

    config = make_transformer_config(model_cfg, mhar, use_cpu_initialization=True, **config_overrides)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return build_gpt_model(model_cfg, mhar, config)


def gpt_batch(seed=0):
    """(tokens, positions), each ``[GPT_BATCH, GPT_SEQ]``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, GPT_VOCAB, (GPT_BATCH, GPT_SEQ), generator=generator)
    positions = torch.arange(GPT_SEQ).unsqueeze(0).expand(GPT_BATCH, GPT_SEQ)
    return tokens, positions


def randomize_routers(model, seed=3):
    """Routing parameters away from their identity init, so that every term of routing counts."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("router.query"):
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.endswith("router.norm_weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith("router.gate") or name.endswith("router.null_source"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))


GATE_NOISE = 2.0**-10
"""How far bf16 moves a delta gate's gradient, as a share of its magnitude sum
(:func:`record_gate_gradient_scales`). A gate's gradient is one sum over every token and
channel of ``dL/dx * route(...)`` whose terms nearly cancel (in the 4-layer test models
``|sum| / sum |.|`` reaches 1/2000), so the bf16 rounding of ``dL/dx`` alone moves it by
~3e-4 of the magnitude sum in either routing path (measured on CPU and an H200): against
its own value that is noise, so bf16 models are judged against this share of the sum
(tests/models/test_fused_in_model.py checks the gates exactly in fp32)."""


def record_gate_gradient_scales(model) -> Dict[str, torch.Tensor]:
    """Hooks on ``model``'s delta routers: after its next forward and backward the returned
    dict maps each gate's parameter name to ``sum |dL/dx * route(...)|`` over the routed
    input ``x = h + gate * route(...)`` (the magnitude of the sum the gate's gradient is)."""
    from megatron_mhar.models.routing import DeltaRouter

    scales: Dict[str, torch.Tensor] = {}

    def hook(name, router, args, x):
        stream = args[0]
        if not router.gate.detach().any():  # a closed gate: the sum is not recoverable from x
            return
        routed = (x - stream.hidden).detach().double() / router.gate.detach().double()
        x.register_hook(lambda grad: scales.__setitem__(f"{name}.gate", (grad.double() * routed).abs().sum()))

    for name, module in model.named_modules():
        if isinstance(module, DeltaRouter):
            module.register_forward_hook(lambda m, args, x, name=name: hook(name, m, args, x))
    return scales


def gradient_tolerance(name: str, grad: torch.Tensor, gate_scales: Dict[str, torch.Tensor]) -> float:
    """The atol of flash-attention's rule for parameter ``name``'s gradient ``grad`` (fp32
    reference): 1% of its largest element, and for a delta gate :data:`GATE_NOISE` of its
    magnitude sum."""
    atol = 1e-2 * grad.abs().max().item() + 1e-6
    if name in gate_scales:
        atol = max(atol, GATE_NOISE * gate_scales[name].item())
    return atol


def capture_sublayers(model):
    """One no-grad forward of :func:`gpt_batch`; returns (inputs, outputs) of every sublayer.

    ``inputs[j - 1]`` is what site j fed its pre-norm (the final norm's input last, when
    the model has one); ``outputs[0]`` is the embedding and ``outputs[j]`` sublayer j's
    output (no bias, no dropout in these models).
    """
    inputs, outputs, hooks = [], [], []

    def capture_in(module, args, out):
        inputs.append(args[0])

    def capture_out(module, args, out):
        outputs.append(out[0] if isinstance(out, tuple) else out)

    hooks.append(model.embedding.register_forward_hook(capture_out))
    for layer in model.decoder.layers:
        hooks.append(layer.input_layernorm.register_forward_hook(capture_in))
        hooks.append(layer.self_attention.register_forward_hook(capture_out))
        hooks.append(layer.pre_mlp_layernorm.register_forward_hook(capture_in))
        hooks.append(layer.mlp.register_forward_hook(capture_out))
    if model.decoder.final_router is not None:
        hooks.append(model.decoder.final_layernorm.register_forward_hook(capture_in))
    tokens, positions = gpt_batch()
    with torch.no_grad():
        model(tokens, positions, None)
    for hook in hooks:
        hook.remove()
    return inputs, outputs


def lm_batches(count: int, batch: int, seq: int, vocab: int, seed: int = 0) -> List[Dict[str, torch.Tensor]]:
    """``count`` micro-batches of next-token prediction, as Megatron's schedules consume them."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (batch, seq), generator=generator)
        batches.append(dict(
            tokens=tokens,
            labels=torch.roll(tokens, shifts=-1, dims=1),
            position_ids=torch.arange(seq).expand(batch, seq),
            loss_mask=torch.ones(batch, seq),
        ))
    return batches


# ---------------------------------------------------------------- training driver

EMBEDDED_BYTES = 200_000  # a few stdlib files: ~100K tokens, enough for every test
EMBEDDED_VOCAB = 512

TINY = [
    "run.device=cpu",
    "run.seed=1234",
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=64",
    f"model.vocab_size={EMBEDDED_VOCAB}",
    "model.seq_length=32",
    "mhar.num_heads=4",
    "training.train_iters=6",
    "training.global_batch_size=4",
    "training.micro_batch_size=2",
    "optimizer.lr=1.0e-2",
    "optimizer.min_lr=1.0e-3",
    "optimizer.lr_warmup_iters=2",
    "eval.interval=3",
    "eval.iters=1",
    "eval.tail=2",
    "logging.interval=1",
    "checkpoint.keep_last=0",
    f"data.embedded_vocab_size={EMBEDDED_VOCAB}",
    f"data.embedded_max_bytes={EMBEDDED_BYTES}",
    "data.split=80,20,0",
]
"""Overrides of the smoke recipe that make a driver run take seconds on CPU."""


def metric_records(run_dir) -> Dict[tuple, dict]:
    """Every ``metrics.jsonl`` record of a run but its timing fields, by (kind, step), in
    file order: two runs' records compare bitwise."""
    from megatron_mhar.training.metrics import read_metrics

    timing = {"tokens_per_s", "memory_gb"}
    return {(r["kind"], r["step"]): {k: v for k, v in r.items() if k not in timing} for r in read_metrics(run_dir)}


# ---------------------------------------------------------------- conversion

HF_VOCAB, HF_SEQ = 100, 16
"""Vocabulary and sequence length of the tiny HF models of the conversion tests."""


def redraw_hf_weights(model, seed: int = 0):
    """An HF model's weights redrawn larger than its init (matrices N(0, 0.1^2), norms
    1 + N(0, 0.2^2)): logits of order one, so that a mapping error cannot hide below a
    tolerance. Returns the model, in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.2 * noise if param.dim() == 1 else 0.1 * noise)
    return model.eval()


def edited_hf_dir(src: Path, dst: Path, config=None, drop=(), add=None, replace=None) -> Path:
    """A copy of an HF directory with config edits and tensors dropped, added or replaced."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(config or {})
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = load_file(str(dst / "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    tensors.update(add or {})
    tensors.update(replace or {})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def plan_hf_import(hf_dir, out, variant="none", **kwargs):
    """``plan_import`` at the conversion tests' sequence length."""
    from megatron_mhar.conversion.convert import plan_import

    return plan_import(hf_dir, out, variant, seq_length=HF_SEQ, **kwargs)


def token_batch(seed: int = 0, batch: int = 2, seq: int = HF_SEQ) -> torch.Tensor:
    return torch.randint(0, HF_VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The fp32 logits of the Hugging Face model saved in ``hf_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def read_safetensors(directory: Path) -> dict:
    """Every tensor of a Hugging Face directory's safetensors files."""
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


# --- Hugging Face export cases (tests/hf): tiny runs of every family and variant ---

EXPORT_LAYERS = 3
EXPORT_SEQ = 64

EXPORT_ARCHITECTURE = [
    "run.device=cpu", "run.seed=1234", f"model.num_layers={EXPORT_LAYERS}", "model.hidden_size=32",
    "model.num_attention_heads=4", "model.num_query_groups=2", "model.ffn_hidden_size=64",
    f"model.vocab_size={EMBEDDED_VOCAB}", f"model.seq_length={EXPORT_SEQ}",
]
EXPORT_TRAINING = [
    "training.train_iters=4", "training.global_batch_size=4", "training.micro_batch_size=4",
    "optimizer.lr=3.0e-2", "optimizer.min_lr=3.0e-3", "optimizer.lr_warmup_iters=1",
    "eval.interval=0", "logging.interval=1", "logging.tensorboard=false", "checkpoint.keep_last=1",
    f"data.embedded_vocab_size={EMBEDDED_VOCAB}", f"data.embedded_max_bytes={EMBEDDED_BYTES}",
    "data.split=80,20,0",
]
QWEN3_FAMILY = ["model.qk_layernorm=true"]
LLAMA_FAMILY = ["model.qk_layernorm=false"]

# case -> overrides of the smoke recipe. Together: both families, every variant, H = 8 and
# H = 1, logit_scale != 1, tied and untied embeddings.
EXPORT_CASES = {
    # Qwen3 (q/k norms), every sublayer output a source, 8 heads, tau = 2, tied embeddings
    "qwen3-full-h8": QWEN3_FAMILY + ["mhar.variant=full", "mhar.num_heads=8", "mhar.logit_scale=2.0",
                              "model.tie_embeddings=true"],
    # Llama, Attention Residuals (one head), untied output layer
    "llama-full-h1": LLAMA_FAMILY + ["mhar.variant=full", "mhar.num_heads=1", "model.tie_embeddings=false"],
    # blocks of 4 sublayers over 6: block 2 spans layers, the final site reads a partial
    "llama-block-h4": LLAMA_FAMILY + ["mhar.variant=block", "mhar.num_heads=4", "mhar.block_size=4",
                               "mhar.logit_scale=4.0", "model.tie_embeddings=true"],
    # delta over blocks of one layer (null source + embedding + 2 deltas), untied, tau = 8
    "qwen3-delta-h8": QWEN3_FAMILY + ["mhar.variant=delta", "mhar.num_heads=8", "mhar.delta_block_layers=1",
                               "mhar.logit_scale=8.0", "model.tie_embeddings=false"],
    # no routing: a plain Qwen3 export
    "qwen3-none": QWEN3_FAMILY + ["mhar.variant=none", "model.tie_embeddings=true"],
}
ROUTED_CASES = [name for name in EXPORT_CASES if not name.endswith("none")]


def export_token_batch(seed: int = 0, batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, EMBEDDED_VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))



# Random-weight MHAR transformers models (no training), weights drawn large
RANDOM_SHAPE = dict(hidden_size=32, num_hidden_layers=EXPORT_LAYERS, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=EMBEDDED_VOCAB, bos_token_id=None, eos_token_id=None)
# name -> (family, MHAR fields) of the random-weight models (random_model)
RANDOM_MODELS = {
    # Qwen3, 8 heads, tau = 2, tied embeddings
    "qwen3-full": ("qwen3", dict(mhar_variant="full", mhar_num_heads=8, mhar_logit_scale=2.0,
                                 tie_word_embeddings=True)),
    # Llama, Attention Residuals (one head), untied
    "llama-full-h1": ("llama", dict(mhar_variant="full", mhar_num_heads=1, tie_word_embeddings=False)),
    # Llama, blocks of 3 sublayers (they straddle layers), partial read at the final site
    "llama-block": ("llama", dict(mhar_variant="block", mhar_num_heads=4, mhar_block_size=3,
                                  mhar_logit_scale=4.0)),
    # Qwen3 delta over blocks of one layer, nonzero gates and null sources
    "qwen3-delta": ("qwen3", dict(mhar_variant="delta", mhar_num_heads=8, mhar_delta_block_layers=1)),
}


def random_model(name: str, seed: int = 0):
    """``RANDOM_MODELS[name]`` with weights drawn large: matrices, queries, null sources and
    gates N(0, 0.3^2), norm weights 1 + N(0, 0.2^2), so logits are O(1) and depend on context."""
    import megatron_mhar.hf as mhar_hf

    family, fields = RANDOM_MODELS[name]
    config_class, model_class = {
        "qwen3": (mhar_hf.MHARQwen3Config, mhar_hf.MHARQwen3ForCausalLM),
        "llama": (mhar_hf.MHARLlamaConfig, mhar_hf.MHARLlamaForCausalLM),
    }[family]
    model = model_class(config_class(**RANDOM_SHAPE, **fields))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            norm = "norm" in param_name.rsplit(".", 2)[-2] or param_name.endswith("norm_weight")
            param.copy_(1 + 0.2 * noise if norm else 0.3 * noise)
    return model.eval()


# --- Triton kernels on CPU (tests/kernels, tests/benchmarks) ---


def use_interpreter_without_cuda() -> None:
    """Run the Triton kernels in the interpreter where there is no CUDA device.

    ``TRITON_INTERPRET`` is read when a kernel is decorated, so it must be set before
    ``mhar_kernels`` is imported; modules imported without it (by tests collected before)
    are dropped, so the next import decorates their kernels for the interpreter (modules
    imported while it was set already run there). The interpreter is exact in fp32 but not
    in bf16, so the CPU tests run in fp32 only.
    """
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    for name in [n for n in sys.modules if n == "mhar_kernels" or n.startswith("mhar_kernels.")]:
        del sys.modules[name]
