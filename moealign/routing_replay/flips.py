"""Route flips: how often two route tables (e.g. rollout engine vs trainer) chose different experts.

Both tables are ``[tokens, layers, k]`` with distinct ids per row. A (token, layer) pair *flips* when
its expert SET differs; slot order is ignored (``[3, 1]`` equals ``[1, 3]``). Rates are over valid
tokens only (``valid`` [tokens] bool, default all):

* ``per_layer_flip_rate[l]``: fraction of tokens whose set differs at layer ``l``;
* ``router_flip_rate``: fraction of (token, layer) pairs that differ (the mean of the per-layer rates);
* ``token_flip_rate``: fraction of tokens that differ at one layer or more;
* ``mean_jaccard``: mean over (token, layer) of ``|A & B| / |A | B|`` (1 when nothing flips).

Routes that are not the model's own decisions for their tokens (shifted or permuted rows, layers rotated, samples
swapped without their routes, a record of another model) flip far more than any engine pair:
:func:`foreign_routes` names a router flip rate above :data:`FOREIGN_FLIP_RATE` (``moealign mismatch`` warns,
``record inspect --model`` reports it).

Vectorised: one sort per table and a ``[tokens, layers, k, k]`` comparison (k is small), then one host
transfer of all numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .routes import RouteError, check_integer_tensor, describe

__all__ = ["RouteFlipMetrics", "route_flip_metrics", "flipped_slots", "FOREIGN_FLIP_RATE", "foreign_routes"]

#: The router flip rate ((token, layer) pairs whose expert set differs) above which a route table is taken for
#: another model's decisions or for routes laid against the wrong tokens. Real engine pairs (bf16 vs fp32, another
#: kernel, another engine) flip 1-5% of pairs; the embedded model's routes shifted by one row flip 99%. Half the pairs
#: is ten times the largest real rate and still far below misaligned routes, even with few experts (Mixtral's
#: 8 choose 2 sets agree by chance on a few percent of rows).
FOREIGN_FLIP_RATE = 0.5


@dataclass
class RouteFlipMetrics:
    per_layer_flip_rate: list[float]
    router_flip_rate: float
    token_flip_rate: float
    mean_jaccard: float
    num_tokens: int
    num_layers: int

    def to_dict(self) -> dict:
        """Plain Python values (the per-layer list copied), ready for a logger or JSON."""
        return asdict(self)


def _sorted_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    x = x.to(torch.int64).sort(dim=-1).values
    if x.shape[-1] > 1:
        duplicate = (x[..., 1:] == x[..., :-1]).any(dim=-1)
        if bool(duplicate.any()):
            token, layer = (int(i) for i in duplicate.nonzero()[0])
            raise RouteError(f"{name} token {token} layer {layer} repeats an expert: {x[token, layer].tolist()}")
    return x


def _shared_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[tokens, layers]`` ``|A & B|``: the experts two route tables share per (token, layer), slot order ignored
    (tables checked: same ``[tokens, layers, k]`` shape, integer, no expert repeated in a row)."""
    check_integer_tensor(a, "a")
    check_integer_tensor(b, "b")
    if a.dim() != 3 or a.shape != b.shape:
        raise RouteError(
            f"route tables must both have shape [tokens, layers, k]: a {tuple(a.shape)} vs b {tuple(b.shape)}"
        )
    if a.shape[1] == 0 or a.shape[2] == 0:
        raise RouteError(f"route tables have no (layer, expert) slots: shape {tuple(a.shape)}")
    a = _sorted_rows(a, "a")
    b = _sorted_rows(b.to(a.device), "b")
    return (a.unsqueeze(-1) == b.unsqueeze(-2)).sum(dim=(-1, -2))


def flipped_slots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[tokens, layers]`` bool: the (token, layer) slots whose expert sets differ between ``a`` and ``b``."""
    return _shared_experts(a, b) != a.shape[-1]


def route_flip_metrics(
    a: torch.Tensor, b: torch.Tensor, valid: torch.Tensor | None = None
) -> RouteFlipMetrics:
    """Flip metrics between route tables ``a`` and ``b`` (``[tokens, layers, k]``, any integer dtypes)."""
    shared = _shared_experts(a, b)   # |A & B| per (token, layer)
    tokens, layers, k = a.shape
    if valid is None:
        valid = torch.ones(tokens, dtype=torch.bool, device=a.device)
    else:
        if not isinstance(valid, torch.Tensor) or valid.shape != (tokens,):
            raise RouteError(
                f"valid must have shape ({tokens},) to match the route tables {tuple(a.shape)}, got {describe(valid)}"
            )
        if valid.dtype != torch.bool:
            raise RouteError(f"valid must be a bool tensor, got dtype {valid.dtype}")
        valid = valid.to(a.device)
    flipped = shared != k  # distinct ids and equal sizes: same set iff all k are shared
    jaccard = shared.double() / (2 * k - shared).double()  # |A | B| = 2k - |A & B|

    validf = valid.double()
    num_tokens = validf.sum()
    flips_per_layer = (flipped.double() * validf[:, None]).sum(dim=0)
    per_layer = flips_per_layer / num_tokens
    router_flip = flips_per_layer.sum() / (num_tokens * layers)
    token_flip = (flipped.any(dim=1).double() * validf).sum() / num_tokens
    mean_jaccard = (jaccard * validf[:, None]).sum() / (num_tokens * layers)
    numbers = torch.stack([num_tokens, router_flip, token_flip, mean_jaccard])
    numbers = torch.cat([numbers, per_layer]).tolist()
    if numbers[0] == 0:
        raise RouteError(f"no valid token to compare (valid has {tokens} entries, none True)")
    return RouteFlipMetrics(
        per_layer_flip_rate=numbers[4:],
        router_flip_rate=numbers[1],
        token_flip_rate=numbers[2],
        mean_jaccard=numbers[3],
        num_tokens=int(numbers[0]),
        num_layers=layers,
    )


def foreign_routes(router_flip_rate: float, *, pairs: int | None = None) -> str | None:
    """The problem, in words, when ``router_flip_rate`` (of the model's own top-k against a route table) is above
    :data:`FOREIGN_FLIP_RATE`; ``None`` otherwise (NaN, no pairs compared, included). ``pairs``: how many (token,
    layer) pairs were compared (named in the message)."""
    if not router_flip_rate > FOREIGN_FLIP_RATE:
        return None
    counted = f" of {pairs}" if pairs is not None else ""
    return (f"the model's own routers choose another expert set than the record on {router_flip_rate:.1%}{counted} "
            f"(token, layer) pairs (threshold {FOREIGN_FLIP_RATE:.0%}; real engine pairs differ on 1-5%): the "
            f"record's routes are not this model's decisions for these tokens: routes shifted, permuted or swapped "
            f"between rows, layers or samples, or a record of another model")
