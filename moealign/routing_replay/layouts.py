"""Route layouts: which record row each router row holds under context, sequence and THD packing.

Pure torch, no engine import: the Megatron adapter applies these to its routers, and they are tested
against Megatron's own ``get_batch_on_this_cp_rank``."""

from __future__ import annotations

import torch

from .._validate import check_offsets
from ..errors import RouteError


def _cu(cu_seqlens, name: str) -> torch.Tensor:
    return check_offsets(cu_seqlens, name, RouteError)


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
