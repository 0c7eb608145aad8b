#!/usr/bin/env python
"""Convert a Hugging Face Llama / Qwen3 checkpoint (safetensors) into a Megatron
distributed checkpoint with MHAR routing parameters, loadable by megatron_mhar.train.

    python checkpoint_tools/hf_to_mcore_mhar.py --hf-dir Llama-3.1-8B --out ckpt/llama8b_delta \
        --variant delta --tp 2 --pp 2 --seq-length 4096

With --tp/--pp above 1 it starts tp*pp local CPU (gloo) processes itself, or runs as
the ranks of a torchrun/srun launch of exactly tp*pp processes. The checkpoint loads
at any TP/PP layout. The output directory is written beside --out under
.tmp.<name> and renamed into place only when complete.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, type=Path, help="HF model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    parser.add_argument("--variant", choices=("none", "full", "block", "delta"),
                        help="routing variant (default: an MHAR export's, from its config.json, or an "
                             "earlier export's mhar_config.json)")
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
    parser.add_argument("--spec", choices=("local", "transformer_engine"), help="model.spec recorded for training")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="stored dtype (default: the HF tensors' dtype)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)

    from megatron_mhar.conversion.convert import hf_to_mcore, plan_import

    mhar = {k: v for k, v in dict(num_heads=args.num_heads, block_size=args.block_size,
                                  delta_block_layers=args.delta_block_layers,
                                  logit_scale=args.logit_scale).items() if v is not None}
    model = {k: v for k, v in dict(attention_backend=args.attention_backend, spec=args.spec).items()
             if v is not None}
    try:
        plan = plan_import(
            args.hf_dir, args.out, args.variant, tp=args.tp, pp=args.pp, dtype=args.dtype,
            seq_length=args.seq_length, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            overwrite=args.overwrite, mhar_overrides=mhar, model_overrides=model,
        )
        out = hf_to_mcore(plan)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        parser.exit(2, f"error: {err}\n")
    print(f"wrote {out} ({plan.mhar.variant}, {plan.dtype}); recipes continuing from it use the "
          f"model/mhar sections of {out}/iter_0000000/train_config.yaml and "
          f"checkpoint.load={out}, checkpoint.load_model_only=true")
    return 0


if __name__ == "__main__":
    sys.exit(main())
