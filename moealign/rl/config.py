"""``RLCheckConfig``: every option of ``moealign rl-check``, checked once, before any engine starts."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..options import (
    check_aligned_run,
    check_count,
    check_device,
    check_rollout_parallel,
    check_model,
    check_sampling,
    check_seed,
    check_train_parallel,
)
from ..record import MIN_TEMPERATURE, SamplingParams

__all__ = ["LEVERS", "RLCheckConfig", "DEFAULT_CORRECTION", "STEP_METRICS", "parse_fail_above", "check_fail_above"]

#: ``--levers``: (routing replay, sampling mask).
LEVERS = {"none": (False, False), "replay": (True, False), "mask": (False, True), "all": (True, True)}
#: The default rollout correction: token-level IcePop (mask tokens whose pi_train / pi_rollout leaves [0.5, 5]).
DEFAULT_CORRECTION = "decoupled_token_icepop"


#: The mismatch metrics rl-check reports per step (the names ``moealign mismatch`` uses).
STEP_METRICS = ("router_flip_rate", "kl_k1", "kl_k3", "max_abs_logp_diff", "mean_abs_logp_diff",
                "support_mismatch_rate", "icepop_masked_fraction", "geo_rs_masked_fraction")


def _float(name: str, value, low: float, *, inclusive: bool = True, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            (value < low if inclusive else value <= low) or (high is not None and value > high):
        raise ConfigError(f"--{name.replace('_', '-')} must be a finite number {'>=' if inclusive else '>'} {low}"
                          f"{'' if high is None else f' and <= {high}'}, got {value!r}")
    return float(value)


def check_fail_above(bounds) -> dict[str, float]:
    """``{metric: bound}`` of ``--fail-above``: each metric one rl-check reports per step, each bound a finite
    number (refused before any engine starts, not after the run)."""
    if not isinstance(bounds, dict):
        raise ConfigError(f"fail_above must be a dict of metric -> bound, got {type(bounds).__name__}")
    names = STEP_METRICS
    out = {}
    for name, bound in bounds.items():
        if name not in names:
            raise ConfigError(f"--fail-above: rl-check does not report {name!r} per step; choose one of "
                              f"{', '.join(names)}")
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
            raise ConfigError(f"--fail-above {name}: the bound must be a finite number, got {bound!r}")
        out[name] = float(bound)
    return out


def parse_fail_above(items: list[str] | None) -> dict[str, float]:
    """``--fail-above METRIC=VALUE`` items as rl-check takes them: the metric one it reports per step (named
    first, before the value is read), the rest as ``moealign mismatch`` parses it."""
    from ..mismatch.report import parse_fail_above as parse_items

    for item in items or []:
        name = item.partition("=")[0].strip()
        if name and "=" in item:
            check_fail_above({name: 0.0})
    return check_fail_above(parse_items(items))


@dataclass
class RLCheckConfig:
    """``moealign rl-check``'s options (see the CLI help). Checked in ``__post_init__``: a config that exists is
    one the loop can run."""

    model: str | None = None            # a local transformers MoE checkpoint; None: the embedded model
    steps: int = 8
    group_size: int = 4
    num_prompts: int = 32
    max_new_tokens: int = 32
    lr: float = 2e-3
    levers: str = "all"
    correction: str = DEFAULT_CORRECTION
    staleness: int = 0
    rollout_precision: str | None = None    # default bf16 (with aligned: the one given, else bf16, both sides)
    train_precision: str | None = None      # default fp32
    rollout_tp: int = 1
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.9
    max_grad_norm: float = 1.0
    verify: bool = True                 # digests + probe after every refit
    probe_sequences: int = 2
    json: str | None = None
    report_dir: str | None = None
    fail_above: dict = field(default_factory=dict)
    compare: bool = False
    device: str = "auto"
    aligned: bool = False               # the canonical forward on both engines: bitwise equal at every step
    rollout_ep: int = 1                 # vLLM expert / data parallelism: above 1 refused where it cannot run
    rollout_dp: int = 1
    train_tp: int = 1                   # the trainer's Megatron layout: above 1 the sharded trainer (one process
    train_ep: int = 1                   # per rank) trains
    train_pp: int = 1
    train_dispatcher: str = "alltoall"

    def __post_init__(self):
        for name in ("num_prompts", "max_new_tokens", "rollout_tp"):            # the shared options' bounds
            check_count(name, getattr(self, name))
        for name, low in (("steps", 1), ("group_size", 2), ("probe_sequences", 1)):
            check_count(name, getattr(self, name), low, 4096)
        check_seed(self.seed)
        check_count("staleness", self.staleness, 0)
        if self.staleness >= self.steps:
            raise ConfigError(f"--staleness {self.staleness} must be below --steps {self.steps} (rollouts from the "
                              f"weights of N steps earlier need more than N steps)")
        self.lr = _float("lr", self.lr, 0.0, high=1.0)
        self.max_grad_norm = _float("max_grad_norm", self.max_grad_norm, 0.0, inclusive=False)
        self.temperature = _float("temperature", self.temperature, MIN_TEMPERATURE)
        self.top_p = _float("top_p", self.top_p, 0.0, inclusive=False, high=1.0)
        check_sampling(self.temperature, self.top_p)
        if self.levers not in LEVERS:
            raise ConfigError(f"unknown --levers {self.levers!r}; choose one of {', '.join(LEVERS)}")
        from ..correction.config import PRESETS

        if self.correction not in PRESETS:
            raise ConfigError(f"unknown --correction preset {self.correction!r}; choose one of "
                              f"{', '.join(sorted(PRESETS))}")
        if PRESETS[self.correction]().bypass_mode:
            raise ConfigError(f"--correction {self.correction}: a bypass-mode preset; rl-check runs the decoupled "
                              f"loss (pi_old = the trainer's own log-probs): choose a decoupled_* preset or disabled")
        self._precisions()
        from ..mismatch.engines import resolve_precision
        from ..precision.policy import megatron_gaps, vllm_gaps

        for side, gaps in (("rollout", vllm_gaps), ("train", megatron_gaps)):
            policy = resolve_precision(getattr(self, f"{side}_precision"))
            missing = gaps(policy)
            if missing:
                raise ConfigError(f"--{side}-precision {policy.name}: the {'vLLM' if side == 'rollout' else 'Megatron'}"
                                  f" engine cannot express it ({'; '.join(missing)})")
            setattr(self, f"{side}_precision", policy.name)
        check_device(self.device)
        config = check_model(self.model, self.model_path(), self.max_new_tokens)
        check_rollout_parallel(tp=self.rollout_tp, ep=self.rollout_ep, dp=self.rollout_dp, device=self.resolved_device())
        self._check_train_parallel()
        self.fail_above = check_fail_above(self.fail_above)
        if self.aligned:
            self._check_aligned()
        if self.probe_sequences > self.num_prompts * self.group_size:
            raise ConfigError(f"--probe-sequences {self.probe_sequences} exceeds the samples of a step "
                              f"({self.num_prompts} x {self.group_size})")
        from .._files import check_outputs

        created = [self.report_dir] if self.report_dir else []
        outputs = [("--json", self.json)]
        if self.report_dir:
            outputs += [("--report", os.path.join(self.report_dir, "report.html")),
                        ("--report", os.path.join(self.report_dir, "report.json"))]
        check_outputs(outputs, {"--model": self.model_path()}, created_dirs=created)   # embedded: its files too
        from ..checkpoint_check import check_checkpoint_tensors

        check_checkpoint_tensors(self.model_path(), config)     # last: the options' own refusals come first

    def _check_train_parallel(self) -> None:
        """``--train-tp`` / ``--train-ep`` / ``--train-pp`` / ``--train-dispatcher``: a layout Megatron can build (the
        checks ``mismatch`` makes, before any process starts); above 1 the sharded trainer trains
        (:meth:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer.train_step`). ``train_layout`` is the
        report's ``train.parallel``."""
        self.train_layout = check_train_parallel(self.model_path(), tp=self.train_tp, ep=self.train_ep,
                                                 pp=self.train_pp, dispatcher=self.train_dispatcher,
                                                 device=self.resolved_device())

    def _precisions(self) -> None:
        if not isinstance(self.aligned, bool):
            raise ConfigError(f"aligned must be a bool, got {self.aligned!r}")
        if not self.aligned:
            self.rollout_precision = self.rollout_precision or "bf16"
            self.train_precision = self.train_precision or "fp32"
            return
        given = {p for p in (self.rollout_precision, self.train_precision) if p is not None}
        if len(given) > 1:
            raise ConfigError(f"--aligned runs one precision on both engines; got rollout {self.rollout_precision} / "
                              f"train {self.train_precision}")
        self.rollout_precision = self.train_precision = given.pop() if given else "bf16"

    def _check_aligned(self) -> None:
        """``--aligned``: the canonical forward's coverage, checked before any work (each refusal names it)."""
        for flag, bad in (("--levers " + self.levers, self.levers != "all"),
                          (f"--staleness {self.staleness}", self.staleness != 0), ("--compare", self.compare)):
            if bad:
                raise ConfigError(f"--aligned certifies the fully aligned, on-policy loop (replay + sampling mask, "
                                  f"identical weights): drop {flag}")
        check_aligned_run(self.model_path(), rollout_precision=self.rollout_precision,
                          train_precision=self.train_precision, device=self.resolved_device(),
                          rollout_tp=self.rollout_tp, train_tp=self.train_tp,
                          train_sharded=self.train_layout.world > 1)

    @property
    def replay(self) -> bool:
        return LEVERS[self.levers][0]

    @property
    def mask(self) -> bool:
        return LEVERS[self.levers][1]

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p)

    def resolved_device(self) -> str:
        from ..embedded import resolve_device

        return resolve_device(self.device)

    def model_path(self) -> str:
        from ..embedded import checkpoint_path

        return checkpoint_path(self.model)
