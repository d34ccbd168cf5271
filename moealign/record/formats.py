"""Route tables in other engines' and frameworks' formats, read into moealign's route rows and written back.

Every reader returns :class:`RouteRows`: the record's route table ``[length - 1, len(moe_layers), top_k]`` (uint8 /
int16, :func:`~moealign.routing_replay.routes.route_dtype`) of one sequence of ``length`` tokens, row ``i`` the
routing of input token ``i``, and ``missing`` (bool, one flag per row): the rows the engine reported no route for.
A missing row holds 0 in the table and is never replayed (:attr:`moealign.record.Sample.route_missing`); a row is
only ever marked missing where the format itself says so (a sentinel, rows the engine did not send, an unwritten
buffer row that cannot be a route), never filled with a guess. Every reader picks the record's MoE layers by
decoder-layer number when the format carries every decoder layer (dense layers must then hold one constant
filler: anything else means the layer mapping is not the model's) or by MoE ordinal when it carries the MoE layers
only, and validates the ids (in range, distinct per token) before compacting them.

Formats, each as the engine's own source builds it:

**SGLang** (``--enable-return-routed-experts``, request ``return_routed_experts=True``; sglang 0.5.x): the response's
``meta_info["routed_experts"]`` is the base64 of one flat, row-major array ``[rows, num_hidden_layers, top_k]``
(every decoder layer, MoE or not); ``meta_info["routed_experts_dtype"]`` names its dtype (``int32``, ``uint16``
or ``uint8``; SGLang falls back to ``int32`` whenever an id, e.g. a negative sentinel, does not fit the
configured unsigned type, and payloads from before that field are ``int32``). Row ``i`` is the routing of input
token ``routed_experts_start_len + i``: the rows cover ``[start_len, length - 1)`` (the last sampled token is never
forwarded), so the ``start_len`` rows before them are missing (slime's ``Sample._apply_meta_info`` counts
``len(tokens) - 1 - start_len`` rows the same way). :func:`routes_from_sglang`.

**vLLM 0.21** (the only release with the split API; ``enable_return_routed_experts=True``): the host cache of
``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py`` holds int16 ``[positions, num_moe_layers,
top_k]`` per request, **MoE layers only** (``_count_moe_layers``; a FusedMoE's ``moe_layer_id`` is its construction
ordinal), zero-initialised, written at each scheduled position. ``split_routed_experts`` cuts it at the prompt
length: ``RequestOutput.prompt_routed_experts`` = rows ``[0, P)`` (None when empty) and
``CompletionOutput.routed_experts`` = rows ``[P, ...)`` clipped to the number of output tokens (None when empty:
a one-token response). Rows are ``P + R - 1`` (the last token is never forwarded), one more when speculative
decoding captured the last token's row (the clip keeps at most ``R``). Prompt tokens served from the prefix cache
(``RequestOutput.num_cached_tokens``) are never scheduled, so their rows stay zero: they are missing; with
``top_k > 1`` any all-zero row is an unwritten row (a real route repeats no expert), with ``top_k == 1`` only the
cached rows can be told apart. vLLM 0.19-0.20 and 0.22+ return one ``routed_experts`` over every decoder layer
(:mod:`moealign.patches.vllm.harvest` reads 0.33's). :func:`routes_from_vllm_0_21`.

**TensorRT-LLM** (Router Replay, NVIDIA/TensorRT-LLM PR #18397 / RFC #17778): ``CompletionOutput.routed_experts``
``(seq_len - 1, num_moe_layers, top_k)``, the **logical** top-k ids captured in ``routing_method.apply()`` before
the EPLB remap (``_load_balancer_route``). Physical slot ids (a capture after the remap) map back through the EPLB
placement, ``MoeLoadBalancerConfig.initial_global_assignments`` (``{decoder layer: [logical expert of each global
slot]}``, ``num_slots`` long); a load balancer that moves experts during the run (``layer_updates_per_iter > 0``)
has no single placement and is refused. :func:`routes_from_trtllm`.

**NeMo-RL** (``nemo_rl/models/generation/vllm/utils.py::pad_and_align_routed_expert_indices``): per sample
``[padded_length, layers, top_k]`` in int8 (<= 128 experts) / int16 / int32; rows ``[0, length - 1)`` hold the
engine's routes, rows vLLM did not return hold the **all -1 sentinel** (``ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL``;
a partially negative row is corruption), rows from ``length - 1`` on hold the filler ``arange(top_k)``. The layer
axis is either every decoder layer or the MoE layers (``router_replay._payload_indices_for_moe_layers`` accepts
both). :func:`routes_from_nemo_rl`, :func:`routes_to_nemo_rl`.

**verl** (``verl/experimental/agent_loop/agent_loop.py::_agent_loop_postprocess``): the batch's
``routed_experts`` is int16 ``[B, prompt_width + response_width, layers, top_k]``, aligned with ``input_ids`` (the
prompt left-padded to ``prompt_width``, the response right-padded): the engine's rows start at ``prompt_width -
prompt_len``; every other row is zero (padding, the last token's row, rows the engine did not record such as a
multi-turn tail). The layer axis is the engine's (vLLM >= 0.22 / SGLang: every decoder layer). Zero rows inside a
sequence are missing when ``top_k > 1`` (a real route repeats no expert); with ``top_k == 1`` verl replays them as
expert 0 and so do we. :func:`routes_from_verl`, :func:`routes_to_verl`.

**slime** (``slime/utils/types.py::Sample._apply_meta_info``, ``slime/ray/rollout.py``): per sample
``rollout_routed_experts`` ``[len(tokens) - 1, num_layers, top_k]``, SGLang's int32 over every decoder layer; slime
has no missing-row marker (its trainer replays every row). :func:`routes_from_slime`, :func:`routes_to_slime`.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError, InputError, RecordMismatchError, RouteError
from ..routing_replay.routes import route_dtype, validate_routes

__all__ = [
    "NEMO_RL_MISSING_ROUTE",
    "RouteRows",
    "SGLANG_WIRE_DTYPES",
    "nemo_rl_route_dtype",
    "routes_from_nemo_rl",
    "routes_from_sglang",
    "routes_from_slime",
    "routes_from_trtllm",
    "routes_from_verl",
    "routes_from_vllm_0_21",
    "routes_to_nemo_rl",
    "routes_to_slime",
    "routes_to_verl",
]

#: The dtypes SGLang's wire format names, and the one a payload without a name has.
SGLANG_WIRE_DTYPES = {"int32": np.int32, "uint16": np.uint16, "uint8": np.uint8}
SGLANG_LEGACY_DTYPE = "int32"
#: NeMo-RL's ``ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL``: a row holding it in every slot has no captured route.
NEMO_RL_MISSING_ROUTE = -1


@dataclass(frozen=True)
class RouteRows:
    """The route rows of one sequence: ``routes`` ``[rows, len(moe_layers), top_k]`` in the record's route dtype
    (0 at missing rows) and ``missing`` bool ``[rows]`` (True: the format reported no route for that row)."""

    routes: torch.Tensor
    missing: torch.Tensor

    def __post_init__(self):
        if not isinstance(self.routes, torch.Tensor) or self.routes.dim() != 3:
            raise RouteError(f"RouteRows.routes must be [rows, layers, k], got {getattr(self.routes, 'shape', None)}")
        if (not isinstance(self.missing, torch.Tensor) or self.missing.dtype != torch.bool
                or tuple(self.missing.shape) != tuple(self.routes.shape[:1])):
            raise RouteError(f"RouteRows.missing must be bool [{self.routes.shape[0]}], got "
                             f"{getattr(self.missing, 'dtype', type(self.missing).__name__)} "
                             f"{tuple(getattr(self.missing, 'shape', ()))}")

    @property
    def route_missing(self) -> torch.Tensor | None:
        """The record's ``Sample.route_missing``: the mask, or None when no row is missing."""
        return self.missing.clone() if bool(self.missing.any()) else None


# --------------------------------------------------------------------------------------------------
# shared pieces
# --------------------------------------------------------------------------------------------------


def _int_table(value, name: str, ndim: int = 3) -> torch.Tensor:
    """``value`` (numpy array, torch tensor or nested lists) as an int64 tensor of ``ndim`` dimensions."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
            raise InputError(f"{name} holds {value.dtype} values, not expert ids")
        table = value.detach().to("cpu", torch.int64)
    else:
        try:
            array = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise InputError(f"{name} is not a rectangular array of expert ids: {exc}") from None
        if array.size and array.dtype.kind not in "iu":
            raise InputError(f"{name} holds {array.dtype} values, not integer expert ids")
        table = torch.from_numpy(np.ascontiguousarray(array.astype(np.int64)))
    if table.dim() != ndim:
        raise InputError(f"{name} has shape {tuple(table.shape)}, expected {ndim} dimensions")
    return table


def _check_layers(moe_layers: Sequence[int], top_k: int, num_experts: int, num_hidden_layers: int | None) -> list[int]:
    layers = [int(x) for x in moe_layers]
    if not layers or layers != sorted(set(layers)) or layers[0] < 0:
        raise ConfigError(f"moe_layers must be ascending, unique decoder-layer numbers, got {layers}")
    if num_hidden_layers is not None and layers[-1] >= num_hidden_layers:
        raise RecordMismatchError(f"MoE layers {[x for x in layers if x >= num_hidden_layers]} are outside the "
                                  f"{num_hidden_layers} decoder layers")
    if not 1 <= top_k <= num_experts:
        raise ConfigError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")
    return layers


def _moe_columns(table: torch.Tensor, *, layers: list[int], num_hidden_layers: int | None, layout: str,
                 missing: torch.Tensor, name: str) -> torch.Tensor:
    """The MoE columns of ``table[rows, n, k]``: by decoder-layer number when ``n`` is every decoder layer
    (``layout`` "all" or "either"; the dense columns of the present rows must hold one constant filler), by
    ordinal when ``n`` is the MoE layers ("moe" or "either")."""
    n = table.shape[1]
    if layout in ("moe", "either") and n == len(layers) and (layout == "moe" or n != num_hidden_layers):
        return table
    if layout in ("all", "either") and num_hidden_layers is not None and n == num_hidden_layers:
        dense = [i for i in range(n) if i not in set(layers)]
        present = table[~missing]
        if dense and present.shape[0]:
            filler = present[:, dense]
            varying = filler != filler.reshape(-1)[0]
            if bool(varying.any()):
                layer = dense[int(varying.any(-1).any(0).nonzero()[0, 0])]
                raise RecordMismatchError(f"{name}: decoder layer {layer} is not a MoE layer of the model (MoE "
                                          f"layers {layers}) but holds varying expert ids: the layer mapping is "
                                          f"not this model's")
        return table[:, layers]
    want = {"all": f"{num_hidden_layers} (every decoder layer)", "moe": f"{len(layers)} (the MoE layers)",
            "either": f"{num_hidden_layers} (every decoder layer) or {len(layers)} (the MoE layers)"}[layout]
    raise RecordMismatchError(f"{name} has {n} layers, expected {want}: another model than the one given")


def _finish(table: torch.Tensor, missing: torch.Tensor, *, top_k: int, num_experts: int, name: str) -> RouteRows:
    """Validate the present rows of ``table[rows, n_moe, k]`` (int64; errors name the true row) and store them."""
    if table.shape[-1] != top_k:
        raise RecordMismatchError(f"{name} has top_k={table.shape[-1]} experts per token, the model {top_k}")
    filled = table.clone()
    if bool(missing.any()):
        filled[missing] = torch.arange(top_k, dtype=torch.int64)   # a valid stand-in so row numbers stay true
    validate_routes(filled, num_experts, name=name)
    filled[missing] = 0
    return RouteRows(filled.to(route_dtype(num_experts)), missing.clone())


def _check_length(length, what: str = "length") -> int:
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or int(length) < 2:
        raise InputError(f"{what} must be an int >= 2 (a prompt token and a response token), got {length!r}")
    return int(length)


# --------------------------------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------------------------------


def routes_from_sglang(meta_info: Mapping, *, num_hidden_layers: int, moe_layers: Sequence[int], top_k: int,
                       num_experts: int, length: int, start_len: int | None = None) -> RouteRows:
    """SGLang's ``meta_info`` routes of one sequence of ``length`` tokens (prompt + response).

    ``start_len``: the request's ``routed_experts_start_len`` (default: ``meta_info["routed_experts_start_len"]``,
    else 0); the rows before it are missing."""
    if not isinstance(meta_info, Mapping) or "routed_experts" not in meta_info:
        raise InputError("SGLang meta_info has no 'routed_experts' (start SGLang with --enable-return-routed-experts "
                         "and send return_routed_experts=True)")
    length = _check_length(length)
    layers = _check_layers(moe_layers, top_k, num_experts, num_hidden_layers)
    if start_len is None:
        start_len = meta_info.get("routed_experts_start_len", 0) or 0
    if isinstance(start_len, bool) or not isinstance(start_len, (int, np.integer)) or not 0 <= start_len < length:
        raise InputError(f"SGLang routed_experts_start_len {start_len!r} is not a position in [0, {length - 1}]")
    start_len = int(start_len)
    name = meta_info.get("routed_experts_dtype", SGLANG_LEGACY_DTYPE)
    if name not in SGLANG_WIRE_DTYPES:
        raise InputError(f"SGLang routed_experts_dtype {name!r} is not one of {sorted(SGLANG_WIRE_DTYPES)}")
    payload = meta_info["routed_experts"]
    if not isinstance(payload, (str, bytes)):
        raise InputError(f"SGLang routed_experts must be a base64 string, got {type(payload).__name__}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"SGLang routed_experts is not valid base64: {exc}") from None
    dtype = np.dtype(SGLANG_WIRE_DTYPES[name])
    if len(raw) % dtype.itemsize:
        raise InputError(f"SGLang routed_experts: {len(raw)} bytes is not a whole number of {name} values")
    flat = np.frombuffer(raw, dtype=dtype)
    per_row = num_hidden_layers * top_k
    sent = length - 1 - start_len
    if flat.size != sent * per_row:
        raise InputError(f"SGLang routed_experts holds {flat.size} ids; {length} tokens from routed_experts_start_len "
                         f"{start_len} x {num_hidden_layers} layers x top-{top_k} need {sent * per_row} ({sent} rows)")
    table = torch.zeros(length - 1, num_hidden_layers, top_k, dtype=torch.int64)
    table[start_len:] = torch.from_numpy(flat.astype(np.int64)).view(sent, num_hidden_layers, top_k)
    missing = torch.zeros(length - 1, dtype=torch.bool)
    missing[:start_len] = True
    moe = _moe_columns(table, layers=layers, num_hidden_layers=num_hidden_layers, layout="all", missing=missing,
                       name="SGLang routed_experts")
    return _finish(moe, missing, top_k=top_k, num_experts=num_experts, name="SGLang routed_experts")


# --------------------------------------------------------------------------------------------------
# vLLM 0.21
# --------------------------------------------------------------------------------------------------


def routes_from_vllm_0_21(prompt_routed_experts, routed_experts, *, prompt_len: int, length: int,
                          moe_layers: Sequence[int], top_k: int, num_experts: int,
                          num_cached_tokens: int = 0) -> RouteRows:
    """vLLM 0.21's split routes of one completion: ``RequestOutput.prompt_routed_experts`` and the completion's
    ``routed_experts`` (numpy int16 ``[rows, num_moe_layers, top_k]`` or None), ``prompt_len`` prompt tokens,
    ``length`` tokens in all, ``num_cached_tokens`` the request's prefix-cache hits (their rows are missing)."""
    length = _check_length(length)
    layers = _check_layers(moe_layers, top_k, num_experts, None)
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, (int, np.integer)) or not 1 <= prompt_len < length:
        raise InputError(f"prompt_len must be in [1, {length}), got {prompt_len!r}")
    if (isinstance(num_cached_tokens, bool) or not isinstance(num_cached_tokens, (int, np.integer))
            or not 0 <= num_cached_tokens <= prompt_len):
        raise InputError(f"num_cached_tokens must be in [0, prompt length {prompt_len}], got {num_cached_tokens!r}")
    if prompt_routed_experts is None and routed_experts is None:
        raise InputError("vLLM 0.21 returned neither prompt_routed_experts nor routed_experts (start vLLM with "
                         "enable_return_routed_experts=True; a preempted request loses its routes)")
    parts = []
    if prompt_routed_experts is not None:
        prompt = _int_table(prompt_routed_experts, "vLLM prompt_routed_experts")
        if prompt.shape[0] > prompt_len:
            raise InputError(f"vLLM prompt_routed_experts has {prompt.shape[0]} rows for a {prompt_len}-token prompt "
                             f"(split_routed_experts cuts at the prompt length)")
        parts.append(prompt)
    if routed_experts is not None:
        generated = _int_table(routed_experts, "vLLM routed_experts")
        if prompt_routed_experts is None or parts[0].shape[0] != prompt_len:
            raise InputError(f"vLLM routed_experts holds generated-token rows but prompt_routed_experts does not cover "
                             f"the {prompt_len} prompt rows (split_routed_experts gives the prompt its rows first)")
        if generated.shape[0] > length - prompt_len:
            raise InputError(f"vLLM routed_experts has {generated.shape[0]} rows for {length - prompt_len} generated "
                             f"tokens (vLLM clips it to the number of output tokens)")
        parts.append(generated)
    if len({tuple(p.shape[1:]) for p in parts}) > 1:
        raise InputError(f"vLLM prompt_routed_experts {tuple(parts[0].shape)} and routed_experts "
                         f"{tuple(parts[1].shape)} differ in layers or top_k")
    got = torch.cat(parts)
    rows = length - 1
    table = torch.zeros(rows, *got.shape[1:], dtype=torch.int64)
    n = min(got.shape[0], rows)                 # a speculative step may have captured the last token's row
    table[:n] = got[:n]
    missing = torch.zeros(rows, dtype=torch.bool)
    missing[n:] = True                          # positions vLLM never wrote (filled_len stopped short)
    if bool((table[:n] < 0).any()):
        raise RouteError("vLLM routed_experts holds a negative id: vLLM 0.21's host cache is zero-initialised and "
                         "holds no sentinel (a -1 row is NeMo-RL's marker: convert with the nemo-rl format)")
    cached = int(num_cached_tokens)
    if cached and bool(table[:cached].any()):
        row = int(table[:cached].flatten(1).any(-1).nonzero()[0, 0])
        raise InputError(f"vLLM route row {row} is a prefix-cache hit (num_cached_tokens={cached}) but holds experts "
                         f"{table[row, 0].tolist()}...: vLLM 0.21 never computes those rows")
    missing[:cached] = True
    if top_k > 1:
        missing |= (table == 0).flatten(1).all(-1)     # an unwritten row: a real route repeats no expert
    moe = _moe_columns(table, layers=layers, num_hidden_layers=None, layout="moe", missing=missing,
                       name="vLLM routed_experts")
    return _finish(moe, missing, top_k=top_k, num_experts=num_experts, name="vLLM routed_experts")


# --------------------------------------------------------------------------------------------------
# TensorRT-LLM
# --------------------------------------------------------------------------------------------------


def _eplb_slot_map(eplb: Mapping, layers: list[int], num_experts: int) -> tuple[torch.Tensor, int]:
    """``[len(layers), num_slots]`` logical expert of each physical slot, from a ``MoeLoadBalancerConfig``."""
    if not isinstance(eplb, Mapping):
        raise ConfigError(f"the EPLB config must be a mapping (MoeLoadBalancerConfig fields), got {type(eplb).__name__}")
    updates = eplb.get("layer_updates_per_iter", 0) or 0
    if updates:
        raise ConfigError(f"the EPLB config has layer_updates_per_iter={updates}: the online load balancer moves "
                          f"experts between slots during the run, so no single placement maps physical slots back")
    assignments = eplb.get("initial_global_assignments")
    if not isinstance(assignments, Mapping) or not assignments:
        raise ConfigError("the EPLB config has no initial_global_assignments ({decoder layer: [expert of each slot]})")
    by_layer = {}
    for key, slots in assignments.items():
        try:
            by_layer[int(key)] = slots
        except (TypeError, ValueError):
            raise ConfigError(f"EPLB initial_global_assignments key {key!r} is not a decoder-layer number") from None
    absent = [layer for layer in layers if layer not in by_layer]
    if absent:
        raise ConfigError(f"the EPLB config places no experts for MoE layers {absent}")
    extra = sorted(set(by_layer) - set(layers))
    if extra:
        raise ConfigError(f"the EPLB config places experts for decoder layers {extra}, which are not MoE layers of "
                          f"the model (MoE layers {layers}): another model's placement")
    num_slots = eplb.get("num_slots")
    table = []
    for layer in layers:
        slots = _int_table(by_layer[layer], f"EPLB initial_global_assignments[{layer}]", ndim=1)
        if num_slots is None:
            num_slots = slots.shape[0]
        if slots.shape[0] != num_slots:
            raise ConfigError(f"EPLB initial_global_assignments[{layer}] places {slots.shape[0]} slots, num_slots is "
                              f"{num_slots}")
        bad = (slots < 0) | (slots >= num_experts)
        if bool(bad.any()):
            slot = int(bad.nonzero()[0, 0])
            raise ConfigError(f"EPLB initial_global_assignments[{layer}][{slot}] = {int(slots[slot])} is not an "
                              f"expert id in [0, {num_experts})")
        unplaced = sorted(set(range(num_experts)) - set(slots.tolist()))
        if unplaced:
            raise ConfigError(f"EPLB initial_global_assignments[{layer}] places no slot for experts {unplaced[:8]}: "
                              f"not a placement of all {num_experts} experts")
        table.append(slots)
    return torch.stack(table), int(num_slots)


def routes_from_trtllm(routed_experts, *, length: int, moe_layers: Sequence[int], top_k: int, num_experts: int,
                       expert_ids: str = "logical", eplb: Mapping | None = None) -> RouteRows:
    """TensorRT-LLM's ``CompletionOutput.routed_experts`` ``(length - 1, num_moe_layers, top_k)`` of one sequence.

    ``expert_ids``: ``"logical"`` (TensorRT-LLM's Router Replay contract: ids captured before the EPLB remap) or
    ``"physical"`` (slot ids after it; then ``eplb``, the run's ``MoeLoadBalancerConfig`` fields
    ``initial_global_assignments`` / ``num_slots`` / ``layer_updates_per_iter``, maps each slot to its expert).
    A mapping with logical ids, or physical ids without one, is refused: either would be read one way silently."""
    length = _check_length(length)
    layers = _check_layers(moe_layers, top_k, num_experts, None)
    if expert_ids not in ("logical", "physical"):
        raise ConfigError(f"expert_ids must be 'logical' or 'physical', got {expert_ids!r}")
    if expert_ids == "logical" and eplb is not None:
        raise ConfigError("an EPLB placement was given for logical expert ids (TensorRT-LLM's Router Replay captures "
                          "ids before the EPLB remap): say expert_ids='physical' if the ids are slots")
    if expert_ids == "physical" and eplb is None:
        raise ConfigError("physical slot ids need the run's EPLB placement (MoeLoadBalancerConfig "
                          "initial_global_assignments) to map each slot back to its expert")
    table = _int_table(routed_experts, "TensorRT-LLM routed_experts")
    if table.shape[0] != length - 1:
        raise InputError(f"TensorRT-LLM routed_experts has {table.shape[0]} rows, {length} tokens need {length - 1} "
                         f"(seq_len - 1: the last token is never forwarded)")
    missing = torch.zeros(length - 1, dtype=torch.bool)
    moe = _moe_columns(table, layers=layers, num_hidden_layers=None, layout="moe", missing=missing,
                       name="TensorRT-LLM routed_experts")
    if expert_ids == "physical":
        slot_map, num_slots = _eplb_slot_map(eplb, layers, num_experts)
        bad = (moe < 0) | (moe >= num_slots)
        if bool(bad.any()):
            row, col, slot = (int(i) for i in bad.nonzero()[0])
            raise RouteError(f"TensorRT-LLM routed_experts[{row}, {col}, {slot}] = {int(moe[row, col, slot])} "
                             f"(decoder layer {layers[col]}) is not a slot in [0, num_slots={num_slots})")
        moe = torch.gather(slot_map.unsqueeze(0).expand(moe.shape[0], -1, -1), 2, moe)
    elif bool((moe >= num_experts).any()):
        row, col, slot = (int(i) for i in (moe >= num_experts).nonzero()[0])
        raise RouteError(f"TensorRT-LLM routed_experts[{row}, {col}, {slot}] = {int(moe[row, col, slot])} is not an "
                         f"expert id in [0, {num_experts}): physical slot ids? convert with expert_ids='physical' and "
                         f"the run's EPLB placement")
    return _finish(moe, missing, top_k=top_k, num_experts=num_experts, name="TensorRT-LLM routed_experts")


# --------------------------------------------------------------------------------------------------
# NeMo-RL
# --------------------------------------------------------------------------------------------------


def nemo_rl_route_dtype(num_experts: int) -> torch.dtype:
    """NeMo-RL's carry dtype (``resolve_routed_experts_dtype``): the narrowest signed dtype holding every id and
    the -1 sentinel."""
    if num_experts - 1 <= torch.iinfo(torch.int8).max:
        return torch.int8
    if num_experts - 1 <= torch.iinfo(torch.int16).max:
        return torch.int16
    return torch.int32


def routes_from_nemo_rl(routed_experts, *, length: int, num_hidden_layers: int, moe_layers: Sequence[int],
                        top_k: int, num_experts: int) -> RouteRows:
    """One sample's NeMo-RL ``routed_experts`` ``[padded_length, layers, top_k]`` (``padded_length >= length - 1``;
    rows from ``length - 1`` on are padding): all -1 rows are missing, a partially negative row is refused."""
    length = _check_length(length)
    layers = _check_layers(moe_layers, top_k, num_experts, num_hidden_layers)
    table = _int_table(routed_experts, "NeMo-RL routed_experts")
    if table.shape[0] < length - 1:
        raise InputError(f"NeMo-RL routed_experts has {table.shape[0]} rows, {length} tokens need {length - 1}")
    table = table[:length - 1]
    sentinel = table == NEMO_RL_MISSING_ROUTE
    missing = sentinel.flatten(1).all(-1)
    negative = (table < 0).flatten(1).any(-1) & ~missing
    if bool(negative.any()):
        row = int(negative.nonzero()[0, 0])
        raise InputError(f"NeMo-RL routed_experts row {row} is partly negative ({table[row].tolist()}): a row without "
                         f"a route is -1 in every slot of every layer, anything else is corruption")
    moe = _moe_columns(table, layers=layers, num_hidden_layers=num_hidden_layers, layout="either", missing=missing,
                       name="NeMo-RL routed_experts")
    return _finish(moe, missing, top_k=top_k, num_experts=num_experts, name="NeMo-RL routed_experts")


def routes_to_nemo_rl(rows: RouteRows, *, padded_length: int, num_experts: int) -> torch.Tensor:
    """One sample in NeMo-RL's layout: ``[padded_length, num_moe_layers, top_k]`` in :func:`nemo_rl_route_dtype`,
    missing rows -1, rows from ``len(rows)`` on the filler ``arange(top_k)`` (as
    ``pad_and_align_routed_expert_indices`` pads them)."""
    _check_rows(rows)
    n, layers, k = rows.routes.shape
    if padded_length < n:
        raise ConfigError(f"padded_length {padded_length} is shorter than the {n} route rows")
    out = torch.arange(k, dtype=torch.int64).view(1, 1, k).expand(padded_length, layers, k).clone()
    out[:n] = rows.routes.to(torch.int64)
    out[:n][rows.missing] = NEMO_RL_MISSING_ROUTE
    return out.to(nemo_rl_route_dtype(num_experts))


# --------------------------------------------------------------------------------------------------
# verl
# --------------------------------------------------------------------------------------------------


def routes_from_verl(routed_experts, attention_mask, *, prompt_width: int, num_hidden_layers: int,
                     moe_layers: Sequence[int], top_k: int, num_experts: int) -> list[RouteRows]:
    """A verl batch's ``routed_experts`` ``[B, S, layers, top_k]`` with its ``attention_mask`` ``[B, S]`` (prompt
    left-padded to ``prompt_width``, response right-padded): per sample the rows of its ``L - 1`` first tokens."""
    layers = _check_layers(moe_layers, top_k, num_experts, num_hidden_layers)
    table = _int_table(routed_experts, "verl routed_experts", ndim=4)
    mask = _int_table(attention_mask, "verl attention_mask", ndim=2)
    if tuple(mask.shape) != tuple(table.shape[:2]):
        raise InputError(f"verl routed_experts {tuple(table.shape)} and attention_mask {tuple(mask.shape)} differ in "
                         f"batch or sequence size")
    out = []
    for b in range(table.shape[0]):
        start, length = _verl_span(mask[b], prompt_width, b)
        rows = table[b, start:start + length - 1]
        missing = (rows == 0).flatten(1).all(-1) if top_k > 1 else torch.zeros(length - 1, dtype=torch.bool)
        name = f"verl routed_experts (sample {b})"
        moe = _moe_columns(rows, layers=layers, num_hidden_layers=num_hidden_layers, layout="either",
                           missing=missing, name=name)
        out.append(_finish(moe, missing, top_k=top_k, num_experts=num_experts, name=name))
    return out


def _verl_span(mask: torch.Tensor, prompt_width: int, b: int) -> tuple[int, int]:
    """(first position, length) of sample ``b``'s tokens: one run of ones ending at or after ``prompt_width``."""
    if bool(((mask != 0) & (mask != 1)).any()):
        raise InputError(f"verl attention_mask of sample {b} holds values other than 0 and 1")
    ones = mask.nonzero().flatten()
    if ones.numel() == 0:
        raise InputError(f"verl sample {b} has no tokens (attention_mask all 0)")
    start, end = int(ones[0]), int(ones[-1]) + 1
    if end - start != ones.numel():
        raise InputError(f"verl attention_mask of sample {b} has a hole: the prompt is left-padded and the response "
                         f"right-padded, so the tokens are one run")
    if not start < prompt_width < end:
        raise InputError(f"verl sample {b}: its tokens [{start}, {end}) do not straddle the prompt width "
                         f"{prompt_width} (an empty prompt or an empty response)")
    return start, end - start


def routes_to_verl(rows: Sequence[RouteRows], prompt_lens: Sequence[int], *, prompt_width: int, response_width: int,
                   num_hidden_layers: int, moe_layers: Sequence[int]) -> torch.Tensor:
    """The verl batch tensor of ``rows`` (one per sample, ``len(rows[b]) + 1`` tokens, ``prompt_lens[b]`` of them
    prompt): int16 ``[B, prompt_width + response_width, num_hidden_layers, top_k]``, every decoder layer (what
    vLLM >= 0.22 and SGLang hand verl; dense layers 0), the rows placed at ``prompt_width - prompt_len``, zero
    elsewhere. Missing rows become zero rows, which verl can only tell from a route when ``top_k > 1``: with
    ``top_k == 1`` they are refused."""
    if len(rows) != len(prompt_lens) or not rows:
        raise ConfigError(f"{len(rows)} route-row sets for {len(prompt_lens)} prompt lengths")
    layers = [int(x) for x in moe_layers]
    k = rows[0].routes.shape[-1]
    out = torch.zeros(len(rows), prompt_width + response_width, num_hidden_layers, k, dtype=torch.int16)
    for b, (r, p) in enumerate(zip(rows, prompt_lens)):
        _check_rows(r)
        n = r.routes.shape[0]
        if r.routes.shape[1:] != (len(layers), k):
            raise ConfigError(f"sample {b}: routes {tuple(r.routes.shape)} are not [rows, {len(layers)}, {k}]")
        if not 1 <= p <= prompt_width or n + 1 - p > response_width or n + 1 - p < 1:
            raise ConfigError(f"sample {b}: {p} prompt + {n + 1 - p} response tokens do not fit prompt width "
                              f"{prompt_width} / response width {response_width}")
        if k == 1 and bool(r.missing.any()):
            raise ConfigError(f"sample {b} has missing route rows and top_k=1: verl holds them as zero rows, which "
                              f"with one expert per token read as routes to expert 0")
        start = prompt_width - p
        block = torch.zeros(n, num_hidden_layers, k, dtype=torch.int16)
        block[:, layers] = r.routes.to(torch.int16)
        out[b, start:start + n] = block
    return out


# --------------------------------------------------------------------------------------------------
# slime
# --------------------------------------------------------------------------------------------------


def routes_from_slime(rollout_routed_experts, *, length: int, num_hidden_layers: int, moe_layers: Sequence[int],
                      top_k: int, num_experts: int) -> RouteRows:
    """One slime sample's ``rollout_routed_experts`` ``[length - 1, num_layers, top_k]`` (every decoder layer).
    slime has no missing-row marker: every row must be a route."""
    length = _check_length(length)
    layers = _check_layers(moe_layers, top_k, num_experts, num_hidden_layers)
    table = _int_table(rollout_routed_experts, "slime rollout_routed_experts")
    if table.shape[0] != length - 1:
        raise InputError(f"slime rollout_routed_experts has {table.shape[0]} rows, {length} tokens need {length - 1} "
                         f"(prepare_routed_experts_for_routing_replay asserts rows == len(tokens) - 1)")
    missing = torch.zeros(length - 1, dtype=torch.bool)
    moe = _moe_columns(table, layers=layers, num_hidden_layers=num_hidden_layers, layout="all", missing=missing,
                       name="slime rollout_routed_experts")
    return _finish(moe, missing, top_k=top_k, num_experts=num_experts, name="slime rollout_routed_experts")


def routes_to_slime(rows: RouteRows, *, num_hidden_layers: int, moe_layers: Sequence[int]) -> torch.Tensor:
    """One sample's ``rollout_routed_experts``: int32 ``[rows, num_hidden_layers, top_k]`` (SGLang's layout, dense
    layers 0). Refused when a row is missing: slime replays every row."""
    _check_rows(rows)
    if bool(rows.missing.any()):
        row = int(rows.missing.nonzero()[0, 0])
        raise ConfigError(f"route row {row} is missing: slime has no missing-row marker (its trainer replays every "
                          f"row), so the sample cannot be written in slime's format")
    layers = [int(x) for x in moe_layers]
    n, _, k = rows.routes.shape
    out = torch.zeros(n, num_hidden_layers, k, dtype=torch.int32)
    out[:, layers] = rows.routes.to(torch.int32)
    return out


def _check_rows(rows) -> None:
    if not isinstance(rows, RouteRows):
        raise ConfigError(f"expected RouteRows, got {type(rows).__name__}")
