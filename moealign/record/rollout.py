"""The rollout record: :class:`RolloutRecord`, a batch of samples plus the metadata of the model and engine that
produced them (row conventions: :mod:`moealign.record`), its layouts, the routes it hands a trainer and its file."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Sequence

import torch

from ..errors import RecordError
from ..routing_replay.protocol import ReplayBatch
from . import io as _io
from .layouts import PackedBatch, PaddedBatch, samples_from_packed, samples_from_padded, to_packed, to_padded
from .meta import RecordMeta, SamplingParams
from .sample import Sample


class RolloutRecord:
    """A batch of rollout samples plus the metadata of the model and engine that produced them."""

    def __init__(self, meta: RecordMeta, samples: Sequence[Sample], *, validate: bool = True,
                 contract: dict | None = None):
        self.meta = meta
        self.samples = list(samples)
        #: the rollout side's execution contract (:mod:`moealign.contract`), or None when not stated
        self.contract = contract
        if validate:
            self.validate()

    def __len__(self) -> int:
        return len(self.samples)

    def __repr__(self) -> str:
        return (f"RolloutRecord({len(self)} samples, {self.num_response_tokens} response tokens, "
                f"engine={self.meta.engine!r}, layers={list(self.meta.moe_layers)}, "
                f"E={self.meta.num_experts}, k={self.meta.top_k})")

    @property
    def has_routes(self) -> bool:
        return bool(self.samples) and self.samples[0].routes is not None

    @property
    def has_kept_sets(self) -> bool:
        return bool(self.samples) and self.samples[0].kept_offsets is not None

    @property
    def num_response_tokens(self) -> int:
        return sum(s.response_len for s in self.samples)

    @property
    def missing_row_fraction(self) -> float:
        """Fraction of route rows without a recorded route (0.0 when none is missing; the record needs routes)."""
        if not self.has_routes:
            raise RecordError("this record has no routes")
        rows = sum(s.length - 1 for s in self.samples)
        missing = sum(int(s.route_missing.sum()) for s in self.samples if s.route_missing is not None)
        return missing / rows if rows else 0.0

    def validate(self) -> None:
        if not self.samples:
            raise RecordError("a rollout record needs at least one sample")
        if self.contract is not None:
            from ..contract import check_contract

            check_contract(self.contract)
        routes = {s.routes is not None for s in self.samples}
        kept = {s.kept_offsets is not None for s in self.samples}
        if len(routes) > 1 or len(kept) > 1:
            raise RecordError("either every sample has routes (kept sets) or none has")
        want = self.meta.route_dtype
        for i, s in enumerate(self.samples):
            if s.routes is not None and s.routes.dtype != want:
                raise RecordError(f"sample {i}: routes are {s.routes.dtype}, the record stores {want} for "
                                  f"{self.meta.num_experts} experts (use compact_routes)")
            s.validate(self.meta, i)

    # ---------------------------------------------------------------- layouts (moealign.record.layouts)
    def to_padded(self, side: str = "right", pad_token_id: int = 0) -> PaddedBatch:
        return to_padded(self.meta, self.samples, side, pad_token_id)

    def to_packed(self) -> PackedBatch:
        return to_packed(self.meta, self.samples)

    @classmethod
    def from_padded(cls, meta: RecordMeta, batch: PaddedBatch, sampling: Sequence[SamplingParams]) -> "RolloutRecord":
        return cls(meta, samples_from_padded(batch, sampling))

    @classmethod
    def from_packed(cls, meta: RecordMeta, batch: PackedBatch, sampling: Sequence[SamplingParams]) -> "RolloutRecord":
        return cls(meta, samples_from_packed(batch, sampling))

    # ---------------------------------------------------------------- routes for the trainer
    def replay_batch(self, layout: str = "padded", side: str = "right", pad_token_id: int = 0, *,
                     allow_degenerate: bool = False) -> ReplayBatch:
        """The routes for a trainer's ``set_routes``, together with the batch they are laid out for.

        ``layout="padded"`` (``side`` ``"right"`` or ``"left"``): the ``[B, T]`` batch of :meth:`to_padded`;
        ``"packed"``: the one-row THD batch of :meth:`to_packed`. Feed the model exactly this batch's
        ``input_ids`` (the adapters check the tokens each router row holds). ``allow_degenerate``: skip the
        broken-capture pattern checks (:class:`~moealign.routing_replay.protocol.ReplayBatch`), e.g. for a model
        with as many experts as it routes to, where every row holds the same set by construction.
        """
        if not self.has_routes:
            raise RecordError("this record has no routes (record with routing capture enabled)")
        if layout not in ("packed", "padded"):
            raise RecordError(f"layout must be 'packed' or 'padded', got {layout!r}")
        batch = self.to_packed() if layout == "packed" else self.to_padded(side, pad_token_id)
        return batch.replay_batch(allow_degenerate=allow_degenerate)

    # ---------------------------------------------------------------- files (moealign.record.io)
    def _tensors(self) -> dict[str, torch.Tensor]:
        return _io.record_tensors(self)

    def save(self, path: str | os.PathLike) -> None:
        """Write the record as safetensors, validated first and atomically
        (:func:`moealign._files.atomic_write`): a temporary ``.NAME.moealign-tmp-XXXXXXXX`` next to ``path``,
        fsynced, renamed into place; removed on any failure or interrupt, the old file left intact. A ``path``
        that exists and is not a regular file (directory, FIFO, device) is refused (:class:`ConfigError`)."""
        _io.write_record(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, expect: RecordMeta | None = None,
             require_weights: bool = False) -> "RolloutRecord":
        """Read a record; verify format version, checksum (over metadata and tensors), every field's type and
        every index, and (with ``expect``) that it fits the model (:meth:`RecordMeta.check_matches`: a record
        or model without router signature warns that the router weights were not checked, or with
        ``require_weights=True`` is refused)."""
        meta, samples, contract = _io.read_record(path, expect=expect, require_weights=require_weights, stacklevel=3)
        return cls(meta, samples, contract=contract)


def with_meta(record: RolloutRecord, **changes) -> RolloutRecord:
    """A copy of ``record`` with metadata fields replaced (validated again)."""
    return RolloutRecord(replace(record.meta, **changes), record.samples, contract=record.contract)
