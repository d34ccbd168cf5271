"""The record's batch layouts: :class:`PaddedBatch` (``[B, T]``, left or right padded) and :class:`PackedBatch` (one
row of concatenated samples, ``cu_seqlens``), built from a record's samples and read back into samples, and the
routes of each laid out for a trainer (``replay_batch``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import RecordError
from ..routing_replay.protocol import ReplayBatch
from ..routing_replay.routes import expand_routes
from ..routing_replay.sampling_mask import KeptSets
from .meta import RecordMeta, SamplingParams
from .sample import Sample


@dataclass
class PaddedBatch:
    """``[B, T]`` layout. Positions index tokens; route row ``t`` is for input token ``t``.

    ``route_mask`` marks rows that carry a recorded route (all real tokens but the last of each
    sample). ``logprobs`` / ``response_mask`` sit at the position of the token they score, and
    ``kept_row`` gives each response token's row in the record-wide CSR kept sets (-1 elsewhere).
    """

    input_ids: torch.Tensor        # int64 [B, T]
    attention_mask: torch.Tensor   # int64 [B, T]
    response_mask: torch.Tensor    # bool [B, T]
    logprobs: torch.Tensor         # float32 [B, T] (0 off the response)
    routes: torch.Tensor | None    # [B, T, n_layers, k] record dtype (0 where route_mask is False)
    route_mask: torch.Tensor       # bool [B, T]
    kept_row: torch.Tensor         # int64 [B, T]
    kept_offsets: torch.Tensor | None
    kept_ids: torch.Tensor | None
    prompt_lens: torch.Tensor      # int64 [B]
    lengths: torch.Tensor          # int64 [B]
    side: str = "right"
    moe_layers: tuple[int, ...] = ()   # decoder layer of each route column

    @property
    def position_ids(self) -> torch.Tensor:
        pos = self.attention_mask.cumsum(-1) - 1
        return pos.clamp(min=0)

    def replay_batch(self, *, allow_degenerate: bool = False) -> ReplayBatch:
        """The routes of this batch together with its tokens and mask, for an adapter's ``set_routes``
        (``allow_degenerate``: skip the broken-capture pattern checks, :class:`ReplayBatch`)."""
        if self.routes is None:
            raise RecordError("this batch has no routes (record with routing capture enabled)")
        return ReplayBatch.padded(expand_routes(self.routes), input_ids=self.input_ids,
                                  attention_mask=self.attention_mask, moe_layers=self.moe_layers,
                                  route_mask=self.route_mask, allow_degenerate=allow_degenerate)


@dataclass
class PackedBatch:
    """One row of concatenated samples (``[N]`` tensors), ``cu_seqlens`` ``[B + 1]``."""

    input_ids: torch.Tensor        # int64 [N]
    position_ids: torch.Tensor     # int64 [N]
    cu_seqlens: torch.Tensor       # int64 [B + 1]
    response_mask: torch.Tensor    # bool [N]
    logprobs: torch.Tensor         # float32 [N]
    routes: torch.Tensor | None    # [N, n_layers, k]
    route_mask: torch.Tensor       # bool [N]
    kept_row: torch.Tensor         # int64 [N]
    kept_offsets: torch.Tensor | None
    kept_ids: torch.Tensor | None
    prompt_lens: torch.Tensor      # int64 [B]
    moe_layers: tuple[int, ...] = ()   # decoder layer of each route column

    def replay_batch(self, *, allow_degenerate: bool = False) -> ReplayBatch:
        """The routes of this packed row together with its tokens and ``cu_seqlens``, for ``set_routes``."""
        if self.routes is None:
            raise RecordError("this batch has no routes (record with routing capture enabled)")
        return ReplayBatch.packed(expand_routes(self.routes), input_ids=self.input_ids, cu_seqlens=self.cu_seqlens,
                                  moe_layers=self.moe_layers, route_mask=self.route_mask,
                                  allow_degenerate=allow_degenerate)


def _missing_from_mask(routes: torch.Tensor | None, route_mask: torch.Tensor) -> torch.Tensor | None:
    """A sample's ``route_missing`` from a batch's ``route_mask`` over its route rows (None: none missing)."""
    if routes is None or bool(route_mask.all()):
        return None
    return ~route_mask.to(torch.bool).clone()


def concat_kept_sets(samples: Sequence[Sample]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The samples' kept sets as one CSR (rows in sample order); ``(None, None)`` when there are none."""
    if not samples or samples[0].kept_offsets is None:
        return None, None
    parts_off, parts_ids, base = [torch.zeros(1, dtype=torch.int64)], [], 0
    for s in samples:
        parts_off.append(s.kept_offsets[1:].to(torch.int64) + base)
        parts_ids.append(s.kept_ids.to(torch.int32))
        base += int(s.kept_offsets[-1])
    return torch.cat(parts_off), torch.cat(parts_ids)


def kept_sets_of(samples: Sequence[Sample], vocab_size: int) -> KeptSets | None:
    """The samples' kept sets as one trusted :class:`~moealign.routing_replay.sampling_mask.KeptSets` (rows in
    sample order; None when there are none): every sample's sets were checked against the record's vocabulary and
    its own tokens when the sample was built or loaded (:class:`~moealign.record.sample.Sample`), so nothing is
    checked again where they are used."""
    offsets, ids = concat_kept_sets(samples)
    return None if offsets is None else KeptSets.trusted(offsets, ids, vocab_size)


def split_kept_sets(offsets: torch.Tensor, ids: torch.Tensor, response_lens: Sequence[int]):
    out, row = [], 0
    for n in response_lens:
        lo, hi = int(offsets[row]), int(offsets[row + n])
        out.append(((offsets[row:row + n + 1] - lo).clone(), ids[lo:hi].clone()))
        row += n
    return out


# --------------------------------------------------------------------------------------------------
# the record
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# samples <-> layouts (RolloutRecord.to_padded / to_packed / from_padded / from_packed)
# --------------------------------------------------------------------------------------------------


def to_padded(meta: RecordMeta, samples: Sequence[Sample], side: str = "right", pad_token_id: int = 0) -> PaddedBatch:
    """The samples as a ``[B, T]`` batch padded on ``side``."""
    if side not in ("left", "right"):
        raise RecordError(f"padding side must be 'left' or 'right', got {side!r}")
    B = len(samples)
    lengths = torch.tensor([s.length for s in samples], dtype=torch.int64)
    T = int(lengths.max())
    input_ids = torch.full((B, T), int(pad_token_id), dtype=torch.int64)
    attention = torch.zeros(B, T, dtype=torch.int64)
    resp = torch.zeros(B, T, dtype=torch.bool)
    logp = torch.zeros(B, T, dtype=torch.float32)
    route_mask = torch.zeros(B, T, dtype=torch.bool)
    kept_row = torch.full((B, T), -1, dtype=torch.int64)
    routes = None
    if samples[0].routes is not None:
        n, k = len(meta.moe_layers), meta.top_k
        routes = torch.zeros(B, T, n, k, dtype=meta.route_dtype)
    row_base = 0
    for b, s in enumerate(samples):
        L, P = s.length, s.prompt_len
        start = 0 if side == "right" else T - L
        sl = slice(start, start + L)
        input_ids[b, sl] = s.token_ids.to(torch.int64)
        attention[b, sl] = 1
        resp[b, start + P:start + L] = True
        logp[b, start + P:start + L] = s.logprobs.to(torch.float32)
        route_mask[b, start:start + L - 1] = s.routed_rows
        if routes is not None:
            routes[b, start:start + L - 1] = s.routes
        kept_row[b, start + P:start + L] = torch.arange(row_base, row_base + L - P)
        row_base += L - P
    kept_offsets, kept_ids = concat_kept_sets(samples)
    return PaddedBatch(input_ids, attention, resp, logp, routes, route_mask, kept_row, kept_offsets,
                       kept_ids, torch.tensor([s.prompt_len for s in samples]), lengths, side,
                       tuple(meta.moe_layers))


def to_packed(meta: RecordMeta, samples: Sequence[Sample]) -> PackedBatch:
    """The samples as one packed (THD) row."""
    lengths = [s.length for s in samples]
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    input_ids = torch.cat([s.token_ids.to(torch.int64) for s in samples])
    position_ids = torch.cat([torch.arange(L) for L in lengths])
    resp = torch.cat([torch.arange(s.length) >= s.prompt_len for s in samples])
    logp = torch.cat([torch.cat([torch.zeros(s.prompt_len), s.logprobs.to(torch.float32)]) for s in samples])
    route_mask = torch.cat([torch.cat([s.routed_rows, torch.zeros(1, dtype=torch.bool)]) for s in samples])
    routes = None
    if samples[0].routes is not None:
        n, k = len(meta.moe_layers), meta.top_k
        pad = torch.zeros(1, n, k, dtype=meta.route_dtype)
        routes = torch.cat([t for s in samples for t in (s.routes, pad)])
    kept_row = torch.full((int(cu[-1]),), -1, dtype=torch.int64)
    kept_row[resp] = torch.arange(int(resp.sum()))
    kept_offsets, kept_ids = concat_kept_sets(samples)
    return PackedBatch(input_ids, position_ids, cu, resp, logp, routes, route_mask, kept_row, kept_offsets,
                       kept_ids, torch.tensor([s.prompt_len for s in samples]), tuple(meta.moe_layers))


def samples_from_padded(batch: PaddedBatch, sampling: Sequence[SamplingParams]) -> list[Sample]:
    """The samples of a ``[B, T]`` batch (one :class:`SamplingParams` per row), not yet validated."""
    B, T = batch.input_ids.shape
    if len(sampling) != B:
        raise RecordError(f"from_padded: {len(sampling)} sampling params for {B} samples")
    kept = None
    if batch.kept_offsets is not None:
        resp_lens = [int(x) for x in (batch.lengths - batch.prompt_lens)]
        kept = split_kept_sets(batch.kept_offsets, batch.kept_ids, resp_lens)
    samples = []
    for b in range(B):
        L, P = int(batch.lengths[b]), int(batch.prompt_lens[b])
        start = 0 if batch.side == "right" else T - L
        if int(batch.attention_mask[b, start:start + L].sum()) != L:
            raise RecordError(f"from_padded: sample {b}: attention_mask does not cover its {L} tokens "
                              f"on the {batch.side}")
        samples.append(Sample(
            token_ids=batch.input_ids[b, start:start + L].clone(),
            prompt_len=P,
            logprobs=batch.logprobs[b, start + P:start + L].clone(),
            routes=None if batch.routes is None else batch.routes[b, start:start + L - 1].clone(),
            kept_offsets=None if kept is None else kept[b][0],
            kept_ids=None if kept is None else kept[b][1],
            sampling=sampling[b],
            route_missing=_missing_from_mask(batch.routes, batch.route_mask[b, start:start + L - 1])))
    return samples


def samples_from_packed(batch: PackedBatch, sampling: Sequence[SamplingParams]) -> list[Sample]:
    """The samples of a packed row (one :class:`SamplingParams` per sample), not yet validated."""
    cu = [int(x) for x in batch.cu_seqlens]
    B = len(cu) - 1
    if len(sampling) != B or batch.prompt_lens.numel() != B:
        raise RecordError(f"from_packed: cu_seqlens has {B} samples, sampling {len(sampling)}, "
                          f"prompt_lens {batch.prompt_lens.numel()}")
    kept = None
    if batch.kept_offsets is not None:
        resp_lens = [cu[b + 1] - cu[b] - int(batch.prompt_lens[b]) for b in range(B)]
        kept = split_kept_sets(batch.kept_offsets, batch.kept_ids, resp_lens)
    samples = []
    for b in range(B):
        lo, hi, P = cu[b], cu[b + 1], int(batch.prompt_lens[b])
        samples.append(Sample(
            token_ids=batch.input_ids[lo:hi].clone(),
            prompt_len=P,
            logprobs=batch.logprobs[lo + P:hi].clone(),
            routes=None if batch.routes is None else batch.routes[lo:hi - 1].clone(),
            kept_offsets=None if kept is None else kept[b][0],
            kept_ids=None if kept is None else kept[b][1],
            sampling=sampling[b],
            route_missing=_missing_from_mask(batch.routes, batch.route_mask[lo:hi - 1])))
    return samples
