"""The lever runs' rollout side: the record re-scored along the rollout's own path in a *rollout setup* (which
precision regions are aligned to the trainer, batch-invariant ops, the injected weight fault), every result cached.

:class:`RolloutRescorer` owns what that takes: the float32 transformers model (one per batch-invariant mode) with a
setup's mixed precision applied for the duration of a re-scoring, the cache of ``(kept-set log-probs, routes)`` per
setup, the shared forwards (the LM head's precision partner scored in the same decode; a batch-invariant setup
re-scored by one forward once a decode confirmed it bitwise), and the decode workers (forked processes, one
intra-op thread each, checked bitwise against the record before any setup uses them). It knows nothing of levers:
:class:`moealign.mismatch.levers.LeverRunner` maps a lever set to a setup and asks for its scores.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from ..precision.batch_invariant import batch_invariant_mode
from ..precision.policy import PrecisionPolicy, get_policy
from ..record import RolloutRecord, kept_sets_of
from ..routing_replay.sampling_mask import full_logprob, kept_logprob
from .faults import Fault, apply_fault
from .workers import fork_map, intra_op_threads

__all__ = ["REGIONS", "RolloutSetup", "RolloutRescorer", "region_dtypes", "mixed_policy"]

REGIONS = ("router", "attention", "experts", "lm_head", "other")


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


@dataclass(frozen=True)
class RolloutSetup:
    """One way of re-scoring the rollout side."""

    aligned: frozenset          # precision regions aligned to the trainer
    batch_invariant: bool
    faulty: bool                # the injected weight fault is applied


class RolloutRescorer:
    """The record re-scored along the transformers rollout's path per :class:`RolloutSetup`, cached.

    ``regions``: the precision regions in play (the LM head's partner is shared only when ``lm_head`` is one);
    ``workers`` / ``decode_threads``: decode processes and a decode's intra-op threads (None: the process's);
    ``share``: share forwards (:data:`moealign.mismatch.levers.SHARE_FORWARDS`); ``keep_logits``: the setups whose
    full logits are kept for :meth:`logits` when they fit ``keep_bytes``; ``notes`` / ``work``: the lever runs'
    notes and counters, appended to here."""

    def __init__(self, *, record: RolloutRecord, model_path: str, device: str, rollout_policy, train_policy,
                 batches: list[list[int]], attention: str | None, fault: Fault | None, pad_token_id: int | None,
                 max_new_tokens: int | None, regions: list[str], share: bool, workers: int,
                 decode_threads: int | None, keep_bytes: int, notes: list[str], work: dict):
        self.record = record
        self.model_path, self.device = model_path, device
        self.rollout_policy, self.train_policy = get_policy(rollout_policy), get_policy(train_policy)
        self.batches = batches
        self.attention, self.fault = attention, fault
        self.pad_token_id, self.max_new_tokens = pad_token_id, max_new_tokens
        self.regions = regions
        self.share = share
        self.workers, self.decode_threads = workers, decode_threads
        self.keep_bytes = keep_bytes
        self.notes, self.work = notes, work
        self.keep_logits: set = set()
        self.recorded_lp = torch.cat([s.logprobs.float() for s in record.samples])
        self.recorded_routes = torch.cat([s.routes.to(torch.int64) for s in record.samples])
        self.routed = torch.cat([s.routed_rows for s in record.samples])
        self.num_tokens = int(self.recorded_lp.numel())
        self._models: dict = {}
        self._head_weights: dict = {}               # bi -> the LM head's float32 (weight, bias) as loaded
        self._cache: dict = {}                      # setup -> (log-probs [N], routes [rows, L, k])
        self._logits: dict = {}                     # setup -> per micro-batch logits (kept when they fit)
        # a batch-invariant setup re-scored by one forward: None until a micro-batch's decode confirmed it bitwise
        # (True) or did not (False: such setups are decoded)
        self._bi_forward: bool | None = None
        # whether check_base found the workers' decodes bitwise the record's (None: not checked yet; until then
        # setups are decoded here, micro-batch after micro-batch)
        self._workers_ok: bool | None = None

    # ------------------------------------------------------------------------------------------ public
    def scores(self, setup: RolloutSetup) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kept-set log-probs [N], routes [rows, L, k])`` of the rollout side in ``setup``.

        One decode per setup, shared: the setup that differs only in the LM head's precision is scored in the same
        decode (:func:`~moealign.patches.hf.rollout.rescore_decode_all`'s head variants), and cached too. The
        log-probs are computed on the model's device (where the rollout computed the record's)."""
        if setup not in self._cache:
            self._rescore_one(setup)
        return self._cache[setup]

    def kept_logits(self, setup: RolloutSetup) -> list[torch.Tensor] | None:
        """The per micro-batch logits of ``setup`` kept by an earlier re-scoring, or None."""
        return self._logits.get(setup)

    def fits(self) -> bool:
        """Whether one setup's full logits (``[N, V]`` float32, kept on the host) fit ``keep_bytes``."""
        return self.share and self.num_tokens * self.record.meta.vocab_size * 4 <= self.keep_bytes

    def logits(self, setup: RolloutSetup, samples: list, *, confirmed: bool = True) -> torch.Tensor:
        """One micro-batch's full logits in ``setup`` (re-scored now; counted)."""
        rescore = self.rescorer(setup, confirmed=confirmed)
        with self.rollout_model(setup) as model:
            return torch.cat(rescore(model, samples, pad_token_id=self.pad_token_id,
                                     max_new_tokens=self.max_new_tokens, record_routes=False).logits)

    def check_base(self, base: RolloutSetup) -> tuple[bool, float]:
        """Re-score the record with nothing changed: ``(reproduced bitwise, max |delta log p|)``. The decode workers
        are checked first (each on at least one micro-batch); when they do not reproduce the record the decodes run
        one at a time on this process's threads, with a note."""
        failed_workers = 0
        if self.decode_threads is not None and not base.batch_invariant and self._workers_ok is None:
            self._workers_ok = self._check_workers(base)
            if not self._workers_ok:
                failed_workers, self.workers, self.decode_threads = self.workers, 1, None
        lp, routes = self.scores(base)
        ok = torch.equal(lp, self.recorded_lp) and torch.equal(routes[self.routed], self.recorded_routes[self.routed])
        if ok and failed_workers:
            self.notes.append(f"decoding on one intra-op thread in {failed_workers} process(es) did not reproduce the "
                              f"record bitwise (on this process's threads it did): rollout setups decoded one at a "
                              f"time on them")
        if not ok:
            self._cache.clear()
            self._logits.clear()
        return ok, (0.0 if ok else float((lp - self.recorded_lp).abs().max()))

    def prefetch(self, setups) -> None:
        """Decode, in the decode workers, every setup of ``setups`` that is decoded (not batch-invariant) and not
        cached yet; nothing before :meth:`check_base` has checked the workers."""
        from ..patches.hf.rollout import rescore_decode_all

        if not (self._workers_ok and self.workers > 1):
            return
        units, planned = [], set(self._cache)
        for setup in setups:
            if setup.batch_invariant or setup in planned:
                continue
            unit = self._unit(setup)
            units.append(unit)
            planned.update(s for s in unit[:2] if s is not None)
        nb = len(self.batches)
        results = self._decode_jobs(units, [(u, b) for u in range(len(units)) for b in range(nb)], pinned=False)
        for u, unit in enumerate(units):
            self._store(unit, results[u * nb:(u + 1) * nb], rescore_decode_all)

    def rescorer(self, setup: RolloutSetup, confirmed: bool = False):
        """How ``setup`` is re-scored: along the rollout's decode (:func:`rescore_decode_all`), or, under
        batch-invariant ops (where a decode step's bits are those of the full forward by the ops' construction), by
        one forward per micro-batch (:func:`rescore_forward`) once a decode has confirmed that on this run's first
        such micro-batch."""
        from ..patches.hf.rollout import rescore_decode_all, rescore_forward

        use_forward = setup.batch_invariant and self.share and self._bi_forward in ((True,) if confirmed else (True, None))
        return rescore_forward if use_forward else rescore_decode_all

    def count(self, rescore) -> None:
        """One rollout setup re-scored by ``rescore`` (every micro-batch), in ``work``."""
        from ..patches.hf.rollout import rescore_forward

        self.work["rollout_forwards" if rescore is rescore_forward else "rollout_decodes"] += 1

    @contextlib.contextmanager
    def rollout_model(self, setup: RolloutSetup):
        """The rollout side's model in ``setup``: the float32 copy with the mixed precision policy applied (and the
        injected weight fault), both undone on exit, under batch-invariant ops when the setup asks, otherwise on
        ``decode_threads`` intra-op threads."""
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

    def close(self) -> None:
        self._models.clear()
        self._cache.clear()
        self._logits.clear()

    # ------------------------------------------------------------------------------------------ one re-scoring
    def _fp32_model(self, bi: bool):
        from ..patches.hf.loading import load_model

        if bi not in self._models:
            model = load_model(self.model_path, "fp32", self.device, "bi" if bi else self.attention)[0]
            self._models[bi] = model
            head = model.get_output_embeddings()
            if type(head) is torch.nn.Linear:      # a plain linear head: its precision variants share the trunk
                self._head_weights[bi] = (head.weight.detach(), None if head.bias is None else head.bias.detach())
        return self._models[bi]

    def _head_partner(self, setup: RolloutSetup) -> RolloutSetup | None:
        """``setup`` with the LM head's precision lever flipped, when that is a precision region here: the two differ
        in the LM head alone, so one decode gives both (the head applied once per variant on the same input)."""
        if not self.share or "precision:lm_head" not in self.regions:
            return None
        return dataclasses.replace(setup, aligned=setup.aligned ^ {"lm_head"})

    def _head_variant(self, partner: RolloutSetup) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The LM head's ``(weight, bias)`` in ``partner``'s precision (as :func:`apply_precision` casts it from the
        float32 values), or None when the head is not a plain linear layer."""
        weights = self._head_weights.get(partner.batch_invariant)
        if weights is None:
            return None
        dtype = region_dtypes(mixed_policy(self.rollout_policy, self.train_policy, partner.aligned))["lm_head"]
        return tuple(None if t is None else t.to(dtype) for t in weights)

    def _unit(self, setup: RolloutSetup) -> tuple[RolloutSetup, RolloutSetup | None, tuple | None]:
        """``(setup, partner, variant)``: what one re-scoring of ``setup`` scores (its LM-head partner, when not
        scored yet and the head is a plain linear layer, with the head's weights in the partner's precision)."""
        self._fp32_model(setup.batch_invariant)                 # the head's weights are taken from it
        partner = self._head_partner(setup)
        variant = None
        if partner is not None and partner not in self._cache:
            variant = self._head_variant(partner)
        return (setup, partner, variant) if variant is not None else (setup, None, None)

    def _score_batch(self, out, samples: list, unit: tuple) -> dict:
        """One micro-batch's re-scoring ``out`` as ``{"lp": {setup: [n]}, "logits": {setup: [n, V]} (the setups in
        ``keep_logits``, when they fit), "routes": [rows, L, k]}``."""
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
        keep = self.keep_logits if self.fits() else set()
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
        self.count(rescore)
        routes = torch.cat([b["routes"] for b in batches])
        for s in unit[:2]:
            if s is not None:
                self._cache[s] = (torch.cat([b["lp"][s] for b in batches]), routes)
                if s in batches[0]["logits"]:
                    self._logits[s] = [b["logits"][s] for b in batches]

    def _rescore_one(self, setup: RolloutSetup) -> None:
        """Re-score ``setup`` in this thread (micro-batch after micro-batch) and cache it."""
        from ..patches.hf.rollout import rescore_decode_all, rescore_forward

        rescore = self.rescorer(setup)
        unit = self._unit(setup)
        batches = []
        with self.rollout_model(setup) as model:
            for indices in self.batches:
                samples = [self.record.samples[i] for i in indices]
                out = rescore(model, samples, **self._kwargs(unit))
                if rescore is rescore_forward and self._bi_forward is None:
                    out = self._confirm_forward(out, rescore_decode_all(model, samples, **self._kwargs(unit)))
                    rescore = self.rescorer(setup)
                batches.append(self._score_batch(out, samples, unit))
                del out
        self._store(unit, batches, rescore)

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

    # ------------------------------------------------------------------------------------------ decode workers
    def _decode_jobs(self, units: list[tuple], jobs: list[tuple[int, int]], *, pinned: bool) -> list[dict]:
        """Decode ``jobs`` (``(unit index, micro-batch index)``) in ``workers`` processes at once: this one and
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
                        model = stack.enter_context(self.rollout_model(units[u][0]))
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

    def _check_workers(self, base: RolloutSetup) -> bool:
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

