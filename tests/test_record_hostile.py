"""Record files under hostile input (issue 11, "Records" and the record part of "Files and paths").

* The checksum covers the metadata and the format version: a flipped bit anywhere in the header fails to parse
  or fails the checksum; it never loads a record with a changed field.
* Every metadata field is type-checked; every index tensor is checked before use, each error naming the field.
* Saving is atomic, refuses special files, names its temporary file recognisably and removes it on any failure.
* Corrupt files (truncated, random, odd headers, huge declared lengths) are :class:`RecordFormatError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import stat
import struct

import pytest
import torch
from safetensors.torch import save_file
from test_record import META, assert_records_equal, make_record, write_raw

from moealign import _files
from moealign.record import io as rec_io
from moealign.errors import ConfigError, MoealignError, MoealignWarning, RecordError, RecordFormatError
from moealign.record import FORMAT_VERSION, RecordMeta, RolloutRecord, SamplingParams

SMALL = [(5, 2), (4, 1)]


@pytest.fixture(scope="module")
def small() -> RolloutRecord:
    return make_record(shapes=SMALL, seed=3)


def header_of(data: bytes) -> tuple[int, dict]:
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8:8 + n])


def meta_dict() -> dict:
    return json.loads(META.to_json())


# --------------------------------------------------------------------------------------------------
# 1. the checksum covers the metadata and the format version; metadata fields are type-checked
# --------------------------------------------------------------------------------------------------


def test_header_bit_flips_never_load_a_changed_record(small, tmp_path):
    """Two bits of every header byte (the 8-byte length, the metadata with meta JSON, format version and checksum,
    every tensor's dtype / shape / offsets), all eight bit positions in turn: each flip raises a RecordError or
    loads the identical record."""
    path = tmp_path / "r.safetensors"
    small.save(path)
    data = path.read_bytes()
    n, _ = header_of(data)
    loaded = 0
    for i in range(8 + n):
        for bit in (i % 8, (i + 4) % 8):
            bad = bytearray(data)
            bad[i] ^= 1 << bit
            path.write_bytes(bytes(bad))
            try:
                back = RolloutRecord.load(path)
            except RecordError:
                continue
            assert back.meta == small.meta, (i, bit)
            assert_records_equal(small, back)
            loaded += 1
    assert loaded < 20   # the few flips that keep the bytes' meaning (JSON padding); the rest were refused


@pytest.mark.parametrize("field, value", [
    ("num_experts", 32), ("num_layers", 5), ("vocab_size", 101), ("dtype", "float16"), ("engine", "vllm2"),
    ("engine_version", "0.0-tesu"), ("model_name", "tiny-mod"), ("top_k", 2), ("moe_layers", [0, 2, 3]),
    ("router_signature", [0.01, 0.5, -0.02, 0.6, 0.003, 0.56]),
])
def test_checksum_covers_every_metadata_field(small, tmp_path, field, value):
    """A metadata field changed after the checksum was taken (by hand or by a bad disk) is refused."""
    path = tmp_path / "r.safetensors"
    good = rec_io._checksum({k: v.contiguous() for k, v in small._tensors().items()},
                             {"moealign.meta": META.to_json(), "moealign.format_version": str(FORMAT_VERSION)})
    write_raw(path, small._tensors())                     # control: the checksum of an unchanged header loads
    assert json.loads(json.dumps(header_of(path.read_bytes())[1]["__metadata__"]))["moealign.checksum"] == good
    RolloutRecord.load(path)
    data = dict(meta_dict(), **{field: value})
    write_raw(path, small._tensors(), meta_json=json.dumps(data, sort_keys=True), checksum=good)
    with pytest.raises(RecordFormatError, match="checksum mismatch"):
        RolloutRecord.load(path)


def test_checksum_covers_the_format_version(small, tmp_path):
    path = tmp_path / "r.safetensors"
    metadata = {"moealign.meta": META.to_json(), "moealign.format_version": "2"}
    tensors = {k: v.contiguous() for k, v in small._tensors().items()}
    v2 = rec_io._checksum(tensors, metadata)
    assert v2 != rec_io._checksum(tensors, dict(metadata, **{"moealign.format_version": "1"}))
    # a version-2 file relabelled version 1 (whose checksum covers the tensors only) fails the v1 checksum
    write_raw(path, small._tensors(), version="1", checksum=v2)
    with pytest.raises(RecordFormatError, match="checksum mismatch"):
        RolloutRecord.load(path)
    # extra metadata entries are covered as well
    save_file(tensors, str(path), metadata=dict(metadata, **{"moealign.checksum": v2, "note": "x"}))
    with pytest.raises(RecordFormatError, match="checksum mismatch"):
        RolloutRecord.load(path)


@pytest.mark.parametrize("field, value, fragment", [
    ("moe_layers", "0123", "moe_layers must be a list, got '0123'"),
    ("moe_layers", [1, 2.0, 3], r"moe_layers\[1\] must be an integer, got 2.0"),
    ("moe_layers", [1, True, 3], r"moe_layers\[1\] must be an integer, got True"),
    ("moe_layers", {"1": 1}, "moe_layers must be a list"),
    ("num_experts", 16.0, "num_experts must be an integer, got 16.0"),
    ("num_experts", "16", "num_experts must be an integer, got '16'"),
    ("num_layers", True, "num_layers must be an integer, got True"),
    ("num_layers", 0, "num_layers must be >= 1, got 0"),
    ("top_k", None, "top_k must be an integer, got None"),
    ("vocab_size", [100], r"vocab_size must be an integer, got \[100\]"),
    ("dtype", "bfloat17", "dtype must be a torch dtype name"),
    ("dtype", 16, "dtype must be a string, got 16"),
    ("engine", "", "engine must be a non-empty string"),
    ("engine", ["vllm"], "engine must be a string"),
    ("engine_version", 1.0, "engine_version must be a string, got 1.0"),
    ("model_fingerprint", None, "model_fingerprint must be a string"),
    ("model_name", 0, "model_name must be a string"),
    ("router_signature", "0.5", "router_signature must be a list"),
    ("router_signature", [0.01, "0.5"], r"router_signature\[1\] must be a finite number, got '0.5'"),
    ("router_signature", [0.01, float("nan")], "NaN is not a JSON number"),
    ("router_samples", [True] * 8, r"router_samples\[0\] must be a finite number, got True"),
    ("format_version", 3, "format_version 3 in a file of format version 2"),
    ("format_version", "2", "format_version '2' in a file of format version 2"),
    ("format_version", 2.0, "format_version 2.0 in a file of format version 2"),
    ("format_version", True, "format_version True in a file of format version 2"),
])
def test_metadata_types_are_checked(small, tmp_path, field, value, fragment):
    """Fields of the wrong type are refused by name even under a valid checksum (a forged or foreign file)."""
    path = tmp_path / "r.safetensors"
    data = dict(meta_dict(), **{field: value})
    write_raw(path, small._tensors(), meta_json=json.dumps(data))
    with pytest.raises(RecordFormatError, match="bad record metadata: .*" + fragment):
        RolloutRecord.load(path)


@pytest.mark.parametrize("text, fragment", [
    ("[1, 2]", "must be a JSON object, got list"), ('"meta"', "must be a JSON object, got str"),
    ("null", "must be a JSON object, got NoneType"), ("{", "is not JSON"),
    (json.dumps({k: v for k, v in meta_dict().items() if k != "format_version"}), r"lacks fields \['format_version'\]"),
])
def test_metadata_that_is_no_object(small, tmp_path, text, fragment):
    path = tmp_path / "r.safetensors"
    write_raw(path, small._tensors(), meta_json=text)
    with pytest.raises(RecordFormatError, match="bad record metadata: .*" + fragment):
        RolloutRecord.load(path)


def test_meta_constructor_checks_types():
    with pytest.raises(RecordError, match="moe_layers must be a list, got '123'"):
        dataclasses.replace(META, moe_layers="123")
    with pytest.raises(RecordError, match="top_k must be an integer, got 2.5"):
        dataclasses.replace(META, top_k=2.5)
    with pytest.raises(RecordError, match="format_version must be 2, got 1"):
        dataclasses.replace(META, format_version=1)
    import numpy as np   # numpy integers and ranges are integers and lists
    meta = dataclasses.replace(META, moe_layers=range(1, 4), num_experts=np.int64(16))
    assert meta == META and type(meta.num_experts) is int


def test_version_1_files_load_with_a_re_save_warning(small, tmp_path):
    """Files of the previous format (checksum over the tensors only) still load; the warning says re-save; the
    loaded record saves as the current version."""
    path = tmp_path / "old.safetensors"
    write_raw(path, small._tensors(), version="1", meta_json=json.dumps(dict(meta_dict(), format_version=1)))
    with pytest.warns(MoealignWarning, match="record format version 1, whose checksum does not cover the metadata; "
                                             "re-save it"):
        back = RolloutRecord.load(path)
    assert_records_equal(small, back)
    assert back.meta.format_version == FORMAT_VERSION
    back.save(path)
    assert header_of(path.read_bytes())[1]["__metadata__"]["moealign.format_version"] == "2"
    assert_records_equal(small, RolloutRecord.load(path))   # no warning: pytest's filter would not show it; check:
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutRecord.load(path)
    # a version-1 file whose meta claims version 2 is refused
    write_raw(path, small._tensors(), version="1")
    with pytest.warns(MoealignWarning), pytest.raises(RecordFormatError, match="format_version 2 in a file of "
                                                                                "format version 1"):
        RolloutRecord.load(path)


# --------------------------------------------------------------------------------------------------
# 3. index tensors and int fields: checked before use, errors name the field
# --------------------------------------------------------------------------------------------------


def _forge(small, tmp_path, change) -> str:
    tensors = {k: v.clone() for k, v in small._tensors().items()}
    change(tensors)
    path = tmp_path / "r.safetensors"
    write_raw(path, tensors)
    return path


def _set(name, index, value):
    def change(t):
        t[name][index] = value
    return change


def _replace(name, fn):
    def change(t):
        t[name] = fn(t[name])
    return change


# SMALL: lengths 5 and 4, prompts 2 and 1: seq_offsets [0, 5, 9], 6 response tokens, 7 route rows
@pytest.mark.parametrize("change, fragment", [
    (_set("seq_offsets", 1, -3), r"seq_offsets must increase, got seq_offsets\[0\] = 0, seq_offsets\[1\] = -3"),
    (_set("seq_offsets", 1, 9), r"seq_offsets must increase, got seq_offsets\[1\] = 9, seq_offsets\[2\] = 9"),
    (_set("seq_offsets", 1, 12), r"seq_offsets must increase, got seq_offsets\[1\] = 12, seq_offsets\[2\] = 9"),
    (_set("seq_offsets", 0, 1), "seq_offsets must run from 0 to 9 .* got 1 .. 9"),
    (_set("seq_offsets", 2, 8), "seq_offsets must run from 0 to 9 .* got 0 .. 8"),
    (_replace("seq_offsets", lambda t: t[:1]), r"the record holds no samples \(seq_offsets has 1 entries\)"),
    (_replace("seq_offsets", lambda t: t.double()), "tensor seq_offsets is torch.float64 with 1 dims"),
    (_replace("seq_offsets", lambda t: t.reshape(1, 3)), "tensor seq_offsets is torch.int64 with 2 dims"),
    (_set("prompt_lens", 0, -1), r"prompt_lens\[0\] = -1, need 1 <= prompt length < sample length 5"),
    (_set("prompt_lens", 1, 4), r"prompt_lens\[1\] = 4, need 1 <= prompt length < sample length 4"),
    (_set("prompt_lens", 0, 0), r"prompt_lens\[0\] = 0"),
    (_replace("prompt_lens", lambda t: t.to(torch.int32)), "tensor prompt_lens is torch.int32"),
    (_replace("token_ids", lambda t: t.double()), "tensor token_ids is torch.float64"),
    (_replace("logprobs", lambda t: t.double()), "tensor logprobs is torch.float64"),
    (_replace("routes", lambda t: t.to(torch.int16)), "tensor routes is torch.int16 .* a record stores torch.uint8"),
    (_replace("sampling", lambda t: t.float()), "tensor sampling is torch.float32"),
    (_set("sampling", (1, 1), 1.5), r"sampling\[1\]: sampling top_k must be an integer >= 0 \(0 = off\), got 1.5"),
    (_set("sampling", (0, 1), float("nan")), r"sampling\[0\]: sampling top_k must be an integer"),
    (_set("sampling", (0, 1), float("inf")), r"sampling\[0\]: sampling top_k must be an integer"),
    (_set("sampling", (0, 1), -1.0), r"sampling\[0\]: sampling top_k must be an integer >= 0"),
    (_set("sampling", (0, 0), float("inf")), r"sampling\[0\]: sampling temperature must be finite and > 0"),
    (_set("sampling", (1, 2), float("nan")), r"sampling\[1\]: sampling top_p must be in \(0, 1\]"),
    (_set("sampling", (1, 3), -0.5), r"sampling\[1\]: sampling min_p must be in \[0, 1\]"),
    (_replace("kept_ids", lambda t: torch.cat([t, t[:2]])),
     r"kept sets \(kept_offsets / kept_ids\): offsets\[-1\] = \d+ but ids has \d+ entries"),
    (_set("kept_offsets", 2, 0), r"kept sets \(kept_offsets / kept_ids\): offsets decrease at row 1"),
    (_set("kept_offsets", 0, -1), r"kept sets \(kept_offsets / kept_ids\): offsets\[0\] must be 0, got -1"),
    (_set("kept_offsets", 6, 10**12), r"kept sets \(kept_offsets / kept_ids\): offsets\[-1\] = 1000000000000"),
    (_set("kept_ids", 0, 100), r"kept sets \(kept_offsets / kept_ids\): .*100"),
    (_replace("kept_ids", lambda t: t.long()), "tensor kept_ids is torch.int64"),
    (_replace("kept_offsets", lambda t: t.float()), "tensor kept_offsets is torch.float32"),
    (lambda t: t.update(extra=torch.zeros(1)), r"record file has unknown tensors \['extra'\]"),
])
def test_forged_indices_name_the_field(small, tmp_path, change, fragment):
    """Under a valid checksum (a forged or foreign file) every index is still checked before it is used."""
    path = _forge(small, tmp_path, change)
    with pytest.raises(RecordFormatError, match=fragment):
        RolloutRecord.load(path)


def test_sampling_params_refuse_fractional_and_non_numbers():
    with pytest.raises(RecordError, match="top_k must be an integer >= 0 .*got 1.5"):
        SamplingParams.from_tuple((1.0, 1.5, 1.0, 0.0))
    assert SamplingParams.from_tuple((1.0, 20.0, 1.0, 0.0)).top_k == 20   # an integral float is that integer
    for kwargs, fragment in [({"top_k": True}, "top_k must be a number, got True"),
                             ({"temperature": "0.7"}, "temperature must be a number, got '0.7'"),
                             ({"top_k": float("nan")}, "top_k must be an integer"),
                             ({"top_p": None}, "top_p must be a number, got None")]:
        with pytest.raises(RecordError, match=fragment):
            SamplingParams(**kwargs)


# --------------------------------------------------------------------------------------------------
# empty records, zero samples, empty responses
# --------------------------------------------------------------------------------------------------


def test_empty_things_are_clear_errors(small, tmp_path):
    with pytest.raises(RecordError, match="at least one sample"):
        RolloutRecord(META, [])
    s = small.samples[0]
    with pytest.raises(RecordError, match="an empty response"):   # prompt only
        RolloutRecord(META, [dataclasses.replace(s, token_ids=s.token_ids[:2], logprobs=s.logprobs[:0],
                                                 routes=s.routes[:1], kept_offsets=s.kept_offsets[:1],
                                                 kept_ids=s.kept_ids[:0])])
    # an unvalidated empty record is refused by save, before any file is touched
    path = tmp_path / "empty.safetensors"
    with pytest.raises(RecordError, match="at least one sample"):
        RolloutRecord(META, [], validate=False).save(path)
    assert not path.exists()
    # a file of zero samples
    tensors = {"token_ids": torch.zeros(0, dtype=torch.int64), "seq_offsets": torch.zeros(1, dtype=torch.int64),
               "prompt_lens": torch.zeros(0, dtype=torch.int64), "logprobs": torch.zeros(0),
               "sampling": torch.zeros(0, 4, dtype=torch.float64)}
    write_raw(path, tensors)
    with pytest.raises(RecordFormatError, match="the record holds no samples"):
        RolloutRecord.load(path)
    tensors["seq_offsets"] = torch.zeros(0, dtype=torch.int64)
    write_raw(path, tensors)
    with pytest.raises(RecordFormatError, match="the record holds no samples"):
        RolloutRecord.load(path)


def test_save_validates_first(small, tmp_path):
    bad = make_record(shapes=SMALL, seed=3)
    bad.samples[0].logprobs = bad.samples[0].logprobs.abs() + 1.0   # probabilities, not log-probs
    path = tmp_path / "r.safetensors"
    small.save(path)
    before = path.read_bytes()
    with pytest.raises(RecordError, match="logprobs has positive entries"):
        bad.save(path)
    assert path.read_bytes() == before


# --------------------------------------------------------------------------------------------------
# 4. saving: atomic, special files refused, temporary file named and removed
# --------------------------------------------------------------------------------------------------


def test_save_refuses_a_fifo(small, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="record path .*pipe: exists and is not a regular file"):
        small.save(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["pipe"]


def test_save_refuses_a_directory_and_a_missing_directory(small, tmp_path):
    with pytest.raises(ConfigError, match="exists and is not a regular file"):
        small.save(tmp_path)
    with pytest.raises(ConfigError, match="the directory .*missing does not exist"):
        small.save(tmp_path / "missing" / "r.safetensors")
    if os.path.exists("/dev/null"):
        with pytest.raises(ConfigError, match="/dev/null: exists and is not a regular file"):
            small.save("/dev/null")
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("path", ["", None, b"r.safetensors", "bad\0name"])
def test_save_refuses_paths_that_are_no_paths(small, tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="record path"):
        small.save(path)
    assert os.listdir(tmp_path) == []


def test_save_through_a_symlink_keeps_the_link(small, tmp_path):
    target = tmp_path / "real.safetensors"
    link = tmp_path / "latest.safetensors"
    target.write_bytes(b"old")
    link.symlink_to(target)
    small.save(link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert_records_equal(small, RolloutRecord.load(target))


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_failing_save_leaves_no_temporary_file_and_the_old_target(small, tmp_path, monkeypatch, exc):
    import safetensors.torch

    path = tmp_path / "r.safetensors"
    make_record(shapes=[(3, 1)], seed=5).save(path)
    before = path.read_bytes()
    seen = []
    real = safetensors.torch.save_file

    def failing(tensors, filename, metadata=None):
        seen.append(os.path.basename(filename))
        real(tensors, filename, metadata=metadata)   # a full-size temporary file, then the failure
        with open(filename, "r+b") as fh:
            fh.truncate(100)
        raise exc

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(type(exc)):
        small.save(path)
    assert seen and seen[0].startswith(".r.safetensors.moealign-tmp-")   # recognisable if a kill leaves it
    assert sorted(os.listdir(tmp_path)) == ["r.safetensors"]
    assert path.read_bytes() == before


def test_save_fsyncs_before_the_rename(small, tmp_path, monkeypatch):
    path = tmp_path / "r.safetensors"
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(_files.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(_files.os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    small.save(path)
    assert events[:2] == ["fsync", "replace"]
    assert_records_equal(small, RolloutRecord.load(path))


def test_atomic_write_on_a_failing_writer(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")

    def writer(tmp):
        with open(tmp, "w") as fh:
            fh.write("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _files.atomic_write(path, writer, flag="--json")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]
    _files.atomic_write(path, lambda tmp: open(tmp, "w").write("new"), flag="--json")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["out.json"]


# --------------------------------------------------------------------------------------------------
# 5. corrupt files: RecordFormatError, never a raw error, what is read is bounded
# --------------------------------------------------------------------------------------------------


def _load_error(path) -> MoealignError:
    with pytest.raises(RecordFormatError) as info:
        RolloutRecord.load(path)
    return info.value


def test_truncated_at_many_lengths(small, tmp_path):
    path = tmp_path / "r.safetensors"
    small.save(path)
    data = path.read_bytes()
    for cut in sorted(set(range(0, 24)) | set(range(0, len(data), 7)) | {len(data) - 1}):
        path.write_bytes(data[:cut])
        _load_error(path)


def test_random_bytes(tmp_path):
    rng = random.Random(11)
    path = tmp_path / "r.safetensors"
    for size in (1, 7, 8, 9, 64, 4096):
        for _ in range(5):
            path.write_bytes(bytes(rng.randrange(256) for _ in range(size)))
            _load_error(path)


def _raw(header: bytes, body: bytes = b"", declared: int | None = None) -> bytes:
    return struct.pack("<Q", len(header) if declared is None else declared) + header + body


@pytest.mark.parametrize("data", [
    _raw(b"[]"), _raw(b'"abc"'), _raw(b"12"), _raw(b"null"), _raw(b"{"),
    _raw(b"{}", declared=2**64 - 1), _raw(b"{}", declared=2**63), _raw(b"{}", declared=100_000_001),
    _raw(b"{}" + b" " * 64, declared=1 << 20),
    _raw(json.dumps({"__metadata__": {"moealign.meta": 3}}).encode()),
    _raw(json.dumps({"__metadata__": []}).encode()),
    _raw(json.dumps({"x": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}).encode(), b"\0" * 8),
    _raw(json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 2**62]}}).encode(), b"\0" * 8),
    _raw(json.dumps({"x": {"dtype": "Q99", "shape": [2], "data_offsets": [0, 8]}}).encode(), b"\0" * 8),
    _raw(json.dumps({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}).encode(), b"\0" * 8),
], ids=lambda d: d[8:40].decode("latin-1"))
def test_odd_headers(tmp_path, data):
    path = tmp_path / "r.safetensors"
    path.write_bytes(data)
    _load_error(path)


def test_record_metadata_on_a_huge_tensor_file(small, tmp_path):
    """A record-like header declaring a huge tensor over a small body: refused by the byte-range check."""
    path = tmp_path / "r.safetensors"
    small.save(path)
    data = path.read_bytes()
    n, header = header_of(data)
    header["token_ids"]["shape"] = [2**40]
    header["token_ids"]["data_offsets"] = [header["token_ids"]["data_offsets"][0], 2**43]
    text = json.dumps(header).encode()
    path.write_bytes(_raw(text) + data[8 + n:])
    _load_error(path)


def test_load_of_a_special_file(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(FileNotFoundError, match="no record file at .*pipe \\(it is not a regular file\\)"):
        RolloutRecord.load(fifo)     # never opened: reading a FIFO would block


def test_meta_of_other_shapes_with_valid_checksum_are_refused(small, tmp_path):
    """The checksum is not the only guard: a self-consistent file of another model's shape is still checked."""
    path = tmp_path / "r.safetensors"
    write_raw(path, small._tensors(), meta_json=dataclasses.replace(META, vocab_size=10).to_json())
    with pytest.raises(RecordError, match=r"not a token id in \[0, 10\)"):
        RolloutRecord.load(path)
    meta = RecordMeta.from_json(META.to_json())
    assert meta == META
