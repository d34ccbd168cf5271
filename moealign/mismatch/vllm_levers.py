"""The diagnosis on the default pair, vLLM -> Megatron: every lever moealign has for it, the rollout side re-scored by
vLLM itself.

vLLM samples once. Its side is re-scored by :class:`VllmRescorer`: one vLLM prefill of each sample's recorded tokens
with the recorded routes forced (:func:`moealign.patches.vllm.rescore.prefill_logits`), one engine per
:class:`VllmSetup` (vLLM's patches are class-level and precede loading: each engine is opened in this process with its
patches, used once and closed, the patches undone), the kept-set log-prob computed from its logits in the trainer's
arithmetic. The trainer side is Megatron, one engine per precision, the canonical ops switched at run time.

=================  ================================================  ==================================================
lever              cause it removes                                  what its runs change
=================  ================================================  ==================================================
``sampling_mask``  sampling truncation                               the trainer's log-prob over the recorded kept set
``routing_replay`` routing flips                                     the trainer replays the recorded routes
``precision``      precision (the trainer's dtype is not the         the trainer runs at the rollout's precision
                   rollout's)
``canonical``      kernels: each engine's own ops                    both engines run the canonical forward
                                                                     (``--aligned``), the rollout re-scored by vLLM
=================  ================================================  ==================================================

**Prefill vs decode.** The record was made by vLLM's decode (one position per engine step, a KV cache, other requests
in the batch); a re-scoring is one prefill of the same tokens. Where a prefill does not reproduce the record, the
difference is its own term of the attribution, ``prefill`` ("the rollout's decode path"): the gap with no lever minus
the gap with the rollout side re-scored by the stock prefill. Every other lever is then played on the prefill
re-scorings. Under the canonical forward a decode and a prefill compute every row alike (each query row attends its
own keys, every op batch- and position-invariant; ``--aligned`` checks its own decode against Megatron bitwise), so the
canonical setups are the same whichever path made them. When the stock prefill reproduces the record bitwise (vLLM's
CPU build on the embedded model does), the term is exactly 0, measured.

The residual after every lever is the fully aligned setting's gap: 0 (bitwise) when the canonical forward covers the
pair, otherwise named by why it could not run. The canonical forward's ops are then each switched back to stock on
the trainer alone (:func:`moealign.mismatch.aligned.canonical_levers`, as ``--aligned --diagnose`` does): the gap each
opens, its negative control.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import ConfigError, EngineError, MoealignError
from ..precision.canonical import OPS, log_softmax_mode
from ..precision.policy import get_policy
from ..record import RolloutRecord, kept_sets_of
from ..routing_replay.sampling_mask import full_logprob, kept_logprob
from .attribution import owen_values
from .levers import ATTRIBUTED_METRICS, CAUSES, LeverRun, LeverTable, lever_label
from .scoring import SideScores, score_batch

__all__ = ["VllmSetup", "VllmRescorer", "VllmLeverRunner", "PREFILL", "CANONICAL", "pair_runner", "rescore_first", "canonical_unavailable"]

#: The lever name of the prefill-vs-decode term and of the canonical forward.
PREFILL, CANONICAL = "prefill", "canonical"


@dataclass(frozen=True)
class VllmSetup:
    """One way of re-scoring the vLLM side: stock, or the canonical forward with ``skip`` left stock."""

    canonical: bool = False
    skip: tuple = ()

    @property
    def label(self) -> str:
        if not self.canonical:
            return "stock"
        return "canonical" + (f" (stock: {', '.join(self.skip)})" if self.skip else "")


class VllmRescorer:
    """The record re-scored by vLLM per :class:`VllmSetup` (one prefill, the recorded routes forced), cached: kept-set
    (or full-vocabulary) log-probs ``[N]`` in the trainer's arithmetic per micro-batch of ``batches``, the routes that
    ran, the logits (kept for the full-vocabulary KL), and the seconds each engine took to open and to re-score."""

    def __init__(self, *, record: RolloutRecord, model_path: str, device: str, precision: str,
                 batches: list[list[int]], work: dict, log: Callable[[str], None]):
        self.record, self.model_path, self.device = record, model_path, device
        self.precision = get_policy(precision).name
        self.batches, self.work, self.log = batches, work, log
        self.recorded_lp = torch.cat([s.logprobs.float() for s in record.samples])
        self.recorded_routes = torch.cat([s.routes.to(torch.int64) for s in record.samples])
        self.routed = torch.cat([s.routed_rows for s in record.samples])
        self._cache: dict = {}
        self._logits: dict = {}
        self.seconds: dict = {}

    def scores(self, setup: VllmSetup) -> tuple[torch.Tensor, torch.Tensor]:
        if setup not in self._cache:
            self._rescore(setup)
        return self._cache[setup]

    def logits(self, setup: VllmSetup) -> list[torch.Tensor]:
        self.scores(setup)
        return self._logits[setup]

    def check_base(self) -> tuple[bool, float]:
        """The stock re-scoring against the record: ``(bitwise equal log-probs and routes, max |delta log p|)``."""
        lp, routes = self.scores(VllmSetup())
        ok = torch.equal(lp, self.recorded_lp) and torch.equal(routes[self.routed], self.recorded_routes[self.routed])
        return ok, float((lp - self.recorded_lp).abs().max()) if lp.numel() else 0.0

    def _rescore(self, setup: VllmSetup) -> None:
        from ..patches.vllm.rescore import prefill_logits
        from .engines import VLLMRolloutEngine

        self.log(f"levers: vLLM re-scoring the record ({setup.label})")
        t0 = time.perf_counter()
        engine = VLLMRolloutEngine(self.model_path, self.precision, self.device, aligned=setup.canonical,
                                   aligned_skip=setup.skip)
        try:
            t1 = time.perf_counter()
            logits, routes = prefill_logits(engine.llm, self.record)
            t2 = time.perf_counter()
            if engine.aligned:
                engine.aligned.audit(engine.llm, ran=True)
            # once more, warm (its time is the setup's cost): the same bits, or the re-scoring is not deterministic
            t3 = time.perf_counter()
            again, _ = prefill_logits(engine.llm, self.record)
            t4 = time.perf_counter()
        finally:
            engine.close()
        if not all(torch.equal(a, b) for a, b in zip(logits, again)):
            raise EngineError(f"vLLM's re-scoring of the record ({setup.label}) gave other logits when run twice in "
                              f"one engine: it cannot measure a lever")
        self.seconds[setup] = {"open_s": t1 - t0, "first_s": t2 - t1, "score_s": t4 - t3}
        self.work["rollout_engines"] = self.work.get("rollout_engines", 0) + 1
        canonical_lsm = setup.canonical and "log_softmax" not in setup.skip
        lps, kept_logits = [], []
        for indices in self.batches:
            samples = [self.record.samples[i] for i in indices]
            batch = torch.cat([logits[i] for i in indices])
            tokens = torch.cat([s.token_ids[s.prompt_len:] for s in samples])
            T = samples[0].sampling.temperature
            with (log_softmax_mode() if canonical_lsm else contextlib.nullcontext()):
                if self.record.has_kept_sets:
                    lps.append(kept_logprob(batch, tokens, kept_sets_of(samples, batch.shape[-1]), temperature=T))
                else:
                    lps.append(full_logprob(batch, tokens, temperature=T))
            kept_logits.append(batch)
        self._cache[setup] = (torch.cat(lps).float(), torch.cat([r[:s.length - 1] for r, s in
                                                                  zip(routes, self.record.samples)]).to(torch.int64))
        self._logits[setup] = kept_logits

    def close(self) -> None:
        self._cache.clear()
        self._logits.clear()


class VllmLeverRunner(LeverTable):
    """:class:`~moealign.mismatch.levers.LeverRunner`'s interface on vLLM -> Megatron (see the module docstring).

    ``trainer``: the base Megatron engine (the run's, not closed here); ``trainer_factory(precision)`` opens another
    one at ``precision``; ``base_sides``: the mismatch test's passes of ``trainer`` (``score_record``), reused."""

    def __init__(self, *, record: RolloutRecord, trainer, trainer_factory: Callable[[str], object], model_path: str,
                 device: str, rollout_policy: str, train_policy: str, batch_size: int,
                 base_sides: dict | None = None, canonical_reason: str | None = None,
                 rescorer: VllmRescorer | None = None, log: Callable[[str], None] | None = None):
        self.rollout_policy, self.train_policy = get_policy(rollout_policy), get_policy(train_policy)
        self._init_table(record, batch_size, self.train_policy.name, trainer, trainer_factory, log)
        self.work = {"rollout_engines": 0, "train_passes": 0, "train_engines": 0}
        self.rescorable = True
        self.workers = 1
        self.regions: list[str] = []
        self.base_exact: bool | None = None
        self.base_diff = 0.0
        self._base_sides = dict(base_sides or {})
        self.seconds: dict = {"train": {}}
        self.canonical_reason = canonical_reason
        self.rollout = rescorer or VllmRescorer(record=record, model_path=model_path, device=device,
                                                precision=self.rollout_policy.name, batches=self.batches,
                                                work=self.work, log=self.log)
        if self.rollout.batches != self.batches:
            raise ConfigError("the vLLM re-scorings were made for other micro-batches than the trainer's")
        self.work["rollout_engines"] = self.rollout.work.get("rollout_engines", 0)
        self.rollout.work = self.work
        self.groups = self._players()

    # ------------------------------------------------------------------------------------------ players
    def _players(self) -> list[list[str]]:
        rec = self.record
        groups = []
        if rec.has_kept_sets and any(s.sampling.top_p < 1 or s.sampling.top_k > 0 or s.sampling.min_p > 0
                                     for s in rec.samples):
            groups.append(["sampling_mask"])
        elif rec.has_kept_sets:
            self.notes.append("sampling_mask: not a lever here (the sampling does not truncate)")
        groups.append(["routing_replay"])
        if self.rollout_policy.name != self.train_policy.name:
            groups.append(["precision"])
        if self.canonical_reason is None:
            groups.append([CANONICAL])
        else:
            self.notes.append(f"canonical: not run ({self.canonical_reason})")
        self.notes.append("tree (the TP-invariant forward): not a lever of its own here: TP 1 on both sides (no "
                          "reduction is split across ranks); its linear layers are the canonical forward's linear op")
        self.notes.append("router / LM head in fp32 on both: not a lever on this pair: Megatron holds no fp32 router "
                          "or LM head inside a bf16 model (precision.policy.megatron_gaps); the fp32 trainer already "
                          "computes them in fp32 (the rollout at bf16-fp32-router-head is a --rollout-precision)")
        return groups

    def check_base(self) -> bool:
        """Re-score the record with vLLM's stock prefill: bitwise equal to the record, or the prefill-vs-decode
        difference is measured as its own term (:data:`PREFILL`)."""
        self.base_exact, self.base_diff = self.rollout.check_base()
        if self.base_exact:
            self.notes.append("prefill vs decode: vLLM's stock prefill of the recorded tokens (routes forced) "
                              "reproduces the record's log-probs and routes bitwise: the term is 0, measured")
        else:
            self.notes.append(f"prefill vs decode: vLLM's stock prefill of the recorded tokens (routes forced) differs "
                              f"from the record's decode (max |delta log p| {self.base_diff:.3g}): measured as its "
                              f"own term, the other levers played on the prefill re-scorings")
        return self.base_exact

    # ------------------------------------------------------------------------------------------ the sides
    def _key(self, levers: frozenset) -> frozenset:
        if PREFILL in levers and (self.base_exact or CANONICAL in levers):
            return levers - {PREFILL}
        return levers

    def _rollout(self, levers: frozenset) -> tuple[torch.Tensor, torch.Tensor]:
        if CANONICAL in levers:
            return self.rollout.scores(VllmSetup(True))
        if PREFILL in levers:
            return self.rollout.scores(VllmSetup())
        return self.recorded_lp, self.recorded_routes

    def _opening(self, precision: str) -> str:
        self.work["train_engines"] += 1
        return f"levers: opening a Megatron training engine at {precision}"

    def _train(self, precision: str, canonical: bool, replay: bool, *, keep_logits: bool = False) -> SideScores:
        key = (precision, canonical, replay)
        if key in self._train_cache and (not keep_logits or key in self._train_logits):
            return self._train_cache[key]
        if not canonical and precision == self.train_policy.name and replay in self._base_sides and not keep_logits:
            self._train_cache[key] = self._base_sides[replay]
            return self._base_sides[replay]
        trainer = self._trainer(precision)
        t0 = time.perf_counter()
        trainer.set_canonical_ops(list(OPS) if canonical else [])
        side, logits = SideScores(), []
        try:
            for indices in self.batches:
                fwd = trainer.forward(self.record, indices, replay=replay)
                with (log_softmax_mode() if canonical else contextlib.nullcontext()):
                    score_batch(self.record, indices, fwd, side)
                if keep_logits:
                    logits.append(fwd.logits.float().cpu())
                del fwd
        finally:
            trainer.set_canonical_ops([])
        self.seconds["train"][f"{precision}{' canonical' if canonical else ''}{' replay' if replay else ''}"] = \
            time.perf_counter() - t0
        self.work["train_passes"] += 1
        self._train_cache[key] = side
        if keep_logits:
            self._train_logits[key] = logits
        return side

    def _train_key(self, levers: frozenset) -> tuple[str, bool, bool]:
        precision = self.rollout_policy.name if "precision" in levers else self.train_policy.name
        return precision, CANONICAL in levers, "routing_replay" in levers

    # ------------------------------------------------------------------------------------------ runs
    def run(self, levers) -> LeverRun:
        levers = self._key(frozenset(levers))
        unknown = levers - set(self.players) - {PREFILL}
        if unknown:
            raise ConfigError(f"levers {sorted(unknown)} are not players of this run (players: {self.players})")
        if levers in self._runs:
            return self._runs[levers]
        rollout_lp, rollout_routes = self._rollout(levers)
        return self._measure(levers, rollout_lp, rollout_routes, self._train(*self._train_key(levers)), bitwise=True)

    def everything(self) -> frozenset:
        """Every lever on (the fully aligned setting this pair reaches)."""
        return self._key(frozenset(self.players) | {PREFILL})

    def attribution(self, metrics=ATTRIBUTED_METRICS) -> dict:
        """``{metric: {"gap", "residual", "levers": {lever: share}, "shares": {cause: share}, "residual_cause"}}``:
        the prefill-vs-decode term (``gap - value(prefill)``, no other lever on), then the Owen / Shapley values of
        the players on the prefill re-scorings; ``sum(levers) + residual == gap``."""
        if self.base_exact is None:
            self.check_base()
        out = {}
        final = self.run(self.everything())
        for name in metrics:
            gap = self.run(frozenset()).metrics[name]
            values = owen_values(self.groups, lambda s: self.run(s | {PREFILL}).metrics[name])
            levers = {PREFILL: gap - self.run(frozenset({PREFILL})).metrics[name], **values}
            residual = final.metrics[name]
            out[name] = {"gap": gap, "residual": residual, "levers": levers,
                         "shares": {CAUSES[k]: v for k, v in levers.items()},
                         "residual_cause": self.residual_cause()}
        return out

    def residual_cause(self) -> str:
        """The residual after every lever, in words: 0 (bitwise) or why the aligned setting was not reached."""
        final = self.run(self.everything())
        if final.metrics["bitwise_equal"]:
            return "none: bitwise equal with every lever on (the aligned setting reached)"
        if CANONICAL not in self.players:
            return f"the engines' own kernels (the canonical forward did not run: {self.canonical_reason})"
        return ("an engine path outside the canonical ops (every op canonical on both engines and the runs still "
                "differ): see the canonical ops' negative controls")

    def full_vocab_kl(self, levers) -> torch.Tensor | None:
        """``[N]`` KL(rollout || trainer) over the whole vocabulary with ``levers`` on (the rollout's logits from its
        re-scoring: the stock prefill for no lever, which the record's decode equals only where check_base found it
        bitwise: None otherwise)."""
        from ..correction.vocab_kl import full_vocab_kl

        levers = self._key(frozenset(levers))
        if CANONICAL not in levers and PREFILL not in levers and not self.base_exact:
            return None
        setup = VllmSetup(CANONICAL in levers)
        train_logits = self._train_logits.get(self._train_key(levers))
        if train_logits is None:
            self._train(*self._train_key(levers), keep_logits=True)
            train_logits = self._train_logits[self._train_key(levers)]
        out = []
        for b, indices in enumerate(self.batches):
            T = self.record.samples[indices[0]].sampling.temperature
            out.append(full_vocab_kl(self.rollout.logits(setup)[b], train_logits[b], temperature=T))
        return torch.cat(out)

    def canonical_ops(self) -> list[dict] | None:
        """Each canonical op switched back to stock on the trainer alone, the rest of the fully aligned setting kept
        (the rollout's canonical re-scoring): the gap it opens (:func:`~moealign.mismatch.aligned.canonical_levers`);
        None when the canonical forward is not a player."""
        from .aligned import canonical_levers

        if CANONICAL not in self.players:
            return None
        lp, _ = self.rollout.scores(VllmSetup(True))
        record, start = [], 0
        for s in self.record.samples:
            record.append(dataclasses.replace(s, logprobs=lp[start:start + s.response_len].to(s.logprobs.dtype)))
            start += s.response_len
        rescored = RolloutRecord(self.record.meta, record, validate=False)
        precision = self.rollout_policy.name if "precision" in self.players else self.train_policy.name
        trainer = self._trainer(precision)
        t0 = time.perf_counter()
        try:
            levers = canonical_levers(rescored, trainer, (), len(self.batches[0]), log=self.log)
        finally:
            trainer.set_canonical_ops([])
        self.seconds["canonical_ops"] = time.perf_counter() - t0
        self.work["train_passes"] += len(levers)
        return levers

    def cost(self) -> dict:
        """The measured cost of the aligned setting against the stock one on this run: vLLM's re-scoring (one prefill
        of the record) and the trainer's pass with replay, canonical vs stock, in seconds and as a ratio."""
        rollout = {s.label: v for s, v in self.rollout.seconds.items()}
        out = {"rollout": rollout, "train": dict(self.seconds["train"])}
        stock, canon = self.rollout.seconds.get(VllmSetup()), self.rollout.seconds.get(VllmSetup(True))
        if stock and canon and stock["score_s"] > 0:
            out["rollout_ratio"] = canon["score_s"] / stock["score_s"]
        prec = self.rollout_policy.name if "precision" in self.players else self.train_policy.name
        t_stock = self.seconds["train"].get(f"{prec} replay")
        t_canon = self.seconds["train"].get(f"{prec} canonical replay")
        if t_stock and t_canon:
            out["train_ratio"] = t_canon / t_stock
        return out

    def verdict(self) -> dict:
        """What the diagnosis concludes from the runs: ``deployed`` (the setting an RL run with moealign's free levers
        runs: the record's own decode, routing replay and the sampling mask on, its residual the preset is chosen
        for), ``aligned`` (every lever on: the switch that reaches it, whether it is bitwise, its measured cost; None
        without the canonical forward), ``canonical_ops`` (each op's negative control) and ``residual_cause``."""
        free = frozenset(p for p in ("sampling_mask", "routing_replay") if p in self.players)
        deployed = self.run(free)
        final = self.run(self.everything())
        out = {"deployed": {"label": lever_label(free), "levers": sorted(free), "metrics": deployed.metrics},
               "residual_cause": self.residual_cause(), "aligned": None, "canonical_ops": None}
        if CANONICAL in self.players:
            precision = self.rollout_policy.name
            out["aligned"] = {"switch": f"--aligned (the canonical forward on both engines, {precision} on both)",
                              "levers": sorted(self.everything()), "bitwise_equal": final.metrics["bitwise_equal"],
                              "metrics": final.metrics, "cost": self.cost()}
            out["canonical_ops"] = self.canonical_ops()
        return out



def _applies(cfg) -> bool:
    """``--diagnose`` on vLLM -> Megatron with the record sampled in this run by vLLM at TP 1, the single-rank
    Megatron trainer, no injected fault, not ``--aligned`` (which has its own levers)."""
    return (cfg.rollout_engine == "vllm" and cfg.train_engine == "megatron" and not cfg.load_record
            and not cfg.inject_fault and not cfg.aligned and (cfg.rollout_tp or 1) == 1
            and not getattr(cfg, "train_sharded", False))


def rescore_first(cfg, record: RolloutRecord, device: str, *,
                  log: Callable[[str], None] | None = None) -> VllmRescorer | None:
    """Re-score ``record`` by vLLM in every setup the lever runs need, before the training engine opens (a vLLM
    engine opened in this process after Megatron's one-process world would take that world's process group down
    when it closes); None where :func:`pair_runner` does not apply."""
    if not (cfg.diagnose and _applies(cfg)):
        return None
    batches = [list(range(i, min(i + cfg.batch_size, len(record)))) for i in range(0, len(record), cfg.batch_size)]
    rescorer = VllmRescorer(record=record, model_path=cfg.model_path(), device=device,
                            precision=cfg.rollout_precision, batches=batches, work={}, log=log or (lambda m: None))
    rescorer.scores(VllmSetup())
    if canonical_unavailable(cfg, device) is None:
        rescorer.scores(VllmSetup(True))
    return rescorer


def pair_runner(cfg, record: RolloutRecord, trainer, *, device: str, sides: dict | None,
                rescorer: VllmRescorer | None = None,
                log: Callable[[str], None] | None = None) -> VllmLeverRunner | None:
    """The lever runs of ``--diagnose`` on vLLM -> Megatron (:func:`_applies`), on ``rescorer``'s re-scorings
    (:func:`rescore_first`); None for any other run (the caller's :class:`~moealign.mismatch.levers.LeverRunner`)."""
    from ..precision.policy import megatron_gaps
    from .scoring import make_train_engine

    if rescorer is None or not _applies(cfg) or not hasattr(trainer, "set_canonical_ops"):
        return None
    model_path = cfg.model_path()

    def factory(precision: str):
        one = dataclasses.replace(cfg, train_precision=precision, train_dtype=None, save_record=None,
                                  load_record=None, report_dir=None, diagnose=False, inject_fault=None)
        return make_train_engine(one, model_path, device)

    runner = VllmLeverRunner(record=record, trainer=trainer, trainer_factory=factory, model_path=model_path,
                             device=device, rollout_policy=cfg.rollout_precision, train_policy=cfg.train_precision,
                             batch_size=cfg.batch_size, base_sides=sides,
                             canonical_reason=canonical_unavailable(cfg, device), rescorer=rescorer, log=log)
    gaps = megatron_gaps(cfg.rollout_precision)
    if gaps and "precision" in runner.players:
        runner.groups = [g for g in runner.groups if g != ["precision"]]
        runner.notes.append(f"precision: not a lever here: Megatron cannot run the rollout's precision "
                            f"{cfg.rollout_precision} ({'; '.join(gaps)})")
    return runner


def canonical_unavailable(cfg, device: str) -> str | None:
    """Why the canonical forward cannot be a lever of this run (None: it can): the checks ``--aligned`` makes, at the
    rollout's precision on both sides."""
    from ..options import check_aligned_run

    try:
        check_aligned_run(cfg.model_path(), rollout_precision=cfg.rollout_precision,
                          train_precision=cfg.rollout_precision, device=device, rollout_tp=cfg.rollout_tp or 1)
    except MoealignError as exc:
        return str(exc)
    return None

