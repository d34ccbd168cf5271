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

Precision: each side runs a named :mod:`moealign.precision.policy` (``rollout_precision`` /
``train_precision``). ``batch_invariant`` runs both sides (and the log-prob computation) under
:func:`moealign.precision.batch_invariant.batch_invariant_mode`, with moealign's batch-invariant attention
(``"bi"``, :mod:`moealign.precision.bi_attention`) in the transformers engines. The trainer's kept-set log-prob is ``log_softmax`` over the whole vocabulary with the entries
outside the recorded kept set at ``-inf`` (the same formula, on the same row length, that the rollout
engine applies to its processed scores), so identical logits give identical log-probs on both sides.
:func:`run_sweep` runs the standard precision configurations on the same prompts.
"""

from __future__ import annotations

import dataclasses
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
from ..errors import ConfigError
from ..precision.batch_invariant import batch_invariant_mode
from ..record import RolloutRecord, SamplingParams, concat_kept_sets
from ..routing_replay.flips import route_flip_metrics
from ..routing_replay.sampling_mask import (
    full_logprob,
    kept_mask,
    support_mismatch,
    truncation_mask,
)
from .engines import (
    ATTENTION,
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    parse_dtype,
    resolve_precision,
)

__all__ = ["MismatchConfig", "RUN_NAMES", "METRIC_NAMES", "SWEEP", "run_mismatch", "run_sweep", "format_sweep",
           "parse_fail_above", "check_fail_above"]

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
    rollout_precision: str = "bf16"     # a moealign.precision.policy name
    train_engine: str = "hf"
    train_precision: str = "fp32"
    rollout_dtype: str | None = None    # alias: fp32 / bf16 / fp16 (sets rollout_precision)
    train_dtype: str | None = None      # alias: fp32 / bf16 / fp16 (sets train_precision)
    batch_invariant: bool = False       # both sides under batch_invariant_mode ("bi" attention in hf engines)
    attention: str | None = None        # hf engines: "sdpa" / "eager" / "bi"; None: bi if batch_invariant else default
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
            raise ConfigError(f"unknown rollout engine {self.rollout_engine!r}; choose one of {sorted(ROLLOUT_ENGINES)}")
        if self.train_engine not in TRAIN_ENGINES:
            raise ConfigError(f"unknown training engine {self.train_engine!r}; choose one of {sorted(TRAIN_ENGINES)}")
        for side in ("rollout", "train"):
            alias = getattr(self, f"{side}_dtype")
            if alias is not None:
                parse_dtype(alias)                 # "unknown dtype ..." for names outside fp32/bf16/fp16
                explicit = getattr(self, f"{side}_precision")
                default = type(self).__dataclass_fields__[f"{side}_precision"].default
                if explicit not in (default, alias):
                    raise ConfigError(f"{side}_dtype={alias!r} contradicts {side}_precision={explicit!r}; give one")
                setattr(self, f"{side}_precision", alias)
            setattr(self, f"{side}_precision", resolve_precision(getattr(self, f"{side}_precision")).name)
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        if self.attention is not None and self.attention not in ATTENTION:
            raise ConfigError(f"unknown attention {self.attention!r}; choose one of {list(ATTENTION)}")
        for name in ("num_prompts", "max_new_tokens", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
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
            raise ConfigError(f"--fail-above expects METRIC=VALUE, got {item!r}")
        if name not in METRIC_NAMES:
            raise ConfigError(f"--fail-above: unknown metric {name!r}; choose one of {', '.join(METRIC_NAMES)}")
        try:
            bound = float(value)
        except ValueError:
            raise ConfigError(f"--fail-above {name}: {value!r} is not a number") from None
        if not math.isfinite(bound):
            raise ConfigError(f"--fail-above {name}: the bound must be finite, got {value!r}")
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


def _kept_logprob_dense(logits: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor, temperature: float):
    """Kept-set log-prob as the rollout engine computes it: ``log_softmax`` over the vocabulary of
    ``logits.float() / T`` with the entries outside ``kept`` (``[N, V]`` bool) at ``-inf``.

    Same value as :func:`moealign.routing_replay.sampling_mask.kept_logprob`, but the reduction runs over
    a fixed row length V instead of the batch's widest kept set, so a row's result does not depend on its
    batch mates (bitwise so under ``batch_invariant_mode``, whose ``log_softmax`` is a fixed tree).
    """
    inside = kept.gather(1, tokens[:, None]).squeeze(1)
    if not bool(inside.all()):
        row = int((~inside).nonzero()[0, 0])
        raise ConfigError(f"row {row}: token {int(tokens[row])} is not in its kept set")
    scores = (logits.float() / temperature).masked_fill(~kept, float("-inf"))
    return torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def _score(record: RolloutRecord, indices, fwd, side: _Side) -> None:
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
    offsets, ids = concat_kept_sets(samples)
    offsets, ids = offsets.to(logits.device), ids.to(logits.device)
    used = kept_mask(offsets, ids, logits.shape[-1])
    side.kept.append(_kept_logprob_dense(logits, fwd.tokens, used, T).cpu())
    own = truncation_mask(logits, temperature=T, top_k=sampling.top_k or None,
                          top_p=sampling.top_p if sampling.top_p < 1 else None, min_p=sampling.min_p or None)
    side.own_support_mismatch.append(support_mismatch(offsets, ids, own).cpu())
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
            with batch_invariant_mode(cfg.batch_invariant):
                _score(record, indices, fwd, sides[replay])
            update(len(indices))
    if bar is not None:
        bar.close()
    return sides


def _describe(engine) -> dict:
    """The report's description of one side: engine, precision policy, compute dtype (+ attention)."""
    desc = {"engine": engine.name, "precision": engine.precision, "dtype": engine.dtype}
    attention = getattr(engine, "attention", None)
    if attention is not None:
        desc["attention"] = attention
    return desc


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
        rollout_desc = {"engine": record.meta.engine, "precision": None, "dtype": record.meta.dtype}
    else:
        prompts = default_prompts(cfg.prompts_file)
        if cfg.num_prompts > len(prompts):
            raise ConfigError(f"--num-prompts {cfg.num_prompts} exceeds the {len(prompts)} prompts available")
        prompts = prompts[:cfg.num_prompts]
        log(f"rollout: {cfg.rollout_engine} {cfg.rollout_precision} on {device}, {len(prompts)} prompts x "
            f"{cfg.max_new_tokens} new tokens{', batch-invariant' if cfg.batch_invariant else ''}")
        rollout = ROLLOUT_ENGINES[cfg.rollout_engine](model_path, cfg.rollout_precision, device,
                                                      batch_invariant=cfg.batch_invariant, attention=cfg.attention)
        bar, update = _progress(len(prompts), "rollout", progress)
        record = rollout.generate(prompts, sampling=sampling, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                                  batch_size=cfg.batch_size, progress=update)
        if bar is not None:
            bar.close()
        rollout_desc = _describe(rollout)
        del rollout
    if cfg.save_record:
        record.save(cfg.save_record)
    if not record.has_routes:
        raise ConfigError("the rollout record has no routes: routing replay cannot be measured")

    log(f"train: {cfg.train_engine} {cfg.train_precision}, {record.num_response_tokens} response tokens")
    trainer = TRAIN_ENGINES[cfg.train_engine](model_path, cfg.train_precision, device,
                                              batch_invariant=cfg.batch_invariant,
                                              attention=cfg.attention if cfg.train_engine == "hf" else None)
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
        "train": _describe(trainer),
        "batch_invariant": cfg.batch_invariant,
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


def _side_label(side: dict) -> str:
    return f"{side['engine']} {side.get('precision') or side['dtype']}"


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
    head = (f"model {report['model']}: rollout {_side_label(report['rollout'])} vs train "
            f"{_side_label(report['train'])}{', batch-invariant' if report.get('batch_invariant') else ''}, "
            f"{report['num_tokens']} response tokens, MoE layers {report['moe_layers']}, {report['elapsed_s']:.1f} s")
    per_layer = "; ".join(f"{r['name']}: {[round(x, 4) for x in r['metrics']['per_layer_flip_rate']]}"
                          for r in report["runs"])
    return "\n".join([head, ""] + lines + ["", f"per-layer router flip rate: {per_layer}"])


# --------------------------------------------------------------------------------------------------
# --sweep
# --------------------------------------------------------------------------------------------------

#: The standard configurations of ``--sweep``: (label, rollout policy, training policy, batch-invariant).
SWEEP: tuple[tuple[str, str, str, bool], ...] = (
    ("bf16 vs fp32", "bf16", "fp32", False),
    ("fp16 vs fp16", "fp16", "fp16", False),
    ("fp8 aligned", "fp8-e4m3-block", "fp8-e4m3-block", False),
    ("fp8 vs bf16", "fp8-e4m3-block", "bf16", False),
    ("fp32 vs fp32", "fp32", "fp32", False),
    ("fully aligned", "fp32", "fp32", True),
)


def run_sweep(cfg: MismatchConfig, *, configs=SWEEP, progress: bool = False,
              log: Callable[[str], None] | None = None) -> dict:
    """Run :func:`run_mismatch` for each ``(label, rollout policy, train policy, batch_invariant)`` of
    ``configs`` with everything else from ``cfg`` (same prompts, seed, sampling, engines).

    Returns ``{"configs": [{"label", "rollout_precision", "train_precision", "batch_invariant", "report"}]}``.
    The fully aligned configuration is fp32 on both sides with batch-invariant ops; its
    ``routing_replay+sampling_mask`` run is the one that should show ``max_abs_logp_diff == 0``.
    """
    log = log or (lambda msg: None)
    out = []
    for label, rollout_precision, train_precision, bi in configs:
        log(f"sweep: {label}")
        one = dataclasses.replace(cfg, rollout_precision=rollout_precision, train_precision=train_precision,
                                  rollout_dtype=None, train_dtype=None, batch_invariant=bi, attention=None,
                                  save_record=None, load_record=None)
        out.append({"label": label, "rollout_precision": one.rollout_precision,
                    "train_precision": one.train_precision, "batch_invariant": bi,
                    "report": run_mismatch(one, progress=progress, log=log)})
    return {"configs": out}


_SWEEP_COLUMNS = (
    ("config", None, "{}"),
    ("rollout", "rollout_precision", "{}"),
    ("train", "train_precision", "{}"),
    ("BI", "batch_invariant", "{}"),
    ("tokens", "num_tokens", "{}"),
    ("base flip", "base:router_flip_rate", "{:.4f}"),
    ("base mean|dlogp|", "base:mean_abs_logp_diff", "{:.2e}"),
    ("base max|dlogp|", "base:max_abs_logp_diff", "{:.2e}"),
    ("aligned mean|dlogp|", "aligned:mean_abs_logp_diff", "{:.2e}"),
    ("aligned max|dlogp|", "aligned:max_abs_logp_diff", "{:.2e}"),
    ("aligned kl k3", "aligned:kl_k3", "{:.2e}"),
    ("s", "elapsed_s", "{:.1f}"),
)


def format_sweep(sweep: dict) -> str:
    """One row per configuration: the baseline run and the fully aligned run
    (``routing_replay+sampling_mask``) of each."""
    rows = []
    for entry in sweep["configs"]:
        report = entry["report"]
        runs = {r["name"]: r["metrics"] for r in report["runs"]}
        values = {"rollout_precision": entry["rollout_precision"], "train_precision": entry["train_precision"],
                  "batch_invariant": "yes" if entry["batch_invariant"] else "no",
                  "num_tokens": report["num_tokens"], "elapsed_s": report["elapsed_s"]}
        for prefix, run in (("base", "baseline"), ("aligned", ALIGNED_RUN)):
            for name, value in runs.get(run, {}).items():
                values[f"{prefix}:{name}"] = value
        rows.append([entry["label"] if key is None else
                     (fmt.format(values[key]) if key in values else "-") for _, key, fmt in _SWEEP_COLUMNS])
    header = [title for title, _, _ in _SWEEP_COLUMNS]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    align = lambda cells: "  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    first = sweep["configs"][0]["report"] if sweep["configs"] else {"model": "?", "device": "?"}
    lines = [f"model {first['model']} on {first['device']}: baseline (own routes, full softmax) and fully aligned "
             f"(routing replay + sampling mask) gap per precision configuration", "",
             align(header), "  ".join("-" * w for w in widths)]
    lines += [align(r) for r in rows]
    return "\n".join(lines)
