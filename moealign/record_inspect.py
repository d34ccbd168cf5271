"""``moealign record inspect``: what a rollout record holds, and the patterns that mean its route capture broke.

Replay that "silently did nothing" usually starts with a record whose routes are not the routes the rollout ran:
a fused MoE kernel that never called the capture hook (all-zero or default rows), a capture that wrote one layer's
routes into every layer, a constant default written for every token, a layer list that names dense layers. Each
check below is one such pattern, computed on the whole record in a few tensor operations:

* ``zero_rows``: (row, layer) pairs whose expert ids are all 0 (a buffer never written);
* ``constant_layer``: a MoE layer in which every row of every sample routes to the same expert set;
* ``identical_layers``: every row has the same expert set in every MoE layer (one layer copied into all);
* ``repeated_set``: one expert set for every token of every layer;
* ``dense_layers`` (with the model's config): the record's MoE layers include layers the model runs dense.

A record whose row count does not match its tokens, or whose ids are out of range, does not load at all
(:meth:`moealign.record.RolloutRecord.load` refuses it, naming the problem). Checks need at least
:data:`MIN_ROWS` rows to speak (a short record may legitimately route every token alike).
"""

from __future__ import annotations

from typing import Any

import torch

from .record import RolloutRecord

__all__ = ["MIN_ROWS", "CHECKS", "inspect_record", "format_inspection"]

#: Fewest route rows for the constant / identical / repeated checks to be meaningful.
MIN_ROWS = 16

CHECKS = ("zero_rows", "constant_layer", "identical_layers", "repeated_set", "dense_layers")


def _sorted_sets(routes: torch.Tensor) -> torch.Tensor:
    """``[rows, layers, k]`` -> the same with each expert set sorted (slot order is not part of a route)."""
    return routes.long().sort(dim=-1).values


def inspect_record(record: RolloutRecord, *, model_moe_layers: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Summary and findings of ``record``. ``model_moe_layers``: the decoder layers the model runs as MoE (from its
    config, e.g. :func:`moealign.families.get_family`), to check the record's layer list against.

    Returns ``{"summary": {...}, "findings": [{"check", "detail"}]}``; no findings means no broken-capture
    pattern was seen."""
    meta = record.meta
    samples = record.samples
    has_routes = bool(samples) and samples[0].routes is not None
    rows = sum(s.routes.shape[0] for s in samples) if has_routes else 0
    summary = {
        "engine": meta.engine, "engine_version": meta.engine_version, "model": meta.model_name,
        "model_fingerprint": meta.model_fingerprint, "dtype": meta.dtype, "num_layers": meta.num_layers,
        "moe_layers": list(meta.moe_layers), "num_experts": meta.num_experts, "top_k": meta.top_k,
        "samples": len(samples), "response_tokens": sum(s.response_len for s in samples),
        "route_rows": rows, "route_dtype": str(samples[0].routes.dtype).replace("torch.", "") if has_routes else None,
        "missing_row_fraction": 0.0 if has_routes else None,
        "kept_sets": bool(samples) and samples[0].kept_offsets is not None,
        "router_signature": bool(meta.router_signature),
    }
    findings: list[dict[str, str]] = []
    if model_moe_layers is not None:
        dense = sorted(set(meta.moe_layers) - set(model_moe_layers))
        if dense:
            findings.append({"check": "dense_layers", "detail": f"the record has routes for layers {dense}, which "
                             f"the model runs dense (its MoE layers: {sorted(model_moe_layers)})"})
    if not has_routes or rows == 0:
        return {"summary": summary, "findings": findings}
    routes = torch.cat([s.routes for s in samples])                    # [rows, layers, k]
    zero = (routes == 0).all(dim=-1)                                   # [rows, layers]
    if bool(zero.any()):
        count = int(zero.sum())
        layers = [meta.moe_layers[i] for i in zero.any(dim=0).nonzero().flatten().tolist()]
        findings.append({"check": "zero_rows", "detail": f"{count} of {zero.numel()} (row, layer) routes are all "
                         f"expert 0, in layers {layers}: a capture buffer that was never written"})
    if rows < MIN_ROWS:
        return {"summary": summary, "findings": findings}
    sets = _sorted_sets(routes)
    same_as_first = (sets == sets[:1]).all(dim=-1)                     # [rows, layers]
    constant = same_as_first.all(dim=0)                                # per layer
    if bool(constant.all()):
        if len(meta.moe_layers) > 1 and bool((sets == sets[:, :1]).all()):
            expert = sets[0, 0].tolist()
            findings.append({"check": "repeated_set", "detail": f"every one of {rows} rows routes to experts {expert} "
                             f"in every MoE layer: a default written for every token, not a capture"})
        else:
            findings.append({"check": "constant_layer", "detail": f"every MoE layer routes all {rows} rows to one "
                             f"expert set each"})
    elif bool(constant.any()):
        layers = [meta.moe_layers[i] for i in constant.nonzero().flatten().tolist()]
        findings.append({"check": "constant_layer", "detail": f"layers {layers} route all {rows} rows to one expert "
                         f"set each"})
    if len(meta.moe_layers) > 1 and not bool(constant.all()) and bool((sets == sets[:, :1]).all()):
        findings.append({"check": "identical_layers", "detail": f"all {rows} rows have the same expert set in every "
                         f"one of the {len(meta.moe_layers)} MoE layers: one layer's routes copied into all"})
    return {"summary": summary, "findings": findings}


def format_inspection(result: dict[str, Any]) -> str:
    """A plain-text report of :func:`inspect_record`'s result."""
    s = result["summary"]
    lines = [f"engine {s['engine']} {s['engine_version']}, model {s['model'] or '?'} ({s['model_fingerprint'][:12]}), "
             f"{s['dtype']}",
             f"layers {s['num_layers']}, MoE layers {s['moe_layers']}, {s['num_experts']} experts, top-{s['top_k']}",
             f"{s['samples']} samples, {s['response_tokens']} response tokens, {s['route_rows']} route rows "
             f"({s['route_dtype'] or 'no routes'}), missing rows {s['missing_row_fraction']}, "
             f"kept sets {'yes' if s['kept_sets'] else 'no'}, router signature {'yes' if s['router_signature'] else 'no'}"]
    if result["findings"]:
        lines += [f"FOUND {f['check']}: {f['detail']}" for f in result["findings"]]
    else:
        lines.append("no broken-capture pattern found (" + ", ".join(CHECKS) + ")")
    return "\n".join(lines)
