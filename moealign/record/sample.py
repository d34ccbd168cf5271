"""One rollout sample (:class:`Sample`: prompt + response, log-probs, routes, kept sets, missing rows, weight
versions) and its checks against the record's metadata. Row conventions: :mod:`moealign.record`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .._validate import check_log_prob_max
from ..errors import RecordError
from ..routing_replay.routes import RouteError, validate_routes
from ..routing_replay.sampling_mask import check_tokens_in_kept, validate_kept_sets
from .meta import RecordMeta, SamplingParams


def routes_from_all_layers(routes: torch.Tensor, moe_layers: Sequence[int]) -> torch.Tensor:
    """Select the MoE layers from an all-decoder-layer route array (vLLM's ``routed_experts``).

    ``routes`` is ``[rows, num_hidden_layers, k]`` (uint8/uint16/int32, numpy or torch).
    """
    t = torch.as_tensor(routes)
    if t.dim() != 3:
        raise RecordError(f"routes must be [rows, layers, k], got shape {tuple(t.shape)}")
    if moe_layers and min(moe_layers) < 0:
        raise RecordError(f"moe_layers must be decoder-layer numbers >= 0, got negative layer {min(moe_layers)}")
    if moe_layers and max(moe_layers) >= t.shape[1]:
        raise RecordError(f"routes have {t.shape[1]} layers but moe_layers go up to {max(moe_layers)}")
    if t.dtype not in (torch.uint8, torch.int16, torch.int32, torch.int64):
        t = t.to(torch.int64)  # torch.uint16 has few kernels; widen first
    return t[:, list(moe_layers)]


@dataclass
class Sample:
    """One prompt + response. See the module docstring for the row conventions."""

    token_ids: torch.Tensor                   # int64 [L]
    prompt_len: int
    logprobs: torch.Tensor                    # float32 [L - prompt_len]
    routes: torch.Tensor | None = None        # [L - 1, n_moe_layers, k] uint8 / int16
    kept_offsets: torch.Tensor | None = None  # int64 [L - prompt_len + 1]
    kept_ids: torch.Tensor | None = None      # int32 [nnz]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    route_missing: torch.Tensor | None = None  # bool [L - 1]: rows without a recorded route (routes hold 0 there)
    route_version: torch.Tensor | None = None  # int64 [L - 1]: weight version each row's route was computed under

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def response_len(self) -> int:
        return self.length - int(self.prompt_len)

    @property
    def response_ids(self) -> torch.Tensor:
        return self.token_ids[self.prompt_len:]

    @property
    def routed_rows(self) -> torch.Tensor:
        """bool ``[L - 1]``: the rows that carry a recorded route (all of them unless :attr:`route_missing` says
        otherwise)."""
        if self.route_missing is None:
            return torch.ones(self.length - 1, dtype=torch.bool)
        return ~self.route_missing

    def stale_rows(self, version: int | None = None) -> torch.Tensor:
        """bool ``[L - 1]``: recorded rows whose route was computed under another weight version than ``version``
        (default: the newest version in the sample); all False without :attr:`route_version`."""
        if self.route_version is None:
            return torch.zeros(self.length - 1, dtype=torch.bool)
        if version is None:
            version = int(self.route_version.max())
        return (self.route_version != int(version)) & self.routed_rows

    def validate(self, meta: RecordMeta, index: int = 0) -> None:
        where = f"sample {index}"
        if self.token_ids.dim() != 1 or self.token_ids.dtype not in (torch.int64, torch.int32):
            raise RecordError(f"{where}: token_ids must be a 1-D integer tensor, got "
                              f"{self.token_ids.dtype} {tuple(self.token_ids.shape)}")
        if not (1 <= self.prompt_len < self.length):
            raise RecordError(f"{where}: need 1 <= prompt_len < len(token_ids) (an empty prompt or an empty "
                              f"response), got prompt_len={self.prompt_len}, len={self.length}")
        if self.length and (int(self.token_ids.min()) < 0 or int(self.token_ids.max()) >= meta.vocab_size):
            raise RecordError(f"{where}: token ids outside [0, vocab_size={meta.vocab_size})")
        if self.logprobs.shape != (self.response_len,):
            raise RecordError(f"{where}: logprobs has shape {tuple(self.logprobs.shape)}, expected "
                              f"({self.response_len},) = response length")
        if not self.logprobs.is_floating_point():
            raise RecordError(f"{where}: logprobs must be floating point, got {self.logprobs.dtype}")
        finite = torch.isfinite(self.logprobs)
        if not bool(finite.all()):
            bad = int((~finite).nonzero()[0, 0])
            raise RecordError(f"{where}: logprobs has NaN/Inf at response position {bad} "
                              f"(value {float(self.logprobs[bad])})")
        check_log_prob_max(float(self.logprobs.max()), f"{where}: logprobs", RecordError)
        if self.routes is not None:
            want = (self.length - 1, len(meta.moe_layers), meta.top_k)
            if tuple(self.routes.shape) != want:
                raise RecordError(f"{where}: routes have shape {tuple(self.routes.shape)}, expected {want} "
                                  f"= [len(token_ids) - 1, len(moe_layers), top_k]")
            _check_row_mask(self.route_missing, "route_missing", torch.bool, self.length - 1, where)
            _check_row_mask(self.route_version, "route_version", torch.int64, self.length - 1, where)
            present = self.routes
            if self.route_missing is not None:
                held = (self.routes[self.route_missing] != 0).any(dim=-1)
                if bool(held.any()):
                    row = int(self.route_missing.nonzero().flatten()[held.nonzero()[0, 0]])
                    raise RecordError(f"{where}: route row {row} is marked missing but holds experts "
                                      f"{self.routes[row, 0].tolist()}...: a missing row holds 0 (it is not replayed)")
                present = self.routes[~self.route_missing]
            try:
                validate_routes(present, meta.num_experts, name=f"{where} routes")
            except RouteError as exc:
                raise RecordError(str(exc)) from None
            if self.route_version is not None and self.length > 1 and int(self.route_version.min()) < 0:
                raise RecordError(f"{where}: route_version holds a negative weight version "
                                  f"{int(self.route_version.min())}")
        elif self.route_missing is not None or self.route_version is not None:
            raise RecordError(f"{where}: route_missing / route_version describe route rows, but the sample has no "
                              f"routes")
        if (self.kept_offsets is None) != (self.kept_ids is None):
            raise RecordError(f"{where}: kept_offsets and kept_ids must be given together")
        if self.kept_offsets is not None:
            try:
                validate_kept_sets(self.kept_offsets, self.kept_ids, meta.vocab_size,
                                   num_rows=self.response_len)
            except ValueError as exc:
                raise RecordError(f"{where}: {exc}") from None
            _check_tokens_in_kept(self, where)


def _check_row_mask(value, name: str, dtype: torch.dtype, rows: int, where: str) -> None:
    if value is None:
        return
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != (rows,):
        raise RecordError(f"{where}: {name} must be {str(dtype).replace('torch.', '')} [{rows}] (one per route row), "
                          f"got {getattr(value, 'dtype', type(value).__name__)} "
                          f"{tuple(getattr(value, 'shape', ()))}")


def _check_tokens_in_kept(sample: Sample, where: str) -> None:
    try:
        check_tokens_in_kept(sample.kept_offsets, sample.kept_ids, sample.response_ids)
    except RouteError as exc:
        if not hasattr(exc, "row"):
            raise RecordError(f"{where}: {exc}") from None
        raise RecordError(f"{where}: sampled token {exc.token} at response position {exc.row} "
                          f"is not in its recorded kept set") from None

