#!/usr/bin/env python
"""Convert a Hugging Face Llama / Qwen3 checkpoint (safetensors) into a Megatron
distributed checkpoint with MHAR routing parameters: ``mhar-convert hf-to-mcore`` as a
script (where the package is installed, as the README's set-up leaves it).

    python checkpoint_tools/hf_to_mcore_mhar.py --hf-dir Llama-3.1-8B --out ckpt/llama8b_delta \
        --variant delta --tp 2 --pp 2 --seq-length 4096

The options and behaviour are those of :mod:`megatron_mhar.conversion.cli`.
"""

import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_mhar.conversion.cli import command_main


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main("hf-to-mcore", Path(__file__).name, argv)


if __name__ == "__main__":
    sys.exit(main())
