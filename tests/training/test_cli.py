"""``mhar-train`` (megatron_mhar.train.main): help, errors before and after the start, --print-config."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_mhar.training.recipes import recipe_description, recipe_names
from tests.helpers import TINY

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_the_recipes_and_where_keys_are_documented(capsys):
    from megatron_mhar.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in recipe_names():
        assert re.search(rf"^  {name} +{re.escape(recipe_description(name))}", out, re.MULTILINE), name
    assert "smoke_cpu" in out and "[default]" in out
    assert "--print-config prints every key" in out and "training/sections.py" in out and "models/gpt_config.py" in out
    assert "data.paths=[a,b] (one item: data.paths=a)" in out


def test_every_recipe_has_a_one_line_description():
    """The first line of each packaged recipe says what it is and where it runs."""
    for name in recipe_names():
        description = recipe_description(name)
        assert 20 <= len(description) <= 80, (name, description)
        assert description.endswith(("GPU, bf16.", "GPU.", "CPU, no download.")), (name, description)


@pytest.mark.parametrize(
    "override, message",
    [
        pytest.param("model.hiden_size=64", "did you mean 'model.hidden_size'", id="config"),
        # launch checks (data, tokenizer, directories) report the same way
        pytest.param("data.paths=[/nonexistent/corpus]", "mhar-train: error: data.paths[0]='/nonexistent/corpus'", id="launch"),
        # a single path is a list of one
        pytest.param("data.paths=/nonexistent/corpus", "mhar-train: error: data.paths[0]='/nonexistent/corpus'", id="one-path"),
    ],
)
def test_main_reports_errors_before_starting(capsys, override, message):
    import torch

    from megatron_mhar.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["smoke_cpu", override])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_print_config(capsys):
    from megatron_mhar.train import main

    assert main(["model.num_layers=3", "data.paths=/data/corpus", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "num_layers: 3" in out and "name: smoke_cpu" in out
    assert "paths:\n  - /data/corpus\n" in out


def test_print_config_shows_no_library_warnings():
    """What a newcomer runs first prints the config and nothing else."""
    done = subprocess.run([sys.executable, "-m", "megatron_mhar.train", "--print-config"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and "name: smoke_cpu" in done.stdout
    assert done.stderr == ""


def test_a_checkpoint_of_another_model_exits_2_with_the_message_alone(tiny, capsys):
    """Resuming with a changed model: exit code 2 and one paragraph naming the differing
    fields, as for any other configuration error; no traceback."""
    from megatron_mhar.train import main
    from megatron_mhar.training.loop import run

    cfg = tiny("training.train_iters=3", "eval.interval=0", name="changed")
    run(cfg)
    capsys.readouterr()
    same = [f"run.output_dir={cfg.run.output_dir}", "run.name=changed", f"data.embedded_dir={cfg.data.embedded_dir}"]
    with pytest.raises(SystemExit) as exit_info:
        main(["smoke_cpu", *TINY, *same, "training.train_iters=4", "mhar.num_heads=2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mhar-train: error: checkpoint {cfg.checkpoint_dir / 'iter_0000003'} was written for a "
                          f"different model")
    assert "\n  mhar.num_heads: 4 (checkpoint) vs 2 (config)\n" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 4
    assert err.strip().splitlines()[-1] == "(MHAR_TRACEBACK=1 shows where it was raised)"
