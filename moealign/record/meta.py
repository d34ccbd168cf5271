"""The record's metadata: :class:`SamplingParams` (one sample's), :class:`RecordMeta` (the model and engine that
made the record), the bounds every record obeys and the model fingerprints it is checked against
(:func:`config_fingerprint`, :func:`router_signature`, :func:`router_samples`)."""

from __future__ import annotations

import json
import math
import numbers
import operator
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Iterable, Sequence

import torch

from .._files import parse_json
from .._validate import short_repr
from ..errors import (
    MoealignWarning,
    RecordError,
    RecordFormatError,
    RecordMismatchError,
)
from ..model_config import MAX_EXPERTS, MAX_LAYERS, MAX_VOCAB
from ..routing_replay.routes import route_dtype

#: The record file format version this moealign writes (:mod:`moealign.record.io`).
FORMAT_VERSION = 2
_ROUTER_SIGNATURE_RTOL = 2e-2


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
                raise RecordError(f"meta: {name} must be at most {hi}, got {short_repr(getattr(self, name))}")
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
                problems.append(f"{name}: record has {short_repr(a)}, {what} has {short_repr(b)}")
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


# --------------------------------------------------------------------------------------------------
# fingerprints
# --------------------------------------------------------------------------------------------------

# Config keys that change what the network computes (per family, from moealign.families). Keys not in a
# config are skipped.


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
