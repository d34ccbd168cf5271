"""Lever runs: the same record scored with every combination of moealign's levers switched on.

A *lever* removes one cause of the rollout / trainer gap:

====================  ===================================  ====================================================
lever                 cause it removes                     what the lever run changes
====================  ===================================  ====================================================
``sampling_mask``     sampling truncation                  the trainer's log-prob over the recorded kept set
``routing_replay``    routing flips                        the trainer replays the rollout side's routes
``precision:REGION``  precision of a region (router,       the rollout side computes that region in the
                      attention, experts, lm_head, other)  trainer's dtype (re-scored along its own path)
``batch_invariant``   batch and KV-cache effects           both sides under batch-invariant ops and attention
``weights``           weights that differ                  the rollout side holds the trainer's weights
====================  ===================================  ====================================================

The record is sampled once. The trainer side is re-run per lever set (it is a forward); the rollout side is
re-scored along the rollout's own path (:func:`moealign.patches.hf.rollout.rescore_decode`: the same
``generate()`` batches, prefill then one decode step per token, forced to the recorded tokens), which
reproduces the record bitwise when nothing changed; the lever runs check that and refuse rollout-side levers
otherwise. Rollout-side levers need a rollout engine moealign can re-score (transformers here; vLLM -> Megatron
has its own table, :mod:`moealign.mismatch.vllm_levers`, vLLM re-scoring its side); with a record loaded from a file
the players are the trainer-side levers only, and the report says so.

A lever is a player only where it changes something (regions whose dtypes already agree, a sampling without
truncation, an already batch-invariant pair, identical weights are left out). :class:`LeverRunner` is the levers'
table: it maps a lever set to a rollout setup (re-scored and cached by
:class:`~moealign.mismatch.rollout_side.RolloutRescorer`) and a trainer pass (cached here), measures the pair, and
:mod:`moealign.mismatch.attribution` turns the gaps into shares.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import ConfigError
from ..precision.batch_invariant import batch_invariant_mode
from ..precision.policy import get_policy
from ..record import RolloutRecord
from ..routing_replay.flips import flipped_slots
from .attribution import owen_values
from .faults import Fault
from .report import logprob_metrics
from .rollout_side import REGIONS, RolloutRescorer, RolloutSetup, mixed_policy, region_dtypes
from .scoring import SideScores, score_batch
from .workers import can_fork

__all__ = ["CAUSES", "REGIONS", "ATTRIBUTED_METRICS", "LeverRun", "LeverRunner", "LeverTable", "region_dtypes", "mixed_policy",
           "lever_label"]

#: The most bytes of ``[N, V]`` float32 logits the lever runs keep per side for :meth:`LeverRunner.full_vocab_kl`
#: (the no-lever and every-lever sets); above it those forwards run again.
KEEP_LOGITS_BYTES = 256 << 20
#: Share forwards between lever sets (the LM head's precision variants in one decode, the mismatch test's own
#: trainer passes, the logits full_vocab_kl needs kept). False: every lever set evaluated on its own, the
#: straightforward way (the reference the shared evaluation is tested bitwise against,
#: ``tests/test_diagnosis.py::test_shared_forwards_give_the_same_attribution``).
SHARE_FORWARDS = True
#: Rollout micro-batches decoded at once on a CPU: this process and ``DECODE_WORKERS - 1`` forked from it
#: (:func:`~moealign.mismatch.workers.fork_map`). None: ``min(8, torch.get_num_threads())``; 1: one at a time
#: (where forking is not safe too). A decode of a small model is mostly small kernels with the interpreter between
#: them: one process per core keeps the cores busy where intra-op threads (or threads of one process) do not.
#: On a CPU every decode of the lever runs uses one intra-op thread, however many workers: a CPU kernel's bits can
#: depend on its thread count (fp32 paths of the embedded model do), so the worker count never changes a result.
#: :meth:`LeverRunner.check_base` runs in the workers, each on at least one micro-batch, so their bits are checked
#: against the record before a lever set uses them; otherwise the decodes run one at a time on the process's
#: threads, with a note. Other devices: one at a time, nothing changed.
DECODE_WORKERS: int | None = None
#: The cause each lever removes (the attribution's names).
CAUSES = {
    "sampling_mask": "sampling truncation",
    "routing_replay": "routing flips",
    "precision": "precision",
    "precision:router": "precision: router",
    "precision:attention": "precision: attention",
    "precision:experts": "precision: experts",
    "precision:lm_head": "precision: LM head",
    "precision:other": "precision: other modules (embeddings, norms)",
    "precision:fp8": "precision: FP8 linear layers",
    "batch_invariant": "batch and KV-cache effects",
    "weights": "weights that differ",
    "canonical": "kernels (each engine's own ops)",
    "prefill": "prefill vs decode (the rollout's decode path)",
}
#: The gap metrics attributed (the issue's three), primary first.
ATTRIBUTED_METRICS = ("mean_abs_logp_diff", "kl_k3", "max_abs_logp_diff")


def lever_label(levers) -> str:
    """``"baseline"`` or the levers joined by ``+`` in :data:`CAUSES` order."""
    order = list(CAUSES)
    names = sorted(levers, key=lambda x: order.index(x) if x in order else len(order))
    return "+".join(names) if names else "baseline"


@dataclass
class LeverRun:
    """One lever set's per-token results (record order) and metrics."""

    levers: frozenset
    rollout_logprobs: torch.Tensor                 # [N]
    train_logprobs: torch.Tensor                   # [N]
    support_mismatch: torch.Tensor | None          # [N] bool (None without kept sets)
    per_layer_flip_rate: list[float]
    router_flip_rate: float
    flipped: torch.Tensor                          # [rows, n_layers] bool, route rows flipped per layer
    metrics: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return lever_label(self.levers)


class LeverTable:
    """What both lever tables share (this module's :class:`LeverRunner`, transformers on both sides, and
    :class:`~moealign.mismatch.vllm_levers.VllmLeverRunner`, vLLM -> Megatron): the record's per-token columns and
    micro-batches, the training engines opened on demand by ``trainer_factory(key)`` (the base one, passed in, is
    not closed here), the passes' caches, one lever set measured into a :class:`LeverRun`, and ``close()``."""

    def _init_table(self, record: RolloutRecord, batch_size: int, trainer_key, trainer,
                    trainer_factory: Callable, log: Callable[[str], None] | None) -> None:
        self.record = record
        self.log = log or (lambda msg: None)
        self.notes: list[str] = []
        self.batches = [list(range(i, min(i + batch_size, len(record)))) for i in range(0, len(record), batch_size)]
        self.lengths = [s.response_len for s in record.samples]
        self.recorded_lp = torch.cat([s.logprobs.float() for s in record.samples])
        self.recorded_routes = torch.cat([s.routes.to(torch.int64) for s in record.samples])
        self.routed = torch.cat([s.routed_rows for s in record.samples])
        self._trainers = {trainer_key: trainer}
        self._own_trainers: list = []
        self._trainer_factory = trainer_factory
        self._train_cache: dict = {}
        self._train_logits: dict = {}               # what full_vocab_kl needs, kept
        self._runs: dict = {}

    @property
    def players(self) -> list[str]:
        return [p for g in self.groups for p in g]

    @property
    def runs(self) -> list[LeverRun]:
        """Every lever set scored so far, in the order it was first asked for."""
        return list(self._runs.values())

    def _trainer(self, key):
        """The training engine for ``key`` (opened by the factory the first time, closed by :meth:`close`)."""
        if key not in self._trainers:
            self.log(self._opening(key))
            engine = self._trainer_factory(key)
            self._trainers[key] = engine
            self._own_trainers.append(engine)
        return self._trainers[key]

    def _opening(self, key) -> str:
        return f"levers: opening a training engine ({key})"

    def _measure(self, levers: frozenset, rollout_lp: torch.Tensor, rollout_routes: torch.Tensor,
                 side: SideScores, *, bitwise: bool = False) -> LeverRun:
        """One lever set's run: the trainer side's log-probs (over the kept sets with ``sampling_mask``), router flips
        against ``rollout_routes`` on the routed rows, the gap metrics, the ESS (``bitwise``: and whether the two
        sides are ``torch.equal``); cached under ``levers``."""
        masked = "sampling_mask" in levers
        train_lp = side.logprobs(masked and self.record.has_kept_sets)
        used = torch.cat(side.routes).to(torch.int64)[self.routed]
        flips = flipped_slots(used, rollout_routes[self.routed])                               # [rows, L]
        per_layer = [float(x) for x in flips.double().mean(0)] if flips.numel() else []
        support = side.support_mismatch(masked) if self.record.has_kept_sets else None
        metrics = logprob_metrics(train_lp, rollout_lp, self.lengths)
        metrics["router_flip_rate"] = float(flips.double().mean()) if flips.numel() else 0.0
        metrics["token_flip_rate"] = float(flips.any(-1).double().mean()) if flips.numel() else 0.0
        metrics["support_mismatch_rate"] = float(support.double().mean()) if support is not None else float("nan")
        metrics["per_layer_flip_rate"] = per_layer
        if bitwise:
            metrics["bitwise_equal"] = bool(torch.equal(train_lp, rollout_lp))
        w = torch.exp((train_lp.double() - rollout_lp.double()).clamp(max=50.0))
        metrics["ess"] = float(w.mean() ** 2 / (w * w).mean()) if w.numel() else float("nan")
        run = LeverRun(levers, rollout_lp, train_lp, support, per_layer, metrics["router_flip_rate"], flips, metrics)
        self._runs[levers] = run
        return run

    def close(self) -> None:
        for engine in self._own_trainers:
            engine.close()
        self._own_trainers.clear()
        self.rollout.close()
        self._train_cache.clear()
        self._train_logits.clear()


class LeverRunner(LeverTable):
    """Evaluates lever sets on one record (every forward cached).

    ``trainer_factory(batch_invariant: bool)`` opens a training engine (the base one is passed as ``trainer``
    and not closed here); ``rescorable``: the record was sampled in this run by the transformers rollout engine
    from ``model_path`` with ``rollout_policy`` (batch size ``batch_size``), so rollout-side levers can run."""

    def __init__(self, *, record: RolloutRecord, trainer, trainer_factory: Callable[[bool], object],
                 model_path: str, device: str, rollout_policy: str, train_policy: str, batch_size: int,
                 batch_invariant: bool = False, attention: str | None = None, rescorable: bool = False,
                 fault: Fault | None = None, pad_token_id: int | None = None, max_new_tokens: int | None = None,
                 base_sides: dict | None = None, log: Callable[[str], None] | None = None):
        self._init_table(record, batch_size, bool(batch_invariant), trainer, trainer_factory, log)
        self.rollout_policy, self.train_policy = get_policy(rollout_policy), get_policy(train_policy)
        self.base_bi = bool(batch_invariant)
        self.fault = fault
        # the base trainer passes the mismatch test already ran (score_record: same trainer, batches, record)
        self.share = SHARE_FORWARDS
        self._base_sides = dict(base_sides) if base_sides and self.share else {}
        self.rescorable = bool(rescorable)
        #: what the evaluation ran: rollout setups re-scored by a decode / by one forward (batch-invariant), trainer
        #: passes (each over every micro-batch)
        self.work = {"rollout_decodes": 0, "rollout_forwards": 0, "forward_checks": 0, "train_passes": 0}
        self.regions: list[str] = []
        self.groups = self._players()
        # the rollout side (re-scored along the transformers rollout's path): decode workers (DECODE_WORKERS), the
        # intra-op threads of a decode (1 on a CPU, None: the process's)
        self.rollout = RolloutRescorer(
            record=record, model_path=model_path, device=device, rollout_policy=self.rollout_policy,
            train_policy=self.train_policy, batches=self.batches, attention=attention, fault=fault,
            pad_token_id=pad_token_id, max_new_tokens=max_new_tokens, regions=self.regions, share=self.share,
            workers=_decode_workers(device), decode_threads=1 if torch.device(device).type == "cpu" else None,
            keep_bytes=KEEP_LOGITS_BYTES, notes=self.notes, work=self.work)
        self.rollout.keep_logits = {self._setup(frozenset()), self._setup(frozenset(self.players))}

    @property
    def workers(self) -> int:
        """The decode processes the rollout side uses (1 after :meth:`check_base` found them not bitwise)."""
        return self.rollout.workers

    # ---------------------------------------------------------------------------------------------- players
    def _players(self) -> list[list[str]]:
        rec = self.record
        groups: list[list[str]] = []
        truncates = rec.has_kept_sets and any(
            s.sampling.top_p < 1 or s.sampling.top_k > 0 or s.sampling.min_p > 0 for s in rec.samples)
        if truncates:
            groups.append(["sampling_mask"])
        elif rec.has_kept_sets:
            self.notes.append("sampling_mask: not a lever here (the sampling does not truncate)")
        groups.append(["routing_replay"])
        if not self.rescorable:
            self.notes.append("rollout-side levers (precision, batch_invariant, weights) not run: the rollout side "
                              "can only be re-scored when this run sampled the record with the transformers engine")
            return groups
        a, b = region_dtypes(self.rollout_policy), region_dtypes(self.train_policy)
        self.regions = [f"precision:{r}" for r in REGIONS if a[r] != b[r]]
        if self.rollout_policy.fp8 != self.train_policy.fp8:
            self.regions.append("precision:fp8")
        if len(self.regions) == 1:
            groups.append(list(self.regions))
        elif self.regions:
            groups.append(["precision"])
        if not self.base_bi:
            groups.append(["batch_invariant"])
        if self.fault is not None and self.fault.kind == "weights":
            groups.append(["weights"])
        return groups

    # ---------------------------------------------------------------------------------------------- rollout side
    def _setup(self, levers: frozenset) -> RolloutSetup:
        """The rollout setup a lever set asks for (the record as sampled when the rollout side cannot be re-scored)."""
        if not self.rescorable:
            return RolloutSetup(frozenset(), self.base_bi, False)
        regions = set(self.regions) if "precision" in levers else set()
        aligned = frozenset(p.split(":", 1)[1] for p in regions | {p for p in levers if p.startswith("precision:")})
        return RolloutSetup(aligned, self.base_bi or "batch_invariant" in levers,
                            self.fault is not None and self.fault.kind == "weights" and "weights" not in levers)

    def _rollout(self, setup: RolloutSetup) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kept-set log-probs [N], routes [rows, L, k])`` of the rollout side in ``setup``."""
        if not self.rescorable:
            return self.recorded_lp, self.recorded_routes
        return self.rollout.scores(setup)

    def check_base(self) -> bool:
        """Re-score the record with nothing changed; ``True`` when that reproduces its log-probs and routes
        bitwise. Otherwise the rollout-side levers are dropped (their runs would measure the re-scoring, not the
        lever) and a note says so."""
        if not self.rescorable:
            return False
        ok, diff = self.rollout.check_base(self._setup(frozenset()))
        if not ok:
            self.notes.append(f"re-scoring the record along the rollout's path did not reproduce it (max |delta log p| "
                              f"{diff:.3g}): rollout-side levers not run")
            self.rescorable = False
            self.groups = self._players()
        return ok

    def prefetch(self) -> None:
        """Decode, in the rollout side's decode workers, every rollout setup :meth:`attribution` will ask for."""
        if not self.rescorable:
            return
        asked: list[frozenset] = []

        def ask(levers: frozenset) -> float:
            asked.append(levers)
            return 0.0

        owen_values(self.groups, ask)               # the lever sets the attribution evaluates, in its order
        if "precision" in self.players:
            owen_values([[r] for r in self.regions], ask)
        self.rollout.prefetch(self._setup(levers) for levers in asked)

    def _kl_train_keys(self) -> set:
        return {self._train_key(frozenset()), self._train_key(frozenset(self.players))}

    def _train_key(self, levers: frozenset):
        return (self.base_bi or "batch_invariant" in levers,
                self._setup(levers) if "routing_replay" in levers else None)

    def _opening(self, bi: bool) -> str:
        return "levers: opening a batch-invariant training engine"

    def _train(self, bi: bool, replay_setup: RolloutSetup | None) -> SideScores:
        key = (bi, replay_setup)
        if key in self._train_cache:
            return self._train_cache[key]
        record = self.record
        if replay_setup is not None and self.rescorable:
            _, routes = self._rollout(replay_setup)
            record = _with_routes(self.record, routes)
        base = self._base_side(bi, replay_setup, record)
        if base is not None:
            self._train_cache[key] = base
            return base
        trainer = self._trainer(bi)
        keep = key in self._kl_train_keys() and self.rollout.fits()
        logits = []
        side = SideScores()
        for indices in self.batches:
            fwd = trainer.forward(record, indices, replay=replay_setup is not None)
            with batch_invariant_mode(bi):
                score_batch(record, indices, fwd, side)
            if keep:
                logits.append(fwd.logits.float().cpu())
            del fwd
        if keep:
            self._train_logits[key] = logits
        self.work["train_passes"] += 1
        self._train_cache[key] = side
        return side

    def _base_side(self, bi: bool, replay_setup: RolloutSetup | None, record: RolloutRecord) -> SideScores | None:
        """The mismatch test's own pass of the base trainer (``base_sides``, :func:`score_record`: the same trainer,
        micro-batches and log-prob arithmetic) where it is this pass: without replay, or replaying routes equal to
        the record's in every row (the re-scored base reproduces them)."""
        replay = replay_setup is not None
        if bi != self.base_bi or replay not in self._base_sides:
            return None
        if replay and record is not self.record and not all(
                torch.equal(a.routes, b.routes) for a, b in zip(record.samples, self.record.samples)):
            return None
        return self._base_sides[replay]

    # ---------------------------------------------------------------------------------------------- runs
    def run(self, levers) -> LeverRun:
        levers = frozenset(levers)
        unknown = levers - set(self.players) - set(self.regions)
        if unknown:
            raise ConfigError(f"levers {sorted(unknown)} are not players of this run (players: {self.players})")
        if levers in self._runs:
            return self._runs[levers]
        setup = self._setup(levers)
        rollout_lp, rollout_routes = self._rollout(setup)
        return self._measure(levers, rollout_lp, rollout_routes, self._train(*self._train_key(levers)))

    def full_vocab_kl(self, levers) -> torch.Tensor | None:
        """``[N]`` KL(rollout || trainer) over the whole vocabulary per response token, with ``levers`` on (the
        rollout's full next-token distribution vs the trainer's, both at the sampling temperature, before any
        truncation); ``None`` when the rollout side cannot be re-scored. Memory: one micro-batch of logits per
        side at a time (:func:`moealign.correction.vocab_kl.full_vocab_kl` works in row chunks), unless the lever
        runs kept this set's logits (no lever, every lever: when ``[N, V]`` float32 fits
        :data:`KEEP_LOGITS_BYTES`), which are used instead of running the forwards again (the same bits)."""
        from ..correction.vocab_kl import full_vocab_kl

        if not self.rescorable:
            return None
        levers = frozenset(levers)
        setup = self._setup(levers)
        bi, replay_setup = self._train_key(levers)
        replay = replay_setup is not None
        kept_rollout = self.rollout.kept_logits(setup)
        kept_train = self._train_logits.get((bi, replay_setup))
        trainer = self._trainer(bi) if kept_train is None else None
        record = _with_routes(self.record, self._rollout(setup)[1]) if replay and kept_train is None else self.record
        if kept_rollout is None:
            self.rollout.count(self.rollout.rescorer(setup, confirmed=True))
        if kept_train is None:
            self.work["train_passes"] += 1
        out = []
        for b, indices in enumerate(self.batches):
            samples = [record.samples[i] for i in indices]
            if kept_rollout is not None:
                logits = kept_rollout[b]
            else:
                logits = self.rollout.logits(setup, samples)
            if kept_train is not None:
                train_logits = kept_train[b]
            else:
                fwd = trainer.forward(record, indices, replay=replay)
                train_logits = fwd.logits.float().cpu()
                del fwd
            T = samples[0].sampling.temperature
            out.append(full_vocab_kl(logits, train_logits, temperature=T))
            del logits, train_logits
        return torch.cat(out)

    def attribution(self, metrics=ATTRIBUTED_METRICS) -> dict:
        """``{metric: {"gap", "residual", "levers": {lever: share}, "shares": {cause: share}}}``: the Shapley
        values of the players (:attr:`groups`); they add up to ``gap - residual``.

        With more than one precision region in play, ``precision`` is one player there (aligning every region
        at once) and ``"regions"`` splits what it removes on its own (``gap - value(precision)``) among the
        regions by their Shapley values in the game of the regions alone (the other levers off)."""
        self.prefetch()
        out = {}
        everything = frozenset(self.players)
        for name in metrics:
            values = owen_values(self.groups, lambda s: self.run(s).metrics[name])
            entry = {"gap": self.run(frozenset()).metrics[name], "residual": self.run(everything).metrics[name],
                     "levers": values, "shares": {CAUSES[k]: v for k, v in values.items()}}
            if "precision" in self.players:
                regions = owen_values([[r] for r in self.regions], lambda s: self.run(s).metrics[name])
                entry["regions"] = {"removed_alone": entry["gap"] - self.run(frozenset({"precision"})).metrics[name],
                                    "shares": {CAUSES[k]: v for k, v in regions.items()}}
            out[name] = entry
        return out



def _decode_workers(device) -> int:
    """How many rollout micro-batches are decoded at once on ``device`` (:data:`DECODE_WORKERS`)."""
    n = DECODE_WORKERS if DECODE_WORKERS is not None else min(8, torch.get_num_threads())
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"DECODE_WORKERS must be a positive int or None, got {n!r}")
    return n if torch.device(device).type == "cpu" and can_fork() else 1


def _with_routes(record: RolloutRecord, routes: torch.Tensor) -> RolloutRecord:
    """``record`` with its samples' routes replaced by ``routes`` (``[rows, L, k]``, record row order)."""
    out, start = [], 0
    for s in record.samples:
        n = s.routes.shape[0]
        out.append(dataclasses.replace(s, routes=routes[start:start + n].to(s.routes.dtype)))
        start += n
    return RolloutRecord(record.meta, out, validate=False)
