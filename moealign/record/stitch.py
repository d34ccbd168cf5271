"""Multi-turn records: the turns of one trajectory stitched into one :class:`~moealign.record.Sample`.

A multi-turn rollout sends each turn as a new request whose context re-prefills every earlier turn. No engine
computes the route of a turn's *final* sampled token (it is never forwarded in that turn); the next turn's prefill
does. :func:`stitch_turns` builds the trajectory's route table row by row:

* row ``r`` takes its route from the **earliest** turn that reports one: the turn that actually ran that token, so
  the tokens a turn sampled are replayed with the experts that produced them; a turn's final-token row, and the
  tokens inserted between turns (user / tool messages), come from the next turn's prefill;
* rows a turn does not report (a prefix served from the engine's cache, rows its format marks missing) fall through to
  a later turn; rows no turn reports stay explicitly missing (``Sample.route_missing``);
* every row carries the weight version of the turn it was taken from (``Sample.route_version``). Turns of different
  weight versions are refused unless ``allow_stale=True``; the stitched sample then says which rows are stale
  (``Sample.stale_rows()``: rows of an older version than the newest turn's);
* where two turns of the *same* weight version both report a row and disagree, the re-prefill flipped the router
  (batch composition, kernels): :attr:`StitchedTrajectory.reprefill_flips` counts those rows, a direct measure of how
  unstable the rollout engine's own routing is.

The stitched sample's response is the final turn's response (its log-probs and kept sets); earlier turns' responses
sit in the context, their routes replayed like every other row. Turn ``t + 1``'s tokens must start with all of turn
``t``'s tokens (the trajectory only grows), and its prompt must hold all of them (a turn never claims an earlier
turn's tokens as its own response); anything else is refused naming the first differing position or the overlap.
Every turn's routes are in the record's route dtype and its weight version fits int64.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..errors import RecordError
from .meta import RecordMeta, SamplingParams
from .sample import Sample

__all__ = ["Turn", "StitchedTrajectory", "stitch_turns"]


@dataclass(frozen=True)
class Turn:
    """One turn's request as its engine reported it: the whole context (earlier turns + new tokens) and this turn's
    response in ``token_ids``; ``routes`` ``[len(token_ids) - 1, n_moe_layers, k]`` (the record's route dtype) for
    the rows this turn computed, ``route_missing`` marking rows it did not (cached prefix); the weight version the
    engine held."""

    token_ids: torch.Tensor
    prompt_len: int
    logprobs: torch.Tensor
    routes: torch.Tensor
    weight_version: int
    route_missing: torch.Tensor | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    kept_offsets: torch.Tensor | None = None
    kept_ids: torch.Tensor | None = None

    def as_sample(self) -> Sample:
        return Sample(token_ids=self.token_ids, prompt_len=self.prompt_len, logprobs=self.logprobs, routes=self.routes,
                      kept_offsets=self.kept_offsets, kept_ids=self.kept_ids, sampling=self.sampling,
                      route_missing=self.route_missing)


@dataclass(frozen=True)
class StitchedTrajectory:
    sample: Sample
    weight_versions: tuple[int, ...]     # per turn
    turn_starts: tuple[int, ...]         # first token of each turn's new tokens (0 for the first turn)
    reprefill_flips: int                 # rows two same-version turns both report, with different expert sets
    stale_rows: int                      # rows of an older weight version than the newest turn's

    @property
    def has_stale_rows(self) -> bool:
        return self.stale_rows > 0


def stitch_turns(meta: RecordMeta, turns: Sequence[Turn], *, allow_stale: bool = False) -> StitchedTrajectory:
    """Stitch ``turns`` (in order) of one trajectory into one sample (see the module docstring). Every turn is
    validated as a sample of ``meta`` first; :class:`RecordError` names the turn and the problem."""
    if not turns:
        raise RecordError("stitch_turns needs at least one turn")
    versions = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, Turn):
            raise RecordError(f"turn {t}: expected a Turn, got {type(turn).__name__}")
        if (isinstance(turn.weight_version, bool) or not isinstance(turn.weight_version, int)
                or not 0 <= turn.weight_version < 2 ** 63):
            raise RecordError(f"turn {t}: weight_version must be an integer in [0, 2**63) (stored as int64), got "
                              f"{turn.weight_version!r}")
        if turn.routes is None:
            raise RecordError(f"turn {t}: has no routes (stitching builds a route table)")
        if not isinstance(turn.routes, torch.Tensor) or turn.routes.dtype != meta.route_dtype:
            got = turn.routes.dtype if isinstance(turn.routes, torch.Tensor) else type(turn.routes).__name__
            raise RecordError(f"turn {t}: routes are {got}, the record's route dtype is {meta.route_dtype} (every "
                              f"turn's table in the record's dtype)")
        turn.as_sample().validate(meta, t)
        versions.append(turn.weight_version)
    if len(set(versions)) > 1 and not allow_stale:
        raise RecordError(f"the turns were generated with different weight versions {versions}: their routes belong to "
                          f"different networks; pass allow_stale=True to stitch anyway (the record then marks the rows "
                          f"of older versions stale)")
    starts = [0]
    for t in range(1, len(turns)):
        prev, cur = turns[t - 1].token_ids, turns[t].token_ids
        if cur.numel() <= prev.numel():
            raise RecordError(f"turn {t} has {cur.numel()} tokens, turn {t - 1} has {prev.numel()}: a later turn's "
                              f"context must contain the earlier turn and add to it")
        differ = (cur[:prev.numel()] != prev).nonzero()
        if differ.numel():
            pos = int(differ[0, 0])
            raise RecordError(f"turn {t} does not continue turn {t - 1}: token {pos} is {int(cur[pos])} in turn {t}, "
                              f"{int(prev[pos])} in turn {t - 1} (re-tokenised context?)")
        if turns[t].prompt_len < prev.numel():
            raise RecordError(f"turn {t} has prompt_len {turns[t].prompt_len}, shorter than turn {t - 1}'s "
                              f"{prev.numel()} tokens: turn {t} claims tokens turn {t - 1} already holds (its response) "
                              f"as its own response; overlapping claims that disagree are refused")
        starts.append(int(prev.numel()))
    last = turns[-1]
    rows = last.token_ids.numel() - 1
    routes = torch.zeros(rows, *last.routes.shape[1:], dtype=last.routes.dtype)
    version = torch.zeros(rows, dtype=torch.int64)
    taken = torch.zeros(rows, dtype=torch.bool)
    flips = 0
    for turn in turns:
        n = turn.token_ids.numel() - 1
        present = torch.ones(n, dtype=torch.bool) if turn.route_missing is None else ~turn.route_missing
        new = present & ~taken[:n]
        routes[:n][new] = turn.routes[new]
        version[:n][new] = turn.weight_version
        both = present & taken[:n] & (version[:n] == turn.weight_version)
        if bool(both.any()):
            a = routes[:n][both].long().sort(dim=-1).values
            b = turn.routes[both].long().sort(dim=-1).values
            flips += int((a != b).any(dim=-1).any(dim=-1).sum())
        taken[:n] |= present
    missing = ~taken
    newest = max(versions)
    sample = Sample(token_ids=last.token_ids.clone(), prompt_len=last.prompt_len, logprobs=last.logprobs.clone(),
                    routes=routes, kept_offsets=last.kept_offsets, kept_ids=last.kept_ids, sampling=last.sampling,
                    route_missing=missing if bool(missing.any()) else None,
                    route_version=version)
    sample.validate(meta)
    stale = int(sample.stale_rows(newest).sum())
    return StitchedTrajectory(sample=sample, weight_versions=tuple(versions), turn_starts=tuple(starts),
                              reprefill_flips=flips, stale_rows=stale)
