"""The numbers behind the report's plots (moealign.mismatch.plots): hand examples, no engine."""

from __future__ import annotations

import math

import pytest
import torch

from moealign.mismatch.levers import LeverRun
from moealign.mismatch.plots import (HIST_EDGES, IS_GRID, by_position, flip_rate, is_tail, kept_set_support,
                                     logp_hist, position_means, worst_tokens)
from moealign.record import RecordMeta, RolloutRecord, Sample


def run_of(rollout, train, *, flipped=None, support=None, per_layer=(0.0, 0.0)):
    rollout = torch.as_tensor(rollout, dtype=torch.float32)
    train = torch.as_tensor(train, dtype=torch.float32)
    if flipped is None:
        flipped = torch.zeros(0, 2, dtype=torch.bool)
    return LeverRun(frozenset(), rollout, train, support, list(per_layer), 0.0, flipped, {})


# ------------------------------------------------------------------------------------------------ histogram
def test_logp_hist_counts_and_zeros():
    g = torch.Generator().manual_seed(0)
    n = 500
    rollout = -torch.rand(n, generator=g) * 5
    delta = torch.exp(torch.empty(n).uniform_(-25, 3, generator=g)) * torch.sign(torch.randn(n, generator=g))
    delta[::7] = 0.0
    train = rollout.double() + delta.double()
    r = run_of(rollout, train.float())
    exact_zero = int(((r.train_logprobs.double() - r.rollout_logprobs.double()) == 0).sum())
    out = logp_hist({"base": r})
    assert out["edges"] == HIST_EDGES
    counts = out["series"]["base"]
    assert len(counts) == len(HIST_EDGES) - 1
    assert out["zeros"]["base"] == exact_zero >= n // 7
    assert sum(counts) == n - exact_zero
    # each nonzero |delta| lands in the bin [edges[i], edges[i+1]) (clamped at both ends)
    d = (r.train_logprobs.double() - r.rollout_logprobs.double()).abs()
    want = [0] * (len(HIST_EDGES) - 1)
    for x in d[d > 0].tolist():
        i = max(0, min(len(HIST_EDGES) - 2, sum(1 for e in HIST_EDGES if e <= x) - 1))
        want[i] += 1
    assert counts == want


def test_logp_hist_beyond_last_edge_in_last_bin_and_below_first_in_first():
    r = run_of([0.0, 0.0, 0.0, 0.0, 0.0], [-1e3, -200.0, -1e-12, -100.0, 0.0])
    out = logp_hist({"x": r})
    counts = out["series"]["x"]
    assert counts[-1] == 3          # 1e3, 200 and exactly 100 (the last edge)
    assert counts[0] == 1           # 1e-12 below the first edge
    assert out["zeros"]["x"] == 1
    assert sum(counts) == 4


def test_logp_hist_nonfinite_dropped():
    r = run_of([0.0, 0.0, float("-inf")], [-1.0, float("-inf"), float("-inf")])
    out = logp_hist({"x": r})
    assert sum(out["series"]["x"]) == 1 and out["zeros"]["x"] == 0


# ------------------------------------------------------------------------------------------------ positions
def test_position_means_hand_example():
    values = torch.tensor([1.0, 2.0, 3.0, 10.0, 20.0, 5.0])
    means = position_means(values, [3, 2, 1])          # positions: 0 1 2 | 0 1 | 0
    assert means[0] == pytest.approx((1 + 10 + 5) / 3)
    assert means[1] == pytest.approx((2 + 20) / 2)
    assert means[2] == pytest.approx(3.0)
    assert len(means) == 3


def test_position_means_empty_position_nan_and_no_lengths():
    means = position_means(torch.tensor([4.0]), [1])
    assert means == [4.0]
    assert position_means(torch.zeros(0), []) == []


def test_by_position_hand_example():
    r = run_of([0.0, 0.0, 0.0, 0.0, 0.0], [-1.0, -2.0, 3.0, -3.0, 0.5])
    out = by_position({"a": r}, [3, 2])
    assert out["positions"] == [0, 1, 2]
    assert out["series"]["a"] == pytest.approx([(1 + 3) / 2, (2 + 0.5) / 2, 3.0])


# ------------------------------------------------------------------------------------------------ IS tail
def test_is_tail_monotone_and_bounded():
    g = torch.Generator().manual_seed(1)
    rollout = -torch.rand(300, generator=g) * 3
    train = rollout + torch.randn(300, generator=g) * 1.5
    out = is_tail({"r": run_of(rollout, train)})
    assert out["grid"] == IS_GRID and out["icepop_band"] == [0.5, 5.0] and out["tis_threshold"] == 2.0
    above, below = out["series"]["r"]["above"], out["series"]["r"]["below"]
    assert len(above) == len(below) == len(IS_GRID)
    assert all(0.0 <= x <= 1.0 for x in above + below)
    assert all(a >= b for a, b in zip(above, above[1:]))      # fraction above a ratio falls as the ratio grows
    assert all(a <= b for a, b in zip(below, below[1:]))
    assert above[0] > above[-1] and below[-1] > below[0]        # negative control: not flat
    ratio = torch.exp(train.double() - rollout.double())
    i = IS_GRID.index(1.0)
    assert above[i] == pytest.approx(float((ratio > 1.0).double().mean()))


def test_is_tail_hand_example():
    r = run_of([0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.log(20.0), math.log(200.0)])
    s = is_tail({"r": r})["series"]["r"]
    assert s["above"][IS_GRID.index(10.0)] == 0.25         # only 200
    assert s["below"][IS_GRID.index(0.1)] == 0.25          # only 1/20
    assert s["above"][0] == 1.0 and s["below"][-1] == 0.75  # 200 > 100 is not below 100


# ------------------------------------------------------------------------------------------------ kept sets
def test_kept_set_support_hand_example():
    sizes = torch.tensor([1, 2, 3, 4, 5, 8, 1])
    support = torch.tensor([True, False, True, False, True, True, False])
    out = kept_set_support({"a": run_of([0.0] * 7, [0.0] * 7, support=support),
                            "none": run_of([0.0] * 7, [0.0] * 7)}, sizes)
    assert out["sizes"] == [1, 2, 4, 8]
    assert set(out["series"]) == {"a"}                      # a run without kept sets is left out
    s = out["series"]["a"]
    # bins (e_{i-1}, e_i]: {1,1} -> 1, {2} -> 2, {3,4} -> 4, {5,8} -> 8
    assert s["tokens"] == [2, 1, 2, 2]
    assert s["support_mismatch_rate"] == pytest.approx([0.5, 0.0, 0.5, 1.0])


def test_kept_set_support_empty():
    r = run_of([0.0], [0.0], support=torch.tensor([True]))
    assert kept_set_support({"a": r}, None) == {}
    assert kept_set_support({"a": r}, torch.zeros(0, dtype=torch.long)) == {}
    assert kept_set_support({"a": run_of([0.0], [0.0])}, torch.tensor([3])) == {}


def test_flip_rate():
    r = run_of([0.0], [0.0], per_layer=(0.1, 0.3))
    assert flip_rate({"b": r}, [1, 3]) == {"layers": [1, 3], "series": {"b": [0.1, 0.3]}}


# ------------------------------------------------------------------------------------------------ worst tokens
def _record(route_missing_first=None):
    meta = RecordMeta(engine="test", engine_version="0", model_fingerprint="fp", num_layers=4, moe_layers=(1, 3),
                      num_experts=4, top_k=2, vocab_size=50, dtype="float32")

    def routes(rows):
        r = torch.zeros(rows, 2, 2, dtype=torch.uint8)
        r[..., 1] = 1
        return r

    r0 = routes(5)
    if route_missing_first is not None:
        r0[route_missing_first] = 0                   # a missing row holds 0
    s0 = Sample(token_ids=torch.tensor([10, 11, 12, 13, 14, 15]), prompt_len=3,
                logprobs=torch.full((3,), -1.0), routes=r0, route_missing=route_missing_first)
    s1 = Sample(token_ids=torch.tensor([20, 21, 22, 23, 24]), prompt_len=2, logprobs=torch.full((3,), -1.0),
                routes=routes(4), route_missing=None if route_missing_first is None else torch.zeros(4, dtype=torch.bool))
    return RolloutRecord(meta, [s0, s1])


def test_worst_tokens_order_and_flipped_layers():
    record = _record()
    # response tokens: s0 t0..2 = idx 0..2 (ids 13 14 15), s1 t0..2 = idx 3..5 (ids 22 23 24)
    rollout = [-1.0] * 6
    train = [-1.5, -1.1, -1.0, -1.2, -4.0, -1.3]      # |delta|: .5 .1 0 .2 3 .3
    flipped = torch.zeros(9, 2, dtype=torch.bool)     # 5 rows of s0, then 4 rows of s1
    flipped[5 + 3 - 1] = torch.tensor([False, True])  # s1 t1: position 3, scored by row 2 of s1 -> layer 3
    flipped[0 + 3 - 1] = torch.tensor([True, True])   # s0 t0: position 3, scored by row 2 of s0 -> layers 1, 3
    run = run_of(rollout, train, flipped=flipped)
    out = worst_tokens(run, record, None, count=3, context_tokens=2)
    assert [(o["sample"], o["position"]) for o in out] == [(1, 1), (0, 0), (1, 2)]
    assert [o["abs_logp_diff"] for o in out] == pytest.approx([3.0, 0.5, 0.3])
    assert out[0]["flipped_layers"] == [3]
    assert out[1]["flipped_layers"] == [1, 3]
    assert out[2]["flipped_layers"] == []
    assert out[0]["token"] == "23" and out[0]["context"] == "21 22"
    assert out[1]["token"] == "13" and out[1]["context"] == "11 12"
    assert out[0]["rollout_logp"] == -1.0 and out[0]["train_logp"] == -4.0
    out_dec = worst_tokens(run, record, lambda ids: "|".join(f"<{i}>" for i in ids), count=1, context_tokens=2)
    assert out_dec[0]["token"] == "<23>" and out_dec[0]["context"] == "<21>|<22>"


def test_worst_tokens_with_missing_route_rows():
    missing = torch.tensor([False, True, False, False, False])       # row 1 of s0 has no route
    record = _record(missing)
    flipped = torch.zeros(8, 2, dtype=torch.bool)                    # only the 8 routed rows
    flipped[7 - 1] = torch.tensor([False, True])                     # s1 row 2 is routed row 6
    flipped[1] = torch.tensor([True, False])                         # s0 row 2 is routed row 1
    run = run_of([-1.0] * 6, [-1.5, -1.1, -1.0, -1.2, -4.0, -1.3], flipped=flipped)
    out = worst_tokens(run, record, None, count=2)
    assert out[0]["flipped_layers"] == [3]
    assert out[1]["flipped_layers"] == [1]


def test_worst_tokens_nonfinite_first():
    record = _record()
    run = run_of([-1.0] * 6, [-1.5, float("-inf"), -1.0, -1.2, -4.0, -1.3], flipped=torch.zeros(9, 2, dtype=torch.bool))
    out = worst_tokens(run, record, None, count=6)
    assert (out[0]["sample"], out[0]["position"]) == (0, 1)
    assert out[0]["abs_logp_diff"] == float("inf")
    assert len(out) == 6
