"""Thin, version-checked, reversible adapters onto real engines.

Each module imports its engine lazily (inside the functions that need it) and only its own engine:

* :mod:`moealign.patches.hf` - transformers MoE models: route recording during ``generate()``,
  routing replay during training forwards, kept-set capture.
"""

from ._version import UnsupportedEngineError, check_engine_version

__all__ = ["UnsupportedEngineError", "check_engine_version"]
