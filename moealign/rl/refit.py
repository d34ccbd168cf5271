"""The refit as users' own RL loops call it: the trainer's weights into a running vLLM engine, then the proof.

::

    from moealign.rl import refit, verify_refit

    refit(llm, trainer)                       # a moealign train engine, a Megatron GPTModel (+ hf_config) or a
    check = verify_refit(llm, trainer)        # transformers model; check.ok / check.check() / check.to_dict()

:func:`refit` streams the trainer's tensors in transformers names (Megatron's ``GPTModel`` converted group by group
with :func:`~moealign.patches.megatron.checkpoint.iter_hf_tensors_from_megatron`, the inverse of the conversion the
trainer was built with) into every vLLM worker in place (:func:`moealign.patches.vllm.refit.refit_weights`: the
manifest checked against the engine's checkpoint first, vLLM's CPU-build trap fixed, prefix / KV cache reset).

:func:`verify_refit` proves the engine now runs the trainer's weights: per (tensor, worker) digests of what every
worker holds, read back through vLLM's packing (:func:`~moealign.patches.vllm.refit.verify_weights`), and, with a
:class:`Probe`, a probe forward: vLLM scores the probe sequences with its own routing (captured), the trainer scores
them replaying those routes, and the mean |Δ log p| over the probe tokens must stay within the probe's bound
(``factor`` = 8 times the step-0 value on identical weights: :meth:`Probe.calibrate`). The mean, not the largest: with a
bf16 rollout against an fp32 trainer the largest per-token gap of a 16-token probe swings several-fold from step to
step with the weights' rounding (measured 0.02-0.19 nats on the embedded model), the mean far less; a wrong model
is off by nats on average (vLLM's stock reload on the CPU build: 4-7), an exact refit by the precision gap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch

from ..errors import ConfigError, InputTypeError, RefitError
from ..record import RolloutRecord, Sample, SamplingParams

__all__ = ["Probe", "RefitCheck", "trainer_tensors", "refit", "verify_refit", "check_same_architecture"]

#: Config fields that must agree between the trainer and the engine before any tensor moves.
ARCHITECTURE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "moe_intermediate_size", "intermediate_size",
                       "num_experts", "num_local_experts", "num_experts_per_tok", "tie_word_embeddings")


def _is_megatron(model) -> bool:
    return type(model).__module__.startswith("megatron.")


def _unwrap(trainer) -> tuple[torch.nn.Module, Any]:
    """``(model, hf_config)`` of a moealign train engine or a bare model."""
    model = getattr(trainer, "model", None)
    if isinstance(model, torch.nn.Module) and not isinstance(trainer, torch.nn.Module):
        config = getattr(trainer, "_hf_config", None) or getattr(model, "config", None)
        return model, config
    if isinstance(trainer, torch.nn.Module):
        return trainer, None if _is_megatron(trainer) else getattr(trainer, "config", None)
    raise InputTypeError(f"trainer must be a moealign train engine, a Megatron GPTModel or a transformers model, got "
                         f"{type(trainer).__name__}")


def trainer_tensors(trainer, hf_config=None, *, meta: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """``(transformers name, full tensor)`` of the trainer's weights, streamed (``meta=True``: shapes only)."""
    model, own = _unwrap(trainer)
    config = hf_config if hf_config is not None else own
    if _is_megatron(model):
        if config is None:
            raise ConfigError("a Megatron GPTModel carries no transformers config: pass hf_config (the config of the "
                              "checkpoint it was converted from)")
        from ..patches.megatron.checkpoint import iter_hf_tensors_from_megatron

        return iter_hf_tensors_from_megatron(model, config, meta=meta)
    return ((n, (t.detach().to("meta") if meta else t.detach())) for n, t in model.state_dict().items())


def _config_dict(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    return config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))


def check_same_architecture(llm, hf_config) -> None:
    """Refuse (:class:`~moealign.errors.RefitError`) a trainer whose architecture fields differ from the engine's."""
    engine = _config_dict(llm.llm_engine.model_config.hf_config)
    mine = _config_dict(hf_config)
    differ = [f"{k}: trainer {mine.get(k)!r}, engine {engine.get(k)!r}" for k in ARCHITECTURE_FIELDS
              if k in mine and k in engine and mine.get(k) != engine.get(k)]
    if differ:
        raise RefitError("refit refused: the engine holds another architecture or vocabulary (" + "; ".join(differ) +
                         ")")


def refit(llm, trainer, hf_config=None, *, chunk_bytes: int | None = None):
    """Push the trainer's weights into every worker of ``llm`` in place; returns
    :class:`~moealign.patches.vllm.refit.RefitResult`. ``trainer`` may also be a snapshot (a mapping of transformers
    names to tensors, e.g. the weights of N steps earlier). Refused before any tensor moves when the architecture or
    the checkpoint layout differs (:class:`~moealign.errors.RefitError`)."""
    from ..patches.vllm import refit as vr

    layout = vr.checkpoint_layout(vr._engine_model_path(llm))
    if isinstance(trainer, Mapping):
        manifest = {n: tuple(t.shape) for n, t in vr.checkpoint_named(trainer.items(), layout)}
        named = vr.checkpoint_named(trainer.items(), layout)
    else:
        _, own = _unwrap(trainer)
        check_same_architecture(llm, hf_config if hf_config is not None else own)
        manifest = {n: tuple(t.shape) for n, t in vr.checkpoint_named(trainer_tensors(trainer, hf_config, meta=True),
                                                                      layout)}
        named = vr.checkpoint_named(trainer_tensors(trainer, hf_config), layout)
    kwargs = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    return vr.refit_weights(llm, named, manifest, **kwargs)


# --------------------------------------------------------------------------------------------------
# the probe forward
# --------------------------------------------------------------------------------------------------


@dataclass
class Probe:
    """Probe sequences (token ids, the last ``score_last`` tokens of each scored) and the bound on the mean
    |Δ log p| between vLLM and the trainer over them (``None`` until :meth:`calibrate` measures it)."""

    sequences: list[torch.Tensor]
    score_last: int = 24
    bound: float | None = None
    factor: float = 8.0
    floor: float = 1e-6
    step0_gap: float | None = None

    def __post_init__(self):
        if not self.sequences:
            raise ConfigError("a refit probe needs at least one sequence")
        for i, s in enumerate(self.sequences):
            if not isinstance(s, torch.Tensor) or s.dim() != 1 or s.numel() <= self.score_last:
                raise ConfigError(f"probe sequence {i}: a 1-D token tensor longer than score_last={self.score_last}")

    def record(self, meta, logprobs=None, routes=None) -> RolloutRecord:
        samples = []
        for i, seq in enumerate(self.sequences):
            lp = logprobs[i] if logprobs is not None else torch.zeros(self.score_last)
            samples.append(Sample(token_ids=seq.to(torch.int64), prompt_len=int(seq.numel()) - self.score_last,
                                  logprobs=lp.float(), routes=None if routes is None else routes[i],
                                  sampling=SamplingParams()))
        return RolloutRecord(meta, samples)

    def gaps(self, llm, train_engine) -> tuple[float, float]:
        """``(mean, max)`` |Δ log p| on the probe: vLLM with its own routing vs the trainer replaying its routes."""
        from ..patches.vllm.replay import score_with_routes
        from ..patches.vllm.rollout import _cached_meta
        from ..routing_replay.routes import compact_routes
        from ..routing_replay.sampling_mask import full_logprob

        meta = _cached_meta(llm)
        vllm_lp, ran = score_with_routes(llm, self.record(meta), force=False, return_routes=True)
        record = self.record(meta, vllm_lp, [compact_routes(r, meta.num_experts) for r in ran])
        # the replay verifier inside forward() checks the experts that ran are vLLM's: no capture needed
        fwd = train_engine.forward(record, list(range(len(record))), replay=True, capture=False)
        train_lp = full_logprob(fwd.logits, fwd.tokens, temperature=1.0).cpu()
        diff = (train_lp - torch.cat(vllm_lp)).abs()
        return float(diff.mean()), float(diff.max())

    def calibrate(self, llm, train_engine) -> float:
        """Measure the step-0 gap (identical weights) and set ``bound = max(factor * gap, floor)``."""
        self.step0_gap = self.gaps(llm, train_engine)[0]
        self.bound = max(self.factor * self.step0_gap, self.floor)
        return self.bound


@dataclass
class RefitCheck:
    """:func:`verify_refit`'s verdict: the weight digests (:class:`~moealign.patches.vllm.refit.WeightCheck`) and
    the probe gap against its bound (``None``: no probe run)."""

    weights: Any
    probe_gap: float | None = None
    probe_bound: float | None = None
    probe_max: float | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        probe_ok = self.probe_gap is None or (self.probe_bound is not None and self.probe_gap <= self.probe_bound)
        return bool(self.weights.ok) and probe_ok

    def describe(self) -> str:
        parts = [self.weights.describe()]
        if self.probe_gap is not None:
            parts.append(f"probe mean |Δ log p| {self.probe_gap:.3g} (bound {self.probe_bound:.3g}; largest "
                         f"{self.probe_max:.3g})")
        return "; ".join(parts + self.notes)

    def check(self) -> "RefitCheck":
        if not self.ok:
            raise RefitError("refit verification failed: " + self.describe())
        return self

    def to_dict(self) -> dict:
        return {"ok": self.ok, "weights": self.weights.to_dict(), "probe_gap": self.probe_gap,
                "probe_bound": self.probe_bound, "probe_max": self.probe_max, "seconds": round(self.seconds, 6), "notes": list(self.notes)}


def verify_refit(llm, trainer, hf_config=None, *, expected=None, probe: Probe | None = None) -> RefitCheck:
    """Prove ``llm`` runs the trainer's weights (see the module docstring). ``expected``: the tensors the engine
    should hold when they are not the trainer's current ones (a stale refit: the snapshot that was pushed); the
    probe then does not run (the engine and the trainer hold different weights by design). ``probe`` needs a
    moealign train engine (its forward replays routes). Never raises for a failed check: read ``.ok`` or call
    ``.check()``."""
    from ..patches.vllm.refit import verify_weights

    t0 = time.perf_counter()
    notes = []
    weights = verify_weights(llm, expected if expected is not None else trainer_tensors(trainer, hf_config))
    gap = bound = largest = None
    if probe is not None:
        if expected is not None:
            notes.append("probe skipped: the engine holds an earlier snapshot (staleness) by design")
        elif not hasattr(trainer, "forward") or isinstance(trainer, torch.nn.Module):
            raise ConfigError("the refit probe needs a moealign train engine (its forward replays vLLM's routes)")
        else:
            if probe.bound is None:
                raise ConfigError("the refit probe has no bound: calibrate it at step 0 (Probe.calibrate)")
            (gap, largest), bound = probe.gaps(llm, trainer), probe.bound
    return RefitCheck(weights=weights, probe_gap=gap, probe_bound=bound, probe_max=largest,
                      seconds=time.perf_counter() - t0,
                      notes=notes)
