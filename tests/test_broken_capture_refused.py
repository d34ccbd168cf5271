"""Issue 13's acceptance: a record corrupted in each broken-capture way is caught by ``moealign record inspect`` AND
refused when a replay adapter is handed it (transformers and Megatron-core), naming the pattern. A clean record of
the same model passes both (the control)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from moealign.embedded import embedded_model_path
from moealign.errors import RecordError, ReplayError, RouteError
from moealign.record import RecordMeta, RolloutRecord, Sample
from moealign.record.inspect import inspect_record
from moealign.routing_replay.routes import compact_routes

L = 40   # one sample of 40 tokens: 39 route rows, above the checks' MIN_ROWS


def _set(experts):
    def edit(ids):
        ids = ids.clone()
        ids[:, :] = torch.tensor(experts)
        return ids
    return edit


def _layer(layer, experts):
    def edit(ids):
        ids = ids.clone()
        ids[:, layer] = torch.tensor(experts)
        return ids
    return edit


def _zero_third(ids):   # top-1: a third of the rows never written, in every layer
    return torch.where(torch.arange(ids.shape[0])[:, None, None] % 3 == 0, 0, ids)


CORRUPTIONS = {
    "constant_layer": lambda k: _layer(1, list(range(2, 2 + k))),
    "identical_layers": lambda k: (lambda ids: ids[:, :1].expand_as(ids).clone()),
    "repeated_set": lambda k: _set(list(range(3, 3 + k))),
}


def _record(meta: RecordMeta, edit=None, seed: int = 0) -> RolloutRecord:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(L - 1, len(meta.moe_layers), meta.num_experts, generator=gen).argsort(-1)[..., :meta.top_k]
    if edit is not None:
        ids = edit(ids)
    return RolloutRecord(meta, [Sample(token_ids=torch.randint(0, meta.vocab_size, (L,), generator=gen), prompt_len=5,
                                       logprobs=-torch.rand(L - 5, generator=gen),
                                       routes=compact_routes(ids, meta.num_experts))])


def _found(record, model_layers=None):
    return [f["check"] for f in inspect_record(record, model_moe_layers=model_layers)["findings"]]


# --------------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model():
    from moealign.patches.hf.loading import load_model

    model, _ = load_model(embedded_model_path(), "fp32")
    return model


def _hf_set_routes(model, record):
    from moealign.patches import hf

    with hf.replay_routing(model) as replay:
        replay.set_routes(record.replay_batch("padded"))


def test_hf_clean_record_passes_both(hf_model):
    from moealign.patches import hf

    record = _record(hf.record_meta(hf_model))
    assert _found(record) == []
    _hf_set_routes(hf_model, record)


@pytest.mark.parametrize("check", list(CORRUPTIONS))
def test_hf_each_pattern_is_caught_by_inspect_and_at_replay(hf_model, check):
    from moealign.patches import hf

    meta = hf.record_meta(hf_model)
    record = _record(meta, CORRUPTIONS[check](meta.top_k))
    assert _found(record) == [check]
    with pytest.raises(ReplayError, match=check):
        _hf_set_routes(hf_model, record)


def test_hf_zero_rows_are_caught_and_all_zero_topk_rows_do_not_load(hf_model):
    from moealign.patches import hf

    meta = hf.record_meta(hf_model)
    assert meta.top_k > 1   # the embedded model routes top-k > 1: an all-zero row repeats expert 0
    s = _record(meta).samples[0]
    with pytest.raises(RecordError, match="repeats expert 0"):
        RolloutRecord(meta, [dataclasses.replace(s, routes=torch.zeros_like(s.routes))])
    # every row marked missing: nothing would replay
    s = dataclasses.replace(s, routes=torch.zeros_like(s.routes), route_missing=torch.ones(L - 1, dtype=torch.bool))
    assert _found(RolloutRecord(meta, [s])) == ["zero_rows"]


def test_hf_dense_layers_in_the_record_are_caught(tmp_path):
    """A model whose config runs layer 1 dense, and a record that has routes for it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moealign.families import get_family
    from moealign.patches import hf

    config = AutoConfig.from_pretrained(embedded_model_path())
    config.mlp_only_layers = [1]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config).eval()
    info = hf.describe_model(model)
    assert 1 in info.dense_layers and 1 not in info.moe_layers
    full = hf.record_meta(model)
    meta = dataclasses.replace(full, moe_layers=tuple(range(full.num_layers)))   # a stale list: every layer
    record = _record(meta)
    pattern = get_family(config.model_type).moe_layer_pattern(config)
    model_layers = tuple(i for i, sparse in enumerate(pattern) if sparse)
    assert model_layers == info.moe_layers
    assert _found(record, model_layers) == ["dense_layers"]
    with pytest.raises(ReplayError, match=r"dense_layers: routes for layers \[1\]"):
        _hf_set_routes(model, record)
    _hf_set_routes(model, _record(full))   # the model's own layer list passes


def test_a_row_count_that_does_not_match_the_tokens_is_refused_by_both():
    meta = RecordMeta(engine="x", engine_version="0", model_fingerprint="f", num_layers=2, moe_layers=(0, 1),
                      num_experts=8, top_k=2, vocab_size=50, dtype="float32")
    record = _record(meta)
    s = record.samples[0]
    with pytest.raises(RecordError, match=r"routes have shape \(38, 2, 2\), expected \(39, 2, 2\)"):
        RolloutRecord(meta, [Sample(token_ids=s.token_ids, prompt_len=5, logprobs=s.logprobs, routes=s.routes[:-1])])
    from moealign.routing_replay.protocol import ReplayBatch

    with pytest.raises(RouteError, match="routes have 38 rows, the batch has 39 token positions"):
        ReplayBatch.packed(s.routes[:-1].long(), input_ids=s.token_ids[:39], cu_seqlens=[0, 39], moe_layers=(0, 1))
