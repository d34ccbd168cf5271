"""The mismatch test, step 2: the training engine scores the record, without and with routing replay.

For every micro-batch of the record, :func:`score_record` runs the trainer's forward (:class:`TrainForward`)
twice (``replay=False`` / ``True``) and turns the logits into per-token results, in record order
(:class:`SideScores`): the log-prob over the full vocabulary, the log-prob restricted to the recorded kept
set (:func:`moealign.routing_replay.sampling_mask.kept_logprob`: ``log_softmax`` over the whole vocabulary
row with ``-inf`` outside the kept set, the formula and row length the rollout engine records its
log-probs with, so equal logits give bitwise equal log-probs), the support mismatch of the trainer's own
truncation and of the kept set it uses, and the router flips of the experts it used against the record's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..precision.batch_invariant import batch_invariant_mode
from ..precision.canonical import log_softmax_mode
from ..record import RolloutRecord, kept_sets_of
from ..routing_replay.flips import RouteFlipMetrics, route_flip_metrics
from ..routing_replay.sampling_mask import (
    full_logprob,
    kept_logprob,
    kept_mask,
    support_mismatch,
    truncation_mask,
)
from .engines import TRAIN_ENGINES, TrainEngine, TrainForward
from .rollout import MismatchConfig, open_engine, progress_bar

__all__ = ["SideScores", "make_train_engine", "train_message", "score_batch", "score_record"]


@dataclass
class SideScores:
    """Per-token results of one pass of the training engine over the record (without or with routing
    replay), in record order. ``kept`` / ``own_support_mismatch`` / ``used_support_mismatch`` stay empty
    for a record without kept sets; :meth:`finish` concatenates the batches and measures the flips."""

    full: list[torch.Tensor] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)
    own_support_mismatch: list[torch.Tensor] = field(default_factory=list)
    used_support_mismatch: list[torch.Tensor] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)
    flips: RouteFlipMetrics | None = None

    def logprobs(self, masked: bool) -> torch.Tensor:
        """``[N]`` the trainer's log-probs: restricted to the kept set (``masked``) or over the vocabulary."""
        return torch.cat(self.kept if masked else self.full)

    def support_mismatch(self, masked: bool) -> torch.Tensor:
        """``[N]`` bool: the recorded kept set vs the one the trainer uses (``masked``) or its own truncation."""
        return torch.cat(self.used_support_mismatch if masked else self.own_support_mismatch)

    def finish(self, recorded_routes: torch.Tensor, recorded: torch.Tensor | None = None) -> "SideScores":
        """Measure the router flips of the trainer's routes against ``recorded_routes`` (``[rows, L, k]``) on the
        ``recorded`` rows (bool ``[rows]``; default all: rows the record marks missing have no route to compare)."""
        ran = torch.cat(self.routes)
        if recorded is not None:
            ran, recorded_routes = ran[recorded], recorded_routes[recorded]
        self.flips = route_flip_metrics(ran, recorded_routes)
        return self


def make_train_engine(cfg: MismatchConfig, model_path: str, device: str) -> TrainEngine:
    """The training engine ``cfg`` names, loaded with its precision policy (the caller closes it)."""
    return open_engine(TRAIN_ENGINES[cfg.train_engine], f"the {cfg.train_engine} training engine", model_path,
                       cfg.train_precision, device, batch_invariant=cfg.batch_invariant,
                       attention=cfg.attention if cfg.train_engine == "hf" else None,
                       **({"aligned": True, "aligned_skip": cfg.aligned_skip} if cfg.aligned else {}),
                       **cfg.train_parallel_kwargs())


def train_message(cfg: MismatchConfig, record: RolloutRecord) -> str:
    return f"train: {cfg.train_engine} {cfg.train_precision}, {record.num_response_tokens} response tokens"


def score_batch(record: RolloutRecord, indices, fwd: TrainForward, side: SideScores) -> None:
    """Append the per-token results of one training forward over ``record.samples[indices]`` to ``side``."""
    samples = [record.samples[i] for i in indices]
    sampling = samples[0].sampling
    if any(s.sampling != sampling for s in samples):
        raise ConfigError("the mismatch test needs one set of sampling parameters per micro-batch")
    logits = fwd.logits
    T = sampling.temperature
    side.full.append(full_logprob(logits, fwd.tokens, temperature=T).cpu())
    side.routes.append(fwd.routes.cpu())
    if not record.has_kept_sets:
        return
    kept = kept_sets_of(samples, logits.shape[-1]).to(logits.device)    # checked when the record was made or loaded
    used = kept_mask(kept)
    side.kept.append(kept_logprob(logits, fwd.tokens, kept, temperature=T).cpu())
    own = truncation_mask(logits, temperature=T, top_k=sampling.top_k or None,
                          top_p=sampling.top_p if sampling.top_p < 1 else None, min_p=sampling.min_p or None)
    side.own_support_mismatch.append(support_mismatch(kept, trainer_mask=own).cpu())
    side.used_support_mismatch.append(support_mismatch(kept, trainer_mask=used).cpu())


def score_record(record: RolloutRecord, trainer: TrainEngine, *, batch_size: int, batch_invariant: bool = False,
                 progress: bool = False, canonical_log_softmax: bool = False) -> dict[bool, SideScores]:
    """Score every sample of ``record`` with ``trainer`` in micro-batches of ``batch_size``, without and with
    routing replay: ``{False: scores, True: scores}`` (flips measured against the record's routes). The
    log-prob arithmetic runs under ``batch_invariant_mode`` when ``batch_invariant``, and under the canonical
    log-softmax (:func:`moealign.precision.canonical.log_softmax_mode`) when ``canonical_log_softmax``."""
    record.meta.check_matches(trainer.meta(), what="training model")
    sides = {False: SideScores(), True: SideScores()}
    batches = [list(range(i, min(i + batch_size, len(record)))) for i in range(0, len(record), batch_size)]
    bar, update = progress_bar(2 * len(record), "train", progress)
    for replay in (False, True):
        for indices in batches:
            fwd = trainer.forward(record, indices, replay=replay)
            with batch_invariant_mode(batch_invariant), \
                    (log_softmax_mode() if canonical_log_softmax else contextlib.nullcontext()):
                score_batch(record, indices, fwd, sides[replay])
            update(len(indices))
    if bar is not None:
        bar.close()
    recorded_routes = torch.cat([s.routes.to(torch.int64) for s in record.samples])
    recorded = torch.cat([s.routed_rows for s in record.samples])
    return {replay: side.finish(recorded_routes, recorded) for replay, side in sides.items()}
