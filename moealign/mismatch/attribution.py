"""Order-independent attribution of a gap to the levers that remove it (pure Python; no engine).

A *lever game*: ``value(S)`` is the gap (mean |delta log p|, k3 KL, max |delta log p|) measured with the set
``S`` of levers switched on. The levers interact (routing replay removes flips that a precision difference
causes; turning on precision alignment first would also remove them), so the share of a lever depends on the
order in which one turns them on. The Shapley value averages that order away: a lever's share is its marginal
effect ``value(S) - value(S + lever)`` averaged over every order, and the shares add up exactly to what all
levers together remove (efficiency):

    sum(shares) = value(no lever) - value(all levers),   so   gap = sum(shares) + residual.

Levers can be grouped (the precision of each region: router, attention, experts, LM head, the rest).
:func:`owen_values` is the Shapley value with a coalition structure (Owen 1977): each group first gets its
Shapley value in the game between groups, then splits it among its members by their Shapley values inside
the group, averaged over the coalitions of the other groups. Its shares still add up to the gap removed, a
group's shares to the group's Shapley value, and with one lever per group it *is* the Shapley value.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Hashable, Iterable, Sequence

from ..errors import ConfigError

__all__ = ["shapley_values", "owen_values", "subsets"]


def subsets(items: Sequence[Hashable]) -> Iterable[frozenset]:
    """Every subset of ``items`` (as frozensets), smallest first."""
    for r in range(len(items) + 1):
        for combo in itertools.combinations(items, r):
            yield frozenset(combo)


def _weight(size: int, total: int) -> float:
    """The Shapley weight of a coalition of ``size`` others among ``total`` players: ``size! (total-size-1)! / total!``."""
    return math.factorial(size) * math.factorial(total - size - 1) / math.factorial(total)


def owen_values(groups: Sequence[Sequence[Hashable]], value: Callable[[frozenset], float]) -> dict:
    """The Owen value of every lever of ``groups`` (a partition of the levers) in the game ``value``
    (``frozenset of levers on -> gap``; called once per subset it needs; cache it if it is expensive).

    ``sum(result.values()) == value(frozenset()) - value(all levers)`` up to float rounding."""
    groups = [tuple(g) for g in groups]
    flat = [p for g in groups for p in g]
    if any(len(g) == 0 for g in groups):
        raise ConfigError("owen_values: a group of levers is empty")
    if len(set(flat)) != len(flat):
        raise ConfigError(f"owen_values: a lever appears twice in {groups}")
    cache: dict[frozenset, float] = {}

    def v(s: frozenset) -> float:
        if s not in cache:
            x = float(value(s))
            if math.isnan(x):
                raise ConfigError(f"the gap with levers {sorted(map(str, s))} is NaN: no attribution")
            cache[s] = x
        return cache[s]

    m = len(groups)
    out: dict = {}
    for k, group in enumerate(groups):
        others = [i for i in range(m) if i != k]
        for player in group:
            mates = [p for p in group if p != player]
            total = 0.0
            for r in range(len(others) + 1):
                w_outer = _weight(r, m)
                for chosen in itertools.combinations(others, r):
                    base = frozenset(p for i in chosen for p in groups[i])
                    for t in range(len(mates) + 1):
                        w_inner = _weight(t, len(group))
                        for inside in itertools.combinations(mates, t):
                            s = base | frozenset(inside)
                            total += w_outer * w_inner * (v(s) - v(s | {player}))
            out[player] = total
    return out


def shapley_values(players: Sequence[Hashable], value: Callable[[frozenset], float]) -> dict:
    """The Shapley value of each of ``players`` (the gap each removes, averaged over every order of turning
    them on); they add up to ``value(frozenset()) - value(frozenset(players))``."""
    return owen_values([[p] for p in players], value)
