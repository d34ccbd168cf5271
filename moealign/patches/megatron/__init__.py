"""Megatron-core adapter: CPU mode, replay safety audit, and a driver for Megatron's own RouterReplay.

Megatron-core (0.16.1 to 0.19.x) already has routing replay (``moe_enable_routing_replay=True``: one
``RouterReplay`` per ``TopKRouter``, a process-global list, actions RECORD / REPLAY_FORWARD /
REPLAY_BACKWARD). This module drives it instead of re-implementing it, and guards its traps:

* :func:`audit_replay_config` raises :class:`ReplayConfigError` naming the field for every config in
  which replay would silently not apply or be wrong (router fusion, sinkhorn / quantile routing,
  capacity-factor token dropping, replay disabled).
* :class:`RouterReplayDriver` binds targets to the live routers of one model by ``layer_number`` (never
  by position in the global list; MTP routers excluded), converts a record's routes into each router's
  int64 ``[local_tokens, k]`` targets, sets the actions, and counts what every router consumed.
* :func:`enable_megatron_cpu` is an explicit, reversible CPU mode (tests, the embedded default); it
  refuses to activate when CUDA is present unless the caller pins the CPU (``pin_cpu=True``;
  ``init_single_process(device="cpu")``).
* :func:`enable_megatron_without_te` binds the names 0.16.1's ``moe_utils`` defines only with
  transformer-engine (its router GEMM raises ``NameError`` without them); the CPU mode nests it and
  :func:`init_single_process` applies it on CUDA (nothing to patch where transformer-engine imported).
"""

from __future__ import annotations

from ...errors import ReplayConfigError, ReplayError, UnsupportedEngineError
from ...routing_replay.layouts import (
    local_route_rows,
    packed_source_rows,
    pad_packed_rows,
)
from .audit import audit_layers, audit_replay_config, check_record_layers
from .replay import RouterReplayDriver, moe_routers, replay_routing
from .version import SUPPORTED_MEGATRON, megatron_version
from .vocab_parallel import kept_logprob
from .world import (
    TE_ONLY_MOE_UTILS_NAMES,
    MegatronCPUMode,
    MegatronWithoutTE,
    MegatronWorld,
    enable_megatron_cpu,
    enable_megatron_without_te,
    init_single_process,
    megatron_cpu_mode_active,
)

__all__ = [
    "SUPPORTED_MEGATRON",
    "ReplayConfigError",
    "ReplayError",
    "UnsupportedEngineError",
    "megatron_version",
    "enable_megatron_cpu",
    "MegatronCPUMode",
    "enable_megatron_without_te",
    "MegatronWithoutTE",
    "TE_ONLY_MOE_UTILS_NAMES",
    "MegatronWorld",
    "init_single_process",
    "megatron_cpu_mode_active",
    "audit_layers",
    "audit_replay_config",
    "check_record_layers",
    "moe_routers",
    "RouterReplayDriver",
    "replay_routing",
    "local_route_rows",
    "packed_source_rows",
    "pad_packed_rows",
    "kept_logprob",
]
