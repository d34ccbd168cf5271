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
  refuses to activate when CUDA is present.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch

from ..routing_replay.routes import RouteError, validate_routes
from ._undo import AttributePatches
from ._version import UnsupportedEngineError, check_engine_version, engine_version

__all__ = [
    "SUPPORTED_MEGATRON",
    "ReplayConfigError",
    "ReplayCounterError",
    "megatron_version",
    "enable_megatron_cpu",
    "MegatronCPUMode",
    "MegatronWorld",
    "init_single_process",
    "audit_replay_config",
    "moe_routers",
    "RouterReplayDriver",
    "local_route_rows",
    "packed_source_rows",
    "pad_packed_rows",
    "kept_logprob",
]

SUPPORTED_MEGATRON = ">=0.16.1,<0.20"
_SKIPPING_ROUTING_TYPES = ("sinkhorn", "quantile_balancing")
_AUX_FROM_OWN_TOPK = ("aux_loss", "seq_aux_loss", "global_aux_loss")
_AUX_MODES = ("warn", "replayed", "own")


class ReplayConfigError(ValueError):
    """A Megatron config in which routing replay would silently not apply, or apply wrongly."""


class ReplayCounterError(RuntimeError):
    """A router did not consume exactly its replay targets."""


def megatron_version():
    """Import megatron.core and check its version against :data:`SUPPORTED_MEGATRON`."""
    _, version = engine_version("megatron.core", "moealign.patches.megatron needs megatron-core")
    check_engine_version("megatron-core", version, SUPPORTED_MEGATRON)
    return version


# --------------------------------------------------------------------------------------------------
# CPU mode
# --------------------------------------------------------------------------------------------------


class MegatronCPUMode(AttributePatches):
    """Undo handle of :func:`enable_megatron_cpu` (also a context manager)."""


def enable_megatron_cpu() -> MegatronCPUMode:
    """Let Megatron-core build and run models on CPU (gloo), reversibly.

    Patches, all undone by ``undo()``: ``torch.cuda.current_device`` returns ``"cpu"`` (Megatron moves
    router weights and rotary buffers to it); the tensor-parallel CUDA RNG tracker uses the CPU RNG;
    ``torch.cuda.get_rng_state`` / ``manual_seed`` map to the CPU ones; 0.16.1's ``moe_utils`` gets the
    names it only defines when transformer-engine imports (set to None, as 0.19 does itself).
    Raises RuntimeError when CUDA is available: the CPU mode is never active on a GPU machine.
    """
    if torch.cuda.is_available():
        raise RuntimeError("enable_megatron_cpu() refuses to run where CUDA is available; use the GPU")
    megatron_version()
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils

    mode = MegatronCPUMode()
    mode._set(torch.cuda, "current_device", lambda: "cpu")
    mode._set(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    mode._set(torch.cuda, "manual_seed", lambda seed: None)
    mode._set(mrandom, "_get_cuda_rng_state",
              lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    mode._set(mrandom, "_set_cuda_rng_state",
              lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
    for name in ("te_general_gemm", "fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss",
                 "fused_moe_aux_loss"):
        if not hasattr(moe_utils, name):
            mode._set(moe_utils, name, None)
    return mode


@dataclass
class MegatronWorld:
    """Undo handle of :func:`init_single_process`: tears down only what it set up."""

    cpu_mode: MegatronCPUMode | None = None
    owns_process_group: bool = False
    owns_parallel_state: bool = False
    init_file: str | None = None

    def close(self) -> None:
        import os

        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.owns_parallel_state:
            parallel_state.destroy_model_parallel()
            self.owns_parallel_state = False
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False
        if self.init_file and os.path.exists(self.init_file):
            os.unlink(self.init_file)
        if self.cpu_mode is not None:
            self.cpu_mode.undo()
            self.cpu_mode = None

    def __enter__(self) -> "MegatronWorld":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def init_single_process(seed: int = 1234) -> MegatronWorld:
    """A one-process Megatron world (TP = PP = CP = EP = 1) for the mismatch harness and benchmarks.

    On CPU it enables :func:`enable_megatron_cpu` and a gloo process group; on CUDA, NCCL. An already
    initialised process group or ``parallel_state`` is used as it is (and left alone by ``close()``).
    """
    import tempfile

    import torch.distributed as dist

    megatron_version()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world = MegatronWorld()
    try:
        if not torch.cuda.is_available():
            world.cpu_mode = enable_megatron_cpu()
        if not dist.is_initialized():
            fd, world.init_file = tempfile.mkstemp(prefix="moealign-dist-")
            import os

            os.close(fd)
            os.unlink(world.init_file)
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    init_method=f"file://{world.init_file}", rank=0, world_size=1)
            world.owns_process_group = True
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
            world.owns_parallel_state = True
        model_parallel_cuda_manual_seed(seed)
    except BaseException:
        world.close()
        raise
    return world


# --------------------------------------------------------------------------------------------------
# audit
# --------------------------------------------------------------------------------------------------


def audit_replay_config(config, *, aux_loss: str = "warn") -> list[str]:
    """Raise :class:`ReplayConfigError` naming the field for every setting that breaks replay.

    ``aux_loss``: Megatron computes its load-balancing aux loss from the router's *own* top-k, not the
    replayed one: ``"warn"`` (default) warns, ``"error"`` raises, ``"ignore"`` says nothing. Returns the
    warnings issued.
    """
    problems, notes = [], []
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    if not get("moe_enable_routing_replay", False):
        problems.append("moe_enable_routing_replay=False: the routers have no RouterReplay, nothing would replay")
    if get("moe_router_fusion", False):
        problems.append("moe_router_fusion=True: the fused top-k returns before the replay hook, so replay is "
                        "silently ignored; set moe_router_fusion=False")
    lb = get("moe_router_load_balancing_type", "aux_loss")
    lb_types = lb if isinstance(lb, (list, tuple)) else [lb]
    for t in lb_types:
        if t in _SKIPPING_ROUTING_TYPES:
            problems.append(f"moe_router_load_balancing_type={t!r}: this routing type bypasses RouterReplay")
    if get("moe_expert_capacity_factor") is not None:
        problems.append(f"moe_expert_capacity_factor={get('moe_expert_capacity_factor')}: token dropping runs "
                        f"after replay and can drop replayed routes; use dropless MoE (None)")
    if get("moe_router_force_load_balancing", False):
        problems.append("moe_router_force_load_balancing=True: the gate weights of the replayed experts would come "
                        "from random logits (a benchmark switch)")
    impl = str(get("cuda_graph_impl", "none") or "none")
    if impl != "none" or get("enable_cuda_graph", False) or get("external_cuda_graph", False):
        # 0.16: cuda_graph_scope; 0.19: cuda_graph_modules (cuda_graph_scope deprecated, migrated, then None)
        field_name = "cuda_graph_modules" if hasattr(config, "cuda_graph_modules") else "cuda_graph_scope"
        scope = get(field_name)
        scope = "full" if scope is None else scope
        scopes = [getattr(x, "name", str(x)).lower() for x in (scope if isinstance(scope, (list, tuple)) else [scope])]
        if not scopes or any(x in ("", "full", "full_iteration", "moe", "moe_router") for x in scopes):
            problems.append(f"cuda_graph_impl={impl!r} with {field_name}={scope!r}: a captured router graph keeps "
                            f"the target tensor it saw at capture, so later targets would not be replayed; exclude the "
                            f"router from the graph (e.g. scope 'attn') or disable CUDA graphs")
    if not get("num_moe_experts"):
        problems.append("num_moe_experts is not set: not a MoE config")
    if problems:
        raise ReplayConfigError("routing replay would not apply as asked: " + "; ".join(problems))
    coeff = get("moe_aux_loss_coeff", 0.0)
    coeff = sum(coeff) if isinstance(coeff, (list, tuple)) else coeff
    if any(t in _AUX_FROM_OWN_TOPK for t in lb_types) and coeff:
        msg = (f"moe_router_load_balancing_type={lb!r} with moe_aux_loss_coeff={coeff}: Megatron computes the "
               f"aux loss from the router's own top-k, not the replayed experts")
        if aux_loss == "error":
            raise ReplayConfigError(msg)
        if aux_loss == "warn":
            warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    return notes


# --------------------------------------------------------------------------------------------------
# routers and the driver
# --------------------------------------------------------------------------------------------------


def moe_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(decoder layer index, TopKRouter)`` of ``model``'s MoE layers, ascending; MTP routers excluded.

    Megatron's ``layer_number`` is 1-based; the returned index is 0-based like the record's ``moe_layers``.
    """
    megatron_version()
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for name, module in model.named_modules():
        if isinstance(module, TopKRouter) and ".mtp." not in f".{name}." and not name.startswith("mtp"):
            if module.layer_number is None:
                raise UnsupportedEngineError(f"router {name!r} has no layer_number (set_layer_number not called)")
            if getattr(module, "router_replay", None) is None:
                raise ReplayConfigError(f"router {name!r} has no RouterReplay: build the model with "
                                        f"moe_enable_routing_replay=True")
            out.append((int(module.layer_number) - 1, module))
    if not out:
        raise UnsupportedEngineError("no TopKRouter in this model")
    out.sort(key=lambda item: item[0])
    layers = [layer for layer, _ in out]
    if len(set(layers)) != len(layers):
        raise UnsupportedEngineError(f"several routers share a layer_number: {layers}")
    return out


# --------------------------------------------------------------------------------------------------
# token layout: record rows -> each router's local rows
# --------------------------------------------------------------------------------------------------


def _cu(cu_seqlens, name: str) -> torch.Tensor:
    cu = torch.as_tensor(cu_seqlens, dtype=torch.int64).cpu()
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise RouteError(f"{name} must be a non-decreasing 1-D tensor starting at 0, got {cu.tolist()}")
    return cu


def packed_source_rows(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """For each position of a padded THD row, the packed row it holds (-1 for a padding slot)."""
    cu, cu_padded = _cu(cu_seqlens, "cu_seqlens"), _cu(cu_seqlens_padded, "cu_seqlens_padded")
    if cu.shape != cu_padded.shape:
        raise RouteError(f"cu_seqlens has {cu.numel() - 1} sequences, cu_seqlens_padded {cu_padded.numel() - 1}")
    lens, padded = cu[1:] - cu[:-1], cu_padded[1:] - cu_padded[:-1]
    if bool((padded < lens).any()):
        raise RouteError(f"padded sequence lengths {padded.tolist()} are shorter than {lens.tolist()}")
    source = torch.full((int(cu_padded[-1]),), -1, dtype=torch.int64)
    for i in range(lens.numel()):
        n, start = int(lens[i]), int(cu_padded[i])
        source[start:start + n] = torch.arange(int(cu[i]), int(cu[i]) + n)
    return source


def pad_packed_rows(cu_seqlens: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad every packed sequence to a multiple of ``multiple`` (THD with padding).

    Returns ``(cu_seqlens_padded, source)`` with ``source`` as :func:`packed_source_rows`. Megatron needs
    each THD sequence padded to a multiple of ``2 * cp_size`` (times ``tp_size`` with sequence parallelism).
    """
    if multiple < 1:
        raise RouteError(f"multiple must be >= 1, got {multiple}")
    cu = _cu(cu_seqlens, "cu_seqlens")
    lens = cu[1:] - cu[:-1]
    padded = (lens + multiple - 1) // multiple * multiple
    cu_padded = torch.cat([torch.zeros(1, dtype=torch.int64), padded.cumsum(0)])
    return cu_padded, packed_source_rows(cu, cu_padded)


def local_route_rows(*, batch_shape: tuple[int, int] | None = None, cu_seqlens_padded: torch.Tensor | None = None,
                     cp_size: int = 1, cp_rank: int = 0, sp_size: int = 1, sp_rank: int = 0) -> torch.Tensor:
    """Which input rows a router sees on this rank, in the router's own row order.

    Input rows are the record's layout: ``b*T + t`` for a padded ``[B, T]`` batch (``batch_shape``), or
    positions of a packed THD row (``cu_seqlens_padded``, one sequence after another). The transformation
    is the one Megatron applies to the data:

    1. context parallelism splits each sequence into ``2*cp_size`` chunks and gives rank ``r`` chunks ``r``
       and ``2*cp_size-1-r`` (``get_batch_on_this_cp_rank``; per sequence for THD, like TE's
       ``thd_get_partitioned_indices``);
    2. the model works sequence-first, ``[s, b, h]``, and the router flattens it: row = ``t*B + b``;
    3. sequence parallelism gives TP rank ``r`` the ``r``-th of ``sp_size`` equal slices of ``s``.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size or sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise RouteError(f"bad parallel layout: cp {cp_rank}/{cp_size}, sp {sp_rank}/{sp_size}")
    if (batch_shape is None) == (cu_seqlens_padded is None):
        raise RouteError("give exactly one of batch_shape (padded [B, T]) or cu_seqlens_padded (packed THD)")
    if batch_shape is not None:
        B, T = (int(x) for x in batch_shape)
        if T % (2 * cp_size if cp_size > 1 else 1):
            raise RouteError(f"sequence length {T} is not divisible by 2*cp_size={2 * cp_size}")
        rows = torch.arange(B * T).reshape(B, T)
        if cp_size > 1:
            chunks = rows.reshape(B, 2 * cp_size, T // (2 * cp_size))
            rows = chunks[:, [cp_rank, 2 * cp_size - 1 - cp_rank]].reshape(B, -1)
        rows = rows.t()                                   # [s_local, B]: sequence-first
    else:
        cu = _cu(cu_seqlens_padded, "cu_seqlens_padded")
        lens = cu[1:] - cu[:-1]
        if cp_size > 1 and bool((lens % (2 * cp_size)).any()):
            raise RouteError(f"THD sequence lengths {lens.tolist()} must be multiples of 2*cp_size={2 * cp_size} "
                             f"(pad them: pad_packed_rows)")
        parts = []
        for i in range(lens.numel()):
            start, n = int(cu[i]), int(lens[i])
            if cp_size == 1:
                parts.append(torch.arange(start, start + n))
                continue
            c = n // (2 * cp_size)
            for j in (cp_rank, 2 * cp_size - 1 - cp_rank):
                parts.append(torch.arange(start + j * c, start + (j + 1) * c))
        rows = torch.cat(parts)[:, None] if parts else torch.zeros(0, 1, dtype=torch.int64)   # [s_local, 1]
    s_local = rows.shape[0]
    if s_local % sp_size:
        raise RouteError(f"local sequence length {s_local} is not divisible by the sequence-parallel size {sp_size}")
    step = s_local // sp_size
    return rows[sp_rank * step:(sp_rank + 1) * step].reshape(-1)


def _parallel_layout(config) -> dict:
    """cp/sp sizes and ranks of this process from megatron's parallel_state (1/0 when not initialised)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return dict(cp_size=1, cp_rank=0, sp_size=1, sp_rank=0)
    sp = bool(getattr(config, "sequence_parallel", False))
    tp_size = ps.get_tensor_model_parallel_world_size()
    return dict(cp_size=ps.get_context_parallel_world_size(), cp_rank=ps.get_context_parallel_rank(),
                sp_size=tp_size if sp else 1, sp_rank=ps.get_tensor_model_parallel_rank() if sp else 0)


@dataclass
class _Counter:
    calls: int = 0
    rows: int = 0


class RouterReplayDriver:
    """Drive Megatron's RouterReplay for one model.

    ``set_routes(routes, moe_layers, batch_shape=(B, T))`` takes a record's routes ``[B*T, n_layers, k]``
    (padded batch order, row = b*T + t, as :meth:`RolloutRecord.routes_int64` gives) or ``[N, n_layers, k]``
    (packed, ``batch_shape=None``) and hands each router its int64 ``[local_tokens, k]`` targets in
    Megatron's sequence-first order (row = t*B + b). ``forward()`` / ``backward()`` set REPLAY_FORWARD /
    REPLAY_BACKWARD (activation recompute) around the model call; ``check()`` verifies the counters;
    ``clear()`` empties targets and FIFOs between phases. Rows without a recorded route must be given
    *distinct* padding experts (Megatron's dispatcher assumes k distinct experts per token).

    ``aux_loss``: Megatron computes the load-balancing aux loss from the router's *own* top-k. ``"warn"``
    (default) measures how often that differs from the replayed experts (``aux_disagreement``) and warns
    once; ``"replayed"`` makes the aux loss count the replayed experts (the ones that ran); ``"own"``
    leaves Megatron as it is.
    """

    def __init__(self, model: torch.nn.Module, *, audit: bool = True, aux_loss: str = "warn"):
        if aux_loss not in _AUX_MODES:
            raise ValueError(f"aux_loss must be one of {_AUX_MODES}, got {aux_loss!r}")
        self.model = model
        self.aux_loss = aux_loss
        self.aux_disagreement: list[float] = []   # per aux-loss computation under replay: rows whose own top-k differs
        self._last_replayed: torch.Tensor | None = None
        self._warned = False
        config = getattr(model, "config", None)
        if audit and config is not None:
            audit_replay_config(config, aux_loss="ignore")
        self.routers = moe_routers(model)
        from megatron.core.transformer.moe.router_replay import RouterReplay

        registry = RouterReplay.global_router_replay_instances
        stale = [layer for layer, r in self.routers if not any(inst is r.router_replay for inst in registry)]
        if stale:
            raise ReplayConfigError(f"routers of layers {stale} are not in RouterReplay's global list (a stale "
                                    f"model, or clear_global_router_replay_instances() was called after build)")
        self.counters = [_Counter() for _ in self.routers]
        self._originals = []
        self._rows = None
        for index, (_, router) in enumerate(self.routers):
            self._wrap(index, router.router_replay)
        self._aux_patch = self._patch_aux_scores() if aux_loss != "own" else None

    def _patch_aux_scores(self):
        """Wrap megatron's ``compute_routing_scores_for_aux_loss`` (router module global): right after a
        replayed top-k of one of this model's routers, measure how often the router's own top-k differs
        from the replayed one and, with ``aux_loss="replayed"``, hand back the replayed routing map so the
        load-balancing loss counts the experts that actually ran."""
        import megatron.core.transformer.moe.router as router_mod

        original = router_mod.compute_routing_scores_for_aux_loss
        driver = self

        def compute_routing_scores_for_aux_loss(logits, topk, score_function, *args, **kwargs):
            routing_map, scores = original(logits, topk, score_function, *args, **kwargs)
            last, driver._last_replayed = driver._last_replayed, None
            if not wrapper.active or last is None or last.shape[0] != routing_map.shape[0]:
                return routing_map, scores
            replayed = torch.zeros_like(routing_map).scatter(1, last.to(routing_map.device), True)
            rate = float((replayed != routing_map).any(-1).float().mean())
            driver.aux_disagreement.append(rate)
            if driver.aux_loss == "replayed":
                return replayed, scores
            if rate > 0 and not driver._warned:
                driver._warned = True
                warnings.warn(f"Megatron computes the MoE aux loss from the router's own top-k, which differs from "
                              f"the replayed experts on {rate:.1%} of tokens; RouterReplayDriver(aux_loss='replayed') "
                              f"counts the replayed experts instead", stacklevel=2)
            return routing_map, scores

        wrapper = compute_routing_scores_for_aux_loss
        wrapper.active = True
        router_mod.compute_routing_scores_for_aux_loss = wrapper
        return router_mod, original, wrapper

    def _wrap(self, index: int, replay) -> None:
        original = replay.get_replay_topk

        def get_replay_topk(scores, topk, *args, **kwargs):
            if replay.router_replay_action is not None and replay.router_replay_action.value != "record":
                self.counters[index].calls += 1
                self.counters[index].rows += scores.shape[0]
                want = self._rows
                if want is not None and scores.shape[0] != want:
                    layer = self.routers[index][0]
                    raise ReplayCounterError(f"layer {layer}: the router saw {scores.shape[0]} tokens, the replay "
                                             f"targets have {want} rows")
            probs, top_indices = original(scores, topk, *args, **kwargs)
            replaying = replay.router_replay_action is not None and replay.router_replay_action.value != "record"
            self._last_replayed = top_indices if replaying else None
            return probs, top_indices

        replay.get_replay_topk = get_replay_topk
        self._originals.append(replay)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, _ in self.routers)

    def set_routes(self, routes: torch.Tensor, moe_layers, *, batch_shape: tuple[int, int] | None = None,
                   route_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                   cu_seqlens_padded: torch.Tensor | None = None, num_experts: int | None = None,
                   parallel: dict | None = None) -> None:
        """Hand each router its targets for the next micro-batch.

        ``routes`` ``[rows, n_layers, k]`` (any integer dtype) with ``moe_layers`` naming the decoder layer
        of each route column (all layers or MoE layers only: the model's MoE layers are picked out).
        Layout: a padded batch (``batch_shape=(B, T)``, row = ``b*T + t``) or a packed row (no
        ``batch_shape``; ``cu_seqlens`` per sample, and ``cu_seqlens_padded`` for THD with padding, whose
        padding slots get filler routes). Context parallelism and sequence parallelism are read from
        megatron's ``parallel_state`` and the model config, or given as ``parallel=dict(cp_size=,
        cp_rank=, sp_size=, sp_rank=)``; see :func:`local_route_rows`.

        ``route_mask`` ``[rows]`` marks rows with a recorded route; the others (padding, each sample's
        last token) get distinct filler experts ``(row + arange(k)) % E``: Megatron's dispatcher counts
        ``k`` distinct experts per token, so a duplicate id is an error here, never silently deduplicated.
        """
        if routes.dim() != 3:
            raise RouteError(f"routes must be [rows, layers, k], got shape {tuple(routes.shape)}")
        moe_layers = tuple(int(x) for x in moe_layers)
        if len(moe_layers) != routes.shape[1]:
            raise RouteError(f"routes have {routes.shape[1]} layers but moe_layers lists {len(moe_layers)}")
        missing = [layer for layer in self.moe_layers if layer not in moe_layers]
        if missing:
            raise RouteError(f"the record has no routes for this model's MoE layers {missing} "
                             f"(record layers {list(moe_layers)}, model layers {list(self.moe_layers)})")
        k = int(self.routers[0][1].topk)
        if routes.shape[2] != k:
            raise RouteError(f"routes have k={routes.shape[2]}, the model routes top-{k}")
        E = num_experts or int(self.routers[0][1].config.num_moe_experts)
        ids = routes.to(torch.int64)
        rows = ids.shape[0]
        mask = torch.ones(rows, dtype=torch.bool) if route_mask is None else route_mask.bool().cpu()
        if mask.shape != (rows,):
            raise RouteError(f"route_mask has shape {tuple(mask.shape)}, expected ({rows},)")
        if batch_shape is not None and (cu_seqlens is not None or cu_seqlens_padded is not None):
            raise RouteError("give batch_shape (padded) or cu_seqlens (packed), not both")
        if batch_shape is not None and rows != batch_shape[0] * batch_shape[1]:
            raise RouteError(f"routes have {rows} rows, batch_shape {tuple(batch_shape)} implies "
                             f"{batch_shape[0] * batch_shape[1]}")
        if cu_seqlens is not None and int(cu_seqlens[-1]) != rows:
            raise RouteError(f"routes have {rows} rows, cu_seqlens ends at {int(cu_seqlens[-1])}")
        if cu_seqlens_padded is not None:
            if cu_seqlens is None:
                raise RouteError("cu_seqlens_padded needs cu_seqlens (the unpadded packing of the routes)")
            source = packed_source_rows(cu_seqlens, cu_seqlens_padded)
            ids, mask = ids[source.clamp(min=0)], mask[source.clamp(min=0)] & (source >= 0)
        filler = (torch.arange(ids.shape[0])[:, None] + torch.arange(k)) % E
        ids = torch.where(mask[:, None, None].to(ids.device), ids, filler[:, None, :].to(ids.device))
        validate_routes(ids, E, name="replay routes")
        layout = parallel if parallel is not None else _parallel_layout(getattr(self.model, "config", None))
        if batch_shape is not None:
            local = local_route_rows(batch_shape=batch_shape, **layout)
        else:
            cu = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
            if cu is None:
                if layout.get("cp_size", 1) > 1:
                    raise RouteError("context parallelism with packed routes needs cu_seqlens")
                cu = torch.tensor([0, ids.shape[0]])
            local = local_route_rows(cu_seqlens_padded=cu, **layout)
        ids = ids[local.to(ids.device)]
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_indices()
        for layer, router in self.routers:
            router.router_replay.set_target_indices(ids[:, moe_layers.index(layer)].contiguous())
        self._rows = ids.shape[0]

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        with self._action(RouterReplayAction.REPLAY_FORWARD):
            yield

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        with self._action(RouterReplayAction.REPLAY_BACKWARD):
            yield

    @contextlib.contextmanager
    def _action(self, action) -> Iterator[None]:
        for _, router in self.routers:
            router.router_replay.set_router_replay_action(action)
        try:
            yield
        finally:
            for _, router in self.routers:
                router.router_replay.clear_router_replay_action()

    def check(self, calls: int = 1) -> None:
        bad = [(layer, c) for (layer, _), c in zip(self.routers, self.counters)
               if c.calls != calls or (self._rows is not None and c.rows != calls * self._rows)]
        if bad:
            detail = ", ".join(f"layer {layer}: {c.calls} calls, {c.rows} rows" for layer, c in bad)
            raise ReplayCounterError(f"replay counters unbalanced (expected {calls} calls of {self._rows} rows per "
                                     f"MoE layer): {detail}")

    def reset_counters(self) -> None:
        self.counters = [_Counter() for _ in self.routers]

    def clear(self) -> None:
        """Empty targets and backward FIFOs (between phases: forward-only passes leave FIFO entries)."""
        for _, router in self.routers:
            router.router_replay.clear_indices()
        self._rows = None

    def undo(self) -> None:
        self.clear()
        for replay in self._originals:
            replay.__dict__.pop("get_replay_topk", None)
        self._originals.clear()
        if self._aux_patch is not None:
            module, original, wrapper = self._aux_patch
            wrapper.active = False            # a pass-through if another driver wrapped it after us
            if module.compute_routing_scores_for_aux_loss is wrapper:
                module.compute_routing_scores_for_aux_loss = original
            self._aux_patch = None

    def __enter__(self) -> "RouterReplayDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


# --------------------------------------------------------------------------------------------------
# Keep Sampling Mask on vocab-parallel logits
# --------------------------------------------------------------------------------------------------


def kept_logprob(logits_shard: torch.Tensor, tokens: torch.Tensor, kept, *, temperature: float = 1.0,
                 tp_group=None) -> torch.Tensor:
    """Selected-token log-prob under the recorded kept sets, on this TP rank's vocab-parallel logits.

    ``logits_shard`` ``[N, V/TP]`` (a GPTModel built with ``parallel_output=True`` returns them),
    ``tokens`` ``[N]``, ``kept`` the CSR ``(offsets, ids)`` of the rows (``None``: full vocabulary). Each rank
    masks its own vocabulary slice ``[rank*V/TP, (rank+1)*V/TP)``; max and sum-exp are all-reduced over the
    tensor-parallel group (``parallel_state``'s unless given). Differentiable; equal on every TP rank.
    """
    megatron_version()
    from megatron.core import parallel_state as ps

    from ..routing_replay.vocab_parallel import vocab_parallel_kept_logprob

    if tp_group is None and ps.model_parallel_is_initialized():
        tp_group = ps.get_tensor_model_parallel_group()
    size = tp_group.size() if tp_group is not None else 1
    rank = tp_group.rank() if tp_group is not None else 0
    group = tp_group if size > 1 else None
    start = rank * logits_shard.shape[-1]
    return vocab_parallel_kept_logprob(logits_shard, tokens, kept, start, group=group, temperature=temperature)
