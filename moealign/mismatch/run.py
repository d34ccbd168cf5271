"""The zero-staleness mismatch test: same checkpoint, same inputs, rollout engine vs training engine.

The rollout engine samples responses and records log-probs, routes and kept sets. The training engine
recomputes the log-probs of the same tokens twice (without and with routing replay); from those two
forwards come four runs:

=============================  =================  ==============================================
run                            trainer routing    trainer log-prob
=============================  =================  ==============================================
baseline                       its own top-k      ``log_softmax(logits / T)`` over the vocabulary
routing_replay                 recorded experts   ``log_softmax(logits / T)`` over the vocabulary
sampling_mask                  its own top-k      restricted to the recorded kept set
routing_replay+sampling_mask   recorded experts   restricted to the recorded kept set
=============================  =================  ==============================================

Metrics per run: router flips (per layer, any layer), the off-policy metrics of
:mod:`moealign.correction` (k1/k3 KL, chi^2, ppl ratio, Pearson of probabilities, |delta log p|), the
support mismatch (recorded kept set vs the trainer's own truncation, or vs the kept set it uses), and
the fractions an IcePop band [0.5, 5] and a geometric RS band 0.999_1.001 would mask.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..correction import (
    compute_agreement_metrics,
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
)
from ..record import RolloutRecord, SamplingParams, concat_kept_sets
from ..routing_replay.flips import route_flip_metrics
from ..routing_replay.sampling_mask import full_logprob, kept_logprob, kept_mask, support_mismatch, truncation_mask
from .engines import ROLLOUT_ENGINES, TRAIN_ENGINES, parse_dtype

__all__ = ["MismatchConfig", "RUN_NAMES", "METRIC_NAMES", "run_mismatch", "parse_fail_above", "check_fail_above"]

RUN_NAMES = ("baseline", "routing_replay", "sampling_mask", "routing_replay+sampling_mask")
ALIGNED_RUN = RUN_NAMES[-1]
METRIC_NAMES = (
    "router_flip_rate", "token_flip_rate", "kl_k1", "kl_k3", "max_abs_logp_diff", "p99_abs_logp_diff",
    "mean_abs_logp_diff", "chi2_token", "chi2_seq", "pearson_prob", "ppl_ratio", "support_mismatch_rate",
    "icepop_masked_fraction", "geo_rs_masked_fraction",
)
ICEPOP_BAND = "0.5_5.0"
GEO_RS_BAND = "0.999_1.001"


@dataclass
class MismatchConfig:
    model: str | None = None            # a local transformers MoE checkpoint; None: the embedded model
    rollout_engine: str = "hf"
    rollout_dtype: str = "bf16"
    train_engine: str = "hf"
    train_dtype: str = "fp32"
    num_prompts: int = 32
    max_new_tokens: int = 48
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    batch_size: int = 16
    prompts_file: str | None = None
    device: str = "auto"
    save_record: str | None = None
    load_record: str | None = None

    def __post_init__(self):
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ValueError(f"unknown rollout engine {self.rollout_engine!r}; choose one of {sorted(ROLLOUT_ENGINES)}")
        if self.train_engine not in TRAIN_ENGINES:
            raise ValueError(f"unknown training engine {self.train_engine!r}; choose one of {sorted(TRAIN_ENGINES)}")
        parse_dtype(self.rollout_dtype)
        parse_dtype(self.train_dtype)
        for name in ("num_prompts", "max_new_tokens", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.sampling  # validates temperature / top-k / top-p / min-p

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


# --------------------------------------------------------------------------------------------------
# --fail-above
# --------------------------------------------------------------------------------------------------


def parse_fail_above(items: list[str] | None) -> dict[str, float]:
    """``["kl_k1=1e-3", ...]`` -> ``{"kl_k1": 0.001}``; unknown metrics and bad numbers are errors."""
    bounds: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip():
            raise ValueError(f"--fail-above expects METRIC=VALUE, got {item!r}")
        if name not in METRIC_NAMES:
            raise ValueError(f"--fail-above: unknown metric {name!r}; choose one of {', '.join(METRIC_NAMES)}")
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(f"--fail-above {name}: {value!r} is not a number") from None
        if not math.isfinite(bound):
            raise ValueError(f"--fail-above {name}: the bound must be finite, got {value!r}")
        bounds[name] = bound
    return bounds


def check_fail_above(report: dict, bounds: dict[str, float]) -> list[str]:
    """Violations (messages) of ``bounds`` by the fully aligned run of ``report``."""
    run = next(r for r in report["runs"] if r["name"] == ALIGNED_RUN)
    failures = []
    for name, bound in bounds.items():
        value = run["metrics"][name]
        if not (value <= bound):   # NaN fails too
            failures.append(f"{ALIGNED_RUN}: {name} = {value:.6g} > {bound:.6g}")
    return failures


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------


@dataclass
class _Side:
    """Per-token results of one training forward (no replay or replay), in record order."""

    full: list[torch.Tensor] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)
    own_support_mismatch: list[torch.Tensor] = field(default_factory=list)
    used_support_mismatch: list[torch.Tensor] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)


def _score(record: RolloutRecord, indices, fwd, side: _Side) -> None:
    samples = [record.samples[i] for i in indices]
    sampling = samples[0].sampling
    if any(s.sampling != sampling for s in samples):
        raise ValueError("the mismatch test needs one set of sampling parameters per micro-batch")
    logits = fwd.logits
    T = sampling.temperature
    side.full.append(full_logprob(logits, fwd.tokens, temperature=T).cpu())
    side.routes.append(fwd.routes.cpu())
    if not record.has_kept_sets:
        return
    offsets, ids = concat_kept_sets(samples)
    offsets, ids = offsets.to(logits.device), ids.to(logits.device)
    side.kept.append(kept_logprob(logits, fwd.tokens, offsets, ids, temperature=T).cpu())
    own = truncation_mask(logits, temperature=T, top_k=sampling.top_k or None,
                          top_p=sampling.top_p if sampling.top_p < 1 else None, min_p=sampling.min_p or None)
    side.own_support_mismatch.append(support_mismatch(offsets, ids, own).cpu())
    used = kept_mask(offsets, ids, logits.shape[-1])
    side.used_support_mismatch.append(support_mismatch(offsets, ids, used).cpu())


def _padded(values: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    B, R = len(lengths), max(lengths)
    out = torch.zeros(B, R, dtype=torch.float32)
    mask = torch.zeros(B, R, dtype=torch.float32)
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = values[start:start + n]
        mask[b, :n] = 1.0
        start += n
    return out, mask


def _logprob_metrics(train_lp: torch.Tensor, rollout_lp: torch.Tensor, lengths: list[int]) -> dict[str, float]:
    old, mask = _padded(train_lp, lengths)
    rollout, _ = _padded(rollout_lp, lengths)
    off = compute_offpolicy_metrics(old, rollout, mask).to_floats()
    agree = compute_agreement_metrics(old, rollout, mask).to_floats()
    _, _, icepop = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_is="token", rollout_is_threshold=ICEPOP_BAND)
    _, _, geo = compute_rollout_correction_and_rejection_mask(
        old, rollout, mask, rollout_rs="seq_mean_k1", rollout_rs_threshold=GEO_RS_BAND)
    icepop, geo = icepop.to_floats(), geo.to_floats()
    return {
        "kl_k1": off["kl"],
        "kl_k3": off["k3_kl"],
        "max_abs_logp_diff": agree["logprob_abs_diff_max"],
        "p99_abs_logp_diff": agree["logprob_abs_diff_p99"],
        "mean_abs_logp_diff": agree["logprob_abs_diff_mean"],
        "chi2_token": off["chi2_token"],
        "chi2_seq": off["chi2_seq"],
        "pearson_prob": agree["rollout_actor_probs_pearson_corr"],
        "ppl_ratio": off["ppl_ratio"],
        "icepop_masked_fraction": icepop["rollout_corr/rollout_is_oob_ratio"],
        "geo_rs_masked_fraction": geo["rollout_corr/rollout_rs_masked_fraction"],
    }


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None, lambda n: None
    try:
        from tqdm.auto import tqdm
    except Exception:  # noqa: BLE001 - tqdm is optional
        return None, lambda n: None
    bar = tqdm(total=total, desc=desc, unit="seq", leave=False)
    return bar, bar.update


def _train_sides(cfg: MismatchConfig, record: RolloutRecord, trainer, progress: bool) -> dict[bool, _Side]:
    """Score every sample with the training engine, without and with routing replay."""
    record.meta.check_matches(trainer.meta(), what="training model")
    sides = {False: _Side(), True: _Side()}
    batches = [list(range(i, min(i + cfg.batch_size, len(record)))) for i in range(0, len(record), cfg.batch_size)]
    bar, update = _progress(2 * len(record), "train", progress)
    for replay in (False, True):
        for indices in batches:
            fwd = trainer.forward(record, indices, replay=replay)
            _score(record, indices, fwd, sides[replay])
            update(len(indices))
    if bar is not None:
        bar.close()
    return sides


def run_mismatch(cfg: MismatchConfig, *, progress: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """Run the mismatch test; returns the JSON-ready report (see the CLI help for its schema)."""
    from ..embedded import default_prompts, embedded_model_path

    log = log or (lambda msg: None)
    t0 = time.perf_counter()
    device = cfg.resolved_device()
    model_path = str(cfg.model) if cfg.model else str(embedded_model_path())
    sampling = cfg.sampling

    if cfg.load_record:
        record = RolloutRecord.load(cfg.load_record)
        rollout_desc = {"engine": record.meta.engine, "dtype": record.meta.dtype}
    else:
        prompts = default_prompts(cfg.prompts_file)
        if cfg.num_prompts > len(prompts):
            raise ValueError(f"--num-prompts {cfg.num_prompts} exceeds the {len(prompts)} prompts available")
        prompts = prompts[:cfg.num_prompts]
        log(f"rollout: {cfg.rollout_engine} {cfg.rollout_dtype} on {device}, {len(prompts)} prompts x "
            f"{cfg.max_new_tokens} new tokens")
        rollout = ROLLOUT_ENGINES[cfg.rollout_engine](model_path, cfg.rollout_dtype, device)
        bar, update = _progress(len(prompts), "rollout", progress)
        record = rollout.generate(prompts, sampling=sampling, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                                  batch_size=cfg.batch_size, progress=update)
        if bar is not None:
            bar.close()
        rollout_desc = {"engine": rollout.name, "dtype": cfg.rollout_dtype}
        del rollout
    if cfg.save_record:
        record.save(cfg.save_record)
    if not record.has_routes:
        raise ValueError("the rollout record has no routes: routing replay cannot be measured")

    log(f"train: {cfg.train_engine} {cfg.train_dtype}, {record.num_response_tokens} response tokens")
    trainer = TRAIN_ENGINES[cfg.train_engine](model_path, cfg.train_dtype, device)
    try:
        sides = _train_sides(cfg, record, trainer, progress)
    finally:
        close = getattr(trainer, "close", None)
        if close is not None:
            close()


    rollout_lp = torch.cat([s.logprobs.float() for s in record.samples])
    recorded_routes = torch.cat([s.routes.to(torch.int64) for s in record.samples])
    lengths = [s.response_len for s in record.samples]
    runs = []
    for name in RUN_NAMES:
        replay = name.startswith("routing_replay")
        masked = name.endswith("sampling_mask")
        side = sides[replay]
        if masked and not record.has_kept_sets:
            continue
        train_lp = torch.cat(side.kept if masked else side.full)
        flips = route_flip_metrics(torch.cat(side.routes), recorded_routes)
        metrics = {"router_flip_rate": flips.router_flip_rate, "token_flip_rate": flips.token_flip_rate}
        metrics.update(_logprob_metrics(train_lp, rollout_lp, lengths))
        if record.has_kept_sets:
            mism = torch.cat(side.used_support_mismatch if masked else side.own_support_mismatch)
            metrics["support_mismatch_rate"] = float(mism.double().mean())
        else:
            metrics["support_mismatch_rate"] = float("nan")
        metrics["per_layer_flip_rate"] = list(flips.per_layer_flip_rate)
        metrics["mean_jaccard"] = flips.mean_jaccard
        runs.append({"name": name, "metrics": metrics})

    return {
        "model": "embedded:tiny_moe" if not cfg.model else model_path,
        "rollout": rollout_desc,
        "train": {"engine": trainer.name, "dtype": cfg.train_dtype},
        "num_tokens": int(record.num_response_tokens),
        "num_route_rows": int(recorded_routes.shape[0]),
        "moe_layers": list(record.meta.moe_layers),
        "sampling": asdict(sampling),
        "device": device,
        "elapsed_s": round(time.perf_counter() - t0, 3),
        "runs": runs,
    }


# --------------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------------

_COLUMNS = (
    ("run", None, "{}"),
    ("router flip", "router_flip_rate", "{:.4f}"),
    ("token flip", "token_flip_rate", "{:.4f}"),
    ("kl k1", "kl_k1", "{:+.2e}"),
    ("kl k3", "kl_k3", "{:.2e}"),
    ("mean|dlogp|", "mean_abs_logp_diff", "{:.2e}"),
    ("p99|dlogp|", "p99_abs_logp_diff", "{:.2e}"),
    ("max|dlogp|", "max_abs_logp_diff", "{:.2e}"),
    ("chi2 tok", "chi2_token", "{:.2e}"),
    ("pearson", "pearson_prob", "{:.6f}"),
    ("support mm", "support_mismatch_rate", "{:.4f}"),
    ("icepop", "icepop_masked_fraction", "{:.4f}"),
    ("geo RS", "geo_rs_masked_fraction", "{:.4f}"),
    ("gap removed", "_gap_removed", "{:>6.1%}"),
)


def format_table(report: dict) -> str:
    """One row per run; "gap removed" = 1 - mean|delta log p| / the baseline's."""
    base = next((r["metrics"]["mean_abs_logp_diff"] for r in report["runs"] if r["name"] == "baseline"), None)
    rows = []
    for run in report["runs"]:
        m = dict(run["metrics"])
        m["_gap_removed"] = (1 - m["mean_abs_logp_diff"] / base) if base else float("nan")
        rows.append([run["name"] if key is None else fmt.format(m[key]) for _, key, fmt in _COLUMNS])
    header = [title for title, _, _ in _COLUMNS]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    head = (f"model {report['model']}: rollout {report['rollout']['engine']} {report['rollout']['dtype']} vs train "
            f"{report['train']['engine']} {report['train']['dtype']}, {report['num_tokens']} response tokens, "
            f"MoE layers {report['moe_layers']}, {report['elapsed_s']:.1f} s")
    per_layer = "; ".join(f"{r['name']}: {[round(x, 4) for x in r['metrics']['per_layer_flip_rate']]}"
                          for r in report["runs"])
    return "\n".join([head, ""] + lines + ["", f"per-layer router flip rate: {per_layer}"])
