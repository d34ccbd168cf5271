"""Weight manifests: the trainer's weights as digests alone, to verify a vLLM engine from another process.

::

    from moealign.rl import WeightManifest, verify_refit, weight_manifest

    weight_manifest(trainer).save("step_120.manifest.json")      # where the trainer runs
    ...                                                          # the weights move by the user's own mechanism
    check = verify_refit(llm, WeightManifest.load("step_120.manifest.json"))   # where the engine runs

A manifest holds, per tensor in transformers names (the fused experts one entry per expert:
``model.layers.3.mlp.experts.gate_up_proj[7]``), its shape and its **layout digest** at each dtype an engine may
hold it in (:func:`moealign.patches.vllm.refit.layout_digest`: two 64-bit lanes, a keyed sum over the tensor's 8-byte
words with one key per (row, word) position), plus the config fields that change the forward
(:func:`~moealign.rl.refit.comparable_config`). Nothing in it depends on the engine: not its TP size, not vLLM's
fused or packed layouts. The engine side reads each worker's tensors back where its forward reads them (kernel
copies through the kernel, CPU-prepacked experts unpacked through the measured packing) and computes what each
shard contributes to the digest of the full tensor at its rows and columns; contributions of disjoint shards add
up to the digest of the whole, so the workers' shards are summed and compared with the manifest
(:func:`moealign.patches.vllm.refit.verify_digests`). About 100 bytes per entry per dtype: 0.3% of the embedded
model (fp32), 0.02% of a 432M-parameter bf16 model (docs/refit.md).

A sharded trainer's manifest (:class:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer`) is computed where
its weights live: each rank digests the pieces it owns (tensor-parallel slices, expert rows, its stage's layers;
data-parallel copies once) at their offsets in the full tensors, and the driver adds each tensor's contributions,
which gives the digest of the whole tensor bit for bit (the same sum over disjoint blocks as the engine side's):
the manifest equals the one of the same weights on one rank, and no tensor is gathered (docs/scale.md).

The file is JSON, written atomically (:func:`moealign._files.atomic_write`) and read through the one input guard
(:func:`moealign._files.read_json_file`: a regular file, bounded size and nesting); every field is checked on
load and a corrupt or hostile file is refused by name (:class:`~moealign.errors.InputError`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from .._files import atomic_write, read_json_file
from ..errors import ConfigError, InputError, InputTypeError

__all__ = ["FORMAT", "FORMAT_VERSION", "DEFAULT_DTYPES", "MAX_MANIFEST_BYTES", "WeightManifest", "weight_manifest"]

#: The ``format`` field of every manifest file, and its version (a file of another version is refused).
FORMAT = "moealign-weight-manifest"
FORMAT_VERSION = 1
#: The dtypes digested by default: every dtype a vLLM engine may hold unquantized weights in.
DEFAULT_DTYPES = ("bfloat16", "float16", "float32")
#: Bounds on a manifest file (checked before it is parsed) and on what it may hold.
MAX_MANIFEST_BYTES = 256 << 20
MAX_TENSORS = 1 << 21
MAX_NAME = 512
MAX_DIMS = 8
MAX_DIM = 1 << 40
MAX_DEPTH = 16
#: dtype names a manifest may carry digests for.
KNOWN_DTYPES = ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2", "int8", "uint8",
                "int16", "int32", "int64", "bool")
_FLOAT_TARGETS = ("float32", "bfloat16", "float16", "float64")
_FIELDS = {"format", "version", "digest", "model_bytes", "config", "tensors"}
_HEX = re.compile(r"^[0-9a-f]{32}$")
_FUSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
_MASK64 = (1 << 64) - 1


def _digest_name() -> str:
    from ..patches.vllm.refit import DIGEST_NAME

    return DIGEST_NAME


def _hex(lanes: tuple[int, int]) -> str:
    return "".join(f"{int(v) & _MASK64:016x}" for v in lanes)


def _lanes(text: str) -> tuple[int, int]:
    return int(text[:16], 16), int(text[16:], 16)


@dataclass
class WeightManifest:
    """Per-tensor layout digests of a trainer's weights (see the module docstring). ``tensors``: ``{name: (shape,
    {dtype name: (lane0, lane1)})}``; ``config``: the comparable config fields (``None``: not known);
    ``model_bytes``: the bytes of the tensors digested, at the trainer's own dtypes. Checked when built."""

    tensors: dict[str, tuple[tuple[int, ...], dict[str, tuple[int, int]]]]
    config: dict | None = None
    model_bytes: int = 0
    digest: str = field(default_factory=_digest_name)

    def __post_init__(self):
        self.validate("WeightManifest")

    # -- checks -------------------------------------------------------------------------------------------------

    def validate(self, what: str) -> "WeightManifest":
        """Every field (:class:`~moealign.errors.InputError` naming ``what`` and the problem)."""
        if self.digest != _digest_name():
            raise InputError(f"{what}: digests of {self.digest!r}; this moealign computes {_digest_name()!r} (a "
                             f"manifest written by another moealign version: write it again)")
        if isinstance(self.model_bytes, bool) or not isinstance(self.model_bytes, int) or self.model_bytes < 0:
            raise InputError(f"{what}: model_bytes must be an integer >= 0, got {self.model_bytes!r}")
        if self.config is not None:
            _check_config(self.config, what)
        if not isinstance(self.tensors, dict) or not self.tensors:
            raise InputError(f"{what}: no tensors")
        if len(self.tensors) > MAX_TENSORS:
            raise InputError(f"{what}: {len(self.tensors)} tensors, more than the {MAX_TENSORS} a manifest may hold")
        for name, entry in self.tensors.items():
            _check_name(name, what)
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise InputError(f"{what}: tensor {name!r}: expected (shape, digests), got {type(entry).__name__}")
            shape, digests = entry
            _check_shape(shape, f"{what}: tensor {name!r}")
            if not isinstance(digests, dict) or not digests:
                raise InputError(f"{what}: tensor {name!r} has no digests")
            for dtype, lanes in digests.items():
                if dtype not in KNOWN_DTYPES:
                    raise InputError(f"{what}: tensor {name!r}: unknown dtype {dtype!r} (known: {list(KNOWN_DTYPES)})")
                if not (isinstance(lanes, tuple) and len(lanes) == 2 and all(
                        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MASK64 for v in lanes)):
                    raise InputError(f"{what}: tensor {name!r}: the {dtype} digest must be two unsigned 64-bit "
                                     f"integers, got {lanes!r}")
        return self

    # -- contents -----------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes every tensor has a digest at."""
        sets = [set(d) for _, d in self.tensors.values()]
        return tuple(sorted(set.intersection(*sets))) if sets else ()

    def digests(self) -> dict[str, tuple[tuple[int, ...], dict[str, tuple[int, int]]]]:
        """``{name: (shape, {dtype: lanes})}``: what :func:`moealign.patches.vllm.refit.verify_digests` takes."""
        return {n: (tuple(s), dict(d)) for n, (s, d) in self.tensors.items()}

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": FORMAT_VERSION, "digest": self.digest, "model_bytes": self.model_bytes,
                "config": self.config,
                "tensors": {n: [list(s), {k: _hex(v) for k, v in sorted(d.items())}]
                            for n, (s, d) in sorted(self.tensors.items())}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True, allow_nan=False)

    @property
    def nbytes(self) -> int:
        """The size of the manifest file, in bytes."""
        return len(self.to_json().encode())

    # -- files --------------------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> str:
        """Write the manifest at ``path`` (JSON, atomically: the old file stays until the new one is complete);
        returns the path."""
        text = self.to_json()
        atomic_write(path, lambda tmp: _write_text(tmp, text), flag="weight manifest", error_cls=ConfigError)
        return os.fspath(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "WeightManifest":
        """Read a manifest written by :meth:`save`, through the input guard; every field checked (a corrupt or hostile
        file is refused by name: :class:`~moealign.errors.InputError`)."""
        data = read_json_file(path, "weight manifest", max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_DEPTH,
                              error_cls=InputError)
        return cls.from_dict(data, f"weight manifest {os.fspath(path)}")

    @classmethod
    def from_dict(cls, data: Any, what: str = "weight manifest") -> "WeightManifest":
        if not isinstance(data, dict):
            raise InputError(f"{what}: not a weight manifest (a JSON {type(data).__name__}, not an object)")
        if data.get("format") != FORMAT:
            raise InputError(f"{what}: not a weight manifest (format {data.get('format')!r}, expected {FORMAT!r})")
        if data.get("version") != FORMAT_VERSION or isinstance(data.get("version"), bool):
            raise InputError(f"{what}: manifest version {data.get('version')!r}; this moealign reads version "
                             f"{FORMAT_VERSION}")
        unknown, missing = sorted(set(data) - _FIELDS), sorted(_FIELDS - set(data))
        if unknown or missing:
            raise InputError(f"{what}: " + "; ".join(p for p in (unknown and f"unknown fields {unknown}",
                                                                 missing and f"missing fields {missing}") if p))
        if not isinstance(data["digest"], str):
            raise InputError(f"{what}: digest must be a string, got {type(data['digest']).__name__}")
        raw = data["tensors"]
        if not isinstance(raw, dict):
            raise InputError(f"{what}: tensors must be an object, got {type(raw).__name__}")
        if len(raw) > MAX_TENSORS:
            raise InputError(f"{what}: {len(raw)} tensors, more than the {MAX_TENSORS} a manifest may hold")
        tensors = {}
        for name, entry in raw.items():
            _check_name(name, what)
            if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], dict):
                raise InputError(f"{what}: tensor {name!r}: expected [shape, {{dtype: digest}}], got {entry!r:.80}")
            shape, digests = entry
            _check_shape(shape, f"{what}: tensor {name!r}")
            lanes = {}
            for dtype, text in digests.items():
                if not isinstance(text, str) or not _HEX.match(text):
                    raise InputError(f"{what}: tensor {name!r}: the {dtype!r} digest must be 32 lowercase hex "
                                     f"digits, got {text!r:.80}")
                lanes[dtype] = _lanes(text)
            tensors[name] = (tuple(shape), lanes)
        manifest = cls.__new__(cls)            # checked once below, naming the file (not by __post_init__)
        manifest.tensors, manifest.config = tensors, data["config"]
        manifest.model_bytes, manifest.digest = data["model_bytes"], data["digest"]
        return manifest.validate(what)

    @classmethod
    def merge(cls, manifests: Iterable["WeightManifest"]) -> "WeightManifest":
        """One manifest from several (ranks that each digest the tensors they own whole: EP, PP): a tensor given by
        two must agree (shape and every dtype both state), as must the configs. Pieces of one tensor (TP slices) are
        not merged here: :func:`weight_manifest` of a sharded trainer adds their digest contributions instead."""
        items = list(manifests)
        if not items or not all(isinstance(m, WeightManifest) for m in items):
            raise InputTypeError("WeightManifest.merge takes one or more WeightManifest")
        tensors: dict = {}
        config = None
        for i, m in enumerate(items):
            if m.config is not None:
                if config is not None and config != m.config:
                    raise InputError(f"WeightManifest.merge: manifest {i} states another config than the earlier ones")
                config = m.config
            for name, (shape, digests) in m.tensors.items():
                if name in tensors:
                    old_shape, old = tensors[name]
                    clash = [d for d in set(old) & set(digests) if old[d] != digests[d]]
                    if old_shape != shape or clash:
                        raise InputError(f"WeightManifest.merge: manifest {i} disagrees with an earlier one on "
                                         f"{name!r} ({'shape' if old_shape != shape else 'digest at ' + clash[0]})")
                    tensors[name] = (shape, {**old, **digests})
                else:
                    tensors[name] = (shape, dict(digests))
        nbytes = sum(m.model_bytes for m in items)
        return cls(tensors=tensors, config=config, model_bytes=nbytes)


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def _check_name(name: Any, what: str) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or not name.isprintable():
        raise InputError(f"{what}: tensor names must be printable strings of 1 to {MAX_NAME} characters, got "
                         f"{name!r:.80}")


def _check_shape(shape: Any, what: str) -> None:
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape):
        raise InputError(f"{what}: the shape must be at most {MAX_DIMS} integers in [0, {MAX_DIM}], got "
                         f"{shape!r:.80}")


def _check_config(config: Any, what: str) -> None:
    from .trainer_state import comparable_fields

    if not isinstance(config, dict):
        raise InputError(f"{what}: config must be an object or null, got {type(config).__name__}")
    unknown = sorted(str(k) for k in set(config) - set(comparable_fields()))
    if unknown:
        raise InputError(f"{what}: config fields {unknown[:4]} are not ones moealign compares")


# --------------------------------------------------------------------------------------------------
# building one
# --------------------------------------------------------------------------------------------------


def _dtype_names(dtypes) -> tuple[str, ...]:
    if isinstance(dtypes, (str, torch.dtype)):
        dtypes = (dtypes,)
    try:
        names = tuple(str(d).replace("torch.", "") for d in dtypes)
    except TypeError:
        raise ConfigError(f"dtypes must be dtype names or torch dtypes, got {type(dtypes).__name__}") from None
    bad = [d for d in names if d not in _FLOAT_TARGETS]
    if bad or not names:
        raise ConfigError(f"dtypes must name one or more of {list(_FLOAT_TARGETS)}, got {list(names) or 'none'}")
    return tuple(dict.fromkeys(names))


def _named(trainer, hf_config):
    from .trainer_state import trainer_tensors

    if isinstance(trainer, Mapping):
        if not trainer:
            raise ConfigError("weight_manifest: the snapshot mapping is empty")
        return iter(trainer.items())
    return trainer_tensors(trainer, hf_config)


def _piece_span(t: torch.Tensor, offsets: tuple[int, ...], full: tuple[int, ...], expert: bool) -> torch.Tensor:
    """What the piece ``t`` of a full tensor of shape ``full`` at ``offsets`` contributes to its layout digest
    (``[L, 2]`` int64 lanes: one per expert of a fused experts piece, else ``L = 1``), the full tensor seen as
    :func:`~moealign.patches.vllm.refit.layout_digest` sees it (every dimension but the last folded into rows)."""
    from ..patches.vllm.refit import span_lanes

    if expert:                         # [experts, rows, columns]: each expert's matrix digested on its own
        return span_lanes(t, [(offsets[1], offsets[1] + t.shape[1])], offsets[2])
    if t.dim() <= 1:
        return span_lanes(t.reshape(1, 1, -1), [(0, 1)], offsets[0] if t.dim() else 0)
    lead = [range(o, o + n) for o, n in zip(offsets[:-2], t.shape[:-2])]
    strides = [math.prod(full[i + 1:-1]) for i in range(len(full) - 2)]
    rows = []
    for index in itertools.product(*lead):          # one row range per index of the dimensions before the rows
        base = sum(i * s for i, s in zip(index, strides))
        rows.append((base + offsets[-2], base + offsets[-2] + t.shape[-2]))
    return span_lanes(t.reshape(1, -1, t.shape[-1]), rows, offsets[-1])


def _piece_digests(pieces, dtypes: tuple[str, ...]) -> list:
    """Run on a sharded trainer's rank, over the pieces it owns of one mapping group
    (:meth:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer.map_hf_shards`): per piece ``(name, full shape,
    offsets, experts?, bytes, {dtype: lanes})``, each floating piece cast to every dtype of ``dtypes`` (others at their
    own), its contribution to the full tensor's layout digest."""
    out = []
    for piece in pieces:
        t = piece.tensor.detach()
        if t.is_meta or t.is_complex():
            raise InputError(f"weight_manifest: {piece.name!r} is {'a meta tensor' if t.is_meta else 'complex'}")
        own = str(t.dtype).replace("torch.", "")
        expert = _FUSED_EXPERTS.search(piece.name) is not None and len(piece.full_shape) == 3
        digests = {}
        for dtype in (dtypes if t.is_floating_point() else (own,)):
            cast = t if own == dtype else t.to(getattr(torch, dtype))
            digests[dtype] = _piece_span(cast, tuple(piece.offsets), tuple(piece.full_shape), expert).tolist()
        out.append((piece.name, tuple(piece.full_shape), tuple(piece.offsets), expert, t.numel() * t.element_size(),
                    digests))
    return out


def _sharded_manifest(trainer, targets: tuple[str, ...], comparable) -> WeightManifest:
    """Each rank digests the pieces it owns (:func:`_piece_digests`; every element once over the world: data-parallel
    copies skipped), this process adds the contributions of each tensor's pieces (tensor-parallel slices, expert
    rows): the layout digest of a full tensor is the sum, mod 2^64, of its disjoint blocks' contributions, so the
    result equals the manifest of the same weights on one rank, and nothing is gathered."""
    tensors: dict = {}
    model_bytes = 0
    for group in trainer.map_hf_shards(_piece_digests, targets):
        for name, full, offsets, expert, nbytes, digests in group:
            model_bytes += nbytes
            for dtype, lanes in digests.items():
                for i, (a, b) in enumerate(lanes):
                    key, shape = (f"{name}[{offsets[0] + i}]", tuple(full[1:])) if expert else (name, tuple(full))
                    entry = tensors.setdefault(key, (shape, {}))[1]
                    old = entry.get(dtype, (0, 0))
                    entry[dtype] = ((old[0] + a) & _MASK64, (old[1] + b) & _MASK64)
    if not tensors:
        raise ConfigError("weight_manifest: the trainer has no tensors")
    return WeightManifest(tensors=tensors, config=comparable, model_bytes=model_bytes)


def weight_manifest(trainer, hf_config=None, *, dtypes=DEFAULT_DTYPES) -> WeightManifest:
    """The :class:`WeightManifest` of a trainer's current weights: ``trainer`` as :func:`moealign.rl.refit` takes it
    (a moealign train engine, a Megatron ``GPTModel`` with ``hf_config``, a transformers model, a sharded Megatron
    trainer (each rank digests its own pieces, the digests of each tensor's pieces are added here: nothing
    gathered), or a mapping of transformers names to tensors). Each floating tensor is digested at every dtype of
    ``dtypes`` (the engine's dtype must be among them: the default covers bf16, fp16 and fp32 engines), on the tensor's
    own device, one tensor at a time; fused experts ``[E, ...]`` one digest per expert. Refused by name before any work:
    an argument of another type, an empty trainer, a value that is not a real tensor with data."""
    from ..patches.vllm.refit import layout_digest
    from .trainer_state import comparable_config, is_sharded_trainer, trainer_config

    targets = _dtype_names(dtypes)
    config = trainer_config(trainer, hf_config)
    comparable = comparable_config(config) if config is not None else None
    if is_sharded_trainer(trainer):
        return _sharded_manifest(trainer, targets, comparable)
    tensors: dict = {}
    seen: set[str] = set()
    model_bytes = 0
    for name, tensor in _named(trainer, hf_config):
        if not isinstance(name, str):
            raise InputTypeError(f"weight_manifest: tensor names must be strings, got {type(name).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise InputTypeError(f"weight_manifest: {name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.is_meta or tensor.is_complex():
            raise InputError(f"weight_manifest: {name!r} is {'a meta tensor' if tensor.is_meta else 'complex'}")
        if name in seen:
            raise InputError(f"weight_manifest: {name!r} comes twice")
        seen.add(name)
        t = tensor.detach()
        model_bytes += t.numel() * t.element_size()
        own = str(t.dtype).replace("torch.", "")
        names = targets if t.is_floating_point() else (own,)
        experts = _FUSED_EXPERTS.search(name) is not None and t.dim() == 3
        for dtype in names:
            cast = t if own == dtype else t.to(getattr(torch, dtype))
            if experts:
                for e, lanes in enumerate(layout_digest(cast, rows=True)):
                    tensors.setdefault(f"{name}[{e}]", (tuple(t.shape[1:]), {}))[1][dtype] = lanes
            else:
                tensors.setdefault(name, (tuple(t.shape), {}))[1][dtype] = layout_digest(cast)
            del cast
    if not tensors:
        raise ConfigError("weight_manifest: the trainer has no tensors")
    return WeightManifest(tensors=tensors, config=comparable, model_bytes=model_bytes)
