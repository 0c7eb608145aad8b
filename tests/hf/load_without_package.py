"""Load HF exports with ``trust_remote_code=True`` where megatron_mhar cannot be imported.

    python load_without_package.py DIRS_JSON TOKENS_PT OUT_PT

DIRS_JSON maps a name to an export directory. Writes ``{name: {"logits", "class",
"module"}}`` plus ``"imported"``, the megatron_mhar / mhar_kernels modules that ended up
imported (none, unless the block below failed). Run by ``tests/hf/conftest.py``.
"""

import importlib.abc
import importlib.util
import json
import sys

BLOCKED = ("megatron_mhar", "mhar_kernels")


class BlockPackage(importlib.abc.MetaPathFinder):
    """Refuses this repository's packages, however they are installed (path, editable finder)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


def main(dirs_json: str, tokens_pt: str, out_pt: str) -> None:
    sys.meta_path.insert(0, BlockPackage())
    for name in BLOCKED:
        try:
            importlib.util.find_spec(name)
        except ModuleNotFoundError:
            continue
        raise SystemExit(f"{name} is importable; the block failed")

    import torch
    from transformers import AutoModelForCausalLM

    tokens = torch.load(tokens_pt)
    results = {}
    with open(dirs_json) as f:
        dirs = json.load(f)
    for name, directory in dirs.items():
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32)
        with torch.no_grad():
            logits = model.eval()(tokens).logits
        results[name] = {"logits": logits, "class": type(model).__name__, "module": type(model).__module__}
    results["imported"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    torch.save(results, out_pt)


if __name__ == "__main__":
    main(*sys.argv[1:])
