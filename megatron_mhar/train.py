"""Train a GPT (plain or MHAR) with Megatron-Core from a YAML recipe.

    mhar-train [RECIPE] [dotted.key=value ...]      (or: python -m megatron_mhar.train ...)
    torchrun --nproc-per-node 8 -m megatron_mhar.train pretrain_350m_mhar

RECIPE is a YAML file or the name of a recipe in ``recipes/`` (installed with the
package; default: ``smoke_cpu``, tiny models on the embedded corpus). ``--print-config``
shows the resolved config and exits. The run writes ``runs/<run.name>/``: config.yaml,
metrics.jsonl, tensorboard/, checkpoints/ and summary.json; it resumes from its own
checkpoints when restarted.

A failure caused by input or environment (a recipe that does not load, data that does
not fit, a checkpoint of another model, a full disk, a run directory in use) prints its
message alone and exits with code 2 (:mod:`megatron_mhar.errors`).
"""

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence


def _epilog() -> str:
    """The recipes with their descriptions, and where the keys are documented."""
    from megatron_mhar.training import sections
    from megatron_mhar.training.recipes import DEFAULT_RECIPE, RECIPES_DIR, recipe_description, recipe_names

    names = recipe_names()
    width = max(len(n) for n in names)
    lines = [f"recipes (in {RECIPES_DIR}; or give a path to a YAML file):"]
    for name in names:
        default = " [default]" if name == DEFAULT_RECIPE else ""
        lines.append(f"  {name:<{width}}  {recipe_description(name)}{default}")
    lines += [
        "",
        "keys: RECIPE --print-config prints every key with the value that runs; each key is",
        f"documented in {sections.__file__}",
        f"(model: {Path(sections.__file__).parents[1] / 'models' / 'gpt_config.py'}, mhar: mhar_config.py beside it).",
        "overrides: dotted.key=value, a list as data.paths=[a,b] (one item: data.paths=a).",
    ]
    return "\n".join(lines)


def _resume_hint(cfg, command: str) -> str:
    """What stopping the run now loses, and how it goes on: from its newest checkpoint, or
    from step 0 where none was saved yet (read when asked, at a Ctrl-C)."""
    from megatron_mhar.checkpoint.format import published_checkpoints

    saved = published_checkpoints(cfg.checkpoint_dir)
    if saved:
        return f"the steps since {saved[0]} are lost; `{command}` resumes from it"
    start = f"the weights of {cfg.checkpoint.load}" if cfg.checkpoint.load else "step 0"
    return f"no checkpoint was saved yet, so every step is lost; `{command}` starts again from {start}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``mhar-train``; ``argv`` None: this process is the command (``sys.argv``)."""
    parser = argparse.ArgumentParser(
        prog="mhar-train",
        description=__doc__.split("\n")[0],
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", nargs="?", default=None, help="recipe path or name (default smoke_cpu)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--check", action="store_true",
                        help="check the config and its files for a launch of $WORLD_SIZE ranks (not this "
                             "machine's devices: a login node checks a GPU job), print it and exit")
    args = parser.parse_args(argv)
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:  # only overrides were given
        recipe, overrides = None, [recipe] + overrides

    from megatron_mhar.errors import command_errors
    from megatron_mhar.training.signals import StopSignal

    # Installed first: a SIGTERM/SIGUSR1 during imports, data preparation or checkpoint
    # loading is then honoured at the first step (save and exit) instead of killing the rank.
    stop = StopSignal()
    try:
        with stop, command_errors(parser.prog):
            from megatron_mhar.training.launch_checks import validate_launch, with_resolved_spec
            from megatron_mhar.training.recipes import load_config, to_yaml

            cfg = load_config(recipe, overrides)
            if args.check:  # the Slurm launchers' check before srun (slurm/launch.sh)
                validate_launch(cfg, int(os.environ.get("WORLD_SIZE", "1")), this_machine=False)
                print(to_yaml(cfg), end="")
                return 0
            if args.print_config:  # what runs here: model.spec auto resolved as the driver does
                print(to_yaml(with_resolved_spec(cfg, say=lambda line: print(f"# {line}"))), end="")
                return 0
            validate_launch(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before any process group

            from megatron_mhar.training.loop import run

            command = " ".join([parser.prog, *(argv if argv is not None else sys.argv[1:])])
            stop.resume_hint = lambda: _resume_hint(cfg, command)
            run(cfg, stop=stop)
    finally:
        if argv is None:
            # What is left is the interpreter's exit (the checkpoint writer's helper is shut
            # down then): a Ctrl-C now stops at once with the way back, instead of a
            # traceback from an exit callback.
            signal.signal(signal.SIGINT, stop.exit_at_once)
    return 0


if __name__ == "__main__":
    sys.exit(main())
