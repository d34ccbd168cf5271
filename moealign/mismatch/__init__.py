"""The zero-staleness mismatch test (``moealign mismatch``): rollout engine vs training engine.

Modules: :mod:`moealign.mismatch.engines` (the engine interfaces, the transformers and Megatron engines, the
registry), :mod:`moealign.mismatch.rollout` (the configuration and the rollout record),
:mod:`moealign.mismatch.scoring` (the trainer's forwards and per-token scores),
:mod:`moealign.mismatch.report` (metrics per run, the report, its tables, ``--fail-above``) and
:mod:`moealign.mismatch.run` (:func:`run_mismatch` and :func:`run_sweep`, which chain the three steps).
"""

from .engines import (
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    register_rollout_engine,
    register_train_engine,
)
from .report import (
    METRIC_NAMES,
    RUN_NAMES,
    check_fail_above,
    format_sweep,
    format_table,
    parse_fail_above,
)
from .rollout import MismatchConfig
from .run import SWEEP, run_mismatch, run_sweep

__all__ = [
    "METRIC_NAMES",
    "RUN_NAMES",
    "ROLLOUT_ENGINES",
    "SWEEP",
    "TRAIN_ENGINES",
    "MismatchConfig",
    "check_fail_above",
    "format_sweep",
    "format_table",
    "parse_fail_above",
    "register_rollout_engine",
    "register_train_engine",
    "run_mismatch",
    "run_sweep",
]
