"""What the benchmarks share: the environment a report records, the JSON report, timing
helpers, and the cases they run (the model sizes, read from the recipes; the compared
models; the routing shapes of each size).

Every benchmark runs from the checkout's root as a module (``python -m
benchmarks.bench_routing``), so ``benchmarks`` and ``megatron_mhar`` import from there;
the maintainers' tools (``tools/perf``) import this module, never another benchmark.

Reports of record live in ``benchmarks/results/<benchmark>/<device>.json`` (``default_out``):
<benchmark> is the script's name without ``bench_``, <device> the GPU model in lower case
with the GPU count where more than one runs (``h200``, ``h200x2``), ``cpu``, or
``analytic`` for the byte models that run nothing. The benchmarks rewrite their report
after each case, so that a run cut short keeps what it measured. ``write_json`` writes a
temporary file beside the report and renames it over the report, so a run that fails
while writing leaves the previous report, never a truncated one; ``check_out`` refuses a
path that could never be written (a directory, a path under a file) before any work, as
an argparse error (exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron_mhar.files import nearest_existing, write_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# ------------------------------------------------------------------ environment

OPTIONAL = ("triton", "transformer_engine", "transformers", "safetensors")
"""Packages whose versions a report records where the benchmark imported them."""


def versions(*packages: str) -> Dict[str, str]:
    """The versions of Python, torch, numpy and Megatron-Core, of ``packages`` (imported
    here) and of the :data:`OPTIONAL` packages this process imported, and CUDA's where
    torch has it."""
    import importlib

    import numpy
    import torch
    from megatron.core import package_info

    out = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
           "megatron_core": package_info.__version__}
    for name in packages:
        importlib.import_module(name)
    for name in (*OPTIONAL, *packages):
        if name in sys.modules:
            out[name] = getattr(sys.modules[name], "__version__", None) or getattr(sys.modules[name], "VERSION")
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


def machine(device: str = "cuda") -> Dict[str, object]:
    """The CPU's model and cores, the host's memory, and with ``device`` cuda the GPU's name,
    count and streaming multiprocessors."""
    cpu = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    out: Dict[str, object] = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform()}
    try:
        import psutil

        out["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    import torch

    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), sms=props.multi_processor_count)
    return out


def environment(device: str = "cuda") -> Dict[str, object]:
    """:func:`versions` and :func:`machine`, as one report field."""
    return {**versions(), **machine(device)}


def commit() -> str:
    """The checkout's HEAD commit (``unknown`` outside a git checkout)."""
    result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def shown(path) -> str:
    """``path`` relative to the checkout when inside it (a report names no checkout)."""
    relative = os.path.relpath(os.path.abspath(path), ROOT)
    return str(path) if relative.startswith("..") else relative


def command(module: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command line that ran ``module`` (``python -m benchmarks.bench_x ARGS``)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", "-m", module, *args])


# ------------------------------------------------------------------ the JSON report


def device_name(gpus: int = 1, device: str = "cuda") -> str:
    """``h200`` (``h200x2`` for ``gpus`` > 1): the CUDA device's model in lower case, or
    ``cpu`` where ``device`` is cpu or there is no CUDA device."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0)
    model = re.search(r"\b([A-Z]+\d+\w*)\b", name.replace("NVIDIA", ""))
    tag = (model.group(1) if model else name).lower().replace(" ", "_")
    return tag if gpus <= 1 else f"{tag}x{gpus}"


def default_out(benchmark: str, device: str) -> str:
    """``benchmarks/results/<benchmark>/<device>.json``, the report of record's path."""
    return str(RESULTS / benchmark / f"{device}.json")


def check_out(parser, path, option="--out"):
    """``parser.error`` unless ``path`` (None: no report) can be written as a file: it is no
    directory and its nearest existing parent is a writable directory (``write_json``
    makes the missing ones)."""
    if path is None:
        return
    target = Path(path).absolute()
    if target.is_dir():
        parser.error(f"{option} {path} is a directory; give the report's file name, e.g. {Path(path) / 'report.json'}")
    parent = nearest_existing(target.parent)
    if not parent.is_dir():
        parser.error(f"{option} {path}: {parent} is a file, not a directory; give a path under a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        parser.error(f"{option} {path}: {parent} is not writable; give a path under a writable directory")


def write_json(path, data, indent=1):
    """Writes ``data`` to ``path`` (making its directories) whole (``write_atomic``): the
    file at ``path`` is always a whole report, the previous one or this one."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(data, indent=indent) + "\n")


# ------------------------------------------------------------------ timing

QUANTILES = [0.5, 0.2, 0.8]


def bench(fn, graph=False):
    """``triton.testing.do_bench`` quantiles (median, 20%, 80%) in ms; with ``graph`` the
    calls replay from a CUDA graph, which times the kernels without the host's launch cost."""
    import triton.testing

    if graph:
        ms = triton.testing.do_bench_cudagraph(fn, rep=100, quantiles=QUANTILES)
    else:
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=QUANTILES)
    return {"ms": ms[0], "ms_p20": ms[1], "ms_p80": ms[2]}


def copy_bandwidth():
    """Device-to-device copy of 1 GiB of bf16 (bytes read + written / time): the ceiling
    the routing kernels' bandwidth is a fraction of."""
    import torch

    x = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    r = bench(lambda: y.copy_(x))
    r["bytes"] = 2 * x.numel() * x.element_size()
    r["gbps"] = r["bytes"] / r["ms"] / 1e6
    return r


# ------------------------------------------------------------------ cases: sizes

SIZE_RECIPES = {
    "100m": "pretrain_100m_baseline",
    "350m": "pretrain_350m_baseline",
    "1b": "pretrain_1b_baseline",
    "8b": "cpt_8b_mhar_delta",
}
"""The model sizes, each a recipe: its ``model`` section and batch sizes (recipes/base/scale_*.yaml,
recipes/base/cpt_8b.yaml) are the one definition of the size."""

PAPER_SIZES = ("100m", "350m", "1b")
"""The sizes trained from scratch (the paper's pretraining configurations)."""

def size_config(size: str, overrides: Sequence[str] = ()):
    """The TrainConfig of ``size`` (:data:`SIZE_RECIPES`), ``overrides`` applied last."""
    from megatron_mhar.training.recipes import load_config

    if size not in SIZE_RECIPES:
        raise ValueError(f"unknown size {size!r}; choose from {list(SIZE_RECIPES)}")
    return load_config(SIZE_RECIPES[size], list(overrides))


# ------------------------------------------------------------------ cases: routing shapes

EPS = 1e-6
HEADS = 8


@dataclasses.dataclass
class SiteCase:
    """One routing site: ``n`` sources of width ``d`` over ``t`` tokens (micro-batch x sequence)."""

    name: str
    d: int
    n: int
    t: int

    def inputs(self, heads: int, tau: float, dtype=None):
        """(sources [n, t, d], query, norm weight [d], output gradient [t, d]) on CUDA in
        ``dtype`` (bf16), seeded; the query scaled so that the logits spread over ``heads``."""
        import torch

        dtype = dtype or torch.bfloat16
        kw = dict(device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
        sources = torch.randn(self.n, self.t, self.d, **kw).to(dtype)
        query = (2.0 / (tau * (self.d // heads) ** 0.5) * torch.randn(self.d, **kw)).to(dtype)
        norm_weight = (1 + 0.3 * torch.randn(self.d, **kw)).to(dtype)
        grad_out = torch.randn(self.t, self.d, **kw).to(dtype)
        return sources, query, norm_weight, grad_out

    def bytes(self, heads: int, dtype=None) -> Dict[str, Dict[str, int]]:
        """Per direction, the bytes the site must move at the least (``min``: each input read
        once, each output written once) and those the fused kernels move (``moved``: the
        backward reads the sources twice)."""
        import torch

        es = torch.tensor([], dtype=dtype or torch.bfloat16).element_size()
        src, tok = self.n * self.t * self.d * es, self.t * self.d * es
        lse = self.t * heads * 4
        return {
            "fwd": {"min": src + tok, "moved": src + tok + lse},
            "bwd": {"min": src + tok + src, "moved": 2 * src + tok + lse + src},
            "fwd+bwd": {"min": 2 * src + 2 * tok, "moved": 4 * src + 2 * tok + 2 * lse},
            # route_backward reads and writes an fp32 gradient buffer (8 bytes per element).
            "bwd_history": {"min": src + tok + 4 * src, "moved": 2 * src + tok + lse + 4 * src},
        }


@dataclasses.dataclass
class StepCase:
    """Every routing site of one micro-batch of a model: ``layers`` decoder layers of width
    ``d`` over ``t`` tokens, the ``full`` variant (sites 1..2L+1, site j over j sources) or
    ``delta`` (2L sites over a null source, the embedding and the completed blocks of
    ``block_layers`` decoder layers)."""

    name: str
    d: int
    layers: int
    t: int
    variant: str
    block_layers: int = 4

    def site_sources(self) -> List[int]:
        sites = 2 * self.layers
        if self.variant == "full":
            return list(range(1, sites + 2))
        return [2 + (j - 1) // (2 * self.block_layers) for j in range(1, sites + 1)]

    @classmethod
    def of_size(cls, size: str, name: str, sequences: Optional[int] = None) -> "StepCase":
        """The case of ``size``'s recipe: its width, depth, variant (``delta`` for the 8B
        continued pretraining, else ``full``) and ``sequences`` (default: its micro-batch)
        of its sequence length."""
        cfg = size_config(size)
        model, mhar = cfg.model, cfg.mhar
        variant = "delta" if mhar.variant == "delta" else "full"
        tokens = (sequences or cfg.training.micro_batch_size) * model.seq_length
        return cls(name, model.hidden_size, model.num_layers, tokens, variant, mhar.delta_block_layers)


def step_cases() -> List[StepCase]:
    """The routing of one micro-batch at each size: the paper's three full-variant models at
    their micro-batches, and the 8B delta model over two sequences (its recipe's micro-batch
    is one; the routing figures of record were measured over two)."""
    cases = [StepCase.of_size(size, size.upper()) for size in PAPER_SIZES]
    return cases + [StepCase.of_size("8b", "8B-delta", sequences=2)]


def site_cases(steps: Sequence[StepCase]) -> List[SiteCase]:
    """Each model's widest site (its final site; the 8B delta model's last), then the paper's
    models' sites of nine sources."""
    widest = [SiteCase(f"{c.name}-final" if c.variant == "full" else c.name, c.d, max(c.site_sources()), c.t)
              for c in steps]
    return widest + [SiteCase(f"{c.name}-N9", c.d, 9, c.t) for c in steps if c.variant == "full"]


# ------------------------------------------------------------------ cases: the compared models


def _recipe_routing(recipe: str):
    """The ``mhar`` section of ``recipes/<recipe>.yaml`` (a recipe file that states its routing)."""
    import yaml

    from megatron_mhar.models.mhar_config import MHARConfig
    from megatron_mhar.training.recipes import RECIPES_DIR

    return MHARConfig(**yaml.safe_load((RECIPES_DIR / f"{recipe}.yaml").read_text())["mhar"])


def _variant(name: str):
    """The routing of ``recipes/base/variant_<name>.yaml``, as every recipe of it trains."""
    return _recipe_routing(f"base/variant_{name}")


def _models():
    baseline, attnres, mhar = _variant("baseline"), _variant("attnres"), _variant("mhar")
    lookahead = dict(routing_schedule="lookahead")
    replace = dataclasses.replace
    return {
        "baseline": baseline,
        "attnres": attnres,
        "mhar": mhar,
        "mhar_lookahead": replace(mhar, **lookahead),
        # The same schedule with phase 1 on one kernel family each (the default, ``auto``,
        # picks per group and direction), and AttnRes on the lookahead schedule.
        "mhar_lookahead_row_loop": replace(mhar, **lookahead, lookahead_kernels="row_loop"),
        "mhar_lookahead_tensor_cores": replace(mhar, **lookahead, lookahead_kernels="tensor_cores"),
        "attnres_lookahead": replace(attnres, **lookahead),
        # Blocks of 8 sublayers (4 decoder layers): the variant the Attention Residuals paper
        # reports under 4% overhead for.
        "mhar_block": replace(mhar, variant="block", block_size=8),
        # The same blocks as lookahead groups: each block's sites read its completed blocks once.
        "mhar_block_lookahead": replace(mhar, variant="block", block_size=8, **lookahead),
        # The continued-pretraining routing (delta, 8 heads, blocks of 4 decoder layers).
        "mhar_delta": _recipe_routing(SIZE_RECIPES["8b"]),
        # The same with each delta block's sites as one lookahead group.
        "mhar_delta_lookahead": replace(_recipe_routing(SIZE_RECIPES["8b"]), **lookahead),
    }


MODELS = _models()
"""The models the training benchmarks compare, by name: the recipes' three routings
(``recipes/base/variant_{baseline,attnres,mhar}.yaml``) and schedules of them."""


def parse_model(spec: str):
    """A ``--models`` entry: a name of :data:`MODELS`, optionally followed by ``@field=value``
    overrides of its MHARConfig (``mhar_lookahead@lookahead_group=8``), so that variants of
    one schedule can be timed in the same run. Unknown names, fields or values raise
    ValueError naming them."""
    from megatron_mhar.models.mhar_config import MHARConfig

    name, *overrides = spec.split("@")
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {list(MODELS)}")
    fields = {f.name: f for f in dataclasses.fields(MHARConfig)}
    changes = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise ValueError(f"model {spec!r}: override {item!r} is not field=value with a field "
                             f"of MHARConfig ({', '.join(fields)})")
        default = getattr(MODELS[name], key)
        if isinstance(default, bool):
            if value not in ("true", "false"):
                raise ValueError(f"model {spec!r}: {key} takes true or false, got {value!r}")
            changes[key] = value == "true"
        elif isinstance(default, (int, float)):
            try:
                changes[key] = type(default)(value)
            except ValueError:
                kind = "an integer" if isinstance(default, int) else "a number"
                raise ValueError(f"model {spec!r}: {key} takes {kind}, got {value!r}") from None
        else:
            changes[key] = value
    return dataclasses.replace(MODELS[name], **changes)  # MHARConfig validates the values


# ------------------------------------------------------------------ cases: training data

QWEN3_TOKENIZER_VOCAB = 151669
"""Tokens of the Qwen3 tokenizer the GPU recipes name (``model.vocab_size`` 151,936 is its
padded embedding)."""

STAND_IN_EOD = "<|endoftext|>"
"""The end-of-document token of the stand-in tokenizer, its last id."""


class StandInTokenizer:
    """What Megatron's GPTDataset and the indexed writer read from a tokenizer, for
    ``vocab_size`` tokens: each document's text is its length, its ids random below
    ``vocab_size`` (the writer appends the end-of-document id, ``vocab_size - 1``)."""

    def __init__(self, vocab_size: int, seed: int = 0):
        import numpy

        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.path = ""
        self._rng = numpy.random.default_rng(seed)

    @property
    def unique_identifiers(self) -> dict:
        return {"class": type(self).__name__, "vocab_size": self.vocab_size, "eod": self.eod}

    def tokenize_batch(self, texts):
        return [self._rng.integers(0, self.vocab_size, int(text) - 1).tolist() for text in texts]


def stand_in_tokenizer_dir(directory: Path, vocab_size: int) -> str:
    """A Hugging Face tokenizer directory the training driver reads (``data.tokenizer``) for
    data of :class:`StandInTokenizer` ids: a word-level vocabulary of ``vocab_size`` tokens
    whose last is :data:`STAND_IN_EOD`. It maps ids, not text."""
    from tokenizers import Tokenizer, models

    vocab = {f"<{i}>": i for i in range(vocab_size - 1)}
    vocab[STAND_IN_EOD] = vocab_size - 1
    path = Path(directory) / "tokenizer"
    path.mkdir(parents=True, exist_ok=True)
    Tokenizer(models.WordLevel(vocab, unk_token=STAND_IN_EOD)).save(str(path / "tokenizer.json"))
    return str(path)


def write_dataset(prefix: str, tokenizer: StandInTokenizer, tokens: int, seq_length: int, seed: int,
                  min_documents: int = 1) -> dict:
    """``prefix.{bin,idx}`` of at least ``tokens`` random ids in at least ``min_documents``
    documents of [seq/4, 2 seq) tokens (end-of-document included), written by the project's
    indexed writer."""
    import numpy

    from megatron_mhar.data.indexed_writer import write_indexed_dataset

    rng = numpy.random.default_rng(seed)
    low, high = max(2, seq_length // 4), 2 * seq_length
    lengths = rng.integers(low, high, max(tokens // low + 1, min_documents))
    count = int(numpy.searchsorted(numpy.cumsum(lengths), tokens)) + 1
    lengths = lengths[: max(count, min_documents)]
    return write_indexed_dataset((str(n) for n in lengths), tokenizer, prefix)
