"""Rows without a recorded route are explicit (``Sample.route_missing``), never replayed and never counted as
routes; per-row weight versions (``Sample.route_version``); multi-turn stitching (``moealign.record.stitch``); and the
broken-capture patterns refused at replay time (``routing_replay.protocol.model_routes``), through the transformers
adapter on the embedded model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import save_file

from moealign.record import io as rec_io
from moealign.embedded import embedded_model_path
from moealign.errors import ReplayError, RouteError
from moealign.record import RecordError, RecordFormatError, RecordMeta, RolloutRecord, Sample
from moealign.record.inspect import inspect_record
from moealign.record.stitch import Turn, stitch_turns
from moealign.routing_replay.protocol import ReplayBatch, model_routes
from moealign.routing_replay.routes import compact_routes

META = RecordMeta(engine="sglang", engine_version="0.0-test", model_fingerprint="0123456789abcdef", num_layers=4,
                  moe_layers=(1, 3), num_experts=8, top_k=2, vocab_size=50, dtype="bfloat16")


def routes_for(gen, rows, meta=META):
    ids = torch.rand(rows, len(meta.moe_layers), meta.num_experts, generator=gen).argsort(-1)[..., :meta.top_k]
    return compact_routes(ids, meta.num_experts)


def sample_with_missing(seed=0, length=20, prompt_len=6, missing_rows=(0, 1, 2)):
    gen = torch.Generator().manual_seed(seed)
    routes = routes_for(gen, length - 1)
    missing = torch.zeros(length - 1, dtype=torch.bool)
    missing[list(missing_rows)] = True
    routes[missing] = 0
    return Sample(token_ids=torch.randint(0, META.vocab_size, (length,), generator=gen), prompt_len=prompt_len,
                  logprobs=-torch.rand(length - prompt_len, generator=gen), routes=routes, route_missing=missing)


# --------------------------------------------------------------------------------------------------
# the mask in the record
# --------------------------------------------------------------------------------------------------


def test_missing_rows_round_trip_and_are_left_out_of_every_layout(tmp_path):
    a, b = sample_with_missing(0, missing_rows=(0, 1, 2)), sample_with_missing(1, length=12, missing_rows=(5,))
    c = dataclasses.replace(sample_with_missing(2, length=9, missing_rows=()), route_missing=None)
    record = RolloutRecord(META, [a, b, c])
    assert record.missing_row_fraction == pytest.approx(4 / (19 + 11 + 8))
    path = tmp_path / "r.safetensors"
    record.save(path)
    loaded = RolloutRecord.load(path)
    assert torch.equal(loaded.samples[0].route_missing, a.route_missing)
    assert torch.equal(loaded.samples[1].route_missing, b.route_missing)
    assert loaded.samples[2].route_missing is None
    for s, t in zip(loaded.samples, record.samples):
        assert torch.equal(s.routes, t.routes)
    padded = record.to_padded("left")
    for i, s in enumerate(record.samples):
        start = padded.input_ids.shape[1] - s.length
        assert torch.equal(padded.route_mask[i, start:start + s.length - 1], s.routed_rows)
    packed = record.to_packed()
    assert int(packed.route_mask.sum()) == sum(int(s.routed_rows.sum()) for s in record.samples)
    # back from either layout, the missing rows are still missing
    sampling = [s.sampling for s in record.samples]
    for back in (RolloutRecord.from_padded(META, padded, sampling), RolloutRecord.from_packed(META, packed, sampling)):
        assert torch.equal(back.samples[0].route_missing, a.route_missing)
        assert back.samples[2].route_missing is None
    batch = record.replay_batch("packed")
    assert batch.num_replayed_rows == int(packed.route_mask.sum())


def test_a_record_without_the_mask_still_reads_and_has_no_missing_rows(tmp_path):
    s = dataclasses.replace(sample_with_missing(missing_rows=()), route_missing=None)
    path = tmp_path / "r.safetensors"
    RolloutRecord(META, [s]).save(path)
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        assert "route_missing" not in f.keys() and "route_version" not in f.keys()
    assert RolloutRecord.load(path).missing_row_fraction == 0.0


def test_bad_masks_are_refused_naming_the_problem():
    s = sample_with_missing()
    held = s.routes.clone()
    held[0] = torch.tensor([1, 2])
    with pytest.raises(RecordError, match="row 0 is marked missing but holds experts"):
        RolloutRecord(META, [dataclasses.replace(s, routes=held)])
    with pytest.raises(RecordError, match=r"route_missing must be bool \[19\]"):
        RolloutRecord(META, [dataclasses.replace(s, route_missing=s.route_missing[:-1])])
    with pytest.raises(RecordError, match="route_missing must be bool"):
        RolloutRecord(META, [dataclasses.replace(s, route_missing=s.route_missing.long())])
    with pytest.raises(RecordError, match="negative weight version"):
        RolloutRecord(META, [dataclasses.replace(s, route_version=torch.full((19,), -1, dtype=torch.int64))])
    with pytest.raises(RecordError, match="has no routes"):
        RolloutRecord(META, [dataclasses.replace(s, routes=None)])
    # the unmasked rows are still validated (a duplicate expert in a present row)
    dup = s.routes.clone()
    dup[7] = torch.tensor([3, 3])
    with pytest.raises(RecordError, match="repeats expert 3"):
        RolloutRecord(META, [dataclasses.replace(s, routes=dup)])
    # route_version for some samples only cannot be written
    v = dataclasses.replace(s, route_version=torch.zeros(19, dtype=torch.int64))
    with pytest.raises(RecordError, match="no route_version while others have one"):
        RolloutRecord(META, [v, s])._tensors()


def test_a_file_whose_mask_does_not_cover_the_rows_is_refused(tmp_path):
    record = RolloutRecord(META, [sample_with_missing()])
    tensors = record._tensors()
    tensors["route_missing"] = tensors["route_missing"][:-2]
    metadata = {rec_io._META_KEY: META.to_json(), rec_io._VERSION_KEY: str(rec_io.FORMAT_VERSION)}
    metadata[rec_io._CHECKSUM_KEY] = rec_io._checksum(tensors, metadata)
    path = tmp_path / "bad.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    with pytest.raises(RecordFormatError, match="route_missing has 17 entries, the record has 19 route rows"):
        RolloutRecord.load(path)


def test_inspect_reports_the_missing_fraction_and_an_all_missing_record():
    record = RolloutRecord(META, [sample_with_missing(missing_rows=range(5))])
    result = inspect_record(record)
    assert result["summary"]["missing_row_fraction"] == pytest.approx(5 / 19) and result["findings"] == []
    s = sample_with_missing(missing_rows=range(19))
    found = inspect_record(RolloutRecord(META, [s]))["findings"]
    assert [f["check"] for f in found] == ["zero_rows"] and "every route row is marked missing" in found[0]["detail"]


def test_missing_rows_are_not_replayed_by_the_transformers_adapter():
    """The router picks its own experts on rows the record marks missing: replaying a record whose missing rows
    hold routes that differ from the router's own (by construction: rotated expert ids) leaves those rows' experts
    the router's own, and replays every other row."""
    from moealign.patches import hf
    from moealign.patches.hf.loading import load_model

    model, _ = load_model(embedded_model_path(), "fp32")
    info = hf.describe_model(model)
    meta = hf.record_meta(model)
    gen = torch.Generator().manual_seed(3)
    L = 24
    tokens = torch.randint(0, meta.vocab_size, (L,), generator=gen)
    with torch.no_grad(), hf.capture_routes(model) as cap:
        model(input_ids=tokens[None], use_cache=False)
    own = cap.last_forward()[:L - 1]
    rotated = (own.long() + 1) % meta.num_experts
    missing = torch.zeros(L - 1, dtype=torch.bool)
    missing[:8] = True
    s = Sample(token_ids=tokens, prompt_len=4, logprobs=-torch.rand(L - 4, generator=gen),
               routes=compact_routes(rotated, meta.num_experts, missing=missing), route_missing=missing)
    record = RolloutRecord(meta, [s])
    batch = record.replay_batch("padded")
    with torch.no_grad(), hf.replay_routing(model, batch) as replay, hf.capture_routes(model) as cap2:
        with replay.forward():
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    ran = cap2.last_forward()[:L - 1].long().sort(-1).values
    assert torch.equal(ran[~missing], rotated[~missing].sort(-1).values)
    assert torch.equal(ran[missing], own.long()[missing].sort(-1).values)
    assert info.moe_layers == meta.moe_layers


# --------------------------------------------------------------------------------------------------
# multi-turn stitching
# --------------------------------------------------------------------------------------------------


def _turn(gen, tokens, prompt_len, version, routes=None, missing=None):
    rows = tokens.numel() - 1
    routes = routes_for(gen, rows) if routes is None else routes
    if missing is not None:
        routes = routes.clone()
        routes[missing] = 0
    return Turn(token_ids=tokens, prompt_len=prompt_len, logprobs=-torch.rand(tokens.numel() - prompt_len, generator=gen),
                routes=routes, weight_version=version, route_missing=missing)


def test_stitching_takes_each_row_from_the_earliest_turn_and_the_final_token_row_from_the_next_prefill():
    gen = torch.Generator().manual_seed(0)
    t0_tokens = torch.randint(0, 50, (10,), generator=gen)
    t1_tokens = torch.cat([t0_tokens, torch.randint(0, 50, (8,), generator=gen)])
    t2_tokens = torch.cat([t1_tokens, torch.randint(0, 50, (6,), generator=gen)])
    t0 = _turn(gen, t0_tokens, 4, 7)
    t1 = _turn(gen, t1_tokens, 13, 7)                           # re-prefills turn 0 (other routes: flips)
    cached = torch.zeros(22 + 1, dtype=torch.bool)[:23]
    cached[:12] = True                                          # turn 2 served a 12-token prefix from cache
    t2 = _turn(gen, t2_tokens, 20, 7, missing=cached)
    out = stitch_turns(META, [t0, t1, t2])
    s = out.sample
    assert s.length == 24 and s.prompt_len == 20 and torch.equal(s.logprobs, t2.logprobs)
    assert torch.equal(s.routes[:9], t0.routes)                 # turn 0's own rows
    assert torch.equal(s.routes[9], t1.routes[9])               # turn 0's final token: turn 1's prefill
    assert torch.equal(s.routes[9:17], t1.routes[9:17])
    assert torch.equal(s.routes[17:], t2.routes[17:])           # turn 1's final token and turn 2's rows
    assert s.route_missing is None and out.turn_starts == (0, 10, 18)
    assert torch.equal(s.route_version, torch.full((23,), 7))
    # turns 0 and 1 both report rows 0..8, turns 1 and 2 rows 12..16 (turn 2's cache ends at 12), all with
    # independent random routes: the differing ones are re-prefill flips
    def differ(a, b):
        return int((a.long().sort(-1).values != b.long().sort(-1).values).any(-1).any(-1).sum())
    expect = differ(t0.routes, t1.routes[:9]) + differ(t1.routes[12:17], t2.routes[12:17])
    assert out.reprefill_flips == expect > 0 and out.stale_rows == 0


def test_rows_no_turn_reports_stay_missing():
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (12,), generator=gen)
    missing = torch.zeros(11, dtype=torch.bool)
    missing[:3] = True
    out = stitch_turns(META, [_turn(gen, tokens, 5, 0, missing=missing)])
    assert torch.equal(out.sample.route_missing, missing)


def test_different_weight_versions_are_refused_unless_asked_and_then_marked_stale():
    gen = torch.Generator().manual_seed(2)
    t0_tokens = torch.randint(0, 50, (10,), generator=gen)
    t1_tokens = torch.cat([t0_tokens, torch.randint(0, 50, (5,), generator=gen)])
    t0, t1 = _turn(gen, t0_tokens, 4, 3), _turn(gen, t1_tokens, 12, 4)
    with pytest.raises(RecordError, match=r"different weight versions \[3, 4\]"):
        stitch_turns(META, [t0, t1])
    out = stitch_turns(META, [t0, t1], allow_stale=True)
    stale = out.sample.stale_rows()
    assert stale[:9].all() and not stale[9:].any() and out.stale_rows == 9
    assert out.reprefill_flips == 0                            # other versions' rows are not compared
    assert inspect_record(RolloutRecord(META, [out.sample]))["summary"]["stale_rows"] == 9


def test_turns_that_do_not_continue_each_other_are_refused():
    gen = torch.Generator().manual_seed(3)
    t0_tokens = torch.randint(0, 50, (10,), generator=gen)
    t1_tokens = torch.cat([t0_tokens, torch.randint(0, 50, (5,), generator=gen)])
    t1_tokens[6] = (t1_tokens[6] + 1) % 50
    with pytest.raises(RecordError, match="token 6 is"):
        stitch_turns(META, [_turn(gen, t0_tokens, 4, 0), _turn(gen, t1_tokens, 12, 0)])
    with pytest.raises(RecordError, match="must contain the earlier turn"):
        stitch_turns(META, [_turn(gen, t0_tokens, 4, 0), _turn(gen, t0_tokens, 4, 0)])
    with pytest.raises(RecordError, match="weight_version must be an integer"):
        stitch_turns(META, [_turn(gen, t0_tokens, 4, -1)])
    with pytest.raises(RecordError, match="at least one turn"):
        stitch_turns(META, [])


# --------------------------------------------------------------------------------------------------
# broken captures refused at replay time
# --------------------------------------------------------------------------------------------------


def _batch(routes, **kw):
    rows = routes.shape[0]
    return ReplayBatch.packed(routes, input_ids=torch.arange(rows), cu_seqlens=[0, rows], moe_layers=(1, 3), **kw)


def _clean(rows=40, k=2):
    gen = torch.Generator().manual_seed(5)
    return torch.rand(rows, 2, 8, generator=gen).argsort(-1)[..., :k]


CORRUPT = {
    "constant_layer": lambda r: torch.cat([r[:, :1], torch.tensor([2, 5]).expand(r.shape[0], 1, 2)], dim=1),
    "identical_layers": lambda r: r[:, :1].expand_as(r).clone(),
    "repeated_set": lambda r: torch.tensor([6, 1]).expand_as(r).clone(),
}


@pytest.mark.parametrize("check", list(CORRUPT))
def test_each_broken_capture_pattern_is_refused_at_set_routes(check):
    assert model_routes(_batch(_clean()), (1, 3), 2).shape == (40, 2, 2)
    with pytest.raises(ReplayError, match=check):
        model_routes(_batch(CORRUPT[check](_clean())), (1, 3), 2)
    # explicitly allowed: the patterns are not checked
    model_routes(_batch(CORRUPT[check](_clean()), allow_degenerate=True), (1, 3), 2)


def test_zero_rows_top1_and_dense_layers_are_refused_at_set_routes():
    zero = _clean(k=1)
    zero[::3] = 0                                                # a third of the rows never written, in both layers
    with pytest.raises(ReplayError, match="zero_rows"):
        model_routes(_batch(zero), (1, 3), 1)
    model_routes(_batch(_clean(k=1)), (1, 3), 1)                 # expert 0 at its own frequency is fine
    with pytest.raises(ReplayError, match=r"dense_layers: routes for layers \[3\]"):
        model_routes(_batch(_clean()), (1,), 2, dense_layers=(0, 2, 3))
    model_routes(_batch(_clean()), (1,), 2, dense_layers=(0, 2))  # layer 3 on another pipeline stage: fine
    # only routed rows are judged: the pattern on rows the batch does not replay is not a capture
    mask = torch.zeros(40, dtype=torch.bool)
    mask[:20] = True
    bad = CORRUPT["repeated_set"](_clean())
    bad[:20] = _clean()[:20]
    model_routes(_batch(bad, route_mask=mask), (1, 3), 2)
    with pytest.raises(RouteError, match="meta device"):
        model_routes(_batch(_clean().to("meta")), (1, 3), 2)


def test_the_transformers_adapter_refuses_a_broken_record():
    from moealign.patches import hf
    from moealign.patches.hf.loading import load_model

    model, _ = load_model(embedded_model_path(), "fp32")
    meta = hf.record_meta(model)
    gen = torch.Generator().manual_seed(4)
    L = 30
    routes = torch.tensor(list(range(meta.top_k))).expand(L - 1, len(meta.moe_layers), meta.top_k).clone()
    s = Sample(token_ids=torch.randint(0, meta.vocab_size, (L,), generator=gen), prompt_len=4,
               logprobs=-torch.rand(L - 4, generator=gen), routes=compact_routes(routes, meta.num_experts))
    record = RolloutRecord(meta, [s])
    assert [f["check"] for f in inspect_record(record)["findings"]] == ["repeated_set"]
    with hf.replay_routing(model) as replay, pytest.raises(ReplayError, match="repeated_set"):
        replay.set_routes(record.replay_batch("padded"))
