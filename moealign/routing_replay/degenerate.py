"""The route-table patterns that mean a route capture broke, in one place: ``moealign record inspect`` reports them,
and a :class:`~moealign.routing_replay.protocol.ReplayBatch` that shows them is refused when it is built (once, where
the data enters; the adapters' ``set_routes`` trust a built batch).

A capture that "silently did nothing" leaves a recognisable table: a buffer never written (all expert 0), one layer's
routes copied into every layer, one default expert set written for every token, or a layer list naming layers the
model runs dense. Each check takes the *recorded* rows only (rows marked missing or padding are left out by the
caller) and is a few tensor operations on the whole table; no check speaks below :data:`MIN_ROWS` rows, where a
short batch may legitimately route every token alike.

* ``zero_rows``: with ``k >= 2`` an all-zero row repeats expert 0 and is refused by route validation already; with
  ``k = 1`` and several layers a row is suspicious if it is expert 0 in *every* layer, and the pattern is reported when
  at least 4 rows are, and they are at least half of the rows with expert 0 in *some* layer: a real router's choices
  of expert 0 in different layers are nearly independent (``1/E`` each, so rows zero everywhere are a small share of
  rows zero somewhere), a never-written buffer is zero in every layer at once. One MoE layer of top-1 routes cannot
  tell a written expert 0 from an unwritten one, and is not judged;
* ``constant_layer``: a layer in which at least :data:`DOMINANT_SHARE` (90%) of the rows route to one expert set;
* ``identical_layers``: at least 90% of the rows have the same expert set in every layer;
* ``repeated_set``: one expert set for at least 90% of the rows of every layer together (reported instead of the
  two above);
* ``dense_layers``: the table's layers include layers the model runs dense.

Pure torch.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["DEGENERATE_CHECKS", "DOMINANT_SHARE", "MIN_ROWS", "find_degenerate"]

#: Fewest recorded rows for the constant / identical / repeated / zero checks to be meaningful.
MIN_ROWS = 16

DEGENERATE_CHECKS = ("zero_rows", "constant_layer", "identical_layers", "repeated_set", "dense_layers")

#: The share of rows at or above which one expert set (per layer, everywhere) or identical layers count as a broken
#: capture. A real router spreads its tokens: a trained MoE's busiest top-k set holds a few percent of a layer's
#: tokens, never most of them.
DOMINANT_SHARE = 0.9

_ZERO_MIN_ROWS = 4
_ZERO_SHARE = 0.5


def _set_keys(sets: torch.Tensor) -> torch.Tensor:
    """One int64 key per sorted expert set (``[rows, layers, k]`` -> ``[rows, layers]``): positional in base 2**15
    (exact for k <= 4; beyond, int64 arithmetic wraps and two sets may share a key with negligible probability,
    which could only raise a share, never hide a pattern)."""
    weights = torch.ones(sets.shape[-1], dtype=torch.int64, device=sets.device)
    for j in range(1, sets.shape[-1]):
        weights[j] = weights[j - 1] * (1 << 15)
    return (sets.long() * weights).sum(dim=-1)


def find_degenerate(routes: torch.Tensor, moe_layers: Sequence[int], *,
                    model_moe_layers: Sequence[int] | None = None) -> list[dict[str, str]]:
    """The broken-capture patterns in ``routes`` (integer ``[rows, len(moe_layers), k]``, recorded rows only) as
    ``[{"check", "detail"}]`` (empty: none seen). ``model_moe_layers``: the layers the model runs as MoE."""
    moe_layers = list(moe_layers)
    findings: list[dict[str, str]] = []
    if model_moe_layers is not None:
        dense = sorted(set(moe_layers) - set(model_moe_layers))
        if dense:
            findings.append({"check": "dense_layers", "detail": f"routes for layers {dense}, which the model runs "
                             f"dense (its MoE layers: {sorted(model_moe_layers)})"})
    rows = int(routes.shape[0])
    if rows < MIN_ROWS:
        return findings
    sets = routes.long().sort(dim=-1).values                            # slot order is not part of a route
    if sets.shape[-1] == 1 and len(moe_layers) > 1:
        zero = sets[..., 0] == 0                                         # [rows, layers]
        everywhere, anywhere = int(zero.all(dim=-1).sum()), int(zero.any(dim=-1).sum())
        if everywhere >= _ZERO_MIN_ROWS and everywhere >= _ZERO_SHARE * anywhere:
            findings.append({"check": "zero_rows", "detail": f"{everywhere} of {rows} rows route to expert 0 in every "
                             f"layer ({anywhere} rows have expert 0 in some layer): a capture buffer that was never "
                             f"written"})
    n_layers = sets.shape[1]
    keys = _set_keys(sets)                                               # [rows, layers]: one key per expert set
    mode = keys.median(dim=0).values                                     # a set held by > half the rows is the median
    layer_share = (keys == mode).double().mean(dim=0)                    # [layers]
    everywhere = keys.reshape(-1).median()
    all_share = float((keys == everywhere).double().mean())
    pct = f"{DOMINANT_SHARE:.0%}"
    if n_layers > 1 and all_share >= DOMINANT_SHARE:
        r, l = (keys == everywhere).nonzero()[0].tolist()
        findings.append({"check": "repeated_set", "detail": f"{all_share:.1%} of the {rows} rows x {n_layers} layers "
                         f"route to experts {sets[r, l].tolist()}: a default written for most tokens, not a capture "
                         f"(threshold {pct} of rows)"})
        return findings
    constant = (layer_share >= DOMINANT_SHARE).nonzero().flatten().tolist()
    if constant:
        shares = ", ".join(f"{moe_layers[i]}: {float(layer_share[i]):.1%}" for i in constant)
        findings.append({"check": "constant_layer", "detail": f"layers {[moe_layers[i] for i in constant]} route most "
                         f"of the {rows} rows to one expert set each ({shares}; threshold {pct} of rows)"})
    if n_layers > 1:
        identical = float((sets == sets[:, :1]).all(dim=-1).all(dim=-1).double().mean())
        if identical >= DOMINANT_SHARE:
            findings.append({"check": "identical_layers", "detail": f"{identical:.1%} of the {rows} rows have the same "
                             f"expert set in every one of the {n_layers} layers: one layer's routes copied into all "
                             f"(threshold {pct} of rows)"})
    return findings
