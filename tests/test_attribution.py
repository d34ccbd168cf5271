"""Shapley / Owen attribution of a gap to the levers (moealign.mismatch.attribution): pure Python, fast."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from moealign.errors import ConfigError, MoealignError
from moealign.mismatch.attribution import owen_values, shapley_values, subsets


def _random_game(players, seed):
    rng = random.Random(seed)
    table = {s: rng.uniform(-3.0, 5.0) for s in subsets(players)}
    return table, lambda s: table[frozenset(s)]


def _brute_shapley(players, value):
    """The permutation definition: average over every order of the lever's marginal removal."""
    out = {p: 0.0 for p in players}
    orders = list(itertools.permutations(players))
    for order in orders:
        on = frozenset()
        for p in order:
            out[p] += value(on) - value(on | {p})
            on = on | {p}
    return {p: v / len(orders) for p, v in out.items()}


def test_subsets_every_subset_smallest_first():
    items = ["a", "b", "c"]
    got = list(subsets(items))
    assert len(got) == 8 and len(set(got)) == 8
    assert [len(s) for s in got] == sorted(len(s) for s in got)
    assert got[0] == frozenset() and got[-1] == frozenset(items)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_efficiency_random_games(n, seed):
    players = [f"p{i}" for i in range(n)]
    table, value = _random_game(players, seed * 10 + n)
    shares = shapley_values(players, value)
    assert set(shares) == set(players)
    expected = table[frozenset()] - table[frozenset(players)]
    assert math.isclose(sum(shares.values()), expected, rel_tol=1e-12, abs_tol=1e-12)
    # negative control: the shares are not trivially the same for every game
    assert not math.isclose(sum(shares.values()), expected + 1.0)


def test_symmetry_interchangeable_players():
    # v depends on a and b only through how many of them are on
    def value(s):
        k = len(s & {"a", "b"})
        return 10.0 - 3.0 * k + 0.5 * k * k - (2.0 if "c" in s else 0.0) * (1 + k)

    shares = shapley_values(["a", "b", "c"], value)
    assert math.isclose(shares["a"], shares["b"], rel_tol=0, abs_tol=1e-12)
    assert not math.isclose(shares["a"], shares["c"])


def test_null_player_gets_zero():
    players = ["a", "b", "n"]
    table, base = _random_game(["a", "b"], 7)
    shares = shapley_values(players, lambda s: base(s - {"n"}))
    assert shares["n"] == 0.0
    assert shares["a"] != 0.0 and shares["b"] != 0.0


def test_additivity():
    players = ["a", "b", "c", "d"]
    _, v1 = _random_game(players, 11)
    _, v2 = _random_game(players, 12)
    s1, s2 = shapley_values(players, v1), shapley_values(players, v2)
    s12 = shapley_values(players, lambda s: v1(s) + v2(s))
    for p in players:
        assert math.isclose(s12[p], s1[p] + s2[p], rel_tol=1e-12, abs_tol=1e-12)


def test_closed_form_additive_game():
    # shares are what a lever REMOVES: value(S) - value(S + lever). With v(S) = sum of weights in S, turning a
    # lever on adds its weight to the gap, so it removes minus its weight.
    weights = {"a": 0.5, "b": -1.25, "c": 3.0, "d": 0.0}
    shares = shapley_values(list(weights), lambda s: sum(weights[p] for p in s))
    for p, w in weights.items():
        assert math.isclose(shares[p], -w, abs_tol=1e-12)
    # and a gap that each lever lowers by its weight: shares == weights
    shares = shapley_values(list(weights), lambda s: 10.0 - sum(weights[p] for p in s))
    for p, w in weights.items():
        assert math.isclose(shares[p], w, abs_tol=1e-12)


def test_order_independence():
    players = ["a", "b", "c", "d"]
    _, value = _random_game(players, 21)
    ref = shapley_values(players, value)
    for perm in itertools.permutations(players):
        got = shapley_values(list(perm), value)
        assert set(got) == set(ref)
        for p in players:
            assert math.isclose(got[p], ref[p], rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_matches_permutation_definition(seed):
    players = ["a", "b", "c", "d"]
    _, value = _random_game(players, seed)
    got, want = shapley_values(players, value), _brute_shapley(players, value)
    for p in players:
        assert math.isclose(got[p], want[p], rel_tol=1e-10, abs_tol=1e-12)
    # negative control: a different game gives different shares
    _, other = _random_game(players, seed + 100)
    assert any(not math.isclose(_brute_shapley(players, other)[p], got[p]) for p in players)


def test_owen_singletons_equal_shapley():
    players = ["a", "b", "c", "d", "e"]
    _, value = _random_game(players, 31)
    sh = shapley_values(players, value)
    ow = owen_values([[p] for p in players], value)
    for p in players:
        assert math.isclose(ow[p], sh[p], rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize("seed", [41, 42, 43])
def test_owen_group_totals_are_quotient_shapley_and_efficient(seed):
    groups = [["a", "b"], ["c"], ["d", "e", "f"]]
    flat = [p for g in groups for p in g]
    table, value = _random_game(flat, seed)
    ow = owen_values(groups, value)
    assert set(ow) == set(flat)
    # quotient game: a coalition of groups switches on all their levers
    names = [f"g{i}" for i in range(len(groups))]
    quotient = lambda gs: value(frozenset(p for g in gs for p in groups[int(g[1:])]))
    qs = shapley_values(names, quotient)
    for name, g in zip(names, groups):
        assert math.isclose(sum(ow[p] for p in g), qs[name], rel_tol=1e-10, abs_tol=1e-12)
    assert math.isclose(sum(ow.values()), table[frozenset()] - table[frozenset(flat)], rel_tol=1e-12,
                        abs_tol=1e-12)
    # with coalition structure the members' shares differ from plain Shapley in general (negative control)
    sh = shapley_values(flat, value)
    assert any(not math.isclose(ow[p], sh[p], rel_tol=1e-9, abs_tol=1e-12) for p in flat)


def test_error_empty_group():
    with pytest.raises(ConfigError, match="empty"):
        owen_values([["a"], []], lambda s: 0.0)


def test_error_duplicate_player():
    with pytest.raises(ConfigError, match="twice"):
        owen_values([["a", "b"], ["b"]], lambda s: 0.0)
    with pytest.raises(ConfigError, match="twice"):
        shapley_values(["a", "a"], lambda s: 0.0)


def test_error_nan_value():
    with pytest.raises(ConfigError, match="NaN") as info:
        shapley_values(["a", "b"], lambda s: float("nan") if s == frozenset({"a"}) else 1.0)
    assert isinstance(info.value, MoealignError)
    assert "'a'" in str(info.value)


def test_value_called_once_per_subset():
    for groups in ([["a"], ["b"], ["c"], ["d"]], [["a", "b"], ["c", "d", "e"]]):
        flat = [p for g in groups for p in g]
        _, base = _random_game(flat, 51)
        calls: dict = {}

        def value(s):
            calls[s] = calls.get(s, 0) + 1
            return base(s)

        owen_values(groups, value)
        assert calls, "value never called"
        assert max(calls.values()) == 1, {k: c for k, c in calls.items() if c > 1}
        assert len(calls) <= 2 ** len(flat)
