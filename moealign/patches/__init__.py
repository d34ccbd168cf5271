"""Thin, version-checked, reversible adapters onto real engines.

Each module imports its engine lazily (inside the functions that need it) and only its own engine:

* :mod:`moealign.patches.hf` - transformers MoE models: route recording during ``generate()``,
  routing replay during training forwards, kept-set capture.
* :mod:`moealign.patches.megatron` - Megatron-core: reversible CPU mode, replay safety audit, a driver
  for Megatron's own RouterReplay (binding by layer number, sequence-first targets, counters).
"""

from ._version import UnsupportedEngineError, check_engine_version

__all__ = ["UnsupportedEngineError", "check_engine_version"]
