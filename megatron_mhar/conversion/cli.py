"""``mhar-convert``: checkpoint conversion between Hugging Face and Megatron MHAR models.

    mhar-convert hf-to-mcore --hf-dir Llama-3.1-8B --out ckpt/llama8b_delta \\
        --variant delta --tp 2 --pp 2 --seq-length 4096
    mhar-convert mcore-to-hf --ckpt runs/cpt/checkpoints --out hf_out

``hf-to-mcore`` turns a Hugging Face Llama / Qwen3 checkpoint (safetensors) into a
Megatron distributed checkpoint with MHAR routing parameters, which ``mhar-train`` loads
(``checkpoint.load``). With ``--tp``/``--pp`` above 1 it starts tp*pp local CPU (gloo)
processes itself, or runs as the ranks of a torchrun/srun launch of exactly tp*pp
processes; the checkpoint loads at any TP/PP layout.

``mcore-to-hf`` turns a Megatron distributed checkpoint (converted or trained) back into
a Hugging Face directory: for variant ``none`` a plain LlamaForCausalLM /
Qwen3ForCausalLM directory that transformers loads; for MHAR variants the model's MHAR
form (:mod:`megatron_mhar.hf`): the routing parameters in its own safetensors and the model
code beside them, loaded with ``trust_remote_code=True``.

Both write their output beside ``--out`` and rename it into place only when complete.
Both refuse weights holding NaN or Inf, naming the tensor, unless ``--allow-nonfinite``; a
converted checkpoint carries a manifest of its files, and ``mcore-to-hf`` verifies the
checkpoint it reads against its manifest.
The commands are argument parsing and one library call
(:mod:`megatron_mhar.conversion.convert`); a failure caused by input or environment
(bad input, an output another conversion is writing, a full disk) exits with code 2 and
its message alone (:mod:`megatron_mhar.errors`). ``mcore-to-hf`` names the checkpoint
and step it converts, and a newer one it passed over as damaged.
``checkpoint_tools/hf_to_mcore_mhar.py`` and ``checkpoint_tools/mcore_to_hf_mhar.py``
run the same two commands from a checkout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_mhar.errors import command_errors

DESCRIPTION = "Convert checkpoints between Hugging Face and Megatron MHAR models."
HF_TO_MCORE_HELP = "Hugging Face Llama / Qwen3 (safetensors) -> Megatron distributed checkpoint with MHAR"
MCORE_TO_HF_HELP = "Megatron distributed checkpoint (converted or trained) -> Hugging Face directory"
NONFINITE_HELP = "convert weights holding NaN or Inf as they are (default: refuse, naming the tensor)"


def add_hf_to_mcore_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``hf-to-mcore``."""
    from megatron_mhar.models.gpt_config import SPECS

    parser.add_argument("--hf-dir", required=True, type=Path, help="HF model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    parser.add_argument("--variant", choices=("none", "full", "block", "delta"),
                        help="routing variant (default: an MHAR export's, from its config.json)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks used to convert")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks used to convert")
    parser.add_argument("--num-heads", type=int, help="mhar.num_heads (default 8)")
    parser.add_argument("--block-size", type=int, help="mhar.block_size, in sublayers (block variant)")
    parser.add_argument("--delta-block-layers", type=int, help="mhar.delta_block_layers (delta variant, default 4)")
    parser.add_argument("--logit-scale", type=float, help="mhar.logit_scale (default 1)")
    parser.add_argument("--seq-length", type=int, help="model.seq_length (default: max_position_embeddings)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="Megatron pads the vocabulary to a multiple of this times TP")
    parser.add_argument("--attention-backend", choices=("sdpa", "megatron"), help="model.attention_backend")
    parser.add_argument("--spec", choices=SPECS, help="model.spec recorded for training")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="stored dtype (default: the HF tensors' dtype)")
    parser.add_argument("--tokenizer", type=Path,
                        help="directory of the tokenizer the model trains with (tokenizer.json), checked "
                             "against the model's vocabulary and carried for the export (default: the one "
                             "in --hf-dir, if any)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--allow-nonfinite", action="store_true", help=NONFINITE_HELP)


def add_mcore_to_hf_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mcore-to-hf``."""
    parser.add_argument("--ckpt", required=True, type=Path,
                        help="checkpoint directory, or a directory with a 'latest' file")
    parser.add_argument("--out", required=True, type=Path, help="HF directory to create")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="dtype of the written tensors (default: as stored)")
    parser.add_argument("--hf-reference", type=Path,
                        help="HF directory whose config.json and tokenizer files to use "
                             "(default: those the converted checkpoint carries)")
    parser.add_argument("--tokenizer", type=Path,
                        help="directory holding the tokenizer.json to ship with the model (e.g. the "
                             "builtin tokenizer a run trained with); default: --hf-reference's")
    parser.add_argument("--max-shard-size", default="2GiB",
                        help="largest safetensors shard, in bytes or as 5GB / 500MiB (default 2GiB; the "
                             "export holds one shard's tensors in memory)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--allow-nonfinite", action="store_true", help=NONFINITE_HELP)


def run_hf_to_mcore(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Plan and run the import."""
    from megatron_mhar.conversion.convert import hf_to_mcore, plan_import

    mhar = {k: v for k, v in dict(num_heads=args.num_heads, block_size=args.block_size,
                                  delta_block_layers=args.delta_block_layers,
                                  logit_scale=args.logit_scale).items() if v is not None}
    model = {k: v for k, v in dict(attention_backend=args.attention_backend, spec=args.spec).items()
             if v is not None}
    plan = plan_import(
        args.hf_dir, args.out, args.variant, tp=args.tp, pp=args.pp, dtype=args.dtype,
        seq_length=args.seq_length, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        overwrite=args.overwrite, mhar_overrides=mhar, model_overrides=model,
        allow_nonfinite=args.allow_nonfinite, tokenizer=args.tokenizer,
    )
    out = hf_to_mcore(plan)
    print(f"wrote {out} ({plan.mhar.variant}, {plan.dtype}); recipes continuing from it use the "
          f"model/mhar sections of {out}/iter_0000000/train_config.yaml and "
          f"checkpoint.load={out}, checkpoint.load_model_only=true")
    return 0


def run_mcore_to_hf(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the export, naming the checkpoint it reads (and a newer one passed over as damaged)."""
    from transformers.utils.hub import convert_file_size_to_int

    from megatron_mhar.checkpoint.format import LATEST, read_common_state, require_checkpoint
    from megatron_mhar.conversion.convert import mcore_to_hf

    size = args.max_shard_size
    try:
        max_shard_bytes = int(size) if size.isdigit() else convert_file_size_to_int(size)
    except ValueError:
        parser.error(f"--max-shard-size {size!r}: give a number of bytes or a size such as 5GB or 500MiB")
    found = require_checkpoint(args.ckpt)  # verified here once: mcore_to_hf reads it as found
    source = f"{found} (step {read_common_state(found).get('iteration')})"
    latest = Path(args.ckpt) / LATEST
    named = latest.read_text(errors="replace").strip() if latest.is_file() else None
    if named is not None and named != found.name:
        source += f"; the newer {named} that {latest} names fails verification and was passed over"
    print(f"converting {source}", flush=True)
    out = mcore_to_hf(found, args.out, overwrite=args.overwrite, dtype=args.dtype,
                      hf_reference=args.hf_reference, tokenizer=args.tokenizer,
                      allow_nonfinite=args.allow_nonfinite, max_shard_bytes=max_shard_bytes, verify="off")
    print(f"wrote {out} from {source}")
    return 0


COMMANDS = {
    "hf-to-mcore": (HF_TO_MCORE_HELP, add_hf_to_mcore_arguments, run_hf_to_mcore),
    "mcore-to-hf": (MCORE_TO_HF_HELP, add_mcore_to_hf_arguments, run_mcore_to_hf),
}
"""Subcommand -> (one-line help, its options, what it runs)."""


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``mhar-convert {hf-to-mcore,mcore-to-hf} ...``."""
    parser = argparse.ArgumentParser(prog="mhar-convert", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, title="commands")
    for name, (summary, add_arguments, _) in COMMANDS.items():
        add_arguments(commands.add_parser(name, help=summary, description=summary))
    args = parser.parse_args(argv)
    with command_errors(f"{parser.prog} {args.command}"):
        return COMMANDS[args.command][2](args, parser)


def command_main(name: str, prog: str, argv: Optional[Sequence[str]] = None) -> int:
    """One subcommand as a program of its own (the ``checkpoint_tools/`` scripts)."""
    summary, add_arguments, run = COMMANDS[name]
    parser = argparse.ArgumentParser(prog=prog, description=summary)
    add_arguments(parser)
    args = parser.parse_args(argv)
    with command_errors(prog):
        return run(args, parser)


if __name__ == "__main__":
    sys.exit(main())
