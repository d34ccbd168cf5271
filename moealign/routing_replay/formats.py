"""Route tables in other engines' wire formats, read into moealign's route table (``[rows, moe layers, k]``).

**SGLang** (``--enable-return-routed-experts``, request ``return_routed_experts=True``): the response's
``meta_info["routed_experts"]`` is the base64 of one flat, row-major array ``[rows, num_hidden_layers, top_k]``
(every decoder layer, MoE or not); ``meta_info["routed_experts_dtype"]`` names its dtype (``int32``, ``uint16``
or ``uint8``; SGLang falls back to ``int32`` whenever an id, e.g. a negative sentinel, does not fit the
configured unsigned type, and payloads from before that field are ``int32``). Row ``i`` is the routing of input
token ``routed_experts_start_len + i`` (``start_len`` defaults to 0 and the rows then cover ``[0, seqlen - 1)``:
the last sampled token is never forwarded).

:func:`routes_from_sglang` picks the record's MoE layers by decoder-layer number (never by position), requires
every other layer to hold one constant filler (SGLang leaves dense layers unwritten: a sentinel or zeros;
anything else means the layer mapping is not the model's), and validates the MoE ids (in range, distinct per
token) before compacting them to the record's route dtype. A record cannot mark rows missing, so rows that do
not start at position 0 are refused rather than padded.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..errors import ConfigError, InputError, RecordMismatchError
from .routes import compact_routes, validate_routes

__all__ = ["SGLANG_WIRE_DTYPES", "routes_from_sglang"]

#: The dtypes SGLang's wire format names, and the one a payload without a name has.
SGLANG_WIRE_DTYPES = {"int32": np.int32, "uint16": np.uint16, "uint8": np.uint8}
SGLANG_LEGACY_DTYPE = "int32"


def routes_from_sglang(meta_info: Mapping, *, num_hidden_layers: int, moe_layers: Sequence[int], top_k: int,
                       num_experts: int, length: int, start_len: int = 0) -> torch.Tensor:
    """SGLang's ``meta_info`` routes of one sequence of ``length`` tokens (prompt + response) as the record's route
    table ``[length - 1, len(moe_layers), top_k]`` (uint8 / int16). ``start_len``: the request's
    ``routed_experts_start_len`` (only 0 can be stored: a record has no missing rows)."""
    if not isinstance(meta_info, Mapping) or "routed_experts" not in meta_info:
        raise InputError("SGLang meta_info has no 'routed_experts' (start SGLang with --enable-return-routed-experts "
                         "and send return_routed_experts=True)")
    if start_len:
        raise ConfigError(f"SGLang routes start at position {start_len}: a record holds a route for every position "
                          f"from 0, so rows before it would be missing; request routed_experts_start_len=0")
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
    rows = length - 1
    if flat.size != rows * per_row:
        raise InputError(f"SGLang routed_experts holds {flat.size} ids; {length} tokens x {num_hidden_layers} "
                         f"layers x top-{top_k} need {rows * per_row} ({rows} rows)")
    layers = list(moe_layers)
    bad = [layer for layer in layers if not 0 <= layer < num_hidden_layers]
    if bad:
        raise RecordMismatchError(f"MoE layers {bad} are outside the {num_hidden_layers} decoder layers SGLang sent")
    table = torch.from_numpy(flat.astype(np.int64)).view(rows, num_hidden_layers, top_k)
    dense = [i for i in range(num_hidden_layers) if i not in set(layers)]
    if dense and rows:
        filler = table[:, dense]
        if not bool((filler == filler.reshape(-1)[0]).all()):
            layer = dense[int((filler != filler.reshape(-1)[0]).any(-1).any(0).nonzero()[0, 0])]
            raise RecordMismatchError(f"SGLang routed_experts: layer {layer} is not a MoE layer of the record "
                                      f"(MoE layers {layers}) but holds varying expert ids: the layer mapping is "
                                      f"not this model's")
    routes = table[:, layers]
    validate_routes(routes, num_experts, name="SGLang routed_experts")
    return compact_routes(routes, num_experts)
