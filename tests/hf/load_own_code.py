"""Load an export with ``trust_remote_code=True`` where megatron_mhar.hf's classes are registered.

    python -m tests.hf.load_own_code DIR OUT_PT

Writes ``{"model_module", "route_module", "route_file", "logits"}``: the module of the
model class, and the module and file of the ``depth_route`` it routes with. Run by
``tests/hf/test_transformers_user.py`` in a process of its own, so that the remote code
lands in that test's ``HF_HOME``.
"""

import inspect
import sys

import torch

from tests.helpers import export_token_batch


def main(directory: str, out_pt: str) -> None:
    import megatron_mhar.hf  # noqa: F401  (the package's classes registered, which transformers prefers)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32).eval()
    route = sys.modules[type(model).__module__].depth_route
    with torch.no_grad():
        logits = model(export_token_batch()).logits
    torch.save({"model_module": type(model).__module__, "route_module": route.__module__,
                "route_file": inspect.getsourcefile(route), "logits": logits}, out_pt)


if __name__ == "__main__":
    main(*sys.argv[1:])
