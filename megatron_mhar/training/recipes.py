"""Recipes: YAML files read into a :class:`~megatron_mhar.training.schema.TrainConfig`.

A recipe is a YAML mapping whose top-level keys are the sections of
:class:`~megatron_mhar.training.schema.TrainConfig`. Two mechanisms keep recipes free of
copy-paste:

* ``include: [base/pretrain.yaml, smoke_cpu, ...]`` merges other recipes first, in order;
  the including file's own keys win. An include is found as the command line finds a
  recipe: a file beside the including file first (``.yaml`` may be left out), then a
  packaged recipe of that name, so a user's recipe anywhere includes ``smoke_cpu``.
  Mappings merge key by key, lists and scalars replace.
* Command-line overrides ``dotted.key=value`` (``model.num_layers=4``,
  ``data.paths=[a,b]``) apply last; the value is parsed as YAML except for string
  fields, which take the text verbatim. A list field also takes a single value, a
  one-item list (``data.paths=/data/corpus_text_document``).

The first line of a recipe, a comment, is its one-line description
(:func:`recipe_description`, listed by ``mhar-train --help``).

The recipes of the paper's runs live in the checkout's ``recipes/`` and install as package
data (``megatron_mhar/recipes``), so a bare name such as ``smoke_cpu`` resolves in a
checkout and in an installed copy alike. Loading is strict (:func:`~megatron_mhar.training.schema.from_dict`)
and happens before any process group starts.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from megatron_mhar.training.schema import TrainConfig, field_hint, from_dict


def _recipes_dir() -> Path:
    """The recipes: the package data ``megatron_mhar.recipes`` of an install (for an editable
    install, the checkout's ``recipes/``), or, where the package is imported from a checkout
    that is not installed (``python -m`` from its root), the ``recipes/`` beside it."""
    try:
        root = resources.files("megatron_mhar.recipes")
    except ModuleNotFoundError:
        root = Path(__file__).resolve().parents[2] / "recipes"
        if not (root / "smoke_cpu.yaml").is_file():
            raise RuntimeError(
                f"megatron_mhar's recipes are neither installed (megatron_mhar.recipes) nor in a "
                f"checkout beside it ({root}); reinstall the package (pip install .)"
            ) from None
    if not isinstance(root, Path):  # includes resolve against the including file's directory
        raise RuntimeError(
            f"megatron_mhar's recipes are not files on disk ({root!r}); install the package "
            f"into a directory (pip install), not as a zip archive"
        )
    return root


RECIPES_DIR = _recipes_dir()
"""The recipes (``recipes/`` of the checkout, installed as ``megatron_mhar/recipes``); a bare
name such as ``smoke_cpu`` resolves here."""

DEFAULT_RECIPE = "smoke_cpu"
"""Recipe used when the command line names none: tiny models on the embedded corpus."""

INCLUDE_KEY = "include"


def recipe_names() -> List[str]:
    """Names of the packaged recipes (``base/`` holds the pieces they include, not recipes)."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def recipe_description(name: str) -> str:
    """The one-line description of a recipe: its first line, a comment (``""`` if none)."""
    with open(resolve_recipe(name), encoding="utf-8") as f:
        first = f.readline().strip()
    return first.lstrip("#").strip() if first.startswith("#") else ""


def resolve_recipe(recipe: str) -> Path:
    """A recipe path, or a bare name (``smoke_cpu``) looked up in the packaged recipes."""
    path = Path(recipe).expanduser()
    if path.is_file():
        return path
    for candidate in (RECIPES_DIR / recipe, RECIPES_DIR / f"{recipe}.yaml"):
        if candidate.is_file():
            return candidate
    known = recipe_names()
    close = difflib.get_close_matches(Path(recipe).stem, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known recipes: {', '.join(known)}"
    raise ValueError(f"recipe {recipe!r} is neither a file nor a name in {RECIPES_DIR}{hint}")


class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    silently: a second ``training:`` section would drop every key of the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value!r} appears twice in one mapping; keep one",
                        key_node.start_mark,
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path, chain: Tuple[Path, ...] = ()) -> Dict[str, Any]:
    """One recipe file with its includes merged in (depth first, in order)."""
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(p.name for p in chain + (path,))
        raise ValueError(f"recipe include cycle: {cycle}")
    with open(path) as f:
        try:
            raw = yaml.load(f, Loader=_RecipeLoader)
        except yaml.YAMLError as err:
            raise ValueError(f"not valid YAML: {err}") from None
    if raw is None:  # an empty file would silently run the defaults
        raise ValueError(
            f"{path} is empty (or only comments); write the recipe's sections, or "
            f"'{INCLUDE_KEY}: <recipe.yaml>' to run another recipe as it is"
        )
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a recipe must be a YAML mapping, got {type(raw).__name__}")
    includes = raw.pop(INCLUDE_KEY, [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ValueError(f"{path}: '{INCLUDE_KEY}' must be a recipe (path or name) or a list of them")
    merged: Dict[str, Any] = {}
    for include in includes:
        target = _resolve_include(include, path)
        merged = _deep_merge(merged, _read_yaml(target, chain + (path,)))
    return _deep_merge(merged, raw)


def _resolve_include(include: str, including: Path) -> Path:
    """An included recipe as the command line finds one: a file beside the including file
    (the name, or the name with ``.yaml``), else a packaged recipe of that name."""
    places = (including.parent, RECIPES_DIR)
    for place in places:
        for candidate in (place / include, place / f"{include}.yaml"):
            # a user's smoke_cpu.yaml including smoke_cpu means the packaged one, not itself
            if candidate.is_file() and candidate.resolve() != including:
                return candidate.resolve()
    looked = " nor ".join(str(place / include) for place in places)
    raise ValueError(f"{including}: included recipe {include!r} is neither {looked}[.yaml]")


def _deep_merge(base: Dict[str, Any], top: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _is_str_field(hint) -> bool:
    if hint is str:
        return True
    args = typing.get_args(hint)
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and str in args


def _is_list_field(hint) -> bool:
    """``List[...]`` or ``Optional[List[...]]``; not a union that also takes a scalar
    (``Union[int, List[int]]``: one value there is the scalar, not a list of one)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return all(_is_list_field(arg) for arg in args)
    return typing.get_origin(hint) is list


def apply_overrides(raw: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    """Apply ``dotted.key=value`` overrides to a recipe dict (returns a new dict); an error
    names the override (``command line override optimizer.lr=abc: ...``)."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        try:
            _apply_override(raw, item)
        except ValueError as err:
            raise ValueError(f"{_overrides_named([item])}: {err}") from None
    return raw


def _overrides_named(items: Sequence[str]) -> str:
    return f"command line override{'s' if len(items) > 1 else ''} {' '.join(items)}"


def _apply_override(raw: Dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError("must look like dotted.key=value")
    hint = field_hint(key)
    if dataclasses.is_dataclass(hint):
        raise ValueError(f"{key!r} names a whole section; set one of its keys")
    if _is_str_field(hint) and text.strip() not in ("null", "~"):
        value: Any = text
    else:
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"cannot parse the value: {err}") from None
        if _is_list_field(hint) and value is not None and not isinstance(value, (list, dict)):
            value = [value]  # data.paths=/data/corpus: a list of one
    node = raw
    *parents, leaf = key.split(".")
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[leaf] = value


def load_config(recipe: Optional[str] = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a recipe (a path or a packaged recipe's name), merge includes and overrides.
    An invalid configuration is said of what made it so: the recipe file, or the command
    line overrides without which it would not arise (:func:`_caused_by`)."""
    path = resolve_recipe(recipe or DEFAULT_RECIPE)
    try:
        recipe_raw = _read_yaml(path)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    raw = apply_overrides(recipe_raw, overrides)
    try:
        return from_dict(raw, source=str(path))
    except ValueError as err:
        message = str(err).removeprefix(f"{path}: ")
        culprits = _caused_by(recipe_raw, list(overrides), message)
        raise ValueError(f"{_overrides_named(culprits) if culprits else path}: {message}") from None


def _caused_by(recipe_raw: Dict[str, Any], overrides: List[str], message: str) -> List[str]:
    """The overrides behind the configuration error ``message``: none where the recipe alone
    fails the same check; else those without which it passes that check, or failing that
    (one key set twice) those without which its values differ; else all of them."""

    def error(items: Sequence[str]) -> Optional[str]:
        try:
            from_dict(apply_overrides(recipe_raw, items), source="")
        except ValueError as err:
            return str(err).removeprefix(": ")
        return None

    def check(text: Optional[str]) -> Optional[str]:
        """The message without its values: which check failed, whatever the numbers."""
        return None if text is None else re.sub(r"'[^']*'|-?\d+(\.\d+)?(e[-+]?\d+)?", "#", text)

    if not overrides or check(error(())) == check(message):
        return []
    without = [error(overrides[:i] + overrides[i + 1:]) for i in range(len(overrides))]
    return ([item for item, other in zip(overrides, without) if check(other) != check(message)]
            or [item for item, other in zip(overrides, without) if other != message] or overrides)


def to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML (what the run directory records)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

