"""Known-harmless warnings of Megatron-Core and torch, silenced when the package is imported.

``megatron_mhar/__init__.py`` calls :func:`quiet_known_warnings` before any module of the
package imports Megatron (which prints some of these at import), so every command and a
user's script that builds a model print only their own output. Each entry
below silences one message, matched by its text, that says nothing about the user's run;
every other warning (ours, Megatron's, torch's) still shows. A ``-W`` option or
``PYTHONWARNINGS`` means the user chose what to see: then nothing is silenced.

pytest silences the same warnings through ``setup.cfg`` (``filterwarnings``).
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from typing import NamedTuple, Type


class KnownWarning(NamedTuple):
    category: Type[Warning]
    message: str
    """Regular expression matched against the start of the message."""
    why: str
    """Why it is harmless here."""


KNOWN_WARNINGS = (
    KnownWarning(
        UserWarning,
        r"Transformer Engine and Apex are not installed",
        "Megatron falls back to torch's optimizers and multi-tensor ops, the path this package "
        "uses without Transformer Engine (model.spec: local); Apex is never a dependency",
    ),
    KnownWarning(
        UserWarning,
        r"Apex is not installed\. Falling back to Torch Norm",
        "the local layer spec uses torch's norms by design",
    ),
    KnownWarning(
        UserWarning,
        r"full scope is deprecated",
        "Megatron's own default of TransformerConfig.cuda_graph_scope; its per-layer CUDA "
        "graphs are refused here and full-iteration graphs do not read the field",
    ),
    KnownWarning(
        FutureWarning,
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        "Megatron's distributed checkpointing builds torch ShardedTensors internally; the "
        "checkpoint format is Megatron's and does not change",
    ),
    KnownWarning(
        FutureWarning,
        r"`load_state_dict` is deprecated and will be removed in future versions",
        "Megatron's checkpoint loader calls torch.distributed.checkpoint.load_state_dict, "
        "which torch renamed to load (same behaviour)",
    ),
)
"""Python warnings silenced by :func:`quiet_known_warnings`."""


class KnownLogMessage(NamedTuple):
    logger: str
    message: str
    """Regular expression matched against the start of the formatted message."""
    why: str


KNOWN_LOG_MESSAGES = (
    KnownLogMessage(
        "megatron.core.rerun_state_machine",
        r"Implicit initialization of Rerun State Machine!",
        "Megatron-LM's rerun machine (re-running a step to tell a hardware fault from a bug) "
        "is not used here; Megatron's schedules create it, disabled, on first use",
    ),
    KnownLogMessage(
        "megatron.core.rerun_state_machine",
        r"RerunStateMachine initialized in mode RerunMode\.DISABLED",
        "the same machine saying that it is disabled",
    ),
)
"""Log records (Megatron logs these at WARNING level) dropped by :func:`quiet_known_warnings`."""


class _DropKnownMessages(logging.Filter):
    """Drops the records of one logger whose message starts with a known pattern."""

    def __init__(self, patterns):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


def quiet_known_warnings() -> bool:
    """Silence :data:`KNOWN_WARNINGS` and :data:`KNOWN_LOG_MESSAGES` in this process.

    Call it before Megatron is imported (some messages are emitted at import). Returns
    whether the filters are in place: ``False`` when ``-W`` or ``PYTHONWARNINGS`` set the
    warning policy. Calling it again changes nothing.
    """
    if sys.warnoptions:
        return False
    for known in KNOWN_WARNINGS:  # an identical filter replaces itself: no duplicates
        warnings.filterwarnings("ignore", message=known.message, category=known.category)
    by_logger = {}
    for known in KNOWN_LOG_MESSAGES:
        by_logger.setdefault(known.logger, []).append(known.message)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownMessages) for f in logger.filters):
            logger.addFilter(_DropKnownMessages(patterns))
    return True
