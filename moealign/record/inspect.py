"""``moealign record inspect``: what a rollout record holds, and the patterns that mean its route capture broke.

Replay that "silently did nothing" usually starts with a record whose routes are not the routes the rollout ran:
a fused MoE kernel that never called the capture hook (all-zero or default rows), a capture that wrote one layer's
routes into every layer, a constant default written for every token, a layer list that names dense layers. The
patterns and their thresholds live in :mod:`moealign.routing_replay.degenerate` (every replay adapter refuses the same
patterns at ``set_routes``); this module adds the record's summary: engine, model, layers, rows, route dtype, the
fraction of rows the record marks missing (``Sample.route_missing``, left out of every check) and the stale rows of a
record stitched across weight versions. A record whose every row is missing is reported as ``zero_rows``; a record without a route table as ``no_routes``
(exit 3 as well: nothing was captured).

With the checkpoint (``--model``) the record is also checked against the model itself
(:func:`moealign.mismatch.router_check.router_check`, which runs the model; :func:`compare_routes` here): the
checkpoint's routers run on the record's tokens (transformers, float32, one forward per micro-batch, nothing
generated) and the fraction of (row, MoE layer) pairs whose recorded expert set equals the model's own is reported
(``router_agreement``). Below ``1 -`` :data:`~moealign.routing_replay.flips.FOREIGN_FLIP_RATE` (half the pairs; real
engine pairs agree on 95-99%) the routes are not the model's decisions for those tokens (rows shifted or permuted,
layers rotated, samples swapped without their routes): finding ``foreign_routes``. A record of another architecture
than the checkpoint (layers, experts, top-k, vocabulary, config fingerprint, router weights) is finding
``other_model``. A checkpoint directory without weight files (a bare config.json) skips the check and says so.

A record whose row count does not match its tokens, or whose ids are out of range, does not load at all
(:meth:`moealign.record.RolloutRecord.load` refuses it, naming the problem).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..routing_replay.degenerate import DEGENERATE_CHECKS as CHECKS
from ..routing_replay.degenerate import MIN_ROWS, find_degenerate
from ..routing_replay.flips import foreign_routes, route_flip_metrics
from .rollout import RolloutRecord

#: ``record -> (summary, findings)``: a model's routers run on a record's tokens (:func:`compare_routes`)
RouterCheck = Callable[[RolloutRecord], "tuple[dict[str, Any], list[dict[str, str]]]"]

__all__ = ["MIN_ROWS", "CHECKS", "RouterCheck", "inspect_record", "format_inspection", "compare_routes"]


def compare_routes(record: RolloutRecord, own: torch.Tensor, what: str) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """``record``'s recorded expert sets vs ``own``, a model's own routes on the record's tokens (``[route rows,
    layers, k]``, the record's rows concatenated; ``what`` names the model): ``(summary, findings)`` with
    ``router_agreement`` (fraction of recorded (row, layer) pairs whose expert set equals the model's own),
    ``router_pairs``, ``router_check`` and the finding ``foreign_routes`` (agreement below
    ``1 -`` :data:`~moealign.routing_replay.flips.FOREIGN_FLIP_RATE`)."""
    recorded = torch.cat([s.routes.to(torch.int64) for s in record.samples])
    present = torch.cat([s.routed_rows for s in record.samples])
    flips = route_flip_metrics(own, recorded, present)
    pairs = flips.num_tokens * flips.num_layers
    summary = {"router_agreement": 1.0 - flips.router_flip_rate, "router_pairs": pairs,
               "router_check": f"{what} on {flips.num_tokens} recorded rows"}
    foreign = foreign_routes(flips.router_flip_rate, pairs=pairs)
    findings = [{"check": "foreign_routes", "detail": f"{foreign} (agreement {1 - flips.router_flip_rate:.1%})"}
                ] if foreign else []
    return summary, findings


def inspect_record(record: RolloutRecord, *, model_moe_layers: tuple[int, ...] | None = None,
                   router_check: RouterCheck | None = None) -> dict[str, Any]:
    """Summary and findings of ``record``. ``model_moe_layers``: the decoder layers the model runs as MoE (from its
    config, e.g. :func:`moealign.families.get_family`), to check the record's layer list against; ``router_check``:
    a model's routers on the record's tokens, ``record -> (summary, findings)`` merged into the result when the record
    has recorded rows (``record inspect --model``: :func:`moealign.mismatch.router_check.router_check`).

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
        "missing_row_fraction": record.missing_row_fraction if has_routes else None,
        "stale_rows": sum(int(s.stale_rows().sum()) for s in samples) if has_routes else None,
        "kept_sets": bool(samples) and samples[0].kept_offsets is not None,
        "router_signature": bool(meta.router_signature),
    }
    if not has_routes or rows == 0:
        findings = find_degenerate(torch.zeros(0, len(meta.moe_layers), meta.top_k), meta.moe_layers,
                                   model_moe_layers=model_moe_layers)
        findings.append({"check": "no_routes", "detail": "the record has no route table: routing replay has nothing "
                         "to replay and no capture can be checked (record the routes at rollout)"})
        return {"summary": summary, "findings": findings}
    present = torch.cat([s.routed_rows for s in samples])
    routes = torch.cat([s.routes for s in samples])[present]           # [recorded rows, layers, k]
    findings = find_degenerate(routes, meta.moe_layers, model_moe_layers=model_moe_layers)
    if routes.shape[0] == 0:
        findings.append({"check": "zero_rows", "detail": "every route row is marked missing: nothing would replay"})
    elif router_check is not None:
        checked, found = router_check(record)
        summary.update(checked)
        findings += found
    return {"summary": summary, "findings": findings}


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def format_inspection(result: dict[str, Any]) -> str:
    """A plain-text report of :func:`inspect_record`'s result."""
    s = result["summary"]
    lines = [f"engine {s['engine']} {s['engine_version']}, model {s['model'] or '?'} ({s['model_fingerprint'][:12]}), "
             f"{s['dtype']}",
             f"layers {s['num_layers']}, MoE layers {s['moe_layers']}, {s['num_experts']} experts, top-{s['top_k']}",
             f"{s['samples']} samples, {s['response_tokens']} response tokens, {s['route_rows']} route rows "
             f"({s['route_dtype'] or 'no routes'}), missing rows {_fraction(s['missing_row_fraction'])}, "
             f"stale rows {s['stale_rows'] if s['stale_rows'] is not None else '-'}, "
             f"kept sets {'yes' if s['kept_sets'] else 'no'}, router signature {'yes' if s['router_signature'] else 'no'}"]
    if "router_check" in s:
        agreement = s["router_agreement"]
        lines.append(f"router check: {s['router_check']}" + ("" if agreement is None else
                     f": the record's expert set is the model's own on {_fraction(agreement)} of "
                     f"{s['router_pairs']} (row, layer) pairs"))
    if result["findings"]:
        lines += [f"FOUND {f['check']}: {f['detail']}" for f in result["findings"]]
    else:
        checked = CHECKS + (("other_model", "foreign_routes") if s.get("router_agreement") is not None else ())
        lines.append("no broken-capture pattern found (" + ", ".join(checked) + ")")
    return "\n".join(lines)
