"""Issue 24, item 2: a ReplayBatch is validated once, when it is built; the adapters' ``set_routes`` trust it and
re-run none of the record-level checks (broken-capture patterns, id scans) per forward."""

from __future__ import annotations

import pytest
import torch

import moealign.routing_replay.protocol as protocol
from moealign.embedded import embedded_model_path
from moealign.errors import ReplayError, RouteError
from moealign.routing_replay.protocol import ReplayBatch, check_route_ids, model_routes

ROWS, E, K = 40, 8, 2


def _routes(seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(ROWS, 2, E, generator=g).argsort(-1)[..., :K]


def _batch(routes, **kw):
    return ReplayBatch.packed(routes, input_ids=torch.arange(ROWS), cu_seqlens=[0, ROWS], moe_layers=(1, 3), **kw)


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = protocol.find_degenerate

    def find_degenerate(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(protocol, "find_degenerate", find_degenerate)
    return calls


def test_patterns_are_judged_once_at_construction(counted):
    batch = _batch(_routes())
    assert len(counted) == 1
    for _ in range(3):
        model_routes(batch, (1, 3), K)
        check_route_ids(batch, E)
    assert len(counted) == 1                       # the adapters' per-forward path reads the batch's facts only
    with pytest.raises(ReplayError, match="repeated_set"):     # a broken capture: refused where it enters
        _batch(torch.tensor([6, 1]).expand(ROWS, 2, K).clone())
    assert len(counted) == 2


def test_the_facts_decide_the_id_checks_and_name_the_row():
    batch = _batch(_routes())
    assert batch.num_replayed_rows == ROWS and batch.all_routed and batch.token_range == (0, ROWS - 1)
    assert batch.id_range[0] >= 0 and batch.id_range[1] < E and not batch.duplicate_ids
    check_route_ids(batch, E)
    bad = _routes()
    bad[7, 1, 0] = E
    with pytest.raises(RouteError, match=rf"replay routes\[7, 1, 0\] = {E} is not an expert id in \[0, {E}\)"):
        check_route_ids(_batch(bad), E)
    check_route_ids(_batch(bad), E + 1)            # the same batch fits a model with one more expert
    dup = _routes()
    dup[9, 0] = torch.tensor([3, 3])
    assert _batch(dup).duplicate_ids
    with pytest.raises(RouteError, match=r"replay routes row \[9, 0\] repeats expert 3"):
        check_route_ids(_batch(dup), E)
    mask = torch.ones(ROWS, dtype=torch.bool)
    mask[9] = False                                # unrouted rows may hold anything
    check_route_ids(_batch(dup, route_mask=mask), E)


def test_hf_set_routes_runs_no_pattern_check(counted):
    from moealign.patches import hf
    from moealign.patches.hf.loading import load_model

    model, _ = load_model(embedded_model_path(), "fp32")
    meta = hf.record_meta(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, meta.vocab_size, (2, 24), generator=g)
    routes = torch.rand(2, 24, len(meta.moe_layers), meta.num_experts, generator=g).argsort(-1)[..., :meta.top_k]
    batch = ReplayBatch.padded(routes, input_ids=ids, attention_mask=torch.ones_like(ids), moe_layers=meta.moe_layers)
    assert len(counted) == 1
    with hf.replay_routing(model) as replay, torch.no_grad():
        for _ in range(3):
            replay.reset_counters()
            replay.set_routes(batch)
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            replay.check(calls=1)
    assert len(counted) == 1
