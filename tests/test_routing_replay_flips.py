"""Route flip metrics: hand values, a Python-set reference, invariances, and every bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moealign.routing_replay import RouteError, RouteFlipMetrics, route_flip_metrics

A = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 2], [1, 3]]])
B = torch.tensor([[[1, 0], [2, 3]], [[4, 6], [6, 7]], [[5, 4], [3, 1]]])


def test_hand_values():
    # token 0: same sets (slot order differs at layer 0); token 1 layer 0: {4,5} vs {4,6} (J = 1/3);
    # token 2 layer 0: {0,2} vs {4,5} (J = 0); token 2 layer 1: {1,3} vs {3,1} (same)
    m = route_flip_metrics(A, B)
    assert m.per_layer_flip_rate == pytest.approx([2 / 3, 0.0])
    assert m.router_flip_rate == pytest.approx(2 / 6)
    assert m.token_flip_rate == pytest.approx(2 / 3)
    assert m.mean_jaccard == pytest.approx((1 + 1 + 1 / 3 + 1 + 0 + 1) / 6)
    assert (m.num_tokens, m.num_layers) == (3, 2)


def test_hand_values_with_valid():
    m = route_flip_metrics(A.to(torch.uint8), B.to(torch.int16), valid=torch.tensor([True, True, False]))
    assert m.per_layer_flip_rate == pytest.approx([1 / 2, 0.0])
    assert m.router_flip_rate == pytest.approx(1 / 4)
    assert m.token_flip_rate == pytest.approx(1 / 2)
    assert m.mean_jaccard == pytest.approx((1 + 1 + 1 / 3 + 1) / 4)
    assert m.num_tokens == 2


def test_to_dict():
    d = route_flip_metrics(A, A).to_dict()
    assert d == {"per_layer_flip_rate": [0.0, 0.0], "router_flip_rate": 0.0, "token_flip_rate": 0.0,
                 "mean_jaccard": 1.0, "num_tokens": 3, "num_layers": 2}
    assert all(isinstance(v, (int, float, list)) for v in d.values())


def reference(a, b, valid):
    """Python sets, one pair at a time."""
    tokens, layers, _ = a.shape
    rows = [t for t in range(tokens) if valid[t]]
    flips = [[set(a[t, l].tolist()) != set(b[t, l].tolist()) for l in range(layers)] for t in rows]
    jac = [len(set(a[t, l].tolist()) & set(b[t, l].tolist())) / len(set(a[t, l].tolist()) | set(b[t, l].tolist()))
           for t in rows for l in range(layers)]
    n = len(rows)
    return dict(
        per_layer=[sum(f[l] for f in flips) / n for l in range(layers)],
        router=sum(map(sum, flips)) / (n * layers),
        token=sum(any(f) for f in flips) / n,
        jaccard=sum(jac) / len(jac),
    )


@st.composite
def route_pairs(draw):
    tokens = draw(st.integers(1, 12))
    layers = draw(st.integers(1, 4))
    experts = draw(st.integers(2, 8))
    k = draw(st.integers(1, min(3, experts)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(tokens, layers, experts, generator=g).argsort(dim=-1)[..., :k]
    b = torch.rand(tokens, layers, experts, generator=g).argsort(dim=-1)[..., :k]
    same = torch.rand(tokens, layers, 1, generator=g) < draw(st.floats(0, 1))
    b = torch.where(same, a, b)  # a mix of equal and random rows
    valid = torch.rand(tokens, generator=g) < 0.8
    valid[draw(st.integers(0, tokens - 1))] = True
    return a, b, valid, g


@given(route_pairs())
@settings(max_examples=60, deadline=None)
def test_matches_python_set_reference(case):
    a, b, valid, _ = case
    m = route_flip_metrics(a, b, valid)
    ref = reference(a, b, valid)
    assert m.per_layer_flip_rate == pytest.approx(ref["per_layer"])
    assert m.router_flip_rate == pytest.approx(ref["router"])
    assert m.token_flip_rate == pytest.approx(ref["token"])
    assert m.mean_jaccard == pytest.approx(ref["jaccard"])
    assert m.num_tokens == int(valid.sum())


@given(route_pairs())
@settings(max_examples=40, deadline=None)
def test_properties(case):
    a, b, valid, g = case
    m = route_flip_metrics(a, b, valid)
    assert 0.0 <= m.mean_jaccard <= 1.0
    assert all(0.0 <= r <= 1.0 for r in m.per_layer_flip_rate)
    assert m.router_flip_rate <= m.token_flip_rate + 1e-12
    assert m.token_flip_rate >= max(m.per_layer_flip_rate) - 1e-12
    # invariant to slot permutations of either table
    perm_a = a.gather(-1, torch.rand(a.shape, generator=g).argsort(dim=-1))
    perm_b = b.gather(-1, torch.rand(b.shape, generator=g).argsort(dim=-1))
    assert route_flip_metrics(perm_a, perm_b, valid) == m
    # symmetric
    assert route_flip_metrics(b, a, valid) == m
    # flip rate 0 iff the valid rows hold the same sets, and then the Jaccard index is 1
    equal_sets = (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)[valid].all().item()
    assert (m.router_flip_rate == 0.0) == equal_sets
    assert (m.token_flip_rate == 0.0) == equal_sets
    assert (m.mean_jaccard == 1.0) == equal_sets
    shuffled = route_flip_metrics(a, perm_a, valid)
    assert shuffled.router_flip_rate == 0.0 and shuffled.mean_jaccard == 1.0


def test_disjoint_sets():
    a = torch.tensor([[[0, 1]], [[2, 3]]])
    m = route_flip_metrics(a, a + 4)
    assert m.router_flip_rate == 1.0 and m.token_flip_rate == 1.0 and m.mean_jaccard == 0.0


def test_type_is_returned():
    assert isinstance(route_flip_metrics(A, B), RouteFlipMetrics)


@pytest.mark.parametrize("a, b, valid, fragment", [
    (A, B[:2], None, r"a \(3, 2, 2\) vs b \(2, 2, 2\)"),
    (A, B[..., :1], None, r"a \(3, 2, 2\) vs b \(3, 2, 1\)"),
    (A[0], B[0], None, r"a \(2, 2\) vs b \(2, 2\)"),
    (A.float(), B, None, "a must be an integer tensor, got dtype torch.float32"),
    (A, B.bool(), None, "b must be an integer tensor, got dtype torch.bool"),
    (A, B, torch.tensor([False, False, False]), "no valid token"),
    (A[:0], B[:0], None, "no valid token"),
    (A, B, torch.tensor([True, False]), r"valid must have shape \(3,\)"),
    (A, B, torch.tensor([1, 1, 0]), "valid must be a bool tensor, got dtype torch.int64"),
    (A[:, :0], B[:, :0], None, "no \\(layer, expert\\) slots"),
    (torch.tensor([[[0, 1]], [[2, 2]]]), torch.tensor([[[0, 1]], [[2, 3]]]), None, "a token 1 layer 0 repeats an expert"),
    (torch.tensor([[[0, 1]], [[2, 4]]]), torch.tensor([[[0, 1]], [[3, 3]]]), None, "b token 1 layer 0 repeats an expert"),
])
def test_errors(a, b, valid, fragment):
    with pytest.raises(RouteError, match=fragment):
        route_flip_metrics(a, b, valid)
