#!/usr/bin/env python
"""Convert a Megatron distributed checkpoint (converted or trained with megatron_mhar)
back to a Hugging Face directory: ``mhar-convert mcore-to-hf`` as a script (where the
package is installed, as the README's set-up leaves it).

    python checkpoint_tools/mcore_to_hf_mhar.py --ckpt runs/cpt/checkpoints --out hf_out

variant none: a plain LlamaForCausalLM / Qwen3ForCausalLM directory that transformers
loads. MHAR variants: an MHARLlamaForCausalLM / MHARQwen3ForCausalLM directory (routing
parameters in its safetensors, its modeling files beside them) that
AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True) loads, with or without
megatron_mhar installed. The options and behaviour are those of
:mod:`megatron_mhar.conversion.cli`.
"""

import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_mhar.conversion.cli import command_main


def main(argv: Optional[Sequence[str]] = None) -> int:
    return command_main("mcore-to-hf", Path(__file__).name, argv)


if __name__ == "__main__":
    sys.exit(main())
