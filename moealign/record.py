"""The rollout record: what flows from the rollout engine to the training engine.

One :class:`RolloutRecord` holds, per sample, the token ids (prompt + response), the prompt length,
the rollout log-probs of the sampled tokens under the distribution that was actually sampled from
(after temperature and truncation), the routes, the kept sampling sets and the sampling parameters;
and, per record, :class:`RecordMeta` (engine and version, model fingerprint, MoE layer numbers,
number of experts, top-k, dtype, format version).

Conventions (vLLM's, so its ``routed_experts`` drop in):

* Route row ``i`` is the decision taken when token ``i`` was the *input*. Rows cover prompt + response
  minus the final token (the last sampled token was never forwarded): ``routes`` is
  ``[len(token_ids) - 1, len(meta.moe_layers), top_k]``.
* Routes are ``uint8`` when the model has <= 256 experts, ``int16`` above (``top_k`` bytes per token
  and layer, or twice that).
* ``meta.moe_layers`` are the decoder-layer numbers of the route table's layer axis (dense layers are
  not stored; :func:`routes_from_all_layers` converts vLLM's all-layer arrays).
* Rows without a recorded route (an engine that did not report them: a prompt prefix served from cache, a -1
  sentinel, a stitched turn's row no engine computed) are explicit: ``Sample.route_missing`` (bool, one per route
  row) marks them, their routes hold 0, and they are never replayed (the replay batch's ``route_mask`` leaves them
  out, so the router picks its own experts there and the replay verifier counts them as unrouted).
* ``Sample.route_version`` (int64, one per route row, optional) is the weight version each row's route was
  computed under (a multi-turn record stitched across versions, :mod:`moealign.record_stitch`);
  ``Sample.stale_rows()`` names the rows of an older version.
* Kept sets are CSR: ``kept_offsets`` int64 ``[response_len + 1]`` and ``kept_ids`` int32, one row per
  generated token, ids ascending.

Files are safetensors: flat concatenated tensors plus JSON metadata, a format version and a
SHA-256 checksum over the format version, the metadata (every header field the record reads) and every
tensor's name, dtype, shape and bytes: a changed byte anywhere in a file either fails to parse or fails the
checksum. Every metadata field is type-checked on load and every index tensor (sequence offsets, prompt
lengths, kept-set offsets) is checked before use. Files of format version 1 (whose checksum covered the
tensors only) are still read, with a :class:`~moealign.errors.MoealignWarning` asking to re-save them.
Saving is atomic (:func:`moealign._files.atomic_write`) and refuses a target that is not a regular file.
A record may carry the rollout side's execution contract (``RolloutRecord.contract``, :mod:`moealign.contract`),
saved as JSON under its own metadata key (so covered by the checksum) and checked on load; files without one load
with ``contract=None``.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import operator
import os
import warnings
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Iterable, Sequence

import torch

from ._files import atomic_write, parse_json
from ._validate import check_log_prob_max
from .errors import (
    MissingFileError,
    MoealignWarning,
    RecordError,
    RecordFormatError,
    RecordMismatchError,
)
from .families import arch_keys
from .routing_replay.protocol import ReplayBatch
from .routing_replay.routes import (
    INT16_MAX_EXPERTS,
    RouteError,
    expand_routes,
    route_dtype,
    validate_routes,
)
from .routing_replay.sampling_mask import check_tokens_in_kept, validate_kept_sets

__all__ = [
    "FORMAT_VERSION",
    "MAX_LAYERS",
    "MAX_EXPERTS",
    "MAX_VOCAB",
    "MIN_TEMPERATURE",
    "RecordError",
    "RecordFormatError",
    "RecordMismatchError",
    "SamplingParams",
    "RecordMeta",
    "Sample",
    "RolloutRecord",
    "PaddedBatch",
    "PackedBatch",
    "config_fingerprint",
    "router_signature",
    "router_samples",
    "routes_from_all_layers",
    "concat_kept_sets",
]

FORMAT_VERSION = 2
_OLD_FORMAT_VERSION = 1   # read (checksum over the tensors only), with a warning asking to re-save
_META_KEY = "moealign.meta"
_VERSION_KEY = "moealign.format_version"
_CHECKSUM_KEY = "moealign.checksum"
_CONTRACT_KEY = "moealign.contract"   # the rollout side's execution contract (moealign.contract), when stated
_ROUTER_SIGNATURE_RTOL = 2e-2


#: The most decoder layers a record (and a config.json moealign reads) may state.
MAX_LAYERS = 10_000
#: The most experts: what a compact route table holds (int16 ids).
MAX_EXPERTS = INT16_MAX_EXPERTS
#: The largest vocabulary: kept-set ids are int32.
MAX_VOCAB = 2 ** 31 - 1


#: The smallest sampling temperature an engine samples with: below vLLM's sampling epsilon (1e-5) vLLM samples
#: greedily, which a record cannot state, and ``logits / T`` overflows fp32 for tiny ``T``.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one sample. ``top_k=0``, ``top_p=1`` and ``min_p=0`` mean "off". The bounds here are
    the ones every record obeys, however it is made (an engine, ``record convert``, a file, ``mismatch``'s flags):
    ``temperature >= MIN_TEMPERATURE``, ``top_p`` in (0, 1], ``min_p`` in [0, 1], ``top_k`` an integer >= 0."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        for name in ("temperature", "top_k", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise RecordError(f"sampling {name} must be a number, got {value!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= MIN_TEMPERATURE):
            raise RecordError(f"sampling temperature must be finite and > 0, got {self.temperature} (at least "
                              f"{MIN_TEMPERATURE}: below it engines sample greedily and logits / T overflows)")
        if not math.isfinite(self.top_k) or int(self.top_k) != self.top_k or self.top_k < 0:
            raise RecordError(f"sampling top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise RecordError(f"sampling top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise RecordError(f"sampling min_p must be in [0, 1], got {self.min_p}")
        object.__setattr__(self, "top_k", int(self.top_k))

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (float(self.temperature), float(self.top_k), float(self.top_p), float(self.min_p))

    @classmethod
    def from_tuple(cls, values: Sequence[float]) -> "SamplingParams":
        t, k, p, m = (float(v) for v in values)
        return cls(temperature=t, top_k=k, top_p=p, min_p=m)   # a fractional top_k is refused, not truncated

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass(frozen=True)
class RecordMeta:
    """Per-record metadata. ``moe_layers`` are decoder-layer numbers of the routes' layer axis."""

    engine: str
    engine_version: str
    model_fingerprint: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    vocab_size: int
    dtype: str
    router_signature: tuple[float, ...] = ()
    router_samples: tuple[float, ...] = ()
    model_name: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self):
        # types first (a file's JSON, or a caller, may hold anything): ints are ints and not bools, sequences
        # are sequences and not strings, strings are strings
        for name in ("engine", "engine_version", "model_fingerprint", "dtype", "model_name"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise RecordError(f"meta: {name} must be a string, got {value!r}")
        if not self.engine:
            raise RecordError("meta: engine must be a non-empty string, got ''")
        if self.dtype not in _DTYPE_NAMES:
            raise RecordError(f"meta: dtype must be a torch dtype name (float32, bfloat16, ...), got {self.dtype!r}")
        for name in ("num_layers", "num_experts", "top_k", "vocab_size", "format_version"):
            object.__setattr__(self, name, _meta_int(name, getattr(self, name)))
        if self.format_version != FORMAT_VERSION:
            raise RecordError(f"meta: format_version must be {FORMAT_VERSION}, got {self.format_version}")
        object.__setattr__(self, "moe_layers",
                           tuple(_meta_int(f"moe_layers[{i}]", x) for i, x in enumerate(_meta_seq("moe_layers",
                                                                                               self.moe_layers))))
        for name in ("router_signature", "router_samples"):
            values = _meta_seq(name, getattr(self, name))
            object.__setattr__(self, name, tuple(_meta_float(f"{name}[{i}]", x) for i, x in enumerate(values)))
        for name, hi in (("num_layers", MAX_LAYERS), ("num_experts", MAX_EXPERTS), ("vocab_size", MAX_VOCAB),
                         ("top_k", MAX_EXPERTS)):
            if getattr(self, name) > hi:
                raise RecordError(f"meta: {name} must be at most {hi}, got {_short(getattr(self, name))}")
        if self.num_layers < 1:
            raise RecordError(f"meta: num_layers must be >= 1, got {self.num_layers}")
        if len(self.router_signature) % 2:
            raise RecordError(f"meta: router_signature holds (mean, rms) pairs, got "
                              f"{len(self.router_signature)} values")
        if self.router_samples and len(self.router_samples) != ROUTER_SAMPLES * (len(self.router_signature) // 2):
            raise RecordError(f"meta: router_samples holds {ROUTER_SAMPLES} values per router of router_signature, "
                              f"got {len(self.router_samples)} values for {len(self.router_signature) // 2} routers")
        if self.num_experts < 1 or self.top_k < 1 or self.top_k > self.num_experts:
            raise RecordError(f"meta: need 1 <= top_k <= num_experts, got top_k={self.top_k}, "
                              f"num_experts={self.num_experts}")
        if not self.moe_layers:
            raise RecordError("meta: moe_layers is empty (a record needs at least one MoE layer)")
        if len(set(self.moe_layers)) != len(self.moe_layers) or list(self.moe_layers) != sorted(self.moe_layers):
            raise RecordError(f"meta: moe_layers must be ascending and unique, got {list(self.moe_layers)}")
        if self.moe_layers[0] < 0 or self.moe_layers[-1] >= self.num_layers:
            raise RecordError(f"meta: moe_layers {list(self.moe_layers)} outside [0, num_layers={self.num_layers})")
        if self.vocab_size < 1:
            raise RecordError(f"meta: vocab_size must be >= 1, got {self.vocab_size}")

    @property
    def route_dtype(self) -> torch.dtype:
        return route_dtype(self.num_experts)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, file_version: int = FORMAT_VERSION) -> "RecordMeta":
        """The metadata of a file of format ``file_version``; :class:`RecordFormatError` naming the first
        problem (not JSON, not an object, unknown or missing fields, a field of the wrong type or value)."""
        data = parse_json(text, "record metadata", error_cls=RecordFormatError)
        if not isinstance(data, dict):
            raise RecordFormatError(f"record metadata must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RecordFormatError(f"record metadata has unknown fields {unknown}")
        missing = sorted(f.name for f in fields(cls) if f.name not in data)
        if missing:
            raise RecordFormatError(f"record metadata lacks fields {missing}")
        version = data["format_version"]
        if isinstance(version, bool) or not isinstance(version, int) or version != file_version:
            raise RecordFormatError(f"record metadata has format_version {version!r} in a file of format version "
                                    f"{file_version}")
        data["format_version"] = FORMAT_VERSION   # read once, held in this version's form (saved as it)
        try:
            return cls(**data)
        except RecordError as exc:
            raise RecordFormatError(str(exc)) from None

    def check_matches(self, other: "RecordMeta", *, what: str = "model", require_weights: bool = False) -> None:
        """Raise :class:`RecordMismatchError` listing every field in which ``other`` is another model.

        The router weights are compared through both sides' ``router_signature``. When either side has none,
        the weights cannot be checked (a record of the same architecture with other weights would pass): a
        :class:`MoealignWarning` says so, or, with ``require_weights=True``, a :class:`RecordMismatchError`.
        """
        problems = []
        for name in ("num_layers", "moe_layers", "num_experts", "top_k", "vocab_size", "model_fingerprint"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                problems.append(f"{name}: record has {_short(a)}, {what} has {_short(b)}")
        sa, sb = self.router_signature, other.router_signature
        if not (sa and sb):
            lacking = [side for side, sig in (("the record", sa), (f"the {what}", sb)) if not sig]
            message = (f"the router weights could not be checked: {' and '.join(lacking)} "
                       f"{'have' if len(lacking) > 1 else 'has'} no router_signature (a record of the same "
                       f"architecture with other weights would pass)")
            if require_weights:
                problems.append(message)
            elif not problems:
                warnings.warn(message, MoealignWarning, stacklevel=2)
        if sa and sb:
            if len(sa) != len(sb):
                problems.append(f"router_signature: record has {len(sa) // 2} routers, {what} has {len(sb) // 2}")
            else:
                bad = []
                for r in range(0, len(sa), 2):   # (mean, rms) per router; tolerance relative to the rms
                    scale = _ROUTER_SIGNATURE_RTOL * max(abs(sa[r + 1]), abs(sb[r + 1]), 1e-12)
                    if abs(sa[r] - sb[r]) > scale or abs(sa[r + 1] - sb[r + 1]) > scale:
                        bad.append(r // 2)
                xa, xb = self.router_samples, other.router_samples
                if xa and xb and len(xa) == len(xb):
                    for r in range(len(sa) // 2):   # sampled weight entries, tolerance relative to the rms
                        scale = _ROUTER_SIGNATURE_RTOL * max(abs(sa[2 * r + 1]), abs(sb[2 * r + 1]), 1e-12)
                        lo, hi = r * ROUTER_SAMPLES, (r + 1) * ROUTER_SAMPLES
                        if r not in bad and any(abs(a - b) > scale for a, b in zip(xa[lo:hi], xb[lo:hi])):
                            bad.append(r)
                if bad:
                    problems.append(f"router weights differ (routers {sorted(bad)[:8]}): other weights")
        if problems:
            raise RecordMismatchError(f"the record does not belong to this {what}: " + "; ".join(problems))


#: Canonical torch dtype names (``str(dtype)`` without ``torch.``): what ``RecordMeta.dtype`` may hold.
_DTYPE_NAMES = frozenset(str(d).replace("torch.", "") for d in vars(torch).values() if isinstance(d, torch.dtype))


def _meta_int(name: str, value) -> int:
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise RecordError(f"meta: {name} must be an integer, got {value!r}")


def _meta_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RecordError(f"meta: {name} must be a finite number, got {value!r}")
    return float(value)


def _meta_seq(name: str, value):
    if isinstance(value, (str, bytes, dict, set, frozenset)) or not hasattr(value, "__iter__"):
        raise RecordError(f"meta: {name} must be a list, got {value!r}")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------------------------------
# fingerprints
# --------------------------------------------------------------------------------------------------

# Config keys that change what the network computes (per family, from moealign.families). Keys not in a
# config are skipped.


def config_fingerprint(config: dict) -> str:
    """SHA-256 (hex, 16 chars) of the architecture fields of a model config (dtype-independent). The fields are
    the family's ``arch_keys`` (:func:`moealign.families.arch_keys`; :data:`moealign.families.ARCH_KEYS` for a
    model_type no family is registered for)."""
    picked = {k: config[k] for k in arch_keys(config.get("model_type")) if k in config and config[k] is not None}
    if "model_type" not in picked:
        raise RecordError("config_fingerprint: the config has no model_type")
    text = json.dumps(picked, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def router_signature(router_weights: Iterable[torch.Tensor]) -> tuple[float, ...]:
    """A dtype-tolerant summary of the router weights: per router, the mean and RMS of its weight.

    Compared with a relative tolerance, it tells "same checkpoint in another dtype" from "other weights".
    """
    out: list[float] = []
    for w in router_weights:
        w64 = w.detach().to("cpu", torch.float64)
        out += [float(w64.mean()), float(w64.square().mean().sqrt())]
    return tuple(out)


ROUTER_SAMPLES = 8


def router_samples(router_weights: Iterable[torch.Tensor], n: int = ROUTER_SAMPLES) -> tuple[float, ...]:
    """``n`` weight entries per router at fixed, evenly spaced flat positions.

    The mean and RMS of :func:`router_signature` cannot tell two random inits of one config apart;
    individual entries can, and a dtype cast moves them by far less than the tolerance (2% of the RMS).
    """
    out: list[float] = []
    for w in router_weights:
        flat = w.detach().reshape(-1)
        idx = torch.linspace(0, flat.numel() - 1, n).round().to(torch.int64)
        out += [float(x) for x in flat[idx.to(flat.device)].to("cpu", torch.float64)]
    return tuple(out)


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


# --------------------------------------------------------------------------------------------------
# samples
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# batch layouts
# --------------------------------------------------------------------------------------------------


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


def _split_kept(offsets: torch.Tensor, ids: torch.Tensor, response_lens: Sequence[int]):
    out, row = [], 0
    for n in response_lens:
        lo, hi = int(offsets[row]), int(offsets[row + n])
        out.append(((offsets[row:row + n + 1] - lo).clone(), ids[lo:hi].clone()))
        row += n
    return out


# --------------------------------------------------------------------------------------------------
# the record
# --------------------------------------------------------------------------------------------------


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
            from .contract import check_contract

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

    # ---------------------------------------------------------------- layouts
    def to_padded(self, side: str = "right", pad_token_id: int = 0) -> PaddedBatch:
        if side not in ("left", "right"):
            raise RecordError(f"padding side must be 'left' or 'right', got {side!r}")
        B = len(self.samples)
        lengths = torch.tensor([s.length for s in self.samples], dtype=torch.int64)
        T = int(lengths.max())
        input_ids = torch.full((B, T), int(pad_token_id), dtype=torch.int64)
        attention = torch.zeros(B, T, dtype=torch.int64)
        resp = torch.zeros(B, T, dtype=torch.bool)
        logp = torch.zeros(B, T, dtype=torch.float32)
        route_mask = torch.zeros(B, T, dtype=torch.bool)
        kept_row = torch.full((B, T), -1, dtype=torch.int64)
        routes = None
        if self.has_routes:
            n, k = len(self.meta.moe_layers), self.meta.top_k
            routes = torch.zeros(B, T, n, k, dtype=self.meta.route_dtype)
        row_base = 0
        for b, s in enumerate(self.samples):
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
        kept_offsets, kept_ids = concat_kept_sets(self.samples)
        return PaddedBatch(input_ids, attention, resp, logp, routes, route_mask, kept_row, kept_offsets,
                           kept_ids, torch.tensor([s.prompt_len for s in self.samples]), lengths, side,
                           tuple(self.meta.moe_layers))

    def to_packed(self) -> PackedBatch:
        lengths = [s.length for s in self.samples]
        cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        input_ids = torch.cat([s.token_ids.to(torch.int64) for s in self.samples])
        position_ids = torch.cat([torch.arange(L) for L in lengths])
        resp = torch.cat([torch.arange(s.length) >= s.prompt_len for s in self.samples])
        logp = torch.cat([torch.cat([torch.zeros(s.prompt_len), s.logprobs.to(torch.float32)])
                          for s in self.samples])
        route_mask = torch.cat([torch.cat([s.routed_rows, torch.zeros(1, dtype=torch.bool)]) for s in self.samples])
        routes = None
        if self.has_routes:
            n, k = len(self.meta.moe_layers), self.meta.top_k
            pad = torch.zeros(1, n, k, dtype=self.meta.route_dtype)
            routes = torch.cat([t for s in self.samples for t in (s.routes, pad)])
        kept_row = torch.full((int(cu[-1]),), -1, dtype=torch.int64)
        kept_row[resp] = torch.arange(int(resp.sum()))
        kept_offsets, kept_ids = concat_kept_sets(self.samples)
        return PackedBatch(input_ids, position_ids, cu, resp, logp, routes, route_mask, kept_row, kept_offsets,
                           kept_ids, torch.tensor([s.prompt_len for s in self.samples]), tuple(self.meta.moe_layers))

    @classmethod
    def from_padded(cls, meta: RecordMeta, batch: PaddedBatch, sampling: Sequence[SamplingParams]) -> "RolloutRecord":
        B, T = batch.input_ids.shape
        if len(sampling) != B:
            raise RecordError(f"from_padded: {len(sampling)} sampling params for {B} samples")
        kept = None
        if batch.kept_offsets is not None:
            resp_lens = [int(x) for x in (batch.lengths - batch.prompt_lens)]
            kept = _split_kept(batch.kept_offsets, batch.kept_ids, resp_lens)
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
        return cls(meta, samples)

    @classmethod
    def from_packed(cls, meta: RecordMeta, batch: PackedBatch, sampling: Sequence[SamplingParams]) -> "RolloutRecord":
        cu = [int(x) for x in batch.cu_seqlens]
        B = len(cu) - 1
        if len(sampling) != B or batch.prompt_lens.numel() != B:
            raise RecordError(f"from_packed: cu_seqlens has {B} samples, sampling {len(sampling)}, "
                              f"prompt_lens {batch.prompt_lens.numel()}")
        kept = None
        if batch.kept_offsets is not None:
            resp_lens = [cu[b + 1] - cu[b] - int(batch.prompt_lens[b]) for b in range(B)]
            kept = _split_kept(batch.kept_offsets, batch.kept_ids, resp_lens)
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
        return cls(meta, samples)

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

    # ---------------------------------------------------------------- files
    def _tensors(self) -> dict[str, torch.Tensor]:
        lengths = [s.length for s in self.samples]
        tensors = {
            "token_ids": torch.cat([s.token_ids.to(torch.int64) for s in self.samples]),
            "seq_offsets": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
            "prompt_lens": torch.tensor([s.prompt_len for s in self.samples], dtype=torch.int64),
            "logprobs": torch.cat([s.logprobs.to(torch.float32) for s in self.samples]),
            "sampling": torch.tensor([s.sampling.as_tuple() for s in self.samples], dtype=torch.float64),
        }
        if self.has_routes:
            tensors["routes"] = torch.cat([s.routes for s in self.samples]).contiguous()
            if any(s.route_missing is not None for s in self.samples):
                tensors["route_missing"] = torch.cat([~s.routed_rows for s in self.samples])
            if any(s.route_version is not None for s in self.samples):
                missing = [i for i, s in enumerate(self.samples) if s.route_version is None]
                if missing:
                    raise RecordError(f"samples {missing[:8]} have no route_version while others have one: give every "
                                      f"sample its weight versions (or none)")
                tensors["route_version"] = torch.cat([s.route_version for s in self.samples])
        if self.has_kept_sets:
            tensors["kept_offsets"], tensors["kept_ids"] = concat_kept_sets(self.samples)
        return tensors

    def save(self, path: str | os.PathLike) -> None:
        """Write the record as safetensors, validated first and atomically
        (:func:`moealign._files.atomic_write`): a temporary ``.NAME.moealign-tmp-XXXXXXXX`` next to ``path``,
        fsynced, renamed into place; removed on any failure or interrupt, the old file left intact. A ``path``
        that exists and is not a regular file (directory, FIFO, device) is refused (:class:`ConfigError`)."""
        from safetensors.torch import save_file

        self.validate()
        tensors = {k: v.contiguous() for k, v in self._tensors().items()}
        metadata = {_META_KEY: self.meta.to_json(), _VERSION_KEY: str(FORMAT_VERSION)}
        if self.contract is not None:
            metadata[_CONTRACT_KEY] = json.dumps(self.contract, sort_keys=True)
        metadata[_CHECKSUM_KEY] = _checksum(tensors, metadata)
        atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata), flag="record path")

    @classmethod
    def load(cls, path: str | os.PathLike, *, expect: RecordMeta | None = None,
             require_weights: bool = False) -> "RolloutRecord":
        """Read a record; verify format version, checksum (over metadata and tensors), every field's type and
        every index, and (with ``expect``) that it fits the model (:meth:`RecordMeta.check_matches`: a record
        or model without router signature warns that the router weights were not checked, or with
        ``require_weights=True`` is refused)."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            kind = " (it is not a regular file)" if os.path.exists(path) else ""
            raise MissingFileError(f"no record file at {path}{kind}")
        tensors, metadata = _read_safetensors(path)
        version = metadata[_VERSION_KEY]
        if version not in (str(FORMAT_VERSION), str(_OLD_FORMAT_VERSION)):
            raise RecordFormatError(f"{path}: record format version {_short(version)[1:-1]}, this moealign reads "
                                    f"version {FORMAT_VERSION} (and {_OLD_FORMAT_VERSION})")
        current = version == str(FORMAT_VERSION)
        if _checksum(tensors, metadata if current else None) != metadata[_CHECKSUM_KEY]:
            raise RecordFormatError(f"{path}: checksum mismatch: the record file is corrupt")
        if not current:
            warnings.warn(f"{path}: record format version {version}, whose checksum does not cover the metadata; "
                          f"re-save it (RolloutRecord.load(path).save(path)) to write version {FORMAT_VERSION}",
                          MoealignWarning, stacklevel=2)
        try:
            meta = RecordMeta.from_json(metadata[_META_KEY], file_version=int(version))
        except RecordError as exc:
            raise RecordFormatError(f"{path}: bad record metadata: {exc}") from None
        contract = _contract_from_metadata(metadata, path) if current else None
        if expect is not None:
            meta.check_matches(expect, require_weights=require_weights)
        return cls(meta, _samples_from_tensors(tensors, meta, path), contract=contract)


def _contract_from_metadata(metadata: dict[str, str], path: str) -> dict | None:
    """The execution contract a file states (``None``: none, as in files written before contracts existed)."""
    from .contract import check_contract

    text = metadata.get(_CONTRACT_KEY)
    if text is None:
        return None
    contract = parse_json(text, f"{path}: the record's contract", error_cls=RecordFormatError)
    try:
        return check_contract(contract)
    except RecordError as exc:
        raise RecordFormatError(f"{path}: bad record contract: {exc}") from None


def _read_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file. safetensors bounds the header (100 MB) and checks every
    tensor's byte range against the file size, so what is read is bounded by the file; anything it cannot
    parse is a :class:`RecordFormatError`."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            metadata = dict(f.metadata() or {})
            if any(key not in metadata for key in (_VERSION_KEY, _META_KEY, _CHECKSUM_KEY)):
                raise RecordFormatError(f"{path}: a safetensors file, but not a moealign rollout record "
                                        f"(metadata keys {_short(sorted(metadata))})")
            names = list(f.keys())
            unknown = sorted(set(names) - set(_FILE_TENSORS))
            if unknown:
                raise RecordFormatError(f"{path}: record file has unknown tensors {_short(unknown)}")
            tensors = {k: f.get_tensor(k) for k in names}
    except RecordFormatError:
        raise
    except Exception as exc:  # safetensors raises SafetensorError / OSError / others on bad bytes
        size = os.path.getsize(path)
        raise RecordFormatError(f"{path}: truncated or corrupt record file ({size} bytes): "
                                f"{type(exc).__name__}: {_short(str(exc))}") from None
    return tensors, metadata


#: The tensors of a record file and their dtypes (``routes``: the metadata's route dtype).
_FILE_TENSORS = {
    "token_ids": torch.int64, "seq_offsets": torch.int64, "prompt_lens": torch.int64, "logprobs": torch.float32,
    "sampling": torch.float64, "routes": None, "kept_offsets": torch.int64, "kept_ids": torch.int32,
    "route_missing": torch.bool, "route_version": torch.int64,
}


def _checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """SHA-256 over every metadata entry but the checksum itself (format version 2; ``None``: version 1, the
    tensors only), then every tensor's name, dtype, shape and bytes. Lengths prefix each metadata key and value."""
    h = hashlib.sha256()
    if metadata is not None:
        h.update(b"moealign-record\0")
        for key in sorted(metadata):
            if key != _CHECKSUM_KEY:
                for part in (key, metadata[key]):
                    data = part.encode("utf-8", "surrogatepass")
                    h.update(len(data).to_bytes(8, "little") + data)
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _samples_from_tensors(tensors: dict[str, torch.Tensor], meta: RecordMeta, path: str) -> list[Sample]:
    """The samples of a file's tensors. Every index is checked before it is used: dtypes and ranks, sequence
    offsets (0, increasing, ending at the token count), prompt lengths, the kept-set CSR as a whole (so no id
    is dropped), the sampling parameters; each error names the tensor."""
    need = ("token_ids", "seq_offsets", "prompt_lens", "logprobs", "sampling")
    missing = [k for k in need if k not in tensors]
    if missing:
        raise RecordFormatError(f"{path}: record file lacks tensors {missing}")
    for name, t in tensors.items():
        want = _FILE_TENSORS[name] or meta.route_dtype
        rank = {"sampling": 2, "routes": 3}.get(name, 1)
        if t.dtype != want or t.dim() != rank:
            raise RecordFormatError(f"{path}: tensor {name} is {t.dtype} with {t.dim()} dims, a record stores "
                                    f"{want} with {rank}")
    off = tensors["seq_offsets"].tolist()
    B = len(off) - 1
    if B < 1:
        raise RecordFormatError(f"{path}: the record holds no samples (seq_offsets has {len(off)} entries)")
    n_tokens = tensors["token_ids"].numel()
    if off[0] != 0 or off[-1] != n_tokens:
        raise RecordFormatError(f"{path}: seq_offsets must run from 0 to {n_tokens} (the token count), got "
                                f"{off[0]} .. {off[-1]}")
    for b in range(B):
        if off[b + 1] <= off[b]:
            raise RecordFormatError(f"{path}: seq_offsets must increase, got seq_offsets[{b}] = {off[b]}, "
                                    f"seq_offsets[{b + 1}] = {off[b + 1]}")
    prompt_lens = tensors["prompt_lens"].tolist()
    if len(prompt_lens) != B or tensors["sampling"].shape != (B, 4):
        raise RecordFormatError(f"{path}: inconsistent sample index (seq_offsets has {B} samples, prompt_lens "
                                f"{len(prompt_lens)}, sampling shape {tuple(tensors['sampling'].shape)})")
    for b, P in enumerate(prompt_lens):
        if not 1 <= P < off[b + 1] - off[b]:
            raise RecordFormatError(f"{path}: prompt_lens[{b}] = {P}, need 1 <= prompt length < sample length "
                                    f"{off[b + 1] - off[b]}")
    resp_lens = [off[b + 1] - off[b] - prompt_lens[b] for b in range(B)]
    if tensors["logprobs"].numel() != sum(resp_lens):
        raise RecordFormatError(f"{path}: {tensors['logprobs'].numel()} logprobs for {sum(resp_lens)} "
                                f"response tokens")
    routes = tensors.get("routes")
    if routes is not None:
        want = (off[-1] - B, len(meta.moe_layers), meta.top_k)
        if tuple(routes.shape) != want:
            raise RecordMismatchError(f"{path}: routes have shape {tuple(routes.shape)}, the metadata implies "
                                      f"{want} (layers {list(meta.moe_layers)}, top_k {meta.top_k})")
    row_tensors = {name: tensors.get(name) for name in ("route_missing", "route_version")}
    for name, t in row_tensors.items():
        if t is not None and (routes is None or t.numel() != off[-1] - B):
            raise RecordFormatError(f"{path}: {name} has {t.numel()} entries, the record has "
                                    f"{0 if routes is None else off[-1] - B} route rows")
    kept = None
    if ("kept_offsets" in tensors) != ("kept_ids" in tensors):
        raise RecordFormatError(f"{path}: record file has only one of kept_offsets / kept_ids")
    if "kept_offsets" in tensors:
        if tuple(tensors["kept_offsets"].shape) != (sum(resp_lens) + 1,):
            raise RecordFormatError(f"{path}: kept_offsets has shape {tuple(tensors['kept_offsets'].shape)}, "
                                    f"expected ({sum(resp_lens) + 1},) = response tokens + 1")
        try:   # the whole CSR at once: offsets from 0, non-decreasing, ending at len(kept_ids); ids in the vocab
            validate_kept_sets(tensors["kept_offsets"], tensors["kept_ids"], meta.vocab_size)
        except RouteError as exc:
            raise RecordFormatError(f"{path}: kept sets (kept_offsets / kept_ids): {exc}") from None
        kept = _split_kept(tensors["kept_offsets"], tensors["kept_ids"], resp_lens)
    samples, lp, rt = [], 0, 0
    for b in range(B):
        L = off[b + 1] - off[b]
        try:
            sampling = SamplingParams.from_tuple(tensors["sampling"][b].tolist())
        except RecordError as exc:
            raise RecordFormatError(f"{path}: sampling[{b}]: {exc}") from None
        samples.append(Sample(
            token_ids=tensors["token_ids"][off[b]:off[b + 1]],
            prompt_len=prompt_lens[b],
            logprobs=tensors["logprobs"][lp:lp + resp_lens[b]],
            routes=None if routes is None else routes[rt:rt + L - 1],
            kept_offsets=None if kept is None else kept[b][0],
            kept_ids=None if kept is None else kept[b][1],
            sampling=sampling,
            route_missing=_missing_rows(row_tensors["route_missing"], rt, rt + L - 1),
            route_version=None if row_tensors["route_version"] is None else row_tensors["route_version"][rt:rt + L - 1]))
        lp += resp_lens[b]
        rt += L - 1
    return samples


def _missing_rows(mask: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """One sample's ``route_missing`` of a file's concatenated mask: ``None`` when none of its rows is missing (as
    it was saved: the file holds a mask for every sample once any sample has one)."""
    if mask is None or not bool(mask[lo:hi].any()):
        return None
    return mask[lo:hi]


def with_meta(record: RolloutRecord, **changes) -> RolloutRecord:
    """A copy of ``record`` with metadata fields replaced (validated again)."""
    return RolloutRecord(replace(record.meta, **changes), record.samples, contract=record.contract)
