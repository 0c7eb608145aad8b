"""A user's own recipe, outside the package: it includes packaged recipes by name, as the
command line names them, and ``--print-config`` shows the configuration that then runs."""

from __future__ import annotations

import pytest
import yaml

from tests.helpers import TINY


def test_a_user_recipe_including_smoke_cpu_by_name_trains(tmp_path, embedded_dir, single_process):
    from megatron_mhar import train

    recipe = tmp_path / "mine" / "smoke_cpu.yaml"  # its own name too: the include is the packaged one
    recipe.parent.mkdir()
    recipe.write_text("# my smoke run\ninclude: smoke_cpu\ntraining:\n  train_iters: 2\n")
    assert train.main([str(recipe), *TINY, "training.train_iters=2", "optimizer.lr_warmup_iters=1",
                       f"run.output_dir={tmp_path}", f"data.embedded_dir={embedded_dir}", "eval.interval=0",
                       "logging.tensorboard=false", "checkpoint.save_at_end=false"]) == 0
    assert yaml.safe_load((tmp_path / "smoke_cpu" / "config.yaml").read_text())["training"]["train_iters"] == 2


def test_an_include_beside_the_recipe_comes_first(tmp_path):
    from megatron_mhar.training.recipes import load_config

    (tmp_path / "smoke_cpu.yaml").write_text("run:\n  name: beside\n")
    (tmp_path / "mine.yaml").write_text("include: [smoke_cpu]\n")
    assert load_config(str(tmp_path / "mine.yaml")).run.name == "beside"
    (tmp_path / "mine.yaml").write_text("include: [pretrain_100m_mhar]\n")
    assert load_config(str(tmp_path / "mine.yaml")).run.name == "pretrain_100m_mhar"


def test_an_include_found_nowhere_names_both_places(tmp_path):
    from megatron_mhar.training.recipes import RECIPES_DIR, load_config

    (tmp_path / "mine.yaml").write_text("include: smoke_gpu\n")
    with pytest.raises(ValueError) as err:
        load_config(str(tmp_path / "mine.yaml"))
    assert f"included recipe 'smoke_gpu' is neither {tmp_path}/smoke_gpu nor {RECIPES_DIR}/smoke_gpu[.yaml]" in str(
        err.value)


def test_print_config_is_the_configuration_that_runs(tmp_path, embedded_dir, single_process, capsys):
    """Field by field, ``--print-config`` equals the ``config.yaml`` the driver writes for
    the run, ``model.spec: auto`` included (resolved for this machine, said in a comment)."""
    from megatron_mhar import train

    args = ["smoke_cpu", *TINY, "model.spec=auto", "training.train_iters=2", "optimizer.lr_warmup_iters=1",
            f"run.output_dir={tmp_path}", f"data.embedded_dir={embedded_dir}", "eval.interval=0",
            "logging.tensorboard=false", "checkpoint.save_at_end=false"]
    assert train.main([*args, "--print-config"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# model.spec auto -> local")
    printed = yaml.safe_load(out)
    assert train.main(args) == 0
    ran = yaml.safe_load((tmp_path / "smoke_cpu" / "config.yaml").read_text())
    assert list(printed) == list(ran)
    for section in ran:
        for key in ran[section]:
            assert printed[section][key] == ran[section][key], f"{section}.{key}"


def test_print_config_shows_the_defaults_it_applies(capsys):
    """No hidden defaults: the split and the decay a recipe leaves out are printed as applied."""
    from megatron_mhar import train

    assert train.main(["smoke_cpu", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["split"] == "98,2,0"
    assert printed["optimizer"]["lr_decay_iters"] == printed["training"]["train_iters"]
    assert train.main(["smoke_cpu", "data.valid_paths=[/data/valid]", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["split"] is None  # held-out data: all of paths trains
