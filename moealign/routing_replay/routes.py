"""Route tables: the expert ids each token was sent to, validated and stored compactly.

A route row is the ``k`` expert ids one router chose for one token (``ids[..., k]``). Rows hold distinct
ids in ``[0, num_experts)``; slot order carries no meaning for the expert *set* (it does for the gate
weights, which are replayed slot by slot). Tables are stored as ``uint8`` when every id fits
(``num_experts <= 256``) and ``int16`` otherwise (``num_experts <= 32767``; int16 is signed, and the
largest id is ``num_experts - 1``), and widened to ``int64`` only where an index is needed.

Every bad input raises :class:`RouteError` (a ``ValueError``) naming the tensor, the offending row or
index, and the value. Validation is vectorised: a handful of whole-tensor ops and one host transfer of
the flags, no Python loop over rows.
"""

from __future__ import annotations

import torch

from ..errors import RouteError

__all__ = ["RouteError", "compact_routes", "expand_routes", "route_dtype", "validate_routes"]

UINT8_MAX_EXPERTS = 256
INT16_MAX_EXPERTS = 32767


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def check_num_experts(num_experts, what: str = "num_experts") -> int:
    """``num_experts`` as an int >= 1 (bools and floats rejected)."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise RouteError(f"{what} must be an int, got {type(num_experts).__name__} {num_experts!r}")
    if num_experts < 1:
        raise RouteError(f"{what} must be >= 1, got {num_experts}")
    return num_experts


def check_integer_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise RouteError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not _is_integer_dtype(x.dtype):
        raise RouteError(f"{name} must be an integer tensor, got dtype {x.dtype}")
    return x


def describe(x) -> str:
    """A tensor's shape, or the type name of anything else, for error messages."""
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest storage dtype that holds every expert id of a model with ``num_experts`` experts.

    ``torch.uint8`` up to 256 experts, ``torch.int16`` up to 32767; more is a :class:`RouteError`.
    """
    num_experts = check_num_experts(num_experts)
    if num_experts <= UINT8_MAX_EXPERTS:
        return torch.uint8
    if num_experts <= INT16_MAX_EXPERTS:
        return torch.int16
    raise RouteError(
        f"num_experts={num_experts} does not fit a compact route table (at most {INT16_MAX_EXPERTS} experts)"
    )


def _index_str(index: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in index) + "]"


def validate_routes(ids: torch.Tensor, num_experts: int, *, name: str = "routes") -> None:
    """Check a route table ``ids[..., k]``; raise :class:`RouteError` naming the first problem.

    Checks, in order: an integer (non-bool) dtype, at least one dimension, ``k >= 1``,
    ``k <= num_experts``, every id in ``[0, num_experts)`` (the message gives the first offending index
    and its value), and distinct ids within each row (the message gives the first offending row).
    Cost: one comparison pass, then k(k-1)/2 vector compares (k <= 8) or one sort along ``k``; the only host syncs are
    the two ``any()`` flags (plus the look-up of the first offender when one exists).
    """
    check_integer_tensor(ids, name)
    num_experts = check_num_experts(num_experts)
    if ids.dim() == 0:
        raise RouteError(f"{name} must have shape [..., k], got a 0-d tensor")
    k = ids.shape[-1]
    if k == 0:
        raise RouteError(f"{name} has k = 0 experts per token (shape {tuple(ids.shape)})")
    if k > num_experts:
        raise RouteError(
            f"{name} has k = {k} experts per token but there are only num_experts = {num_experts} experts"
        )
    if ids.numel() == 0:
        return
    # compare in a dtype that can hold num_experts: on uint8 routes, 256 wraps to 0
    if ids.dtype == torch.int64 or num_experts <= torch.iinfo(ids.dtype).max:
        out_of_range = (ids < 0) | (ids >= num_experts)
    else:
        out_of_range = ids < 0
    if bool(out_of_range.any()):
        index = tuple(int(i) for i in out_of_range.nonzero()[0])
        raise RouteError(
            f"{name}{_index_str(index)} = {int(ids[index])} is not an expert id in [0, {num_experts})"
        )
    if k > 1:
        if k <= 8:   # k(k-1)/2 vector compares are cheaper than a sort along a short last axis
            duplicate = torch.zeros(ids.shape[:-1], dtype=torch.bool, device=ids.device)
            for i in range(k - 1):
                duplicate |= (ids[..., i + 1:] == ids[..., i:i + 1]).any(dim=-1)
        else:
            sorted_ids = ids.sort(dim=-1).values
            duplicate = (sorted_ids[..., 1:] == sorted_ids[..., :-1]).any(dim=-1)
        if bool(duplicate.any()):
            row = tuple(int(i) for i in duplicate.nonzero()[0])
            sorted_row = ids[row].sort().values
            value = int(sorted_row[1:][sorted_row[1:] == sorted_row[:-1]][0])
            raise RouteError(
                f"{name} row {_index_str(row)} repeats expert {value}: {ids[row].tolist()} "
                "(a token's k experts must be distinct)"
            )


def compact_routes(ids: torch.Tensor, num_experts: int, *, missing: torch.Tensor | None = None) -> torch.Tensor:
    """Validate ``ids[..., k]`` and cast it to :func:`route_dtype` ``(num_experts)`` for storage.

    ``missing`` (bool ``[rows]``, one flag per row ``ids[r]``): rows without a recorded route; they are not
    validated and are stored as 0 (the record's filler for a missing row, :attr:`moealign.record.Sample.route_missing`).
    """
    if missing is None:
        validate_routes(ids, num_experts)
        return ids.to(route_dtype(num_experts))
    check_integer_tensor(ids, "routes")
    if not isinstance(missing, torch.Tensor) or missing.dtype != torch.bool or missing.shape != ids.shape[:1]:
        raise RouteError(f"missing must be a bool tensor with one flag per route row {tuple(ids.shape[:1])}, got "
                         f"{getattr(missing, 'dtype', type(missing).__name__)} {tuple(getattr(missing, 'shape', ()))}")
    validate_routes(ids[~missing], num_experts)
    out = ids.to(torch.int64).masked_fill(missing.reshape(-1, *([1] * (ids.dim() - 1))), 0)
    return out.to(route_dtype(num_experts))


def expand_routes(ids: torch.Tensor) -> torch.Tensor:
    """A stored route table (uint8 / int16 / any integer dtype) as int64, ready to index with."""
    check_integer_tensor(ids, "routes")
    return ids.to(torch.int64)
