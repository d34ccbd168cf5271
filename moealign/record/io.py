"""The record file: safetensors, flat concatenated tensors plus JSON metadata, a format version and a SHA-256
checksum over the format version, the metadata (every header field the record reads) and every tensor's name,
dtype, shape and bytes: a changed byte anywhere in a file either fails to parse or fails the checksum. Every metadata
field is type-checked on load and every index tensor (sequence offsets, prompt lengths, kept-set offsets) is checked
before use. Files of format version 1 (whose checksum covered the tensors only) are still read, with a
:class:`~moealign.errors.MoealignWarning` asking to re-save them. Saving is atomic (:func:`moealign._files.atomic_write`)
and refuses a target that is not a regular file. The rollout side's execution contract (:mod:`moealign.contract`),
when the record states one, is saved as JSON under its own metadata key (so covered by the checksum) and checked on
load; files without one load with ``contract=None``.

:meth:`RolloutRecord.save <moealign.record.RolloutRecord.save>` / :meth:`~moealign.record.RolloutRecord.load` are
the entry points; this module holds what they write and read.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings

import torch

from .._files import atomic_write, parse_json
from .._validate import short_repr
from ..errors import (
    MissingFileError,
    MoealignWarning,
    RecordError,
    RecordFormatError,
    RecordMismatchError,
)
from ..routing_replay.routes import RouteError
from ..routing_replay.sampling_mask import validate_kept_sets
from .layouts import concat_kept_sets, split_kept_sets
from .meta import FORMAT_VERSION, RecordMeta, SamplingParams
from .sample import Sample

# ``record`` below is a RolloutRecord (moealign.record.rollout), left unannotated: rollout.py imports this module,
# not the other way round

_OLD_FORMAT_VERSION = 1   # read (checksum over the tensors only), with a warning asking to re-save
_META_KEY = "moealign.meta"
_VERSION_KEY = "moealign.format_version"
_CHECKSUM_KEY = "moealign.checksum"
_CONTRACT_KEY = "moealign.contract"   # the rollout side's execution contract (moealign.contract), when stated


def record_tensors(record) -> dict[str, torch.Tensor]:
    """The tensors a file of ``record`` holds (samples concatenated; the record is not validated here)."""
    samples = record.samples
    lengths = [s.length for s in samples]
    tensors = {
        "token_ids": torch.cat([s.token_ids.to(torch.int64) for s in samples]),
        "seq_offsets": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
        "prompt_lens": torch.tensor([s.prompt_len for s in samples], dtype=torch.int64),
        "logprobs": torch.cat([s.logprobs.to(torch.float32) for s in samples]),
        "sampling": torch.tensor([s.sampling.as_tuple() for s in samples], dtype=torch.float64),
    }
    if record.has_routes:
        tensors["routes"] = torch.cat([s.routes for s in samples]).contiguous()
        if any(s.route_missing is not None for s in samples):
            tensors["route_missing"] = torch.cat([~s.routed_rows for s in samples])
        if any(s.route_version is not None for s in samples):
            missing = [i for i, s in enumerate(samples) if s.route_version is None]
            if missing:
                raise RecordError(f"samples {missing[:8]} have no route_version while others have one: give every "
                                  f"sample its weight versions (or none)")
            tensors["route_version"] = torch.cat([s.route_version for s in samples])
    if record.has_kept_sets:
        tensors["kept_offsets"], tensors["kept_ids"] = concat_kept_sets(samples)
    return tensors


def write_record(record, path: str | os.PathLike) -> None:
    """Write ``record`` (validated first) to ``path``, atomically (:meth:`RolloutRecord.save
    <moealign.record.RolloutRecord.save>`)."""
    from safetensors.torch import save_file

    record.validate()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in record_tensors(record).items()}   # CUDA samples too
    metadata = {_META_KEY: record.meta.to_json(), _VERSION_KEY: str(FORMAT_VERSION)}
    if record.contract is not None:
        metadata[_CONTRACT_KEY] = json.dumps(record.contract, sort_keys=True)
    metadata[_CHECKSUM_KEY] = _checksum(tensors, metadata)
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata), flag="record path")


def read_record(path: str | os.PathLike, *, expect: RecordMeta | None = None, require_weights: bool = False,
                stacklevel: int = 2) -> tuple[RecordMeta, list[Sample], dict | None]:
    """``(meta, samples, contract)`` of the record file at ``path``, every check of :meth:`RolloutRecord.load
    <moealign.record.RolloutRecord.load>` done (the samples themselves are validated when the record is built);
    ``stacklevel``: the old-format warning's (2: this function's caller)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        kind = " (it is not a regular file)" if os.path.exists(path) else ""
        raise MissingFileError(f"no record file at {path}{kind}")
    tensors, metadata = _read_safetensors(path)
    version = metadata[_VERSION_KEY]
    if version not in (str(FORMAT_VERSION), str(_OLD_FORMAT_VERSION)):
        raise RecordFormatError(f"{path}: record format version {short_repr(version)[1:-1]}, this moealign reads "
                                f"version {FORMAT_VERSION} (and {_OLD_FORMAT_VERSION})")
    current = version == str(FORMAT_VERSION)
    if _checksum(tensors, metadata if current else None) != metadata[_CHECKSUM_KEY]:
        raise RecordFormatError(f"{path}: checksum mismatch: the record file is corrupt")
    if not current:
        warnings.warn(f"{path}: record format version {version}, whose checksum does not cover the metadata; "
                      f"re-save it (RolloutRecord.load(path).save(path)) to write version {FORMAT_VERSION}",
                      MoealignWarning, stacklevel=stacklevel)
    try:
        meta = RecordMeta.from_json(metadata[_META_KEY], file_version=int(version))
    except RecordError as exc:
        raise RecordFormatError(f"{path}: bad record metadata: {exc}") from None
    contract = _contract_from_metadata(metadata, path) if current else None
    if expect is not None:
        meta.check_matches(expect, require_weights=require_weights)
    return meta, _samples_from_tensors(tensors, meta, path), contract


def _contract_from_metadata(metadata: dict[str, str], path: str) -> dict | None:
    """The execution contract a file states (``None``: none, as in files written before contracts existed)."""
    from ..contract import check_contract

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
                                        f"(metadata keys {short_repr(sorted(metadata))})")
            names = list(f.keys())
            unknown = sorted(set(names) - set(_FILE_TENSORS))
            if unknown:
                raise RecordFormatError(f"{path}: record file has unknown tensors {short_repr(unknown)}")
            tensors = {k: f.get_tensor(k) for k in names}
    except RecordFormatError:
        raise
    except Exception as exc:  # safetensors raises SafetensorError / OSError / others on bad bytes
        size = os.path.getsize(path)
        raise RecordFormatError(f"{path}: truncated or corrupt record file ({size} bytes): "
                                f"{type(exc).__name__}: {short_repr(str(exc))}") from None
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
        kept = split_kept_sets(tensors["kept_offsets"], tensors["kept_ids"], resp_lens)
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
