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
otherwise. Rollout-side levers need a rollout engine moealign can re-score (transformers); with another
engine (vLLM) or a record loaded from a file the players are the trainer-side levers only, and the report
says so.

A lever is a player only where it changes something (regions whose dtypes already agree, a sampling without
truncation, an already batch-invariant pair, identical weights are left out). :class:`LeverRunner` evaluates
any lever set on demand and caches every forward; :mod:`moealign.mismatch.attribution` turns the gaps into
shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import ConfigError
from ..precision.batch_invariant import batch_invariant_mode
from ..precision.policy import PrecisionPolicy, get_policy
from ..record import RolloutRecord, kept_sets_of
from ..routing_replay.flips import flipped_slots
from ..routing_replay.sampling_mask import full_logprob, kept_logprob
from .attribution import owen_values
from .faults import Fault, apply_fault
from .report import logprob_metrics
from .scoring import SideScores, score_batch
from .workers import can_fork, fork_map, intra_op_threads

__all__ = ["CAUSES", "REGIONS", "ATTRIBUTED_METRICS", "LeverRun", "LeverRunner", "region_dtypes", "mixed_policy",
           "lever_label"]

REGIONS = ("router", "attention", "experts", "lm_head", "other")
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
}
#: The gap metrics attributed (the issue's three), primary first.
ATTRIBUTED_METRICS = ("mean_abs_logp_diff", "kl_k3", "max_abs_logp_diff")


def lever_label(levers) -> str:
    """``"baseline"`` or the levers joined by ``+`` in :data:`CAUSES` order."""
    order = list(CAUSES)
    names = sorted(levers, key=lambda x: order.index(x) if x in order else len(order))
    return "+".join(names) if names else "baseline"


def region_dtypes(policy: PrecisionPolicy) -> dict[str, torch.dtype]:
    """The dtype each region of :data:`REGIONS` computes in under ``policy``."""
    policy = get_policy(policy)
    return {"router": policy.module_dtype("router"), "attention": getattr(policy, "attention_dtype", None) or policy.dtype,
            "experts": getattr(policy, "experts_dtype", None) or policy.dtype, "lm_head": policy.module_dtype("lm_head"),
            "other": policy.dtype}


def mixed_policy(rollout: PrecisionPolicy, train: PrecisionPolicy, aligned) -> PrecisionPolicy:
    """The rollout policy with the regions in ``aligned`` (``"router"``, ..., ``"fp8"``) taken from ``train``."""
    a, b = region_dtypes(rollout), region_dtypes(train)
    d = {r: (b[r] if r in aligned else a[r]) for r in REGIONS}
    fp8 = train.fp8 if "fp8" in aligned else rollout.fp8
    fields = {"router_dtype": d["router"], "lm_head_dtype": d["lm_head"]}
    if hasattr(rollout, "attention_dtype"):
        fields.update(attention_dtype=d["attention"], experts_dtype=d["experts"])
    name = f"{rollout.name}[{','.join(sorted(aligned))} as {train.name}]" if aligned else rollout.name
    return PrecisionPolicy(name, d["other"], fp8=fp8 if d["other"] != torch.float16 else None, **fields)


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


@dataclass(frozen=True)
class _RolloutSetup:
    aligned: frozenset          # precision regions aligned to the trainer
    batch_invariant: bool
    faulty: bool                # the injected weight fault is applied


class LeverRunner:
    """Evaluates lever sets on one record (every forward cached).

    ``trainer_factory(batch_invariant: bool)`` opens a training engine (the base one is passed as ``trainer``
    and not closed here); ``rescorable``: the record was sampled in this run by the transformers rollout engine
    from ``model_path`` with ``rollout_policy`` (batch size ``batch_size``), so rollout-side levers can run."""

    def __init__(self, *, record: RolloutRecord, trainer, trainer_factory: Callable[[bool], object],
                 model_path: str, device: str, rollout_policy: str, train_policy: str, batch_size: int,
                 batch_invariant: bool = False, attention: str | None = None, rescorable: bool = False,
                 fault: Fault | None = None, pad_token_id: int | None = None, max_new_tokens: int | None = None,
                 base_sides: dict | None = None, log: Callable[[str], None] | None = None):
        self.record = record
        self.model_path, self.device = model_path, device
        self.rollout_policy, self.train_policy = get_policy(rollout_policy), get_policy(train_policy)
        self.batch_size = batch_size
        self.base_bi = bool(batch_invariant)
        self.attention = attention
        self.fault = fault
        self.pad_token_id = pad_token_id
        self.max_new_tokens = max_new_tokens
        self.log = log or (lambda msg: None)
        self._trainers = {self.base_bi: trainer}
        self._own_trainers: list = []
        self._trainer_factory = trainer_factory
        self._models: dict = {}
        self._head_weights: dict = {}               # bi -> the LM head's float32 (weight, bias) as loaded
        self._rollout_cache: dict = {}
        self._train_cache: dict = {}
        self._logits: dict = {}                     # what full_vocab_kl needs, kept when it fits KEEP_LOGITS_BYTES
        # the base trainer passes the mismatch test already ran (score_record: same trainer, batches, record)
        self.share = SHARE_FORWARDS
        self._base_sides = dict(base_sides) if base_sides and self.share else {}
        self._runs: dict = {}
        self.notes: list[str] = []
        self.batches = [list(range(i, min(i + batch_size, len(record)))) for i in range(0, len(record), batch_size)]
        self.lengths = [s.response_len for s in record.samples]
        self.tokens = torch.cat([s.token_ids[s.prompt_len:] for s in record.samples])
        self.recorded_lp = torch.cat([s.logprobs.float() for s in record.samples])
        self.recorded_routes = torch.cat([s.routes.to(torch.int64) for s in record.samples])
        self.routed = torch.cat([s.routed_rows for s in record.samples])
        self.rescorable = bool(rescorable)
        #: what the evaluation ran: rollout setups re-scored by a decode / by one forward (batch-invariant), trainer
        #: passes (each over every micro-batch)
        self.work = {"rollout_decodes": 0, "rollout_forwards": 0, "forward_checks": 0, "train_passes": 0}
        # a batch-invariant setup re-scored by one forward: None until a micro-batch's decode confirmed it bitwise
        # (True) or did not (False: such setups are decoded)
        self._bi_forward: bool | None = None
        # decode workers (DECODE_WORKERS): their count, the intra-op threads of a decode (1 on a CPU, None: the
        # process's), whether check_base found the workers' decodes bitwise the record's (None: not checked yet;
        # until then setups are decoded here, micro-batch after micro-batch)
        self.workers = _decode_workers(device)
        self.decode_threads: int | None = 1 if torch.device(device).type == "cpu" else None
        self._workers_ok: bool | None = None
        self.regions: list[str] = []
        self.groups = self._players()

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

    @property
    def players(self) -> list[str]:
        return [p for g in self.groups for p in g]

    # ---------------------------------------------------------------------------------------------- rollout side
    def _setup(self, levers: frozenset) -> _RolloutSetup:
        if not self.rescorable:
            return _RolloutSetup(frozenset(), self.base_bi, False)
        regions = set(self.regions) if "precision" in levers else set()
        aligned = frozenset(p.split(":", 1)[1] for p in regions | {p for p in levers if p.startswith("precision:")})
        return _RolloutSetup(aligned, self.base_bi or "batch_invariant" in levers,
                             self.fault is not None and self.fault.kind == "weights" and "weights" not in levers)

    def _fp32_model(self, bi: bool):
        from ..patches.hf.loading import load_model

        if bi not in self._models:
            model = load_model(self.model_path, "fp32", self.device, "bi" if bi else self.attention)[0]
            self._models[bi] = model
            head = model.get_output_embeddings()
            if type(head) is torch.nn.Linear:      # a plain linear head: its precision variants share the trunk
                self._head_weights[bi] = (head.weight.detach(), None if head.bias is None else head.bias.detach())
        return self._models[bi]

    @contextlib.contextmanager
    def _rollout_model(self, setup: _RolloutSetup):
        """The rollout side's model in ``setup``: the float32 copy with the mixed precision policy applied (and the
        injected weight fault), both undone on exit, under batch-invariant ops when the setup asks, otherwise on
        :attr:`decode_threads` intra-op threads."""
        from ..patches.hf.precision import apply_precision

        model = self._fp32_model(setup.batch_invariant)
        with contextlib.ExitStack() as stack:
            stack.enter_context(apply_precision(model, mixed_policy(self.rollout_policy, self.train_policy,
                                                                    setup.aligned), keep_original=True))
            if setup.faulty:
                stack.enter_context(apply_fault(model, self.fault))
            stack.enter_context(batch_invariant_mode(setup.batch_invariant))
            stack.enter_context(intra_op_threads(None if setup.batch_invariant else self.decode_threads))
            yield model

    def _head_partner(self, setup: _RolloutSetup) -> _RolloutSetup | None:
        """``setup`` with the LM head's precision lever flipped, when that is a precision region here: the two differ
        in the LM head alone, so one decode gives both (the head applied once per variant on the same input)."""
        if not self.share or "precision:lm_head" not in self.regions:
            return None
        return dataclasses.replace(setup, aligned=setup.aligned ^ {"lm_head"})

    def _head_variant(self, partner: _RolloutSetup) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The LM head's ``(weight, bias)`` in ``partner``'s precision (as :func:`apply_precision` casts it from the
        float32 values), or None when the head is not a plain linear layer."""
        weights = self._head_weights.get(partner.batch_invariant)
        if weights is None:
            return None
        dtype = region_dtypes(mixed_policy(self.rollout_policy, self.train_policy, partner.aligned))["lm_head"]
        return tuple(None if t is None else t.to(dtype) for t in weights)

    def _rollout(self, setup: _RolloutSetup) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kept-set log-probs [N], routes [rows, L, k])`` of the rollout side in ``setup``.

        One decode per setup, shared: the setup that differs only in the LM head's precision is scored in the same
        decode (:func:`~moealign.patches.hf.rollout.rescore_decode_all`'s head variants), and cached too. The
        log-probs are computed on the model's device (where the rollout computed the record's)."""
        if not self.rescorable:
            return self.recorded_lp, self.recorded_routes
        if setup not in self._rollout_cache:
            self._rescore_one(setup)
        return self._rollout_cache[setup]

    def _unit(self, setup: _RolloutSetup) -> tuple[_RolloutSetup, _RolloutSetup | None, tuple | None]:
        """``(setup, partner, variant)``: what one re-scoring of ``setup`` scores (its LM-head partner, when not
        scored yet and the head is a plain linear layer, with the head's weights in the partner's precision)."""
        self._fp32_model(setup.batch_invariant)                 # the head's weights are taken from it
        partner = self._head_partner(setup)
        variant = None
        if partner is not None and partner not in self._rollout_cache:
            variant = self._head_variant(partner)
        return (setup, partner, variant) if variant is not None else (setup, None, None)

    def _score_batch(self, out, samples: list, unit: tuple) -> dict:
        """One micro-batch's re-scoring ``out`` as ``{"lp": {setup: [n]}, "logits": {setup: [n, V]} (the sets
        full_vocab_kl asks for, when they fit), "routes": [rows, L, k]}``."""
        setup, partner, _ = unit
        dev = out.logits[0].device
        tokens = torch.cat([s.token_ids[s.prompt_len:] for s in samples]).to(dev)
        kept = None
        if self.record.has_kept_sets:                   # checked when the record was made or loaded
            kept = kept_sets_of(samples, out.logits[0].shape[-1]).to(dev)
        T = samples[0].sampling.temperature
        per_setup = {setup: out.logits}
        if partner is not None:
            per_setup[partner] = out.head_variants["partner"]
        keep = self._kl_setups() if self._fits() else set()
        res = {"lp": {}, "logits": {}, "routes": torch.cat([r.to(torch.int64) for r in out.routes])}
        for s, logits in per_setup.items():
            logits = torch.cat(logits)
            if kept is not None:
                lp = kept_logprob(logits, tokens, kept, temperature=T)
            else:
                lp = full_logprob(logits, tokens, temperature=T)
            res["lp"][s] = lp.cpu()
            if s in keep:
                res["logits"][s] = logits.cpu()
        return res

    def _kwargs(self, unit: tuple) -> dict:
        return dict(pad_token_id=self.pad_token_id, max_new_tokens=self.max_new_tokens, logits_device=None,
                    head_variants={"partner": unit[2]} if unit[1] is not None else None)

    def _store(self, unit: tuple, batches: list[dict], rescore) -> None:
        """Cache one re-scoring's results (``batches``: :meth:`_score_batch` per micro-batch, in order)."""
        self._count(rescore)
        routes = torch.cat([b["routes"] for b in batches])
        for s in unit[:2]:
            if s is not None:
                self._rollout_cache[s] = (torch.cat([b["lp"][s] for b in batches]), routes)
                if s in batches[0]["logits"]:
                    self._logits[("rollout", s)] = [b["logits"][s] for b in batches]

    def _rescore_one(self, setup: _RolloutSetup) -> None:
        """Re-score ``setup`` in this thread (micro-batch after micro-batch) and cache it."""
        from ..patches.hf.rollout import rescore_decode_all, rescore_forward

        rescore = self._rescorer(setup)
        unit = self._unit(setup)
        batches = []
        with self._rollout_model(setup) as model:
            for indices in self.batches:
                samples = [self.record.samples[i] for i in indices]
                out = rescore(model, samples, **self._kwargs(unit))
                if rescore is rescore_forward and self._bi_forward is None:
                    out = self._confirm_forward(out, rescore_decode_all(model, samples, **self._kwargs(unit)))
                    rescore = self._rescorer(setup)
                batches.append(self._score_batch(out, samples, unit))
                del out
        self._store(unit, batches, rescore)

    def _decode_jobs(self, units: list[tuple], jobs: list[tuple[int, int]], *, pinned: bool) -> list[dict]:
        """Decode ``jobs`` (``(unit index, micro-batch index)``) in :attr:`workers` processes at once: this one and
        ``workers - 1`` forked from it (:func:`~moealign.mismatch.workers.fork_map`), each on one intra-op thread;
        :meth:`_score_batch` per job, in order. ``pinned``: worker ``w`` runs ``jobs[w::workers]`` (so that
        every worker runs one of them); otherwise contiguous shares (a worker keeps a setup applied across its
        jobs in that setup). A worker that fails or does not answer has its jobs decoded here, with a note."""
        from ..patches.hf.rollout import rescore_decode_all

        def run(share: list[int]) -> list[dict]:
            out = []
            with contextlib.ExitStack() as stack:
                current = None
                for u, b in (jobs[i] for i in share):
                    if current != u:
                        stack.close()
                        model = stack.enter_context(self._rollout_model(units[u][0]))
                        current = u
                    samples = [self.record.samples[k] for k in self.batches[b]]
                    res = rescore_decode_all(model, samples, **self._kwargs(units[u]))
                    out.append(self._score_batch(res, samples, units[u]))
                    del res
            return out

        n, m = self.workers, len(jobs)
        if pinned:
            shares = [list(range(w, m, n)) for w in range(n)]
        else:
            shares = [list(range(round(w * m / n), round((w + 1) * m / n))) for w in range(n)]
        results, failures = fork_map(run, shares)
        for failure in failures:
            self.notes.append(f"a decode worker {failure}: its micro-batches were decoded in the main process")
        out: list = [None] * m
        for share, res in zip(shares, results):
            for i, r in zip(share, res):
                out[i] = r
        return out

    def _rescorer(self, setup: _RolloutSetup, confirmed: bool = False):
        """How ``setup`` is re-scored: along the rollout's decode (:func:`rescore_decode_all`), or, under batch-invariant
        ops (where a decode step's bits are those of the full forward by the ops' construction), by one forward per
        micro-batch (:func:`rescore_forward`) once a decode has confirmed that on this run's first such micro-batch."""
        from ..patches.hf.rollout import rescore_decode_all, rescore_forward

        use_forward = setup.batch_invariant and self.share and self._bi_forward in ((True,) if confirmed else (True, None))
        return rescore_forward if use_forward else rescore_decode_all

    def _count(self, rescore) -> None:
        """One rollout setup re-scored by ``rescore`` (every micro-batch), in :attr:`work`."""
        from ..patches.hf.rollout import rescore_forward

        self.work["rollout_forwards" if rescore is rescore_forward else "rollout_decodes"] += 1

    def _confirm_forward(self, forward, decode):
        """Compare one micro-batch's forward re-scoring with its decode, bitwise (logits, routes, LM-head variants);
        the decode's result either way. A difference turns the forwards off for this run, with a note: the lever
        then measures the decode path it is about."""
        self.work["forward_checks"] += 1
        same = (all(torch.equal(a, b) for a, b in zip(forward.logits, decode.logits))
                and all(torch.equal(a, b) for a, b in zip(forward.routes, decode.routes))
                and forward.head_variants.keys() == decode.head_variants.keys()
                and all(torch.equal(a, b) for k in decode.head_variants
                        for a, b in zip(forward.head_variants[k], decode.head_variants[k])))
        self._bi_forward = same
        if not same:
            diff = max(float((a - b).abs().max()) for a, b in zip(forward.logits, decode.logits))
            self.notes.append(f"batch_invariant: one forward did not reproduce the decode of a micro-batch under "
                              f"batch-invariant ops (max |delta logit| {diff:.3g}): batch-invariant setups decoded")
        return decode

    def _kl_setups(self) -> set:
        """The rollout setups :meth:`full_vocab_kl` is asked for by the report (no lever, every lever)."""
        return {self._setup(frozenset()), self._setup(frozenset(self.players))}

    def _kl_train_keys(self) -> set:
        return {self._train_key(frozenset()), self._train_key(frozenset(self.players))}

    def _train_key(self, levers: frozenset):
        return (self.base_bi or "batch_invariant" in levers,
                self._setup(levers) if "routing_replay" in levers else None)

    def _fits(self) -> bool:
        """Whether one lever set's full logits (``[N, V]`` float32, kept on the host for :meth:`full_vocab_kl`)
        fit :data:`KEEP_LOGITS_BYTES`."""
        return self.share and self.tokens.numel() * self.record.meta.vocab_size * 4 <= KEEP_LOGITS_BYTES

    def check_base(self) -> bool:
        """Re-score the record with nothing changed; ``True`` when that reproduces its log-probs and routes
        bitwise. Otherwise the rollout-side levers are dropped (their runs would measure the re-scoring, not the
        lever) and a note says so."""
        if not self.rescorable:
            return False
        base = self._setup(frozenset())
        failed_workers = 0
        if self.decode_threads is not None and not base.batch_invariant and self._workers_ok is None:
            self._workers_ok = self._check_workers(base)
            if not self._workers_ok:
                failed_workers, self.workers, self.decode_threads = self.workers, 1, None
        lp, routes = self._rollout(base)
        ok = torch.equal(lp, self.recorded_lp) and torch.equal(routes[self.routed], self.recorded_routes[self.routed])
        if ok and failed_workers:
            self.notes.append(f"decoding on one intra-op thread in {failed_workers} process(es) did not reproduce the "
                              f"record bitwise (on this process's threads it did): rollout setups decoded one at a "
                              f"time on them")
        if not ok:
            diff = float((lp - self.recorded_lp).abs().max())
            self.notes.append(f"re-scoring the record along the rollout's path did not reproduce it (max |delta log p| "
                              f"{diff:.3g}): rollout-side levers not run")
            self.rescorable = False
            self._rollout_cache.clear()
            self._logits.clear()
            self.groups = self._players()
        return ok

    def _check_workers(self, base: _RolloutSetup) -> bool:
        """Re-score the record with nothing changed in the decode workers (one intra-op thread each), every worker on
        at least one micro-batch (a micro-batch decoded twice where there are fewer); ``True`` (and the result
        cached) when every worker's decode reproduces the record's log-probs and routes bitwise."""
        from ..patches.hf.rollout import rescore_decode_all

        unit = self._unit(base)
        nb = len(self.batches)
        res = self._decode_jobs([unit], [(0, b % nb) for b in range(max(nb, self.workers))], pinned=True)
        batches = res[:nb]
        lp = torch.cat([b["lp"][base] for b in batches])
        routes = torch.cat([b["routes"] for b in batches])
        same = all(a["lp"].keys() == b["lp"].keys() and all(torch.equal(a["lp"][k], b["lp"][k]) for k in a["lp"])
                   and torch.equal(a["routes"], b["routes"]) for a, b in zip(res[nb:], batches))
        if not (same and torch.equal(lp, self.recorded_lp)
                and torch.equal(routes[self.routed], self.recorded_routes[self.routed])):
            self.work["rollout_decodes"] += 1
            return False
        self._store(unit, batches, rescore_decode_all)
        return True

    def prefetch(self) -> None:
        """Decode, in the decode workers, every rollout setup :meth:`attribution` will ask for that is decoded (not
        batch-invariant) and not cached yet; nothing before :meth:`check_base` has checked the workers."""
        from ..patches.hf.rollout import rescore_decode_all

        if not (self.rescorable and self._workers_ok and self.workers > 1):
            return
        asked: list[frozenset] = []

        def ask(levers: frozenset) -> float:
            asked.append(levers)
            return 0.0

        owen_values(self.groups, ask)               # the lever sets the attribution evaluates, in its order
        if "precision" in self.players:
            owen_values([[r] for r in self.regions], ask)
        units, planned = [], set(self._rollout_cache)
        for levers in asked:
            setup = self._setup(levers)
            if setup.batch_invariant or setup in planned:
                continue
            unit = self._unit(setup)
            units.append(unit)
            planned.update(s for s in unit[:2] if s is not None)
        nb = len(self.batches)
        results = self._decode_jobs(units, [(u, b) for u in range(len(units)) for b in range(nb)], pinned=False)
        for u, unit in enumerate(units):
            self._store(unit, results[u * nb:(u + 1) * nb], rescore_decode_all)

    # ---------------------------------------------------------------------------------------------- train side
    def _trainer(self, bi: bool):
        if bi not in self._trainers:
            self.log("levers: opening a batch-invariant training engine")
            engine = self._trainer_factory(True)
            self._trainers[bi] = engine
            self._own_trainers.append(engine)
        return self._trainers[bi]

    def _train(self, bi: bool, replay_setup: _RolloutSetup | None) -> SideScores:
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
        keep = key in self._kl_train_keys() and self._fits()
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
            self._logits[("train", key)] = logits
        self.work["train_passes"] += 1
        self._train_cache[key] = side
        return side

    def _base_side(self, bi: bool, replay_setup: _RolloutSetup | None, record: RolloutRecord) -> SideScores | None:
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
        side = self._train(*self._train_key(levers))
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
        w = torch.exp((train_lp.double() - rollout_lp.double()).clamp(max=50.0))
        metrics["ess"] = float(w.mean() ** 2 / (w * w).mean()) if w.numel() else float("nan")
        run = LeverRun(levers, rollout_lp, train_lp, support, per_layer, metrics["router_flip_rate"], flips, metrics)
        self._runs[levers] = run
        return run

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
        kept_rollout = self._logits.get(("rollout", setup))
        kept_train = self._logits.get(("train", (bi, replay_setup)))
        trainer = self._trainer(bi) if kept_train is None else None
        record = _with_routes(self.record, self._rollout(setup)[1]) if replay and kept_train is None else self.record
        rescore = self._rescorer(setup, confirmed=True)
        if kept_rollout is None:
            self._count(rescore)
        if kept_train is None:
            self.work["train_passes"] += 1
        out = []
        for b, indices in enumerate(self.batches):
            samples = [record.samples[i] for i in indices]
            if kept_rollout is not None:
                logits = kept_rollout[b]
            else:
                with self._rollout_model(setup) as model:
                    logits = torch.cat(rescore(model, samples, pad_token_id=self.pad_token_id,
                                               max_new_tokens=self.max_new_tokens, record_routes=False).logits)
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

    @property
    def runs(self) -> list[LeverRun]:
        """Every lever set scored so far, in the order it was first asked for."""
        return list(self._runs.values())

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

    def close(self) -> None:
        for engine in self._own_trainers:
            engine.close()
        self._own_trainers.clear()
        self._models.clear()
        self._rollout_cache.clear()
        self._train_cache.clear()
        self._logits.clear()


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
