"""The zero-staleness mismatch test (``moealign mismatch``): rollout engine vs training engine.

See :mod:`moealign.mismatch.run` for the runs and metrics, :mod:`moealign.mismatch.engines` for the
engine interfaces and registry.
"""

from .engines import (
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    register_rollout_engine,
    register_train_engine,
)
from .run import (
    METRIC_NAMES,
    RUN_NAMES,
    MismatchConfig,
    check_fail_above,
    format_table,
    parse_fail_above,
    run_mismatch,
)

__all__ = [
    "METRIC_NAMES",
    "RUN_NAMES",
    "ROLLOUT_ENGINES",
    "TRAIN_ENGINES",
    "MismatchConfig",
    "check_fail_above",
    "format_table",
    "parse_fail_above",
    "register_rollout_engine",
    "register_train_engine",
    "run_mismatch",
]
