"""The numbers behind the report's plots, from the lever runs' per-token results (JSON-ready, pure torch).

Each function returns one ``report["plots"]`` section (schema in :mod:`moealign.mismatch.html_report`); the
HTML report draws them and ``--json`` carries them, so the page and the JSON show the same numbers.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

__all__ = ["HIST_EDGES", "IS_GRID", "flip_rate", "logp_hist", "by_position", "is_tail", "kept_set_support",
           "worst_tokens", "position_means"]

#: |delta log p| histogram edges (log-spaced, 1e-8 .. 1e2); exact zeros are counted apart.
HIST_EDGES = [10.0 ** (e / 4) for e in range(-32, 9)]
#: IS-ratio grid (log-spaced, 1e-2 .. 1e2, 100 points a decade: ratios a few percent from 1, as a bf16 vs fp32 run
#: gives, still span several points).
IS_GRID = [10.0 ** (e / 100) for e in range(-200, 201)]


def _nan_to_none(values):
    return [None if (isinstance(v, float) and not math.isfinite(v)) else v for v in values]


def flip_rate(runs: dict, layers: Sequence[int]) -> dict:
    """``{"layers", "series": {run: per-layer router flip rate}}``."""
    return {"layers": list(layers), "series": {name: list(r.per_layer_flip_rate) for name, r in runs.items()}}


def logp_hist(runs: dict) -> dict:
    """|delta log p| per run counted in :data:`HIST_EDGES` bins (values past the last edge in the last bin),
    exact zeros apart."""
    edges = torch.tensor(HIST_EDGES, dtype=torch.float64)
    series, zeros = {}, {}
    for name, r in runs.items():
        d = (r.train_logprobs.double() - r.rollout_logprobs.double()).abs()
        d = d[torch.isfinite(d)]
        zeros[name] = int((d == 0).sum())
        nz = d[d > 0].clamp(edges[0], edges[-1])
        idx = torch.bucketize(nz, edges, right=True).clamp(1, len(edges) - 1) - 1
        series[name] = torch.bincount(idx, minlength=len(edges) - 1).tolist()
    return {"edges": HIST_EDGES, "series": series, "zeros": zeros}


def position_means(values: torch.Tensor, lengths: Sequence[int]) -> list[float]:
    """Mean of ``values`` (``[N]``, samples' responses concatenated) per response position (NaN where none)."""
    width = max(lengths) if lengths else 0
    sums = torch.zeros(width, dtype=torch.float64)
    counts = torch.zeros(width, dtype=torch.float64)
    pos = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
    sums.index_add_(0, pos, values.double())
    counts.index_add_(0, pos, torch.ones_like(values, dtype=torch.float64))
    return [float(s / c) if c > 0 else float("nan") for s, c in zip(sums, counts)]


def by_position(runs: dict, lengths: Sequence[int]) -> dict:
    """``{"positions", "series": {run: mean |delta log p| per response position}}``."""
    series = {name: _nan_to_none(position_means((r.train_logprobs - r.rollout_logprobs).abs(), lengths))
              for name, r in runs.items()}
    return {"positions": list(range(max(lengths) if lengths else 0)), "series": series}


def is_tail(runs: dict, icepop_band=(0.5, 5.0), tis_threshold: float = 2.0) -> dict:
    """The token IS ratio ``exp(train - rollout)`` tail per run: the fraction above / below each grid ratio."""
    grid = torch.tensor(IS_GRID, dtype=torch.float64)
    series = {}
    for name, r in runs.items():
        ratio = torch.exp(r.train_logprobs.double() - r.rollout_logprobs.double())
        n = max(int(ratio.numel()), 1)
        ratio = torch.sort(ratio[~torch.isnan(ratio)]).values         # NaN is neither above nor below
        above = (ratio.numel() - torch.searchsorted(ratio, grid, right=True)).double() / n   # count(ratio > g)
        below = torch.searchsorted(ratio, grid, right=False).double() / n                     # count(ratio < g)
        series[name] = {"above": above.tolist(), "below": below.tolist()}
    return {"grid": IS_GRID, "series": series, "icepop_band": list(icepop_band), "tis_threshold": tis_threshold}


def kept_set_support(runs: dict, kept_sizes: torch.Tensor | None) -> dict:
    """Support-mismatch rate per kept-set size bin (powers of two) per run; empty without kept sets."""
    if kept_sizes is None or kept_sizes.numel() == 0:
        return {}
    top = max(int(kept_sizes.max()), 1)
    edges = [2 ** i for i in range(int(math.ceil(math.log2(top))) + 1)]
    idx = torch.bucketize(kept_sizes.double(), torch.tensor(edges, dtype=torch.float64))
    series = {}
    for name, r in runs.items():
        if r.support_mismatch is None:
            continue
        tokens = torch.bincount(idx, minlength=len(edges)).double()
        bad = torch.bincount(idx, weights=r.support_mismatch.double(), minlength=len(edges))
        rate = [float(b / t) if t > 0 else float("nan") for b, t in zip(bad, tokens)]
        series[name] = {"tokens": [int(t) for t in tokens], "support_mismatch_rate": _nan_to_none(rate)}
    return {"sizes": edges, "series": series} if series else {}


def worst_tokens(run, record, decode: Callable[[list[int]], str] | None, *, count: int = 20,
                 context_tokens: int = 12) -> list[dict]:
    """The ``count`` tokens of ``run`` with the largest |delta log p|: sample, response position, text context,
    both log-probs, and the MoE layers whose routes differed at the row that computed the token's logits."""
    d = (run.train_logprobs - run.rollout_logprobs).abs()
    d = torch.where(torch.isfinite(d), d, torch.full_like(d, float("inf")))
    order = torch.argsort(d, descending=True)[:count]
    starts, s0 = [], 0
    for s in record.samples:
        starts.append(s0)
        s0 += s.response_len
    row_starts, r0 = [], 0
    for s in record.samples:
        row_starts.append(r0)
        r0 += int(s.routes.shape[0]) if s.routes is not None else 0
    routed = torch.cat([s.routed_rows for s in record.samples]) if record.has_routes else None
    routed_index = torch.cumsum(routed.long(), 0) - 1 if routed is not None else None
    out = []
    for i in order.tolist():
        b = max(j for j, st in enumerate(starts) if st <= i)
        sample = record.samples[b]
        t = i - starts[b]
        pos = sample.prompt_len + t                       # the token's position in the sequence
        tokens = sample.token_ids.tolist()
        flipped = []
        row = row_starts[b] + pos - 1                     # the row whose logits scored the token
        if routed is not None and row < routed.numel() and bool(routed[row]):
            k = int(routed_index[row])
            if k < run.flipped.shape[0]:
                layers = record.meta.moe_layers
                flipped = [int(layers[x]) for x in run.flipped[k].nonzero().flatten()]
        ctx = tokens[max(0, pos - context_tokens):pos]
        out.append({"sample": b, "position": t,
                    "context": decode(ctx) if decode else " ".join(map(str, ctx)),
                    "token": decode([tokens[pos]]) if decode else str(tokens[pos]),
                    "abs_logp_diff": float(d[i]), "rollout_logp": float(run.rollout_logprobs[i]),
                    "train_logp": float(run.train_logprobs[i]), "flipped_layers": flipped})
    return out
