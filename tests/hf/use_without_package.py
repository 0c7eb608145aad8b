"""Use HF exports as a transformers / PEFT user would, where megatron_mhar cannot be imported.

    python use_without_package.py DIRS_JSON TOKENS_PT OUT_PT

DIRS_JSON maps a name to an export directory. Every directory is loaded with
``trust_remote_code=True`` and used the ways ``USES`` lists; OUT_PT gets ``{name: {use:
what it gave}}`` (tensors, class names, texts; the tests judge them), plus ``"imported"``,
the megatron_mhar / mhar_kernels modules that ended up imported (none, unless the block
below failed), and ``"old_transformers"``, the error loading an MHAR config gives under a
transformers version older than the models support. Run by ``tests/hf/conftest.py``.
"""

import importlib.abc
import importlib.util
import json
import sys
import warnings

BLOCKED = ("megatron_mhar", "mhar_kernels")
PROMPTS = ["def main():\n    return", "import os\nimport sys\n\nclass Point:"]  # two lengths: padded


class BlockPackage(importlib.abc.MetaPathFinder):
    """Refuses this repository's packages, however they are installed (path, editable finder)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


def load(directory, **kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32, **kwargs)


def plain(directory, tokens):
    """The logits of the default forward, and the classes that computed them."""
    import torch

    model = load(directory).eval()
    with torch.no_grad():
        out = model(tokens)
        as_tuple = model(tokens, labels=tokens, return_dict=False)
    return {"logits": out.logits, "class": type(model).__name__, "module": type(model).__module__,
            "tuple": [type(as_tuple).__name__, len(as_tuple), as_tuple[0], as_tuple[1]]}


def cache(directory, tokens):
    """Logits of the prompt's last 8 tokens decoded after its first ones, through a cache
    passed as past_key_values (transformers' usual spelling) and as cache, and of the last 8
    alone (what an ignored cache gives)."""
    import torch
    from transformers import DynamicCache

    model = load(directory).eval()
    split = tokens.shape[1] - 8
    with torch.no_grad():
        results = {"alone": model(tokens[:, split:]).logits}
        for spelling in ("past_key_values", "cache"):
            kv = DynamicCache(config=model.config)
            model(tokens[:, :split], **{spelling: kv})
            results[spelling] = model(tokens[:, split:], **{spelling: kv}).logits
    return results


def outputs(directory, tokens):
    """hidden_states and (eager) attentions, and the base model's output through AutoModel."""
    import torch
    from transformers import AutoModel

    model = load(directory, attn_implementation="eager").eval()
    base = AutoModel.from_pretrained(directory, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True, output_attentions=True)
        base_out = base(tokens)
        base_tuple = base(tokens, return_dict=False)
    return {"hidden_states": list(out.hidden_states), "attentions": list(out.attentions),
            "base_class": type(base).__name__, "base_last": base_out.last_hidden_state,
            "base_tuple": [type(base_tuple).__name__, base_tuple[0]]}


def checkpointing(directory, tokens):
    """Every parameter's gradient of one training loss without activation checkpointing and
    with it (reentrant and not), and how often the MLPs ran in each (forward and backward)."""
    model = load(directory).train()
    calls = []

    def counted(run):  # counted in forward itself: a recomputation need not call module hooks
        def forward(*args):
            calls.append(1)
            return run(*args)
        return forward

    for layer in model.model.layers:
        layer.mlp.forward = counted(layer.mlp.forward)
    grads, runs = {}, {}
    for mode in ("off", "reentrant", "non_reentrant"):
        if mode == "off":
            model.gradient_checkpointing_disable()
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
        model.zero_grad()
        calls.clear()
        model(tokens, labels=tokens).loss.backward()
        grads[mode] = {name: p.grad.clone() for name, p in model.named_parameters()}
        runs[mode] = len(calls)
    return {"grads": grads, "mlp_runs": runs}


def trainer(directory, tokens, out_dir):
    """Two steps of transformers' Trainer with gradient_checkpointing=True: the losses and
    whether every parameter moved."""
    import torch
    from transformers import Trainer, TrainingArguments

    model = load(directory)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    args = TrainingArguments(out_dir, max_steps=2, per_device_train_batch_size=2, gradient_checkpointing=True,
                             learning_rate=1e-2, report_to=[], save_strategy="no", logging_steps=1,
                             use_cpu=True, disable_tqdm=True)
    rows = [{"input_ids": row, "labels": row} for row in tokens]
    state = Trainer(model=model, args=args, train_dataset=rows).train()
    moved = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    return {"loss": state.training_loss, "moved": moved, "params": sorted(before)}


def prefix_tuning(directory, tokens):
    """PEFT prefix tuning: logits without and with the prefix, and the loss over 6 steps
    in which only the prefix trains."""
    import torch
    from peft import PrefixTuningConfig, get_peft_model

    model = load(directory).eval()
    with torch.no_grad():
        base = model(tokens).logits
    torch.manual_seed(0)
    tuned = get_peft_model(model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with torch.no_grad():
        prefixed = tuned(input_ids=tokens).logits
    optimizer = torch.optim.Adam([p for p in tuned.parameters() if p.requires_grad], lr=3e-2)
    losses = []
    for _ in range(6):
        loss = tuned(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"base": base, "prefixed": prefixed, "losses": losses,
            "trainable": sorted(n for n, p in tuned.named_parameters() if p.requires_grad)}


def text_pipeline(directory):
    """A batched greedy pipeline("text-generation") with the export's own tokenizer and
    generation config (nothing set by hand)."""
    from transformers import pipeline

    generate = pipeline("text-generation", model=directory, trust_remote_code=True, batch_size=2, device="cpu")
    results = generate(PROMPTS, max_new_tokens=6, do_sample=False, return_full_text=False)
    return {"texts": [r[0]["generated_text"] for r in results], "padding_side": generate.tokenizer.padding_side}


def old_transformers(directory):
    """The error an MHAR config gives where transformers is older than the models support."""
    import transformers
    from transformers import AutoConfig

    real, transformers.__version__ = transformers.__version__, "5.22.2"
    try:
        AutoConfig.from_pretrained(directory, trust_remote_code=True)
    except ImportError as err:
        return {"type": type(err).__name__, "message": str(err)}
    finally:
        transformers.__version__ = real
    return {"type": None, "message": ""}


def main(dirs_json: str, tokens_pt: str, out_pt: str) -> None:
    sys.meta_path.insert(0, BlockPackage())
    for name in BLOCKED:
        try:
            importlib.util.find_spec(name)
        except ModuleNotFoundError:
            continue
        raise SystemExit(f"{name} is importable; the block failed")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renamed methods and arguments

    import tempfile

    import torch

    tokens = torch.load(tokens_pt)
    with open(dirs_json) as f:
        dirs = json.load(f)
    results = {}
    routed = [d for d in dirs.values() if json.load(open(f"{d}/config.json")).get("auto_map")]
    if routed:  # first: the config module must not have been imported yet
        results["old_transformers"] = old_transformers(routed[0])
    for name, directory in dirs.items():
        with tempfile.TemporaryDirectory() as scratch:
            results[name] = {
                "plain": plain(directory, tokens), "cache": cache(directory, tokens),
                "outputs": outputs(directory, tokens), "checkpointing": checkpointing(directory, tokens),
                "trainer": trainer(directory, tokens, scratch), "prefix_tuning": prefix_tuning(directory, tokens),
                "pipeline": text_pipeline(directory),
            }
    results["imported"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    torch.save(results, out_pt)


if __name__ == "__main__":
    main(*sys.argv[1:])
