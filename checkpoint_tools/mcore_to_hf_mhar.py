#!/usr/bin/env python
"""Convert a Megatron distributed checkpoint (converted or trained with megatron_mhar)
back to a Hugging Face directory.

    python checkpoint_tools/mcore_to_hf_mhar.py --ckpt runs/cpt/checkpoints --out hf_out

variant none: a plain LlamaForCausalLM / Qwen3ForCausalLM directory that transformers
loads. MHAR variants: an MHARLlamaForCausalLM / MHARQwen3ForCausalLM directory (routing
parameters in its safetensors, its modeling files beside them) that
AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True) loads, with or without
megatron_mhar installed. The output directory is written aside and renamed into place
only when complete.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)

    from megatron_mhar.conversion.convert import mcore_to_hf

    try:
        out = mcore_to_hf(args.ckpt, args.out, overwrite=args.overwrite, dtype=args.dtype,
                          hf_reference=args.hf_reference, tokenizer=args.tokenizer)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        parser.exit(2, f"error: {err}\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
