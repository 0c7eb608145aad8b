"""HF Llama/Qwen3 (safetensors) <-> Megatron distributed checkpoint with MHAR parameters.

:func:`hf_to_mcore` runs one process per model-parallel rank (``tp * pp`` gloo
processes on CPU: spawned here, or given by torchrun/srun). Each rank builds its
GPT chunk, reads only the HF tensors it holds, fuses and slices them by the table
in :mod:`megatron_mhar.conversion.mapping`, and Megatron's ``dist_checkpointing``
writes the shards. The result loads at any TP/PP layout (Megatron's sharded keys
are global; the padded vocabulary rows are ``allow_shape_mismatch``).

:func:`mcore_to_hf` loads a converted or trained checkpoint into a single-process
model and writes HF safetensors. An MHAR model becomes a directory of its MHAR form
(:mod:`megatron_mhar.hf`): the routing parameters in the model's own safetensors, the
``mhar_*`` fields and ``auto_map`` in ``config.json`` and the modeling files beside it
(see :mod:`megatron_mhar.conversion.hf_io`). The import reads such exports and plain
Llama / Qwen3 directories.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_mhar.checkpoint.format import (
    HF_SUBDIR,
    LATEST,
    TOKENIZER_DIR,
    common_state,
    read_configs,
    require_checkpoint,
    staging_dir,
    stored_dtype,
    write_train_config,
)
from megatron_mhar.checkpoint.model import build_model, check_layout, tp_slice
from megatron_mhar.checkpoint.streaming import read_streamed, save_streamed
from megatron_mhar.conversion import hf_config, hf_io, mapping, weight_checks
from megatron_mhar.conversion.model_card import model_card
from megatron_mhar.conversion.output import (
    CONVERSION_FILE,
    ITERATION_DIR,
    SOURCE_CONFIG,
    SOURCE_GENERATION_CONFIG,
    check_output,
    prepare_output,
    publish,
)
from megatron_mhar.errors import UserError
from megatron_mhar.models.gpt_config import GPTModelConfig
from megatron_mhar.models.mhar_config import MHARConfig, function_fields
from megatron_mhar.models.mtp import without_mtp
from megatron_mhar.runtime import lifetime
from megatron_mhar.runtime.lock import DirectoryInUse

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclasses.dataclass
class ImportPlan:
    """Everything every rank needs to convert one HF directory (picklable)."""

    hf_dir: str
    out: str
    model: GPTModelConfig
    mhar: MHARConfig
    dtype: str
    tp: int
    pp: int
    overwrite: bool
    routing_source: str
    """Where routing parameters come from: ``"export"`` (the tensors of an MHAR export) or
    ``"initial"`` (the values the model is built with)."""
    hf_ignored: tuple
    allow_nonfinite: bool = False
    """Convert weights holding NaN/Inf as they are (default: refuse)."""
    tokenizer: Optional[str] = None
    """The directory of ``--tokenizer``, whose tokenizer files the checkpoint carries instead
    of those beside the model."""


# The variants each routing option of the import changes; given with another, it would be
# recorded in the checkpoint's config and do nothing.
_OVERRIDE_VARIANTS = {"num_heads": ("full", "block", "delta"), "logit_scale": ("full", "block", "delta"),
                      "block_size": ("block",), "delta_block_layers": ("delta",)}  # fmt: skip


def plan_import(
    hf_dir: Path,
    out: Path,
    variant: Optional[str] = None,
    tp: int = 1,
    pp: int = 1,
    dtype: Optional[str] = None,
    seq_length: Optional[int] = None,
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
    mhar_overrides: Optional[Dict[str, Any]] = None,
    model_overrides: Optional[Dict[str, Any]] = None,
    allow_nonfinite: bool = False,
    tokenizer: Optional[Path] = None,
) -> ImportPlan:
    """Validate everything that can be checked before any process starts.

    ``tokenizer``: the directory of the tokenizer the model is trained with, checked against
    the model's vocabulary (:func:`_check_tokenizer`) and carried in the checkpoint's ``hf/``;
    default: the one beside the model, where there is one."""
    hf_dir = Path(hf_dir)
    check_output(out, overwrite, inputs=(hf_dir,))
    if make_vocab_size_divisible_by < 1:
        raise ValueError(f"--make-vocab-size-divisible-by must be at least 1, got {make_vocab_size_divisible_by}")
    raw = hf_io.read_config(hf_dir)
    model = hf_config.model_config_from_hf(
        raw, seq_length, make_vocab_size_divisible_by, **(model_overrides or {})
    )
    check_layout(model, tp, pp)
    _check_tokenizer(Path(tokenizer) if tokenizer else None, hf_dir, model.vocab_size)
    hf_io.check_no_side_file(hf_dir)
    exported = hf_config.mhar_config_from_hf(raw) if hf_config.is_mhar_export(raw) else None
    fields: Dict[str, Any] = {}
    if exported is not None:
        fields.update(function_fields(dataclasses.asdict(exported)))
        if variant is not None and variant != fields["variant"]:
            raise ValueError(
                f"{hf_dir} carries MHAR parameters of variant {fields['variant']!r} "
                f"(config.json); --variant {variant} would drop or misplace them. "
                f"Use --variant {fields['variant']} or convert a directory without them"
            )
    elif variant is None:
        raise ValueError("--variant is required (none, full, block or delta)")
    else:
        fields["variant"] = variant
    for name in mhar_overrides or {}:
        applies = _OVERRIDE_VARIANTS.get(name, ())
        if fields["variant"] not in applies:
            raise ValueError(f"--{name.replace('_', '-')} applies to the {' / '.join(applies)} variant, not "
                             f"{fields['variant']!r}; drop it or choose one of those variants")  # fmt: skip
    fields.update(mhar_overrides or {})
    try:
        mhar = MHARConfig(**fields)
        mhar.validate_for_model(model.hidden_size, model.num_layers)
    except ValueError as err:  # named by the options they came from, not the config keys
        message = str(err)
        for name in mhar_overrides or {}:
            message = message.replace(f"mhar.{name}", f"--{name.replace('_', '-')}")
        raise ValueError(message) from None
    if exported is not None:
        _check_same_routing(exported, mhar, f"{hf_dir}/config.json")
    reader = hf_io.SafetensorsReader(hf_dir)
    ignored = mapping.check_hf_names(reader.keys(), model, str(hf_dir), exported)
    if exported is not None:
        _check_routing_shapes(reader, model, exported, hf_dir)
    weight_checks.check_hf_headers(hf_dir, model, dtype_chosen=dtype is not None)
    dtype = dtype or _hf_dtype(hf_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    source = "export" if exported is not None else "initial"
    return ImportPlan(str(hf_dir), str(Path(out).absolute()), model, mhar, dtype, tp, pp,
                      overwrite, source, tuple(ignored), allow_nonfinite,
                      str(Path(tokenizer).absolute()) if tokenizer else None)


def _check_tokenizer(tokenizer: Optional[Path], hf_dir: Path, vocab_size: int) -> None:
    """The tokenizer given (or, where none is, the one beside the model) has no token beyond
    the model's embedding rows: data it writes would stop the training that reads it. A
    tokenizer with fewer tokens is usual (the rows are padded to a round number)."""
    from tokenizers import Tokenizer as HFTokenizer

    directory = tokenizer or hf_dir
    path = directory / "tokenizer.json"
    if not path.is_file():
        if tokenizer is not None:
            raise FileNotFoundError(f"--tokenizer {tokenizer} has no tokenizer.json")
        return  # nothing beside the model to compare; training compares data.tokenizer
    try:
        size = HFTokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as err:  # the Rust library raises a bare Exception
        raise ValueError(f"{path} is not a tokenizer the tokenizers library can read ({err})") from None
    if size > vocab_size:
        given = "--tokenizer" if tokenizer is not None else "the tokenizer beside the model,"
        raise ValueError(
            f"{given} {path} has {size} tokens but the model has {vocab_size} embedding rows (vocab_size "
            f"in {hf_dir}/config.json): ids from {vocab_size} up would have no embedding, and training "
            f"on data written with it stops at the first. Give the tokenizer this model was trained "
            f"with (--tokenizer DIR), or convert a model whose vocabulary covers this tokenizer"
        )


def _hf_dtype(hf_dir: Path) -> str:
    """The dtype of the HF tensors (kept, so HF -> Megatron -> HF is bitwise)."""
    reader = hf_io.SafetensorsReader(hf_dir)
    return _DTYPE_NAMES[reader("model.embed_tokens.weight").dtype]


def _check_same_routing(saved: MHARConfig, mhar: MHARConfig, where: str) -> None:
    saved_fields = function_fields(dataclasses.asdict(saved))
    if saved_fields != function_fields(dataclasses.asdict(mhar)):
        raise ValueError(
            f"{where} has mhar={saved_fields}, the options ask for "
            f"{function_fields(dataclasses.asdict(mhar))}; routing parameters only fit the "
            f"configuration they were trained with"
        )


def _check_routing_shapes(reader, model: GPTModelConfig, mhar: MHARConfig, hf_dir: Path) -> None:
    """Every routing tensor of an MHAR export has the shape its config.json implies."""
    base = set(mapping.expected_hf_names(model))
    for name in mapping.expected_hf_names(model, mhar):
        if name in base:
            continue
        wanted = (1,) if name.endswith(".gate") else (model.hidden_size,)
        shape = tuple(reader(name).shape)
        if shape != wanted:
            raise ValueError(
                f"{hf_dir}: {name} has shape {shape}, but config.json (hidden_size="
                f"{model.hidden_size}, mhar_variant={mhar.variant!r}) implies {wanted}; the config "
                f"does not belong to these weights"
            )


def hf_to_mcore(plan: ImportPlan) -> Path:
    """Convert; spawns ``tp * pp`` ranks unless already launched as that many ranks."""
    world = plan.tp * plan.pp
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if "WORLD_SIZE" in os.environ and launched != world:
        raise ValueError(f"launched with WORLD_SIZE={launched}, but --tp x --pp = {world}")
    if world > 1 and "WORLD_SIZE" not in os.environ:
        try:
            spawn(_import_rank, world, plan)
        except BaseException as err:  # a rank stopped inside a collective leaves its staging behind
            if not isinstance(err, DirectoryInUse):  # that staging is another conversion's
                shutil.rmtree(staging_dir(Path(plan.out)), ignore_errors=True)
            raise
    else:
        _import_rank(plan)
    return Path(plan.out)


def _import_rank(plan: ImportPlan) -> None:
    """One rank of the import (a collective over ``tp * pp`` ranks)."""
    from megatron_mhar.runtime import destroy

    lifetime.install()  # the checkpoint writer's processes die with this rank
    started = _ensure_parallel_state(plan.tp, plan.pp)
    rank = torch.distributed.get_rank()
    out = Path(plan.out)
    tmp = staging_dir(out)
    lock = None
    try:
        if rank == 0:
            _, lock = prepare_output(out, plan.overwrite, inputs=(Path(plan.hf_dir),))
        lifetime.start_writer_helper()
        torch.distributed.barrier()

        chunk = build_model(plan.model, plan.mhar, DTYPES[plan.dtype], device="meta")
        value_of = _hf_values(chunk, plan)
        iteration_dir = tmp / ITERATION_DIR
        if rank == 0:
            iteration_dir.mkdir()
        torch.distributed.barrier()
        source_config = hf_io.read_config(Path(plan.hf_dir))
        conversion = {
            "source": str(Path(plan.hf_dir).absolute()),
            "architecture": hf_config.architecture(source_config),
            "dtype": plan.dtype,
            "converted_at_layout": {"tp": plan.tp, "pp": plan.pp},
            "routing_source": plan.routing_source,
            "ignored_hf_tensors": list(plan.hf_ignored),
            # The source's own config, carried by every checkpoint trained from this one
            # (the training driver keeps this record), so that every export restores it.
            SOURCE_CONFIG: source_config,
            SOURCE_GENERATION_CONFIG: hf_io.read_generation_config(Path(plan.hf_dir)),
        }
        common = common_state(plan.model, plan.mhar, conversion)
        save_streamed(chunk, iteration_dir, common, value_of)
        if rank == 0:
            write_train_config(iteration_dir, plan.model, plan.mhar)
            (iteration_dir / CONVERSION_FILE).write_text(json.dumps(conversion, indent=2) + "\n")
            hf_dir = iteration_dir / HF_SUBDIR
            hf_dir.mkdir()
            hf_io.copy_auxiliary(Path(plan.hf_dir), hf_dir, ("config.json",) + hf_io.AUXILIARY_FILES)
            if plan.tokenizer is not None:  # the tokenizer checked against the model, not the one beside it
                hf_io.write_tokenizer(hf_io.read_tokenizer_files(Path(plan.tokenizer)), hf_dir)
            (tmp / LATEST).write_text(ITERATION_DIR + "\n")
            publish(tmp, out)
        torch.distributed.barrier()
    except BaseException as err:
        # never leave a half-written checkpoint behind (nor touch another conversion's)
        if rank == 0 and tmp.exists() and not isinstance(err, DirectoryInUse):
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.release()
        if started:
            destroy()


def _ensure_parallel_state(tp: int, pp: int) -> bool:
    """Initialise Megatron for ``tp x pp`` CPU ranks unless it already is; True if started here."""
    from megatron.core import parallel_state

    from megatron_mhar.runtime import initialize_model_parallel_from_env

    if not torch.distributed.is_initialized():
        initialize_model_parallel_from_env(tp=tp, pp=pp, device="cpu", create_gloo_process_groups=False)
        return True
    have = (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            torch.distributed.get_world_size())
    if have != (tp, pp, tp * pp):
        raise ValueError(
            f"Megatron is already initialised with TP={have[0]}, PP={have[1]}, world size "
            f"{have[2]}; the conversion needs TP={tp}, PP={pp} on {tp * pp} ranks"
        )
    return False


def _hf_values(chunk, plan: ImportPlan):
    """``value_of(name, param)`` for :func:`save_streamed`: this rank's part of
    each tensor of ``chunk``, read from the HF checkpoint when asked for."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    reader = weight_checks.FiniteReader(hf_io.SafetensorsReader(Path(plan.hf_dir)), plan.hf_dir, plan.allow_nonfinite)
    shapes = mapping.Shapes.of(plan.model, tp_size)
    if plan.model.tie_embeddings and "lm_head.weight" in reader:
        _check_tied_copy(reader)

    def value_of(key: str, param: torch.Tensor) -> torch.Tensor:
        if mapping.is_mhar_param(key) and plan.routing_source == "initial":
            return param  # the identity values of the model's construction
        if key == "output_layer.weight" and plan.model.tie_embeddings:
            full = mapping.megatron_tensor("embedding.word_embeddings.weight", reader, shapes)
        else:
            full = mapping.megatron_tensor(key, reader, shapes)
        return tp_slice(key, full, param, tp_rank, tp_size)

    return value_of


def _check_tied_copy(reader) -> None:
    if not torch.equal(reader("lm_head.weight"), reader("model.embed_tokens.weight")):
        raise ValueError(
            "tie_word_embeddings=true but lm_head.weight differs from model.embed_tokens.weight; "
            "fix tie_word_embeddings in config.json"
        )


# ---------------------------------------------------------------- Megatron -> HF


def mcore_to_hf(
    ckpt: Path,
    out: Path,
    overwrite: bool = False,
    dtype: Optional[str] = None,
    hf_reference: Optional[Path] = None,
    tokenizer: Optional[Path] = None,
    allow_nonfinite: bool = False,
    max_shard_bytes: int = hf_io.DEFAULT_SHARD_BYTES,
    verify: str = "full",
) -> Path:
    """Write an HF directory from a checkpoint: a plain Llama / Qwen3 for ``variant: none``,
    else its MHAR form, which ``AutoModelForCausalLM`` loads (``trust_remote_code=True``, or
    none once :mod:`megatron_mhar.hf` is imported).

    ``config.json`` is the source model's, from ``hf_reference`` if given, else from the
    ``hf/`` folder a converted checkpoint carries, else from the conversion record a
    checkpoint trained from a converted one carries (:data:`SOURCE_CONFIG`): every field
    (context length, RoPE scaling, token ids, dtype, model-specific fields) is kept, except
    what the checkpoint really changed (:func:`_trained_changes`), which is said in one line.
    A checkpoint with none of them (trained from scratch) gets a config derived from its
    model config. The tokenizer files come with the source config, except for a trained
    checkpoint, which ships the tokenizer it trained with. ``tokenizer``
    (a directory holding ``tokenizer.json``, such as the one a run trained on) supplies
    the tokenizer files instead (with a pad token, :func:`hf_io.tokenizer_files`), and a
    derived config its special tokens (:func:`hf_io.special_token_ids`); by default a
    trained checkpoint's own tokenizer (its ``tokenizer/``) does. A directory whose source
    has no ``generation_config.json`` gets one with the BOS, EOS and pad token ids, and every
    export a model card (:mod:`megatron_mhar.conversion.model_card`). The tensors stream
    from the checkpoint into safetensors shards of at most ``max_shard_bytes`` (with an
    index when there are several), each checked for NaN/Inf unless ``allow_nonfinite``;
    every file gets the mode a new file gets (:func:`hf_io.set_file_modes`).
    ``verify``: how the checkpoint is checked against its manifest first (``full``, ``size``,
    or ``off`` for one :func:`require_checkpoint` has just verified).
    """
    if max_shard_bytes < 1:
        raise ValueError(f"--max-shard-size must be positive, got {max_shard_bytes} bytes")
    found = require_checkpoint(Path(ckpt), verify)
    own_tokenizer = found / TOKENIZER_DIR
    if tokenizer is None and not hf_reference and not (found / HF_SUBDIR / "config.json").is_file():
        tokenizer = own_tokenizer if (own_tokenizer / "tokenizer.json").is_file() else None
    inputs = (Path(ckpt), found) + tuple(Path(p) for p in (hf_reference, tokenizer) if p)
    check_output(out, overwrite, inputs)
    source_hf = Path(hf_reference) if hf_reference else found / HF_SUBDIR
    if hf_reference and not (source_hf / "config.json").is_file():
        raise FileNotFoundError(f"--hf-reference {hf_reference} has no config.json")
    tokenizer_files = hf_io.tokenizer_files(Path(tokenizer)) if tokenizer else None
    model_cfg, mhar, common = read_configs(found)
    if model_cfg.mtp_num_layers is not None:
        print(f"multi-token prediction: the checkpoint's {model_cfg.mtp_num_layers} MTP depth(s) (its mtp.* "
              f"tensors) are left out of the export; transformers models do not run them", flush=True)
        model_cfg = without_mtp(model_cfg)
    stored = stored_dtype(found)
    target = DTYPES[dtype] if dtype else stored
    original, what = _source_config(source_hf, hf_reference, common)
    generation = None  # the source's generation_config.json, where it is not copied with its files
    ids = {}  # special token ids from the tokenizer, for a derived config
    if original is not None:
        config = hf_config.plain_hf_config(original)
        derived = hf_config.model_config_from_hf(config)
        hf_config.check_same_function(derived, model_cfg, f"{what} and the checkpoint's model")
        config, changes = _trained_changes(config, model_cfg, _DTYPE_NAMES[target], dtype is not None)
        if not (source_hf / "config.json").is_file():
            generation = common["conversion"].get(SOURCE_GENERATION_CONFIG)
        kept = f"config.json: the source model's ({what})"
        print(kept + (f", changed: {'; '.join(changes)}" if changes else ", unchanged"), flush=True)
    else:
        config = hf_config.hf_config_from_model(model_cfg, _DTYPE_NAMES[target])
        if tokenizer is not None:
            from megatron_mhar.data.tokenizer import Tokenizer

            ids = hf_io.special_token_ids(tokenizer_files, Tokenizer.from_dir(str(tokenizer)).eod)
            # no pad_token_id in config.json: the embedding would take it as padding_idx,
            # whose row fine-tuning never updates (generation_config.json has it)
            config.update(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"])
    if mhar.enabled:
        config = hf_config.mhar_hf_config(config, mhar)

    out = Path(out).absolute()
    tmp, lock = prepare_output(out, overwrite, inputs)  # the lock: held until published or cleaned up
    try:
        if (source_hf / "config.json").is_file():
            hf_io.copy_auxiliary(source_hf, tmp)
        if tokenizer_files is not None:
            hf_io.write_tokenizer(tokenizer_files, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if generation is not None:
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if not (tmp / "generation_config.json").is_file():
            hf_io.write_generation_config({**config, **ids}, tmp)
        (tmp / "README.md").write_text(model_card(config, found, common))
        _write_hf_tensors(found, model_cfg, mhar, stored, target, tmp, max_shard_bytes, allow_nonfinite)
        if mhar.enabled:
            hf_io.copy_remote_code(tmp)
        hf_io.set_file_modes(tmp)
        return publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written directory behind
        raise
    finally:
        lock.release()


def _source_config(source_hf: Path, hf_reference: Optional[Path],
                   common: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], str]:
    """(the source model's config.json, where it comes from), or ``(None, "")`` for a
    checkpoint that has no source model (trained from scratch)."""
    if (source_hf / "config.json").is_file():
        where = f"--hf-reference {hf_reference}/config.json" if hf_reference else f"{source_hf}/config.json"
        return hf_io.read_config(source_hf), where
    record = common.get("conversion") or {}
    if isinstance(record.get(SOURCE_CONFIG), dict):
        return record[SOURCE_CONFIG], f"{record.get('source')}/config.json, carried by the checkpoint"
    return None, ""


def _trained_changes(config: Dict[str, Any], model: GPTModelConfig, dtype: str,
                     dtype_chosen: bool) -> Tuple[Dict[str, Any], List[str]]:
    """The source ``config`` with what the checkpoint changed, and ``field old -> new (why)``
    for each: the dtype of the written tensors, and a context longer than the source's
    where the model trained on longer sequences. Everything else is the source's."""
    out, changes = dict(config), []
    why = "--dtype" if dtype_chosen else "the checkpoint's stored dtype"
    for key in ("torch_dtype", "dtype"):
        if key in out and out[key] != dtype:
            changes.append(f"{key} {out[key]!r} -> {dtype!r} ({why})")
            out[key] = dtype
    context = out.get("max_position_embeddings")
    if context is not None and model.seq_length > context:
        changes.append(f"max_position_embeddings {context} -> {model.seq_length} (trained at "
                       f"model.seq_length={model.seq_length})")
        out["max_position_embeddings"] = model.seq_length
    return out, changes


def _write_hf_tensors(found: Path, model_cfg: GPTModelConfig, mhar: MHARConfig, stored: torch.dtype,
                      target: torch.dtype, out_dir: Path, max_shard_bytes: int, allow_nonfinite: bool) -> None:
    """The checkpoint's tensors as HF safetensors shards in ``out_dir``, streamed: one stored
    tensor is read, converted and queued for its shard at a time, never the whole model."""
    from megatron_mhar.runtime import destroy

    started = _ensure_parallel_state(1, 1)
    try:
        chunk = build_model(model_cfg, mhar, stored, device="meta")
        writer = hf_io.ShardWriter(out_dir, max_shard_bytes)
        scale = target.itemsize / stored.itemsize
        # A new shard where the next stored tensor would overflow this one: at most one
        # shard's worth of tensors, or one stored tensor's, is held at a time.
        tensors = read_streamed(chunk, found, before_load=lambda n: writer.make_room(int(n * scale)))
        megatron = ((name, _finite(name, tensor.to(target), found, allow_nonfinite)) for name, tensor in tensors)
        for name, tensor in mapping.hf_tensors_streamed(megatron, model_cfg, mapping.Shapes.of(model_cfg), mhar):
            writer.add(name, tensor)
        writer.close()
    finally:
        if started:
            destroy()


def _finite(name: str, tensor: torch.Tensor, found: Path, allow: bool) -> torch.Tensor:
    weight_checks.check_finite(name, tensor, str(found), allow)
    return tensor


# ---------------------------------------------------------------- local ranks


# What a rank raises for bad input; the parent re-raises it as the same type.
INPUT_ERRORS = (ValueError, FileNotFoundError, FileExistsError, UserError)


def _rank_main(rank: int, world: int, port: int, fn, args, errors, parent: int) -> None:
    lifetime.die_with_parent(parent)  # a conversion killed by any signal takes its ranks along
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        fn(*args)
    except BaseException as err:
        kind = next((k for k in INPUT_ERRORS if isinstance(err, k)), None)
        errors.put((rank, traceback.format_exc(), kind, str(err)))
        raise SystemExit(1)


def spawn(fn, world: int, *args, timeout: float = 24 * 3600.0, grace: float = 10.0) -> None:
    """Run ``fn(*args)`` on ``world`` local gloo ranks; raise the failure that explains the others.

    When one rank fails, the others fail too once their peer is gone (or wait in a
    collective): they get ``grace`` seconds to report, then are stopped. A rank's
    bad-input error (:data:`INPUT_ERRORS`) is re-raised as that type, whichever rank
    reported first; anything else as a ``RuntimeError`` with the rank's traceback.
    """
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    from megatron_mhar.runtime import free_port

    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, fn, args, errors, os.getpid()), daemon=False)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    failures = []
    try:
        while any(p.is_alive() for p in procs) and not failures and time.monotonic() < deadline:
            try:
                failures.append(errors.get(timeout=0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and errors.empty():
                    failures.append((dead[0], f"exited with code {procs[dead[0]].exitcode}", None, ""))
        if failures:
            stop = time.monotonic() + grace
            for proc in procs:
                proc.join(timeout=max(0.0, stop - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive() and (failures or time.monotonic() >= deadline):
                proc.terminate()
        for proc in procs:
            proc.join()
    while not errors.empty():
        failures.append(errors.get())
    named = [f for f in failures if f[2] is not None]
    if named:
        rank, _, kind, message = named[0]
        raise kind(f"conversion rank {rank} of {world}: {message}")
    if failures:
        rank, text = failures[0][:2]
        raise RuntimeError(f"conversion rank {rank} of {world} failed:\n{text}")
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"conversion ranks exited with codes {[p.exitcode for p in procs]}")
