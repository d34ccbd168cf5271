"""The rollout record (moealign.record): layouts, files, validation, fingerprints.

Records are built by hand from small synthetic tensors (no model): random valid routes (distinct ids
per row, compacted with ``compact_routes``), CSR kept sets holding the sampled token (ids ascending)
and log-probs <= 0. Every equality claimed to be exact is checked bitwise and with the dtype.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from moealign.record import io as rec_io
from moealign.errors import MoealignWarning
from moealign.record import (
    FORMAT_VERSION,
    PackedBatch,
    PaddedBatch,
    RecordError,
    RecordFormatError,
    RecordMeta,
    RecordMismatchError,
    RolloutRecord,
    Sample,
    SamplingParams,
    config_fingerprint,
    router_signature,
    routes_from_all_layers,
    with_meta,
)
from moealign.routing_replay.routes import compact_routes

SIGNATURE = (0.01, 0.5, -0.02, 0.6, 0.003, 0.55)

META = RecordMeta(
    engine="vllm", engine_version="0.0-test", model_fingerprint="0123456789abcdef", num_layers=4,
    moe_layers=(1, 2, 3), num_experts=16, top_k=4, vocab_size=100, dtype="bfloat16",
    router_signature=SIGNATURE, model_name="tiny-moe",
)
META_300 = dataclasses.replace(META, num_experts=300, top_k=3)


# --------------------------------------------------------------------------------------------------
# builders and comparisons
# --------------------------------------------------------------------------------------------------


def random_routes(gen: torch.Generator, rows: int, meta: RecordMeta) -> torch.Tensor:
    n = len(meta.moe_layers)
    ids = torch.rand(rows, n, meta.num_experts, generator=gen).argsort(dim=-1)[..., : meta.top_k]
    return compact_routes(ids, meta.num_experts)


def random_kept(gen: torch.Generator, response: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets, ids = [0], []
    for tok in response.tolist():
        size = int(torch.randint(1, min(vocab, 6) + 1, (1,), generator=gen))
        others = [i for i in torch.randperm(vocab, generator=gen).tolist() if i != tok][: size - 1]
        row = sorted([tok] + others)
        ids += row
        offsets.append(offsets[-1] + len(row))
    return torch.tensor(offsets, dtype=torch.int64), torch.tensor(ids, dtype=torch.int32)


def make_sample(gen: torch.Generator, length: int, prompt_len: int, meta: RecordMeta = META, *,
                routes: bool = True, kept: bool = True, sampling: SamplingParams | None = None) -> Sample:
    token_ids = torch.randint(0, meta.vocab_size, (length,), generator=gen, dtype=torch.int64)
    logprobs = -5.0 * torch.rand(length - prompt_len, generator=gen)
    logprobs[0] = 0.0  # a certain token (log-prob exactly 0) is valid
    offsets = ids = None
    if kept:
        offsets, ids = random_kept(gen, token_ids[prompt_len:], meta.vocab_size)
    return Sample(
        token_ids=token_ids, prompt_len=prompt_len, logprobs=logprobs,
        routes=random_routes(gen, length - 1, meta) if routes else None,
        kept_offsets=offsets, kept_ids=ids,
        sampling=sampling or SamplingParams(temperature=0.7, top_k=20, top_p=0.95, min_p=0.0),
    )


SHAPES = [(9, 4), (2, 1), (5, 2), (12, 11), (3, 1), (7, 3)]  # (length, prompt_len); length-2 samples too


def make_record(meta: RecordMeta = META, shapes=SHAPES, *, seed: int = 0, routes: bool = True,
                kept: bool = True) -> RolloutRecord:
    gen = torch.Generator().manual_seed(seed)
    samples = [
        make_sample(gen, L, P, meta, routes=routes, kept=kept,
                    sampling=SamplingParams(temperature=0.5 + 0.25 * i, top_k=i, top_p=1.0 - 0.05 * i,
                                            min_p=0.01 * i))
        for i, (L, P) in enumerate(shapes)
    ]
    return RolloutRecord(meta, samples)


def assert_bitwise(a: torch.Tensor | None, b: torch.Tensor | None, what: str = "") -> None:
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    if a.numel():
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                           b.contiguous().reshape(-1).view(torch.uint8)), what


def assert_records_equal(a: RolloutRecord, b: RolloutRecord) -> None:
    assert a.meta == b.meta
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a.samples, b.samples)):
        assert x.prompt_len == y.prompt_len, i
        assert x.sampling == y.sampling, i
        for name in ("token_ids", "logprobs", "routes", "kept_offsets", "kept_ids"):
            assert_bitwise(getattr(x, name), getattr(y, name), f"sample {i} {name}")


def tamper(sample: Sample, **changes) -> RolloutRecord:
    """A record of one sample with fields replaced (validated: raises on bad input)."""
    return RolloutRecord(META, [dataclasses.replace(sample, **changes)])


@pytest.fixture(scope="module")
def record() -> RolloutRecord:
    """Shared and read-only: tests that change samples build their own."""
    return make_record()


@pytest.fixture
def sample() -> Sample:
    return make_sample(torch.Generator().manual_seed(1), 8, 3)


# --------------------------------------------------------------------------------------------------
# basic properties
# --------------------------------------------------------------------------------------------------


def test_error_hierarchy():
    assert issubclass(RecordError, ValueError)
    assert issubclass(RecordFormatError, RecordError)
    assert issubclass(RecordMismatchError, RecordError)


def test_record_properties(record):
    assert len(record) == len(SHAPES)
    assert record.has_routes and record.has_kept_sets
    assert record.num_response_tokens == sum(L - P for L, P in SHAPES)
    s = record.samples[0]
    assert (s.length, s.response_len) == (9, 5)
    assert torch.equal(s.response_ids, s.token_ids[4:])
    assert "6 samples" in repr(record)
    bare = make_record(routes=False, kept=False)
    assert not bare.has_routes and not bare.has_kept_sets


def test_empty_record_is_rejected():
    with pytest.raises(RecordError, match="at least one sample"):
        RolloutRecord(META, [])


# --------------------------------------------------------------------------------------------------
# padded layout
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_layout_conventions(record, side):
    pad = 7
    batch = record.to_padded(side, pad_token_id=pad)
    B, T = len(record), max(L for L, _ in SHAPES)
    assert batch.side == side
    assert batch.input_ids.shape == (B, T) and batch.input_ids.dtype == torch.int64
    assert batch.attention_mask.dtype == torch.int64
    assert batch.response_mask.dtype == torch.bool and batch.route_mask.dtype == torch.bool
    assert batch.logprobs.dtype == torch.float32 and batch.kept_row.dtype == torch.int64
    assert batch.routes.shape == (B, T, 3, 4) and batch.routes.dtype == torch.uint8
    assert torch.equal(batch.lengths, torch.tensor([L for L, _ in SHAPES]))
    assert torch.equal(batch.prompt_lens, torch.tensor([P for _, P in SHAPES]))
    pos = torch.arange(T)
    next_row = 0
    for b, s in enumerate(record.samples):
        L, P = s.length, s.prompt_len
        start = 0 if side == "right" else T - L
        real = (pos >= start) & (pos < start + L)
        if side == "left":  # tokens at the right end
            assert start + L == T
        assert torch.equal(batch.input_ids[b, start:start + L], s.token_ids)
        assert bool((batch.input_ids[b][~real] == pad).all())
        assert torch.equal(batch.attention_mask[b], real.to(torch.int64))
        # response tokens (and their log-probs) sit at the position of the token they score
        assert torch.equal(batch.response_mask[b], (pos >= start + P) & (pos < start + L))
        assert_bitwise(batch.logprobs[b, start + P:start + L], s.logprobs)
        assert bool((batch.logprobs[b][~batch.response_mask[b]] == 0).all())
        # route row t is for input token t: every real token but the last of the sample
        assert torch.equal(batch.route_mask[b], (pos >= start) & (pos < start + L - 1))
        assert_bitwise(batch.routes[b, start:start + L - 1], s.routes)
        assert bool((batch.routes[b][~batch.route_mask[b]] == 0).all())
        # the logits at position t - 1 score the token at t: those positions all carry a route
        scoring = batch.response_mask[b].nonzero().squeeze(1) - 1
        assert bool(batch.route_mask[b, scoring].all())
        assert int(scoring.min()) == start + P - 1  # the last prompt token predicts the first response token
        # kept_row: record-wide CSR rows, in order, on the response tokens; -1 elsewhere
        rows = batch.kept_row[b]
        assert torch.equal(rows[batch.response_mask[b]], torch.arange(next_row, next_row + L - P))
        assert bool((rows[~batch.response_mask[b]] == -1).all())
        for j, t in enumerate(range(start + P, start + L)):
            r = int(rows[t])
            lo, hi = int(batch.kept_offsets[r]), int(batch.kept_offsets[r + 1])
            assert torch.equal(batch.kept_ids[lo:hi], s.kept_ids[s.kept_offsets[j]:s.kept_offsets[j + 1]])
            assert int(batch.input_ids[b, t]) in batch.kept_ids[lo:hi].tolist()
        next_row += L - P
        # position ids count the real tokens from 0
        assert torch.equal(batch.position_ids[b, start:start + L], torch.arange(L))
    assert next_row == record.num_response_tokens
    assert batch.kept_offsets.dtype == torch.int64 and batch.kept_ids.dtype == torch.int32
    assert batch.kept_offsets.numel() == record.num_response_tokens + 1
    assert int(batch.kept_offsets[0]) == 0 and int(batch.kept_offsets[-1]) == batch.kept_ids.numel()


def test_left_padding_puts_tokens_at_the_right_end(record):
    left = record.to_padded("left")
    right = record.to_padded("right")
    assert bool((left.attention_mask[:, -1] == 1).all())
    assert bool((right.attention_mask[:, 0] == 1).all())
    for b, s in enumerate(record.samples):
        assert torch.equal(left.input_ids[b, -s.length:], s.token_ids)
        assert torch.equal(left.attention_mask[b].flip(0), right.attention_mask[b])
        assert bool(left.response_mask[b, -1]) and not bool(left.route_mask[b, -1])


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_round_trip(record, side):
    batch = record.to_padded(side, pad_token_id=3)
    back = RolloutRecord.from_padded(record.meta, batch, [s.sampling for s in record.samples])
    assert_records_equal(record, back)
    # the samples own their memory: changing the batch afterwards does not change the record
    batch.input_ids.fill_(0)
    batch.logprobs.fill_(1.0)
    batch.routes.fill_(0)
    assert_records_equal(record, back)


@pytest.mark.parametrize("routes, kept", [(False, False), (True, False), (False, True)])
def test_padded_and_packed_round_trip_without_optional_fields(routes, kept):
    record = make_record(routes=routes, kept=kept, seed=3)
    sampling = [s.sampling for s in record.samples]
    for side in ("right", "left"):
        batch = record.to_padded(side)
        assert (batch.routes is None) == (not routes)
        assert (batch.kept_offsets is None) == (not kept) and (batch.kept_ids is None) == (not kept)
        assert_records_equal(record, RolloutRecord.from_padded(record.meta, batch, sampling))
    packed = record.to_packed()
    assert (packed.routes is None) == (not routes)
    assert_records_equal(record, RolloutRecord.from_packed(record.meta, packed, sampling))


def test_padded_errors(record):
    with pytest.raises(RecordError, match="padding side must be 'left' or 'right', got 'middle'"):
        record.to_padded("middle")
    batch = record.to_padded("right")
    with pytest.raises(RecordError, match="from_padded: 2 sampling params for 6 samples"):
        RolloutRecord.from_padded(record.meta, batch, [SamplingParams()] * 2)
    batch.side = "left"  # the tokens are on the right-padded side: the attention mask disagrees
    with pytest.raises(RecordError, match="attention_mask does not cover its 9 tokens on the left"):
        RolloutRecord.from_padded(record.meta, batch, [SamplingParams()] * 6)


# --------------------------------------------------------------------------------------------------
# packed layout
# --------------------------------------------------------------------------------------------------


def test_packed_layout_conventions(record):
    batch = record.to_packed()
    lengths = [L for L, _ in SHAPES]
    N = sum(lengths)
    assert torch.equal(batch.cu_seqlens, torch.tensor([0] + lengths).cumsum(0))
    assert batch.cu_seqlens.dtype == torch.int64
    assert torch.equal(batch.input_ids, torch.cat([s.token_ids for s in record.samples]))
    assert torch.equal(batch.position_ids, torch.cat([torch.arange(L) for L in lengths]))
    assert batch.routes.shape == (N, 3, 4) and batch.routes.dtype == torch.uint8
    assert batch.logprobs.dtype == torch.float32 and batch.logprobs.shape == (N,)
    assert torch.equal(batch.prompt_lens, torch.tensor([P for _, P in SHAPES]))
    last = batch.cu_seqlens[1:] - 1
    # route_mask: False exactly at each sample's final token
    want_mask = torch.ones(N, dtype=torch.bool)
    want_mask[last] = False
    assert torch.equal(batch.route_mask, want_mask)
    assert bool((batch.routes[last] == 0).all())
    assert_bitwise(batch.routes[batch.route_mask], torch.cat([s.routes for s in record.samples]))
    for b, s in enumerate(record.samples):
        lo, hi, P = int(batch.cu_seqlens[b]), int(batch.cu_seqlens[b + 1]), s.prompt_len
        assert torch.equal(batch.response_mask[lo:hi], torch.arange(s.length) >= P)
        assert_bitwise(batch.logprobs[lo + P:hi], s.logprobs)
        assert bool((batch.logprobs[lo:lo + P] == 0).all())
        assert_bitwise(batch.routes[lo:hi - 1], s.routes)
    assert_bitwise(batch.logprobs[batch.response_mask], torch.cat([s.logprobs for s in record.samples]))
    # the logits at position t - 1 (same sample) score token t and carry a route
    scoring = batch.response_mask.nonzero().squeeze(1) - 1
    assert bool(batch.route_mask[scoring].all())
    # kept_row: the response tokens in order index the CSR rows 0..R-1
    R = record.num_response_tokens
    assert torch.equal(batch.kept_row[batch.response_mask], torch.arange(R))
    assert bool((batch.kept_row[~batch.response_mask] == -1).all())
    for t in batch.response_mask.nonzero().squeeze(1).tolist():
        r = int(batch.kept_row[t])
        assert int(batch.input_ids[t]) in batch.kept_ids[batch.kept_offsets[r]:batch.kept_offsets[r + 1]].tolist()


def test_packed_round_trip(record):
    batch = record.to_packed()
    back = RolloutRecord.from_packed(record.meta, batch, [s.sampling for s in record.samples])
    assert_records_equal(record, back)
    batch.input_ids.fill_(0)
    batch.routes.fill_(0)
    batch.kept_ids.fill_(0)
    assert_records_equal(record, back)


def test_packed_errors(record):
    batch = record.to_packed()
    with pytest.raises(RecordError, match="from_packed: cu_seqlens has 6 samples, sampling 5"):
        RolloutRecord.from_packed(record.meta, batch, [SamplingParams()] * 5)


def test_padded_and_packed_agree(record):
    padded, packed = record.to_padded("right"), record.to_packed()
    mask = padded.attention_mask.bool()
    assert torch.equal(padded.input_ids[mask], packed.input_ids)
    assert torch.equal(padded.response_mask[mask], packed.response_mask)
    assert torch.equal(padded.route_mask[mask], packed.route_mask)
    assert torch.equal(padded.routes[mask], packed.routes)
    assert torch.equal(padded.kept_row[mask], packed.kept_row)
    assert torch.equal(padded.position_ids[mask], packed.position_ids)
    assert_bitwise(padded.logprobs[mask], packed.logprobs)
    assert_bitwise(padded.kept_offsets, packed.kept_offsets)
    assert_bitwise(padded.kept_ids, packed.kept_ids)


# --------------------------------------------------------------------------------------------------
# routes: dtypes, storage, int64 views
# --------------------------------------------------------------------------------------------------


def test_routes_uint8_up_to_256_experts():
    assert META.route_dtype == torch.uint8
    assert dataclasses.replace(META, num_experts=256).route_dtype == torch.uint8
    assert dataclasses.replace(META, num_experts=257).route_dtype == torch.int16
    assert dataclasses.replace(META, num_experts=32767).route_dtype == torch.int16


def test_record_with_300_experts_stores_int16(tmp_path):
    record = make_record(META_300, seed=5)
    assert all(s.routes.dtype == torch.int16 for s in record.samples)
    assert max(int(s.routes.max()) for s in record.samples) > 255  # ids that do not fit a byte
    assert record.to_padded().routes.dtype == torch.int16
    assert record.to_packed().routes.dtype == torch.int16
    path = tmp_path / "r300.safetensors"
    record.save(path)
    with safe_open(str(path), framework="pt") as f:
        stored = f.get_tensor("routes")
    assert stored.dtype == torch.int16 and stored.element_size() == 2
    back = RolloutRecord.load(path, expect=META_300)
    assert_records_equal(record, back)
    rb = back.replay_batch("packed")
    assert torch.equal(rb.routes[rb.route_mask], torch.cat([s.routes for s in record.samples]).long())


def test_record_with_256_experts_uint8_boundary(tmp_path):
    # 256 experts is the largest uint8 model (DeepSeek-V3 size): ids 0..255 fill the byte
    meta = dataclasses.replace(META, num_experts=256, top_k=8)
    assert meta.route_dtype == torch.uint8
    record = make_record(meta, shapes=[(40, 5), (2, 1)], seed=6)
    routes = torch.cat([s.routes for s in record.samples])
    assert routes.dtype == torch.uint8 and int(routes.max()) > 200
    record.save(tmp_path / "r.safetensors")
    assert_records_equal(record, RolloutRecord.load(tmp_path / "r.safetensors", expect=meta))


@pytest.mark.parametrize("meta, bad", [
    (META, torch.int64), (META, torch.int16), (META, torch.int32),
    (META_300, torch.int32), (META_300, torch.int64),
])
def test_routes_of_the_wrong_dtype_are_rejected(meta, bad):
    s = make_sample(torch.Generator().manual_seed(2), 6, 2, meta)
    s.routes = s.routes.to(bad)
    with pytest.raises(RecordError, match=f"routes are {bad}, the record stores {meta.route_dtype}"):
        RolloutRecord(meta, [s])


def test_uint8_routes_rejected_for_300_experts():
    s = make_sample(torch.Generator().manual_seed(2), 6, 2, META_300)
    s.routes = (s.routes % 200).to(torch.uint8)
    with pytest.raises(RecordError, match="routes are torch.uint8, the record stores torch.int16"):
        RolloutRecord(META_300, [s])


def test_route_storage_is_top_k_bytes_per_token_and_layer(record, tmp_path):
    path = tmp_path / "r.safetensors"
    record.save(path)
    with safe_open(str(path), framework="pt") as f:
        stored = f.get_tensor("routes")
    rows = sum(L - 1 for L, _ in SHAPES)
    assert stored.dtype == torch.uint8 and stored.element_size() == 1
    assert stored.shape == (rows, len(META.moe_layers), META.top_k)
    # in the file itself: exactly top_k bytes per (token, layer)
    data = path.read_bytes()
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    begin, end = header["routes"]["data_offsets"]
    assert header["routes"]["dtype"] == "U8"
    assert end - begin == rows * len(META.moe_layers) * META.top_k


@pytest.mark.parametrize("layout, side", [("packed", "right"), ("padded", "right"), ("padded", "left")])
def test_replay_batch(record, layout, side):
    rb = record.replay_batch(layout, side)
    batch = record.to_packed() if layout == "packed" else record.to_padded(side)
    n, k = len(META.moe_layers), META.top_k
    assert rb.layout == layout and rb.moe_layers == tuple(META.moe_layers)
    assert rb.routes.dtype == torch.int64 and rb.route_mask.dtype == torch.bool
    assert rb.routes.shape == (batch.input_ids.numel(), n, k)
    assert torch.equal(rb.route_mask, batch.route_mask.reshape(-1))
    assert torch.equal(rb.routes, batch.routes.reshape(-1, n, k).long())
    assert torch.equal(rb.input_ids, batch.input_ids)           # the routes travel with their tokens
    if layout == "padded":
        assert rb.padding_side in (side, "none") and torch.equal(rb.attention_mask, batch.attention_mask)
    else:
        assert torch.equal(rb.cu_seqlens, batch.cu_seqlens)
    # recorded rows come back in sample order; unrecorded rows are zero
    assert torch.equal(rb.routes[rb.route_mask], torch.cat([s.routes for s in record.samples]).long())
    assert bool((rb.routes[~rb.route_mask] == 0).all())


def test_replay_batch_without_routes():
    with pytest.raises(RecordError, match="this record has no routes"):
        make_record(routes=False).replay_batch()


def test_replay_batch_unknown_layout(record):
    with pytest.raises(RecordError, match="layout must be 'packed' or 'padded', got 'pakced'"):
        record.replay_batch("pakced")


# --------------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------------


def test_save_load_round_trip(record, tmp_path):
    path = tmp_path / "record.safetensors"
    record.save(path)
    assert sorted(os.listdir(tmp_path)) == ["record.safetensors"]  # no temporary file left behind
    back = RolloutRecord.load(path)
    assert_records_equal(record, back)
    assert back.meta == META
    assert [s.sampling for s in back.samples] == [s.sampling for s in record.samples]
    # str paths work as well, and a second save replaces the file
    other = make_record(seed=9, shapes=[(4, 2)])
    other.save(str(path))
    assert_records_equal(other, RolloutRecord.load(str(path), expect=META))


@pytest.mark.parametrize("routes, kept", [(False, False), (True, False), (False, True)])
def test_save_load_without_optional_fields(tmp_path, routes, kept):
    record = make_record(routes=routes, kept=kept, seed=4)
    record.save(tmp_path / "r.safetensors")
    back = RolloutRecord.load(tmp_path / "r.safetensors")
    assert back.has_routes == routes and back.has_kept_sets == kept
    assert_records_equal(record, back)


def test_sampling_params_round_trip(tmp_path):
    params = [SamplingParams(), SamplingParams(temperature=0.6, top_k=50, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=1.3, top_k=1), SamplingParams(top_p=0.1, min_p=1.0)]
    gen = torch.Generator().manual_seed(0)
    record = RolloutRecord(META, [make_sample(gen, 5, 2, sampling=p) for p in params])
    record.save(tmp_path / "s.safetensors")
    back = RolloutRecord.load(tmp_path / "s.safetensors")
    assert [s.sampling for s in back.samples] == params
    assert all(isinstance(s.sampling.top_k, int) for s in back.samples)
    for p in params:
        assert SamplingParams.from_tuple(p.as_tuple()) == p
    assert not SamplingParams().truncates
    assert all(p.truncates for p in params[1:])


def test_meta_round_trip():
    text = META.to_json()
    assert json.loads(text)["moe_layers"] == [1, 2, 3]
    back = RecordMeta.from_json(text)
    assert back == META
    assert isinstance(back.moe_layers, tuple) and isinstance(back.router_signature, tuple)
    assert back.format_version == FORMAT_VERSION


def test_meta_from_json_unknown_field():
    data = json.loads(META.to_json())
    data["surprise"] = 1
    with pytest.raises(RecordFormatError, match=r"unknown fields \['surprise'\]"):
        RecordMeta.from_json(json.dumps(data))


def write_raw(path, tensors, *, meta_json=None, version=str(FORMAT_VERSION), checksum=None):
    """Write a record-like safetensors file by hand (to forge headers) with a valid checksum: over metadata and
    tensors (format version 2), over the tensors only for version "1"."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    metadata = {
        "moealign.meta": META.to_json() if meta_json is None else meta_json,
        "moealign.format_version": version,
    }
    if checksum is None:
        checksum = rec_io._checksum(tensors, None if version == "1" else metadata)
    metadata["moealign.checksum"] = checksum
    save_file(tensors, str(path), metadata=metadata)


def test_write_raw_matches_save(record, tmp_path):
    # the forging helper writes what save writes, so the error tests below change one thing only
    write_raw(tmp_path / "raw.safetensors", record._tensors())
    assert_records_equal(record, RolloutRecord.load(tmp_path / "raw.safetensors"))


@pytest.mark.parametrize("keep", ["half", "minus3", "header"])
def test_truncated_file(record, tmp_path, keep):
    path = tmp_path / "r.safetensors"
    record.save(path)
    data = path.read_bytes()
    cut = {"half": len(data) // 2, "minus3": len(data) - 3, "header": 4}[keep]
    path.write_bytes(data[:cut])
    with pytest.raises(RecordFormatError, match=rf"truncated or corrupt record file \({cut} bytes\)"):
        RolloutRecord.load(path)


def test_empty_and_garbage_files(tmp_path):
    path = tmp_path / "empty.safetensors"
    path.write_bytes(b"")
    with pytest.raises(RecordFormatError, match=r"truncated or corrupt record file \(0 bytes\)"):
        RolloutRecord.load(path)
    path.write_bytes(b"this is not a safetensors file at all, just some text " * 4)
    with pytest.raises(RecordFormatError, match="truncated or corrupt"):
        RolloutRecord.load(path)


@pytest.mark.parametrize("back", [1, 2, 7])
def test_corrupted_byte_gives_checksum_mismatch(record, tmp_path, back):
    path = tmp_path / "r.safetensors"
    record.save(path)
    data = bytearray(path.read_bytes())
    data[-back] ^= 0xFF  # inside the last tensor's data (safetensors stores no trailer)
    path.write_bytes(bytes(data))
    with pytest.raises(RecordFormatError, match="checksum mismatch: the record file is corrupt"):
        RolloutRecord.load(path)


def test_corrupted_byte_in_every_tensor(record, tmp_path):
    path = tmp_path / "r.safetensors"
    record.save(path)
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    names = [k for k in header if k != "__metadata__"]
    assert set(names) == {"token_ids", "seq_offsets", "prompt_lens", "logprobs", "sampling", "routes",
                          "kept_offsets", "kept_ids"}
    for name in names:
        begin, end = header[name]["data_offsets"]
        pos = 8 + header_len + (begin + end) // 2
        bad = bytearray(data)
        bad[pos] ^= 0x01
        path.write_bytes(bytes(bad))
        with pytest.raises(RecordFormatError, match="checksum mismatch"):
            RolloutRecord.load(path)


def test_checksum_covers_names_dtypes_and_shapes():
    t = {"a": torch.arange(6, dtype=torch.int64)}
    base = rec_io._checksum(t)
    assert rec_io._checksum({"b": t["a"]}) != base
    assert rec_io._checksum({"a": t["a"].view(torch.float64)}) != base
    assert rec_io._checksum({"a": t["a"].reshape(2, 3)}) != base
    assert rec_io._checksum({"a": torch.arange(6, dtype=torch.int64)}) == base


def test_non_record_safetensors_file(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(3)}, str(path))
    with pytest.raises(RecordFormatError, match="a safetensors file, but not a moealign rollout record"):
        RolloutRecord.load(path)
    save_file({"w": torch.zeros(3)}, str(path), metadata={"format": "pt"})
    with pytest.raises(RecordFormatError, match=r"not a moealign rollout record \(metadata keys \['format'\]\)"):
        RolloutRecord.load(path)


@pytest.mark.parametrize("version", ["3", "0", "1.0", "2 ", "02"])
def test_wrong_format_version(record, tmp_path, version):
    path = tmp_path / "r.safetensors"
    write_raw(path, record._tensors(), version=version)
    with pytest.raises(RecordFormatError, match=f"record format version {version}, this moealign reads version 2"):
        RolloutRecord.load(path)


def test_bad_metadata_json(record, tmp_path):
    path = tmp_path / "r.safetensors"
    data = json.loads(META.to_json())
    data["extra"] = True
    write_raw(path, record._tensors(), meta_json=json.dumps(data))
    with pytest.raises(RecordFormatError, match="bad record metadata: record metadata has unknown fields"):
        RolloutRecord.load(path)
    data = json.loads(META.to_json())
    data["top_k"] = 99  # top_k > num_experts: the meta itself is invalid
    write_raw(path, record._tensors(), meta_json=json.dumps(data))
    with pytest.raises(RecordFormatError, match="bad record metadata: meta: need 1 <= top_k <= num_experts"):
        RolloutRecord.load(path)
    data = json.loads(META.to_json())
    del data["num_layers"]
    write_raw(path, record._tensors(), meta_json=json.dumps(data))
    with pytest.raises(RecordFormatError, match="bad record metadata: .*num_layers"):
        RolloutRecord.load(path)
    write_raw(path, record._tensors(), meta_json="{not json")
    with pytest.raises(RecordFormatError, match="bad record metadata"):
        RolloutRecord.load(path)


def test_file_routes_disagree_with_metadata(record, tmp_path):
    path = tmp_path / "r.safetensors"
    write_raw(path, record._tensors(), meta_json=dataclasses.replace(META, top_k=2).to_json())
    with pytest.raises(RecordMismatchError, match=r"routes have shape \(32, 3, 4\), the metadata implies \(32, 3, 2\)"):
        RolloutRecord.load(path)


def test_file_with_inconsistent_index(record, tmp_path):
    path = tmp_path / "r.safetensors"
    tensors = record._tensors()
    tensors["prompt_lens"] = tensors["prompt_lens"][:-1]
    write_raw(path, tensors)
    with pytest.raises(RecordFormatError, match="inconsistent sample index"):
        RolloutRecord.load(path)
    tensors = record._tensors()
    tensors["logprobs"] = tensors["logprobs"][:-1]
    write_raw(path, tensors)
    with pytest.raises(RecordFormatError, match="15 logprobs for 16 response tokens"):
        RolloutRecord.load(path)
    tensors = record._tensors()
    del tensors["sampling"]
    write_raw(path, tensors)
    with pytest.raises(RecordFormatError, match=r"record file lacks tensors \['sampling'\]"):
        RolloutRecord.load(path)


def test_file_with_inconsistent_kept_sets(record, tmp_path):
    path = tmp_path / "r.safetensors"
    tensors = record._tensors()
    del tensors["kept_ids"]
    write_raw(path, tensors)
    with pytest.raises(RecordFormatError, match="has only one of kept_offsets / kept_ids"):
        RolloutRecord.load(path)
    tensors = record._tensors()
    tensors["kept_offsets"] = tensors["kept_offsets"][:-2]
    write_raw(path, tensors)
    with pytest.raises(RecordFormatError, match=r"kept_offsets has shape \(15,\), expected \(17,\)"):
        RolloutRecord.load(path)


def test_loaded_values_are_validated(record, tmp_path):
    path = tmp_path / "r.safetensors"
    tensors = record._tensors()
    tensors["logprobs"] = tensors["logprobs"].clone()
    tensors["logprobs"][3] = 0.5  # a valid checksum over an invalid record
    write_raw(path, tensors)
    with pytest.raises(RecordError, match="logprobs has positive entries"):
        RolloutRecord.load(path)


def test_load_not_a_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no record file at"):
        RolloutRecord.load(tmp_path)  # a directory
    with pytest.raises(FileNotFoundError, match="no record file at"):
        RolloutRecord.load(tmp_path / "missing.safetensors")


# --------------------------------------------------------------------------------------------------
# load(expect=...): the record must belong to the model
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def saved(record, tmp_path):
    path = tmp_path / "r.safetensors"
    record.save(path)
    return path


@pytest.mark.parametrize("changes, fragment", [
    ({"num_layers": 6}, "num_layers: record has 4, model has 6"),
    ({"moe_layers": (0, 1, 2)}, r"moe_layers: record has \(1, 2, 3\), model has \(0, 1, 2\)"),
    ({"moe_layers": (1, 3)}, "moe_layers"),
    ({"num_experts": 32}, "num_experts: record has 16, model has 32"),
    ({"top_k": 2}, "top_k: record has 4, model has 2"),
    ({"vocab_size": 101}, "vocab_size: record has 100, model has 101"),
    ({"model_fingerprint": "ffffffffffffffff"}, "model_fingerprint: record has '0123456789abcdef'"),
    ({"router_signature": tuple(1.1 * x for x in SIGNATURE)}, r"router weights differ \(routers \[0, 1, 2\]\)"),
    ({"router_signature": SIGNATURE[:4]}, "router_signature: record has 3 routers, model has 2"),
])
def test_load_expect_other_model(saved, changes, fragment):
    other = dataclasses.replace(META, **changes)
    with pytest.raises(RecordMismatchError, match="the record does not belong to this model: .*" + fragment):
        RolloutRecord.load(saved, expect=other)


def test_load_expect_lists_every_problem(saved):
    other = dataclasses.replace(META, num_experts=32, top_k=8, model_fingerprint="x" * 16)
    with pytest.raises(RecordMismatchError) as info:
        RolloutRecord.load(saved, expect=other)
    for name in ("num_experts", "top_k", "model_fingerprint"):
        assert name in str(info.value)


def test_one_router_differing(saved):
    sig = list(SIGNATURE)
    sig[3] *= 1.1  # router 1's rms
    with pytest.raises(RecordMismatchError, match=r"router weights differ \(routers \[1\]\)"):
        RolloutRecord.load(saved, expect=dataclasses.replace(META, router_signature=tuple(sig)))


@pytest.mark.parametrize("changes", [
    {"router_signature": tuple(1.001 * x for x in SIGNATURE)},       # a dtype cast
    {"router_signature": tuple(x * (1 - 1e-3) for x in SIGNATURE)},
    {"dtype": "float32"},                                           # dtype is no model property
    {"engine": "hf", "engine_version": "5.0", "model_name": "other-name"},
])
def test_load_expect_same_model_accepted(saved, record, changes):
    back = RolloutRecord.load(saved, expect=dataclasses.replace(META, **changes))
    assert_records_equal(record, back)


def test_load_expect_without_router_signature_warns_or_refuses(saved, record, tmp_path):
    """Router weights that cannot be compared (no signature on one side) are said, not silently accepted."""
    no_sig = dataclasses.replace(META, router_signature=())
    with pytest.warns(MoealignWarning, match="router weights could not be checked: the model has no router_sig"):
        assert_records_equal(record, RolloutRecord.load(saved, expect=no_sig))
    with pytest.raises(RecordMismatchError, match="router weights could not be checked"):
        RolloutRecord.load(saved, expect=no_sig, require_weights=True)
    # the record without a signature, the model with one (the case: a record for other weights)
    bare = tmp_path / "bare.safetensors"
    with_meta(record, router_signature=()).save(bare)
    with pytest.warns(MoealignWarning, match="the record has no router_signature"):
        RolloutRecord.load(bare, expect=META)
    with pytest.raises(RecordMismatchError, match="the record has no router_signature"):
        RolloutRecord.load(bare, expect=META, require_weights=True)
    with pytest.warns(MoealignWarning, match="the record and the trainer have no router_signature"):
        no_sig.check_matches(no_sig, what="trainer")
    with warnings.catch_warnings():   # negative control: both signatures present, nothing to say
        warnings.simplefilter("error")
        RolloutRecord.load(saved, expect=META, require_weights=True)


def test_check_matches_names_what():
    with pytest.raises(RecordMismatchError, match="belong to this trainer: num_layers: record has 4, trainer has 5"):
        META.check_matches(dataclasses.replace(META, num_layers=5), what="trainer")


def test_with_meta_revalidates(record):
    renamed = with_meta(record, model_name="renamed")
    assert renamed.meta.model_name == "renamed" and renamed.samples == record.samples
    with pytest.raises(RecordError, match="routes have shape"):
        with_meta(record, top_k=2)


# --------------------------------------------------------------------------------------------------
# validation: meta, sampling params
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, fragment", [
    ({"top_k": 17}, r"need 1 <= top_k <= num_experts, got top_k=17, num_experts=16"),
    ({"top_k": 0}, "need 1 <= top_k <= num_experts"),
    ({"num_experts": 0, "top_k": 1}, "need 1 <= top_k <= num_experts"),
    ({"moe_layers": ()}, "moe_layers is empty"),
    ({"moe_layers": (3, 1, 2)}, r"moe_layers must be ascending and unique, got \[3, 1, 2\]"),
    ({"moe_layers": (1, 1, 2)}, r"moe_layers must be ascending and unique, got \[1, 1, 2\]"),
    ({"moe_layers": (1, 4)}, r"moe_layers \[1, 4\] outside \[0, num_layers=4\)"),
    ({"moe_layers": (-1, 2)}, r"moe_layers \[-1, 2\] outside \[0, num_layers=4\)"),
    ({"vocab_size": 0}, "vocab_size must be >= 1"),
    ({"router_signature": (0.1, 0.5, 0.2)}, r"router_signature holds \(mean, rms\) pairs, got 3 values"),
])
def test_meta_validation(changes, fragment):
    with pytest.raises(RecordError, match=fragment):
        dataclasses.replace(META, **changes)


def test_meta_normalises_sequences():
    meta = dataclasses.replace(META, moe_layers=[1, 2, 3], router_signature=[1, 2])
    assert meta.moe_layers == (1, 2, 3) and meta.router_signature == (1.0, 2.0)
    assert meta == dataclasses.replace(META, router_signature=(1.0, 2.0))


@pytest.mark.parametrize("kwargs, fragment", [
    ({"temperature": 0.0}, "temperature must be finite and > 0, got 0.0"),
    ({"temperature": -1.0}, "temperature must be finite and > 0"),
    ({"temperature": float("inf")}, "temperature must be finite and > 0"),
    ({"temperature": float("nan")}, "temperature must be finite and > 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0"),
    ({"min_p": 2.0}, r"min_p must be in \[0, 1\], got 2.0"),
    ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
])
def test_sampling_params_validation(kwargs, fragment):
    with pytest.raises(RecordError, match=fragment):
        SamplingParams(**kwargs)


# --------------------------------------------------------------------------------------------------
# validation: samples
# --------------------------------------------------------------------------------------------------


def test_valid_sample_is_accepted(sample):
    assert len(tamper(sample)) == 1


@pytest.mark.parametrize("rows", [6, 8, 0])  # a valid sample of 8 tokens has 7 route rows
def test_routes_wrong_number_of_rows(sample, rows):
    routes = random_routes(torch.Generator().manual_seed(0), rows, META)
    with pytest.raises(RecordError, match=rf"routes have shape \({rows}, 3, 4\), expected \(7, 3, 4\)"):
        tamper(sample, routes=routes)


def test_routes_wrong_layers_or_top_k(sample):
    with pytest.raises(RecordError, match=r"routes have shape \(7, 2, 4\), expected \(7, 3, 4\)"):
        tamper(sample, routes=sample.routes[:, :2])
    with pytest.raises(RecordError, match=r"routes have shape \(7, 3, 3\), expected \(7, 3, 4\)"):
        tamper(sample, routes=sample.routes[..., :3].contiguous())


def test_routes_out_of_range_id(sample):
    routes = sample.routes.clone()
    routes[5, 1] = torch.tensor([16, 0, 1, 2], dtype=torch.uint8)
    with pytest.raises(RecordError, match=r"sample 0 routes\[5, 1, 0\] = 16 is not an expert id in \[0, 16\)"):
        tamper(sample, routes=routes)


def test_routes_duplicate_id(sample):
    routes = sample.routes.clone()
    routes[2, 0] = torch.tensor([3, 9, 3, 4], dtype=torch.uint8)
    with pytest.raises(RecordError, match=r"sample 0 routes row \[2, 0\] repeats expert 3"):
        tamper(sample, routes=routes)


@pytest.mark.parametrize("value, fragment", [
    (float("nan"), "logprobs has NaN/Inf at response position 2"),
    (float("inf"), "logprobs has NaN/Inf at response position 2"),
    (float("-inf"), "logprobs has NaN/Inf at response position 2"),
    (0.5, "logprobs has positive entries"),
    (1e-3, "logprobs has positive entries"),
])
def test_bad_logprobs(sample, value, fragment):
    logprobs = sample.logprobs.clone()
    logprobs[2] = value
    with pytest.raises(RecordError, match=fragment):
        tamper(sample, logprobs=logprobs)


@pytest.mark.parametrize("n", [4, 6, 0])
def test_logprobs_wrong_length(sample, n):
    with pytest.raises(RecordError, match=rf"logprobs has shape \({n},\), expected \(5,\) = response length"):
        tamper(sample, logprobs=-torch.rand(n))


def test_logprobs_wrong_dtype_or_rank(sample):
    with pytest.raises(RecordError, match="logprobs must be floating point"):
        tamper(sample, logprobs=torch.zeros(5, dtype=torch.int64))
    with pytest.raises(RecordError, match=r"logprobs has shape \(1, 5\)"):
        tamper(sample, logprobs=sample.logprobs[None])


def test_empty_response(sample):
    with pytest.raises(RecordError, match=r"an empty response\), got prompt_len=8, len=8"):
        tamper(sample, prompt_len=8)
    with pytest.raises(RecordError, match="got prompt_len=9, len=8"):
        tamper(sample, prompt_len=9)


def test_empty_prompt(sample):
    with pytest.raises(RecordError, match=r"\(an empty prompt or an empty response\), got prompt_len=0"):
        tamper(sample, prompt_len=0)


def test_too_short_sample():
    s = Sample(token_ids=torch.tensor([5]), prompt_len=1, logprobs=torch.zeros(0))
    with pytest.raises(RecordError, match="got prompt_len=1, len=1"):
        RolloutRecord(META, [s])


@pytest.mark.parametrize("value", [100, 1000, -1])
def test_token_ids_outside_vocab(sample, value):
    ids = sample.token_ids.clone()
    ids[1] = value
    with pytest.raises(RecordError, match=r"sample 0: token ids outside \[0, vocab_size=100\)"):
        tamper(sample, token_ids=ids)


def test_token_ids_must_be_1d_integers(sample):
    with pytest.raises(RecordError, match="token_ids must be a 1-D integer tensor"):
        tamper(sample, token_ids=sample.token_ids.float())
    with pytest.raises(RecordError, match="token_ids must be a 1-D integer tensor"):
        tamper(sample, token_ids=sample.token_ids[None])


def test_int32_token_ids_are_accepted(sample, tmp_path):
    record = tamper(sample, token_ids=sample.token_ids.to(torch.int32))
    assert record.to_packed().input_ids.dtype == torch.int64
    record.save(tmp_path / "r.safetensors")
    assert torch.equal(RolloutRecord.load(tmp_path / "r.safetensors").samples[0].token_ids, sample.token_ids)


def test_error_names_the_sample():
    gen = torch.Generator().manual_seed(0)
    samples = [make_sample(gen, 5, 2) for _ in range(3)]
    samples[2].logprobs = samples[2].logprobs + 1.0
    with pytest.raises(RecordError, match="sample 2: logprobs has positive entries"):
        RolloutRecord(META, samples)


@pytest.mark.parametrize("mutate, fragment", [
    (lambda o, i: (o + 1, i), r"offsets\[0\] must be 0, got 1"),
    (lambda o, i: (o[:-1], i[: int(o[-2])]), "kept sets have 4 rows .* but 5 were expected"),
    (lambda o, i: (torch.cat([o, o[-1:]]), i), "kept sets have 6 rows .* but 5 were expected"),
    (lambda o, i: (o, i[:-1]), r"offsets\[-1\] = \d+ but ids has \d+ entries"),
    (lambda o, i: (torch.tensor([0, 3, 2, 4, 5, int(o[-1])]), i), "offsets decrease at row 1"),
    (lambda o, i: (o.float(), i), "offsets must be an integer tensor"),
])
def test_bad_kept_offsets(sample, mutate, fragment):
    offsets, ids = mutate(sample.kept_offsets.clone(), sample.kept_ids.clone())
    with pytest.raises(RecordError, match="sample 0: " + fragment):
        tamper(sample, kept_offsets=offsets, kept_ids=ids)


def test_kept_set_empty_row(sample):
    # row 2 empty, its ids moved to row 3 (the sampled token of row 2 is then missing as well)
    offsets = sample.kept_offsets.clone()
    offsets[3] = offsets[2]
    with pytest.raises(RecordError, match="sample 0: kept set of row 2 is empty"):
        tamper(sample, kept_offsets=offsets)


def test_kept_set_duplicate_or_out_of_vocab_id():
    tokens = torch.tensor([1, 2, 3, 4, 5])
    s = Sample(token_ids=tokens, prompt_len=3, logprobs=torch.tensor([-0.1, -0.2]),
               kept_offsets=torch.tensor([0, 2, 4]), kept_ids=torch.tensor([4, 4, 5, 7], dtype=torch.int32))
    with pytest.raises(RecordError, match="sample 0: kept set of row 0 holds token 4 more than once"):
        RolloutRecord(META, [s])
    s.kept_ids = torch.tensor([4, 100, 5, 7], dtype=torch.int32)
    with pytest.raises(RecordError, match=r"sample 0: ids\[1\] = 100 \(row 0\) is not a token id in \[0, 100\)"):
        RolloutRecord(META, [s])
    s.kept_ids = torch.tensor([4, 9, 5, 7], dtype=torch.int32)
    assert len(RolloutRecord(META, [s])) == 1


def test_sampled_token_outside_its_kept_set():
    tokens = torch.tensor([1, 2, 3, 4, 5, 6])
    ok = torch.tensor([0, 2, 3, 5]), torch.tensor([4, 8, 5, 1, 6], dtype=torch.int32)
    s = Sample(token_ids=tokens, prompt_len=3, logprobs=torch.tensor([-0.1, -0.2, -0.3]),
               kept_offsets=ok[0], kept_ids=ok[1])
    RolloutRecord(META, [s])
    s.kept_ids = torch.tensor([4, 8, 5, 1, 7], dtype=torch.int32)  # token 6 not in row 2
    with pytest.raises(RecordError,
                       match="sample 0: sampled token 6 at response position 2 is not in its recorded kept set"):
        RolloutRecord(META, [s])
    s.kept_ids = torch.tensor([4, 8, 6, 1, 6], dtype=torch.int32)  # token 5 (row 1) only in row 2's set
    with pytest.raises(RecordError, match="sampled token 5 at response position 1 is not in its recorded kept set"):
        RolloutRecord(META, [s])


def test_kept_offsets_without_kept_ids(sample):
    with pytest.raises(RecordError, match="kept_offsets and kept_ids must be given together"):
        tamper(sample, kept_ids=None)
    with pytest.raises(RecordError, match="kept_offsets and kept_ids must be given together"):
        tamper(sample, kept_offsets=None)


def test_mixing_samples_with_and_without_routes_or_kept_sets():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(RecordError, match=r"either every sample has routes \(kept sets\) or none has"):
        RolloutRecord(META, [make_sample(gen, 5, 2), make_sample(gen, 5, 2, routes=False)])
    with pytest.raises(RecordError, match=r"either every sample has routes \(kept sets\) or none has"):
        RolloutRecord(META, [make_sample(gen, 5, 2, kept=False), make_sample(gen, 5, 2)])


def test_validate_false_skips_checks(sample):
    bad = dataclasses.replace(sample, prompt_len=0)
    record = RolloutRecord(META, [bad], validate=False)
    with pytest.raises(RecordError, match="prompt_len=0"):
        record.validate()


# --------------------------------------------------------------------------------------------------
# vLLM all-layer route arrays
# --------------------------------------------------------------------------------------------------


def vllm_routes(rows: int, num_hidden_layers: int, meta: RecordMeta = META, seed: int = 0) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(rows, num_hidden_layers, meta.num_experts, generator=gen).argsort(-1)[..., : meta.top_k]
    return ids.to(torch.uint8).numpy()


def test_routes_from_all_layers_numpy_uint8():
    arr = vllm_routes(7, 4)
    out = routes_from_all_layers(arr, META.moe_layers)
    assert out.dtype == torch.uint8 and out.shape == (7, 3, 4)
    assert torch.equal(out, torch.from_numpy(arr)[:, 1:4])
    for j, layer in enumerate(META.moe_layers):
        assert torch.equal(out[:, j], torch.from_numpy(arr[:, layer]))
    # it drops into a sample directly
    tokens = torch.arange(8) % META.vocab_size
    s = Sample(token_ids=tokens, prompt_len=3, logprobs=torch.full((5,), -0.5), routes=out)
    assert RolloutRecord(META, [s]).has_routes


def test_routes_from_all_layers_picks_non_contiguous_layers():
    t = torch.from_numpy(vllm_routes(5, 6, seed=1))
    out = routes_from_all_layers(t, [0, 2, 5])
    assert torch.equal(out, torch.stack([t[:, 0], t[:, 2], t[:, 5]], dim=1))
    assert out.dtype == torch.uint8


@pytest.mark.parametrize("np_dtype, torch_dtype", [
    (np.uint16, torch.int64), (np.int32, torch.int32), (np.int64, torch.int64), (np.int16, torch.int16),
])
def test_routes_from_all_layers_other_dtypes(np_dtype, torch_dtype):
    arr = (vllm_routes(4, 4).astype(np.int64) * 7).astype(np_dtype)  # ids up to 105
    out = routes_from_all_layers(arr, (1, 3))
    assert out.dtype == torch_dtype
    assert torch.equal(out.long(), torch.from_numpy(arr.astype(np.int64))[:, [1, 3]])


def test_routes_from_all_layers_errors():
    with pytest.raises(RecordError, match=r"routes must be \[rows, layers, k\], got shape \(7, 4\)"):
        routes_from_all_layers(np.zeros((7, 4), dtype=np.uint8), (1, 2))
    with pytest.raises(RecordError, match="routes have 4 layers but moe_layers go up to 4"):
        routes_from_all_layers(vllm_routes(3, 4), (1, 4))
    with pytest.raises(RecordError, match="negative layer"):
        routes_from_all_layers(vllm_routes(3, 4), (-1, 2))


# --------------------------------------------------------------------------------------------------
# fingerprints
# --------------------------------------------------------------------------------------------------

CONFIG = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "_name_or_path": "Qwen/Qwen3-30B-A3B",
}


def test_config_fingerprint_format():
    fp = config_fingerprint(CONFIG)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert config_fingerprint(dict(CONFIG)) == fp
    assert config_fingerprint(dict(reversed(list(CONFIG.items())))) == fp  # key order is irrelevant


@pytest.mark.parametrize("changes", [
    {"torch_dtype": "float32"}, {"dtype": "float16"}, {"torch_dtype": None},
    {"transformers_version": "5.23.0"}, {"_name_or_path": "/local/copy"}, {"use_cache": False},
    {"sliding_window": None},  # None values are skipped
])
def test_config_fingerprint_ignores_dtype_and_bookkeeping(changes):
    assert config_fingerprint({**CONFIG, **changes}) == config_fingerprint(CONFIG)


def test_config_fingerprint_ignores_removed_dtype_keys():
    stripped = {k: v for k, v in CONFIG.items() if k != "torch_dtype"}
    assert config_fingerprint({**stripped, "dtype": "bfloat16"}) == config_fingerprint(CONFIG)


@pytest.mark.parametrize("changes", [
    {"num_experts": 64}, {"num_experts_per_tok": 4}, {"num_hidden_layers": 24}, {"vocab_size": 1000},
    {"model_type": "mixtral"}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    {"mlp_only_layers": [0]}, {"norm_topk_prob": False}, {"num_local_experts": 8},
])
def test_config_fingerprint_changes_with_architecture(changes):
    assert config_fingerprint({**CONFIG, **changes}) != config_fingerprint(CONFIG)


def test_config_fingerprint_needs_model_type():
    with pytest.raises(RecordError, match="the config has no model_type"):
        config_fingerprint({k: v for k, v in CONFIG.items() if k != "model_type"})


def _routers(seed: int = 0, n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [0.02 * torch.randn(16, 64, generator=gen) + 0.001 * (i + 1) for i in range(n)]


def test_router_signature_values():
    routers = _routers()
    sig = router_signature(routers)
    assert len(sig) == 6 and all(isinstance(x, float) for x in sig)
    for r, w in enumerate(routers):
        w64 = w.double()
        assert sig[2 * r] == pytest.approx(float(w64.mean()), rel=1e-12)
        assert sig[2 * r + 1] == pytest.approx(float(w64.pow(2).mean().sqrt()), rel=1e-12)
    assert router_signature([]) == ()
    assert router_signature(w.requires_grad_() for w in _routers()) == sig  # any iterable, grads detached


def _meta_with(sig):
    return dataclasses.replace(META, router_signature=sig)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_router_signature_tolerates_dtype_casts(dtype):
    routers = _routers()
    a = _meta_with(router_signature(routers))
    b = _meta_with(router_signature([w.to(dtype) for w in routers]))
    a.check_matches(b)
    b.check_matches(a)


def test_router_signature_tolerance():
    sig = router_signature(_routers())
    base = _meta_with(sig)
    base.check_matches(_meta_with(tuple(x * 1.001 for x in sig)))  # 0.1%: accepted
    base.check_matches(_meta_with(tuple(x * 0.99 for x in sig)))   # 1%: accepted (tolerance 2% of the rms)
    with pytest.raises(RecordMismatchError, match=r"router weights differ \(routers \[0, 1, 2\]\): other weights"):
        base.check_matches(_meta_with(tuple(x * 1.1 for x in sig)))  # 10%: other weights
    scaled = [w * 1.1 for w in _routers()]  # the same weights scaled by 10%
    with pytest.raises(RecordMismatchError, match=r"router weights differ \(routers \[0, 1, 2\]\)"):
        base.check_matches(_meta_with(router_signature(scaled)))
    shifted = _routers()
    shifted[2] = shifted[2] + 0.005  # router 2 shifted by 25% of its rms
    with pytest.raises(RecordMismatchError, match=r"router weights differ \(routers \[2\]\)"):
        base.check_matches(_meta_with(router_signature(shifted)))


def test_router_signature_load_with_real_signatures(tmp_path):
    routers = _routers(n=3)
    meta = _meta_with(router_signature(routers))
    record = make_record(meta, shapes=[(5, 2), (2, 1)])
    record.save(tmp_path / "r.safetensors")
    cast = _meta_with(router_signature([w.to(torch.bfloat16) for w in routers]))
    assert_records_equal(record, RolloutRecord.load(tmp_path / "r.safetensors", expect=cast))
    other = _meta_with(router_signature([w * 0.9 for w in routers]))
    with pytest.raises(RecordMismatchError, match="router weights differ"):
        RolloutRecord.load(tmp_path / "r.safetensors", expect=other)


# --------------------------------------------------------------------------------------------------
# property: random batches survive every layout and the file unchanged
# --------------------------------------------------------------------------------------------------


@st.composite
def random_records(draw):
    num_layers = draw(st.integers(1, 6))
    moe_layers = draw(st.lists(st.integers(0, num_layers - 1), min_size=1, max_size=num_layers, unique=True))
    num_experts = draw(st.sampled_from([1, 2, 8, 16, 255, 257, 300]))
    top_k = draw(st.integers(1, min(num_experts, 6)))
    vocab = draw(st.integers(2, 64))
    meta = dataclasses.replace(
        META, num_layers=num_layers, moe_layers=tuple(sorted(moe_layers)), num_experts=num_experts,
        top_k=top_k, vocab_size=vocab,
        router_signature=tuple(x for pair in draw(st.lists(st.tuples(st.floats(-1, 1), st.floats(1e-3, 1)),
                                                          max_size=3)) for x in pair),
    )
    shapes = []
    for _ in range(draw(st.integers(1, 5))):
        length = draw(st.integers(2, 14))
        shapes.append((length, draw(st.integers(1, length - 1))))
    routes, kept = draw(st.booleans()), draw(st.booleans())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    samples = []
    for L, P in shapes:
        sampling = SamplingParams(
            temperature=draw(st.floats(0.05, 3.0)), top_k=draw(st.integers(0, 100)),
            top_p=draw(st.floats(0.01, 1.0)), min_p=draw(st.floats(0.0, 1.0)))
        samples.append(make_sample(gen, L, P, meta, routes=routes, kept=kept, sampling=sampling))
    return RolloutRecord(meta, samples)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=random_records(), pad=st.integers(0, 5))
def test_property_round_trips(record, pad):
    sampling = [s.sampling for s in record.samples]
    for side in ("right", "left"):
        batch = record.to_padded(side, pad_token_id=pad)
        assert isinstance(batch, PaddedBatch)
        assert int(batch.attention_mask.sum()) == sum(s.length for s in record.samples)
        assert int(batch.route_mask.sum()) == sum(s.length - 1 for s in record.samples)
        assert_records_equal(record, RolloutRecord.from_padded(record.meta, batch, sampling))
    packed = record.to_packed()
    assert isinstance(packed, PackedBatch)
    assert torch.equal(packed.kept_row[packed.response_mask], torch.arange(record.num_response_tokens))
    assert_records_equal(record, RolloutRecord.from_packed(record.meta, packed, sampling))
    if record.has_routes:
        assert record.samples[0].routes.dtype == record.meta.route_dtype
        for layout, side in (("packed", "right"), ("padded", "right"), ("padded", "left")):
            # random tables of 1-2 experts are degenerate by chance (one set in most rows); this property is the
            # round trip, not the broken-capture checks (tests/test_broken_capture_refused.py)
            rb = record.replay_batch(layout, side, allow_degenerate=True)
            assert_bitwise(rb.routes[rb.route_mask], torch.cat([s.routes for s in record.samples]).long())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.safetensors")
        record.save(path)
        if record.meta.router_signature:
            back = RolloutRecord.load(path, expect=record.meta)
        else:   # nothing to compare the router weights with: said, not silent
            with pytest.warns(MoealignWarning, match="router weights could not be checked"):
                back = RolloutRecord.load(path, expect=record.meta)
        assert_records_equal(record, back)
        # and once more through a layout of the loaded record
        assert_records_equal(record, RolloutRecord.from_packed(back.meta, back.to_packed(), sampling))


def test_router_samples_tell_random_inits_apart_but_not_dtype_casts():
    """mean/RMS alone cannot separate two random inits of one config; sampled entries can."""
    from moealign.record import router_samples

    torch.manual_seed(1)
    a = [torch.randn(64, 2048) * 0.02 for _ in range(3)]   # large enough for mean/RMS to agree
    b = [torch.randn(64, 2048) * 0.02 for _ in range(3)]

    def meta(ws):
        return dataclasses.replace(META, router_signature=router_signature(ws), router_samples=router_samples(ws))

    meta(a).check_matches(meta([w.to(torch.bfloat16) for w in a]))
    meta(a).check_matches(meta([w.to(torch.float16) for w in a]))
    # negative control: without the samples the two inits pass as the same model
    dataclasses.replace(meta(a), router_samples=()).check_matches(meta(b))
    with pytest.raises(RecordMismatchError, match=r"router weights differ \(routers \[0, 1, 2\]\)"):
        meta(a).check_matches(meta(b))
    with pytest.raises(RecordError, match="router_samples holds 8 values per router"):
        dataclasses.replace(meta(a), router_samples=(0.1,) * 5)
