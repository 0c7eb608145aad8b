"""Train a GPT (plain or MHAR) with Megatron-Core from a YAML recipe.

    mhar-train [RECIPE] [dotted.key=value ...]      (or: python -m megatron_mhar.train ...)
    torchrun --nproc-per-node 8 -m megatron_mhar.train pretrain_350m_mhar

RECIPE is a YAML file or the name of a recipe in ``recipes/`` (installed with the
package; default: ``smoke_cpu``, tiny models on the embedded corpus). ``--print-config``
shows the resolved config and exits. The run writes ``runs/<run.name>/``: config.yaml,
metrics.jsonl, tensorboard/, checkpoints/ and summary.json; it resumes from its own
checkpoints when restarted.

A configuration error (a recipe that does not load, data that does not fit, a
checkpoint of another model) prints its message alone and exits with code 2.
"""

import argparse
import os
import sys
from typing import Optional, Sequence

from megatron_mhar.quiet import quiet_known_warnings


def _epilog() -> str:
    """The recipes with their descriptions, and where the keys are documented."""
    from megatron_mhar.training import schema
    from megatron_mhar.training.recipes import DEFAULT_RECIPE, RECIPES_DIR, recipe_description, recipe_names

    names = recipe_names()
    width = max(len(n) for n in names)
    lines = [f"recipes (in {RECIPES_DIR}; or give a path to a YAML file):"]
    for name in names:
        default = " [default]" if name == DEFAULT_RECIPE else ""
        lines.append(f"  {name:<{width}}  {recipe_description(name)}{default}")
    lines += [
        "",
        "keys: RECIPE --print-config prints every key with its resolved value; each key is",
        f"documented in {schema.__file__}.",
        "overrides: dotted.key=value, a list as data.paths=[a,b] (one item: data.paths=a).",
    ]
    return "\n".join(lines)


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def main(argv: Optional[Sequence[str]] = None) -> int:
    quiet_known_warnings()
    parser = argparse.ArgumentParser(
        prog="mhar-train",
        description=__doc__.split("\n")[0],
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", nargs="?", default=None, help="recipe path or name (default smoke_cpu)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:  # only overrides were given
        recipe, overrides = None, [recipe] + overrides

    from megatron_mhar.training.signals import StopSignal

    # Installed first: a SIGTERM/SIGUSR1 during imports, data preparation or checkpoint
    # loading is then honoured at the first step (save and exit) instead of killing the rank.
    with StopSignal() as stop:
        from megatron_mhar.training.launch_checks import validate_launch
        from megatron_mhar.training.recipes import load_config, to_yaml

        try:
            cfg = load_config(recipe, overrides)
            if not args.print_config:  # data, tokenizer, directories: before any process group
                validate_launch(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        except ValueError as err:
            parser.exit(2, f"config error: {err}\n")
        if args.print_config:
            print(to_yaml(cfg), end="")
            return 0

        from megatron_mhar.errors import ConfigError
        from megatron_mhar.training.loop import run

        command = " ".join([parser.prog, *(argv if argv is not None else sys.argv[1:])])
        stop.stop_message = (f"stopped at once; `{command}` resumes from the last checkpoint in "
                             f"{cfg.run.dir / 'checkpoints'}")
        try:
            run(cfg, stop=stop)
        except ConfigError as err:  # found once the run started (a checkpoint of another model)
            parser.exit(2, f"config error: {err}\n" if _is_rank0() else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
