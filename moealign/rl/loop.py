"""``moealign rl-check``: a real RL loop (vLLM rolls out, Megatron-core trains, weights refit in place) with the
mismatch measured, and the refit verified, at every step.

One step (synchronous; with ``staleness = N`` the rollout engine holds the weights of N steps earlier):

1. **rollout**: vLLM samples ``group_size`` completions per prompt (sample ``i`` from seed ``seed + step * n + i``),
   recording log-probs, routes and kept sets (:func:`moealign.patches.vllm.rollout.generate_with_record`);
2. **reward**: :func:`moealign.rl.reward.balanced_brackets` of each completion's text; group-relative advantages;
3. **train**: (``--aligned``: first the trainer's recompute of the log-probs, no grad, kept for the three-log-prob
   certificate: rollout, recompute and the first training forward, bitwise equal per token, :func:`certificate`)
   Megatron re-computes the log-probs with the chosen levers (routing replay through Megatron's
   RouterReplay, the sampling mask: the log-prob restricted to the recorded kept set), the rollout correction
   (a :mod:`moealign.correction` preset, decoupled: pi_old = the trainer's own log-probs) weights / masks the
   tokens, PPO-clip loss (ratio 1 at the point: one update per batch), backward, grad-norm clip, Adam step
   (``--train-tp / --train-ep / --train-pp`` above 1: the sharded trainer, the same loss on its logits, its gradient
   with respect to them sent to the ranks, which run the backward and the step: :meth:`_Run._train_sharded`);
4. **measure**: the mismatch metrics ``moealign mismatch`` reports (same names) between the trainer's log-probs
   (before the update) and the rollout's, the router flips of the trainer against the record;
5. **refit**: the trainer's weights streamed into every vLLM worker in place (:func:`moealign.rl.refit.refit`);
6. **verify**: every worker's tensors against the trainer's (fingerprints read through vLLM's packing,
   :func:`moealign.rl.refit.verify_refit`) before the next rollout; and a probe within the step-0 bound: in the
   aligned loop (replay + sampling mask, no staleness) the next rollout itself is the probe (the mean |Δ log p|
   between the engines over all its response tokens, identical weights, vLLM's routes replayed, the same kept
   sets: no extra forward), the last refit and every other loop get the standalone probe (:class:`~moealign.rl.
   refit.Probe`: vLLM scores two sequences with its own routing, the trainer replays it).

``compare=True`` runs the stock loop (levers ``none``) and the aligned loop (the configured levers, ``all`` when
``none`` was asked) from the same seed, one after the other on the same vLLM engine (refit back to the checkpoint
before the second run, which is itself a refit the verifier checks).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..errors import ConfigError
from .config import LEVERS, STEP_METRICS, RLCheckConfig
from .refit import Probe, refit, trainer_tensors, verify_refit
from .reward import REWARD_NAME, group_advantages, rewards

__all__ = ["run_rl_check", "certificate"]



def _pad(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(list(values.split(lengths)), batch_first=True)


def _snapshot(trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer_tensors(trainer)}


def certificate(rollout: torch.Tensor, recompute: torch.Tensor, train: torch.Tensor) -> dict:
    """The three-log-prob certificate (NeMo-RL #4039) of one step: per token the rollout's log-prob (vLLM), the
    trainer's recompute before the update and the first training forward's inside it, all float32; ``bitwise_equal``
    when the three are equal bit for bit (``torch.equal``), ``mismatch_count`` the tokens where any two differ."""
    rollout, recompute, train = (t.to(torch.float32) for t in (rollout, recompute, train))
    differ = (rollout != recompute) | (recompute != train)
    count = int(differ.sum())
    return {"bitwise_equal": count == 0 and torch.equal(rollout, recompute) and torch.equal(recompute, train),
            "tokens_differing": count, "mismatch_count": count, "tokens": int(rollout.numel()),
            "rollout_vs_recompute": bool(torch.equal(rollout, recompute)),
            "recompute_vs_train": bool(torch.equal(recompute, train))}


class _Run:
    """One loop (stock or aligned) on an open vLLM engine and a fresh Megatron trainer."""

    def __init__(self, cfg: RLCheckConfig, name: str, levers: str, rollout, log: Callable[[str], None]):
        from ..correction import RolloutCorrectionConfig
        from ..mismatch.engines import megatron_train_engine

        self.cfg, self.name, self.levers, self.log = cfg, name, levers, log
        self.replay, self.mask = LEVERS[levers]
        self.rollout = rollout
        self.llm = rollout.llm
        self.correction = RolloutCorrectionConfig.preset(cfg.correction)
        # one process at TP = EP = PP = 1, else the sharded trainer (one process per rank; its optimizer lives on
        # its ranks: ShardedMegatronTrainer.train_step)
        self.trainer = megatron_train_engine(cfg.model_path(), cfg.train_precision, cfg.resolved_device(),
                                             tp=cfg.train_tp, ep=cfg.train_ep, pp=cfg.train_pp,
                                             dispatcher=cfg.train_dispatcher, aligned=bool(cfg.aligned))
        self.sharded = cfg.train_layout.world > 1
        self.params = self.optimizer = None
        if not self.sharded:
            self.params = [p for p in self.trainer.model.parameters()]
            for p in self.params:
                p.requires_grad_(True)
            self.optimizer = torch.optim.Adam(self.params, lr=cfg.lr)
        self.tokenizer = self.llm.get_tokenizer()

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None

    # ------------------------------------------------------------------ pieces of a step
    def _log_softmax(self):
        """The canonical log-softmax for the trainer's log-probs in the aligned mode (vLLM's sampler runs it too)."""
        import contextlib

        from ..precision.canonical import log_softmax_mode

        return log_softmax_mode() if self.cfg.aligned else contextlib.nullcontext()

    def _logprobs(self, record, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The per-token log-probs the loss uses, from the trainer's logits at the response positions: the kept-set
        log-prob under the sampling mask, else the full vocabulary's (the canonical log-softmax under --aligned)."""
        from ..record import kept_sets_of
        from ..routing_replay.sampling_mask import full_logprob, kept_logprob

        with self._log_softmax():
            if self.mask:
                kept = kept_sets_of(record.samples, logits.shape[-1]).to(logits.device)    # checked at build
                return kept_logprob(logits, tokens, kept, temperature=self.cfg.temperature)
            return full_logprob(logits, tokens, temperature=self.cfg.temperature)

    def _loss(self, record, logp: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The step's loss from the log-probs of the first training forward (``logp``, with its graph) -- the one
        objective both trainers optimise (the single-process trainer backpropagates it through its model; the sharded
        one takes its gradient with respect to the logits and sends it to its ranks): the rollout correction
        (decoupled, pi_old = ``logp`` detached), group-relative advantages of the reward, PPO-clip. Returns the loss
        and the step's figures (reward, engine gap, correction)."""
        from ..correction.losses import ppo_clip_loss

        cfg = self.cfg
        lengths = [s.response_len for s in record.samples]
        logp_pad = _pad(logp, lengths)
        old = logp_pad.detach()
        rollout_lp = _pad(torch.cat([s.logprobs.float() for s in record.samples]).to(old.device), lengths)
        mask = _pad(torch.ones(sum(lengths), device=old.device), lengths)
        weights, kept, corr = self.correction.compute(old, rollout_lp, mask)
        texts = [self.tokenizer.decode(s.response_ids.tolist()) for s in record.samples]
        reward = rewards(texts)
        adv = group_advantages(reward, cfg.group_size).to(old.device)
        loss, _ = ppo_clip_loss(logp_pad, old, adv[:, None].expand_as(old).contiguous(), kept,
                                rollout_is_weights=weights)
        corr_floats = {k: v for k, v in corr.to_floats().items() if "masked" in k or "oob" in k or "veto" in k}
        dropped = (kept == 0) if weights is None else ((kept == 0) | (weights == 0))   # RS mask or IcePop's zeros
        masked = float((dropped & (mask > 0)).sum()) / max(1.0, float(mask.sum()))
        # mean |delta log p| between the engine's and the trainer's log-probs of the rollout (the refit probe of the
        # aligned loop: same weights, vLLM's routes replayed, the same kept sets)
        engine_gap = float(((old - rollout_lp).abs() * mask).sum() / mask.sum().clamp(min=1))
        return loss, {"reward_mean": float(reward.mean()), "reward_std": float(reward.std(unbiased=False)),
                      "engine_gap": engine_gap, "correction": {"masked_fraction": masked, **corr_floats}}

    def _train(self, record) -> tuple[dict, object]:
        """Score, loss, backward, clip, Adam: in this process (the single-process trainer), or through the sharded
        trainer's two passes (:meth:`_train_sharded`)."""
        from ..mismatch.engines import TrainForward

        if self.sharded:
            return self._train_sharded(record)
        cfg = self.cfg
        idx = list(range(len(record)))
        recompute = None
        if cfg.aligned:        # the trainer's recompute before the update (no grad), kept: the certificate's 2nd term
            with torch.no_grad():
                fwd0 = self.trainer.forward(record, idx, replay=self.replay, capture=False)
                recompute = self._logprobs(record, fwd0.logits, fwd0.tokens)
        fwd = self.trainer.forward(record, idx, replay=self.replay, grad=True)
        logp = self._logprobs(record, fwd.logits, fwd.tokens)      # the first training forward, inside the update
        loss, out = self._loss(record, logp)
        if cfg.aligned:
            rollout_flat = torch.cat([s.logprobs.float() for s in record.samples]).to(logp.device)
            out["aligned"] = certificate(rollout_flat, recompute, logp.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
        self.optimizer.step()
        out.update(loss=float(loss.detach()), grad_norm=grad_norm)
        detached = TrainForward(logits=fwd.logits.detach(), tokens=fwd.tokens, routes=fwd.routes)
        return out, detached

    def _train_sharded(self, record) -> tuple[dict, object]:
        """The sharded trainer's step. Pass 1: its forward (Megatron's schedule, forward only; the certificate's
        recompute under --aligned) returns the logits; here the loss (:meth:`_loss`, the same objective) on a leaf
        copy of them, its backward giving G = dLoss/dlogits; pass 2: every rank's forward + backward with the
        surrogate sum(logits * G) (:meth:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer.train_step`:
        gradients reduced over the data-parallel ranks, the global norm, the clip, each rank's Adam step). Pass 2's
        logits must be pass 1's bit for bit (the gradient was taken at them; the certificate's training term)."""
        from ..errors import EngineError
        from ..mismatch.engines import TrainForward

        cfg = self.cfg
        idx = list(range(len(record)))
        fwd = self.trainer.forward(record, idx, replay=self.replay)
        leaf = fwd.logits.detach().clone().requires_grad_(True)
        logp = self._logprobs(record, leaf, fwd.tokens)
        loss, out = self._loss(record, logp)
        loss.backward()
        step = self.trainer.train_step(record, idx, leaf.grad.float(), replay=self.replay, lr=cfg.lr,
                                       max_grad_norm=cfg.max_grad_norm)
        if not torch.equal(step.logits, fwd.logits):
            differ = int((step.logits != fwd.logits).any(-1).sum())
            raise EngineError(f"the sharded trainer's training pass computed other logits than its forward at "
                              f"{differ} of {fwd.logits.shape[0]} response tokens: the gradient sent to its ranks "
                              f"was not taken at the logits they trained on")
        if cfg.aligned:
            with torch.no_grad():
                train = self._logprobs(record, step.logits, fwd.tokens)
            rollout_flat = torch.cat([s.logprobs.float() for s in record.samples]).to(train.device)
            out["aligned"] = certificate(rollout_flat, logp.detach(), train)
        out.update(loss=float(loss.detach()), grad_norm=float(step.grad_norm))
        return out, TrainForward(logits=fwd.logits, tokens=fwd.tokens, routes=fwd.routes)

    def _measure(self, record, fwd) -> dict:
        from ..mismatch.report import side_metrics
        from ..mismatch.scoring import SideScores, score_batch

        side = SideScores()
        with self._log_softmax():
            score_batch(record, list(range(len(record))), fwd, side)
        recorded_routes = torch.cat([s.routes.to(torch.int64) for s in record.samples])
        recorded = torch.cat([s.routed_rows for s in record.samples])
        side.finish(recorded_routes, recorded)
        metrics = side_metrics(record, side, masked=self.mask and record.has_kept_sets)
        return {k: metrics[k] for k in STEP_METRICS}

    # ------------------------------------------------------------------ the loop, in the order of the docstring
    def run(self, prompts: list[str]) -> dict:
        """The loop: the engine set to this trainer's weights (:meth:`_start`), then ``steps`` times
        :meth:`_step` (rollout, reward + train, measure, refit, verify)."""
        cfg = self.cfg
        self.log(f"{self.name}: levers {self.levers}, correction {cfg.correction}, {cfg.steps} steps, "
                 f"{len(prompts)} prompts x {cfg.group_size}, lr {cfg.lr:g}, staleness {cfg.staleness}")
        t0 = time.perf_counter()
        header = self._start(prompts)
        repeated = [p for p in prompts for _ in range(cfg.group_size)]
        steps: list[dict] = []
        for step in range(cfg.steps):
            steps.append(self._step(step, repeated, steps[-1] if steps else None, header))
            self._log_step(steps[-1])
        header["elapsed_s"] = round(time.perf_counter() - t0, 3)
        header["steps"] = steps
        return header

    def _start(self, prompts: list[str]) -> dict:
        """The engine refit to this trainer's weights and verified; the standalone probe calibrated (step 0's gap on
        identical weights); whether the next rollout certifies each refit (the aligned loop); the run's header."""
        cfg = self.cfg
        start = refit(self.llm, self.trainer)            # the engine starts from this trainer's weights
        start_check = verify_refit(self.llm, self.trainer)
        self.probe = None
        if cfg.verify:
            seqs = [torch.tensor(self.tokenizer(p)["input_ids"][:32]) for p in prompts[:cfg.probe_sequences]]
            seqs = [s for s in seqs if s.numel() > 25]
            if seqs:
                self.probe = Probe(seqs)
                self.probe.calibrate(self.llm, self.trainer)
        # the aligned loop (replay + sampling mask, no staleness) certifies each refit with the next rollout itself:
        # its mean |delta log p| between the engines on identical weights, replayed routes and the same kept sets,
        # over every response token, within the probe's factor x its step-0 value; the last refit gets the standalone
        # probe
        self.rollout_probe = bool(cfg.verify and self.replay and self.mask and not cfg.staleness
                                  and self.probe is not None)
        self.rollout_bound = None
        self.history: dict[int, dict] = {}               # staleness: weight version -> the trainer's tensors
        probe = self.probe
        return {"name": self.name, "levers": self.levers, "replay": self.replay, "sampling_mask": self.mask,
                "initial_refit": {"seconds": round(start.seconds, 6), "verify": start_check.to_dict()},
                "probe": None if probe is None else {"sequences": len(probe.sequences), "scored_tokens":
                                                     probe.score_last, "step0_gap": probe.step0_gap,
                                                     "bound": probe.bound}}

    def _step(self, step: int, prompts: list[str], previous: dict | None, header: dict) -> dict:
        """One step, its six phases in order, each timed."""
        from ..patches.vllm.rollout import generate_with_record

        cfg, times = self.cfg, {}

        def timed(name, fn, *args):
            t = time.perf_counter()
            value = fn(*args)
            times[name] = time.perf_counter() - t
            return value

        record = timed("rollout", lambda: generate_with_record(
            self.llm, prompts, sampling=cfg.sampling, max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed + step * len(prompts)))
        out, fwd = timed("train", self._train, record)
        self._certify_previous_refit(step, out.pop("engine_gap"), record, previous, header)
        out["metrics"] = timed("measure", self._measure, record, fwd)
        result, expected = timed("refit", self._refit, step)
        check = timed("verify", self._verify, step, result, expected)
        times["total"] = sum(times.values())
        out.update({"step": step, "samples": len(record), "response_tokens": record.num_response_tokens,
                    "refit": None if result is None else {"seconds": round(result.seconds, 6),
                                                          "tensors": result.tensors, "bytes": result.bytes,
                                                          "workers": result.workers},
                    "verify": None if check is None else {
                        **check.to_dict(), "probe": "standalone" if check.probe_gap is not None else None},
                    "time": {k: round(v, 6) for k, v in times.items()}})
        return out

    def _certify_previous_refit(self, step: int, engine_gap: float, record, previous: dict | None,
                                header: dict) -> None:
        """The aligned loop: step 0's engine gap sets the bound; each later rollout, decoded with the previous
        refit's weights, certifies that refit (its verification's probe is this rollout)."""
        if not self.rollout_probe:
            return
        if step == 0:
            self.rollout_bound = max(self.probe.factor * engine_gap, self.probe.floor)
            header["rollout_probe"] = {"step0_gap": engine_gap, "bound": self.rollout_bound,
                                       "tokens": record.num_response_tokens}
        elif previous is not None and previous["verify"] is not None:
            prev = previous["verify"]
            prev.update({"probe": "next rollout", "probe_gap": engine_gap, "probe_bound": self.rollout_bound,
                         "probe_max": None})
            prev["ok"] = bool(prev["weights"]["ok"] and not prev.get("config_mismatches")
                              and engine_gap <= self.rollout_bound)
            # the rollout decoded with the refit's weights: its forward and decode path were probed
            prev["not_checked"] = [x for x in prev.get("not_checked", [])
                                   if not x.startswith(("the forward", "decode path"))]

    def _refit(self, step: int):
        """``(refit result or None, the tensors the engine should now hold or None: the trainer's)``; with staleness
        the engine serves the weights of N steps earlier (and keeps theta_0 until N steps have passed)."""
        cfg = self.cfg
        if not cfg.staleness:
            return refit(self.llm, self.trainer), None
        self.history[step + 1] = _snapshot(self.trainer)
        version = step + 1 - cfg.staleness
        for old in [v for v in self.history if v < version]:
            del self.history[old]
        if version < 1:
            return None, None
        expected = self.history[version]
        return refit(self.llm, expected), expected

    def _verify(self, step: int, result, expected):
        """The refit verified (tensors; the standalone probe unless the next rollout will certify it)."""
        if not self.cfg.verify or result is None:
            return None
        standalone = self.probe if not self.rollout_probe or step == self.cfg.steps - 1 else None
        return verify_refit(self.llm, self.trainer, expected=expected, probe=standalone)

    def _log_step(self, out: dict) -> None:
        m = out["metrics"]
        bits = "" if "aligned" not in out else (
            ", bitwise equal" if out["aligned"]["bitwise_equal"] else
            f", NOT bitwise equal ({out['aligned']['tokens_differing']} tokens)")
        refit_ms = "-" if out["refit"] is None else f"{out['refit']['seconds'] * 1e3:.0f} ms"
        verify = "-" if out["verify"] is None else ("ok" if out["verify"]["ok"] else "FAILED")
        self.log(f"{self.name} step {out['step']}{bits}: reward {out['reward_mean']:.3f}, kl_k3 {m['kl_k3']:.3g}, "
                 f"max|dlogp| {m['max_abs_logp_diff']:.3g}, router flips {m['router_flip_rate']:.4f}, refit "
                 f"{refit_ms}, verify {verify}")


def run_rl_check(cfg: RLCheckConfig, *, log: Callable[[str], None] | None = None) -> dict:
    """Run ``moealign rl-check`` (see the module docstring); returns the JSON-ready report."""
    from ..embedded import default_prompts
    from ..mismatch.engines import VLLMRolloutEngine, describe_engine
    from ..mismatch.run import describe_train
    from ..options import train_parallel_note
    from ..patches.vllm.refit import check_refit_version

    log = log or (lambda msg: None)
    if not isinstance(cfg, RLCheckConfig):
        raise ConfigError(f"cfg must be an RLCheckConfig, got {type(cfg).__name__}")
    check_refit_version()                               # an engine whose reload path moealign does not know
    t0 = time.perf_counter()
    prompts = default_prompts()[:cfg.num_prompts]
    if len(prompts) < cfg.num_prompts:
        raise ConfigError(f"--num-prompts {cfg.num_prompts}: the prompt set holds {len(prompts)}")
    runs_wanted = [("stock", "none"), ("aligned", cfg.levers if cfg.levers != "none" else "all")] if cfg.compare \
        else [("aligned" if cfg.levers != "none" else "stock", cfg.levers)]
    log(f"rollout: vllm {cfg.rollout_precision} (TP={cfg.rollout_tp}); train: megatron {cfg.train_precision}"
        + ("" if cfg.train_layout.world == 1 else f" ({cfg.train_layout}, {cfg.train_dispatcher} dispatcher)"))
    slow = train_parallel_note(cfg.train_layout, cfg.resolved_device())
    if slow:
        log(slow)
    rollout = VLLMRolloutEngine(cfg.model_path(), cfg.rollout_precision, cfg.resolved_device(), tp=cfg.rollout_tp,
                                **({"aligned": True} if cfg.aligned else {}))
    runs = []
    try:
        rollout_desc = describe_engine(rollout)
        for name, levers in runs_wanted:
            run = _Run(cfg, name, levers, rollout, log)
            try:
                runs.append(run.run(prompts))
                train_desc = describe_train(cfg, run.trainer)      # + parallel (the layout that trained)
            finally:
                run.close()
    finally:
        rollout.close()
    return {"command": "rl-check", "model": cfg.model_path() if cfg.model else "embedded:tiny_moe",
            "reward": REWARD_NAME, "correction": cfg.correction,
            "config": {k: getattr(cfg, k) for k in ("steps", "group_size", "num_prompts", "max_new_tokens", "lr",
                                                     "levers", "staleness", "rollout_precision", "train_precision",
                                                     "rollout_tp", "seed", "temperature", "top_p", "compare",
                                                     "aligned")},
            "rollout": rollout_desc, "train": train_desc, "runs": runs,
            "elapsed_s": round(time.perf_counter() - t0, 3)}
