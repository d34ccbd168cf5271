"""The mismatch test, step 3: the metrics of each run, the report, its tables, and ``--fail-above``.

From the scores of :mod:`moealign.mismatch.scoring` come four runs (:data:`RUN_NAMES`): the trainer's
routing (its own top-k, or the recorded experts replayed) crossed with its log-prob (over the vocabulary,
or restricted to the recorded kept set). :func:`run_metrics` gives each run's metrics (:data:`METRIC_NAMES`:
router flips, the off-policy and agreement metrics of :mod:`moealign.correction`, the support mismatch, the
fractions an IcePop band [0.5, 5] and a geometric RS band 0.999_1.001 would mask); :func:`build_report`
assembles the JSON-ready report; :func:`format_table` / :func:`format_sweep` print it;
:func:`parse_fail_above` / :func:`check_fail_above` are ``--fail-above``.
"""

from __future__ import annotations

import math
import time

import torch

from ..correction import (
    compute_agreement_metrics,
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
)
from ..errors import ConfigError
from ..record import RolloutRecord
from .scoring import SideScores

__all__ = ["RUN_NAMES", "ALIGNED_RUN", "METRIC_NAMES", "ICEPOP_BAND", "GEO_RS_BAND", "LOWER_IS_BETTER",
           "HIGHER_IS_BETTER", "TWO_SIDED", "parse_fail_above", "judged_run",
           "check_fail_above", "run_metrics", "side_metrics", "build_report", "format_table", "format_sweep", "format_diagnosis"]

RUN_NAMES = ("baseline", "routing_replay", "sampling_mask", "routing_replay+sampling_mask")
ALIGNED_RUN = RUN_NAMES[-1]
METRIC_NAMES = (
    "router_flip_rate", "token_flip_rate", "kl_k1", "kl_k3", "max_abs_logp_diff", "p99_abs_logp_diff",
    "mean_abs_logp_diff", "chi2_token", "chi2_seq", "pearson_prob", "ppl_ratio", "support_mismatch_rate",
    "icepop_masked_fraction", "geo_rs_masked_fraction",
)
ICEPOP_BAND = "0.5_5.0"
GEO_RS_BAND = "0.999_1.001"


# --------------------------------------------------------------------------------------------------
# --fail-above
# --------------------------------------------------------------------------------------------------


#: Metrics for which a larger value means a worse agreement (``--fail-above`` judges them).
LOWER_IS_BETTER = ("router_flip_rate", "token_flip_rate", "kl_k3", "max_abs_logp_diff", "p99_abs_logp_diff",
                   "mean_abs_logp_diff", "chi2_token", "chi2_seq", "support_mismatch_rate", "icepop_masked_fraction",
                   "geo_rs_masked_fraction")
#: Metrics for which a smaller value means a worse agreement (``--fail-below`` judges them).
HIGHER_IS_BETTER = ("pearson_prob",)
#: Signed metrics whose ideal lies inside the range (0 for the k1 KL, 1 for the ppl ratio): both gates apply.
TWO_SIDED = ("kl_k1", "ppl_ratio")


def parse_fail_above(items: list[str] | None, *, below: bool = False) -> dict[str, float]:
    """``["kl_k1=1e-3", ...]`` -> ``{"kl_k1": 0.001}``; unknown metrics, bad numbers and a metric whose gate
    would point the wrong way (``--fail-above pearson_prob``: it would fail when agreement is excellent) are
    errors. ``below``: the items of ``--fail-below``."""
    option = "--fail-below" if below else "--fail-above"
    allowed = (HIGHER_IS_BETTER if below else LOWER_IS_BETTER) + TWO_SIDED
    bounds: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name or not value.strip():
            raise ConfigError(f"{option} expects METRIC=VALUE, got {item!r}")
        if name not in METRIC_NAMES:
            raise ConfigError(f"{option}: unknown metric {name!r}; choose one of {', '.join(METRIC_NAMES)}")
        if name not in allowed:
            other = "--fail-above" if below else "--fail-below"
            way = "lower" if below else "higher"
            raise ConfigError(f"{option} {name}: a {way} {name} means a better agreement, so this gate would fail "
                              f"good runs; use {other} {name}=VALUE")
        try:
            bound = float(value)
        except ValueError:
            raise ConfigError(f"{option} {name}: {value!r} is not a number") from None
        if not math.isfinite(bound):
            raise ConfigError(f"{option} {name}: the bound must be finite, got {value!r}")
        bounds[name] = bound
    return bounds


def judged_run(report: dict) -> dict:
    """The run the gates judge: the fully aligned run, or (a record without kept sets has no sampling-mask
    runs) the most aligned run the report has."""
    runs = {r["name"]: r for r in report["runs"]}
    for name in (ALIGNED_RUN, "routing_replay", "baseline"):
        if name in runs:
            return runs[name]
    raise ConfigError("the report has no runs to judge")


def check_fail_above(report: dict, bounds: dict[str, float], below: dict[str, float] | None = None) -> list[str]:
    """Violations (messages) of ``bounds`` (``--fail-above``) and ``below`` (``--fail-below``) by the judged
    run of ``report`` (:func:`judged_run`). A NaN metric fails either gate."""
    run = judged_run(report)
    failures = []
    for name, bound in bounds.items():
        value = run["metrics"][name]
        if not (value <= bound):   # NaN fails too
            failures.append(f"{run['name']}: {name} = {value:.6g} > {bound:.6g}")
    for name, bound in (below or {}).items():
        value = run["metrics"][name]
        if not (value >= bound):
            failures.append(f"{run['name']}: {name} = {value:.6g} < {bound:.6g}")
    return failures


# --------------------------------------------------------------------------------------------------
# the runs
# --------------------------------------------------------------------------------------------------


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


def logprob_metrics(train_lp: torch.Tensor, rollout_lp: torch.Tensor, lengths: list[int]) -> dict[str, float]:
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


def run_metrics(record: RolloutRecord, sides: dict[bool, SideScores]) -> list[dict]:
    """``[{"name", "metrics"}]``, one entry per run of :data:`RUN_NAMES` (the kept-set runs only when the
    record has kept sets), from the trainer's scores without (``sides[False]``) and with routing replay."""
    rollout_lp = torch.cat([s.logprobs.float() for s in record.samples])
    lengths = [s.response_len for s in record.samples]
    runs = []
    for name in RUN_NAMES:
        replay = name.startswith("routing_replay")
        masked = name.endswith("sampling_mask")
        if masked and not record.has_kept_sets:
            continue
        runs.append({"name": name, "metrics": side_metrics(record, sides[replay], masked, rollout_lp, lengths)})
    return runs


def side_metrics(record: RolloutRecord, side: SideScores, masked: bool, rollout_lp: torch.Tensor | None = None,
                 lengths: list[int] | None = None) -> dict:
    """The :data:`METRIC_NAMES` metrics (plus per-layer flips and the mean Jaccard) of one trainer pass ``side``
    (its log-probs restricted to the recorded kept sets when ``masked``) against the record's log-probs."""
    if rollout_lp is None:
        rollout_lp = torch.cat([s.logprobs.float() for s in record.samples])
    if lengths is None:
        lengths = [s.response_len for s in record.samples]
    flips = side.flips
    metrics = {"router_flip_rate": flips.router_flip_rate, "token_flip_rate": flips.token_flip_rate}
    metrics.update(logprob_metrics(side.logprobs(masked), rollout_lp, lengths))
    if record.has_kept_sets:
        metrics["support_mismatch_rate"] = float(side.support_mismatch(masked).double().mean())
    else:
        metrics["support_mismatch_rate"] = float("nan")
    metrics["per_layer_flip_rate"] = list(flips.per_layer_flip_rate)
    metrics["mean_jaccard"] = flips.mean_jaccard
    return metrics


def build_report(*, model: str, record: RolloutRecord, sides: dict[bool, SideScores], rollout: dict, train: dict,
                 sampling: dict, batch_invariant: bool, device: str, started: float) -> dict:
    """The JSON-ready report: the two sides' descriptions (``rollout`` / ``train``, see
    :func:`moealign.mismatch.engines.describe_engine`), the record's size, the sampling parameters, the runs
    (:func:`run_metrics`) and ``elapsed_s`` since ``started`` (a :func:`time.perf_counter` value).
    ``sampling`` is the record's own (:func:`moealign.mismatch.rollout.record_sampling`)."""
    runs = run_metrics(record, sides)
    skipped = {} if record.has_kept_sets else {
        name: "the record has no kept sets" for name in RUN_NAMES if name.endswith("sampling_mask")}
    return {
        "model": model,
        "rollout": rollout,
        "train": train,
        "batch_invariant": batch_invariant,
        "num_tokens": int(record.num_response_tokens),
        "num_route_rows": int(sum(int(s.routes.shape[0]) for s in record.samples)),
        "moe_layers": list(record.meta.moe_layers),
        "sampling": sampling,
        "device": device,
        "elapsed_s": round(time.perf_counter() - started, 3),
        "runs": runs,
        "skipped_runs": skipped,
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
    notes = [f"{name}: not run ({why})" for name, why in report.get("skipped_runs", {}).items()]
    return "\n".join([head, ""] + lines + ["", f"per-layer router flip rate: {per_layer}"] + notes)


# --------------------------------------------------------------------------------------------------
# --sweep
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
# --diagnose
# --------------------------------------------------------------------------------------------------


def format_diagnosis(report: dict) -> str:
    """The diagnosis in words, the attribution table (each cause's share of each metric, the residual) and the
    contract gaps, for the terminal."""
    d = report["diagnosis"]
    lines = [f"diagnosis: {d['headline']}"]
    attribution = report.get("attribution", {}).get("metrics", {})
    if attribution:
        metrics = list(attribution)
        causes = []
        for m in metrics:
            for cause in attribution[m]["shares"]:
                if cause not in causes:
                    causes.append(cause)
        width = max([len(c) for c in causes] + [len("residual after all levers"), 5])
        lines.append("")
        lines.append("cause".ljust(width) + "".join(f"  {m:>20}" for m in metrics))
        lines.append("-" * width + "".join("  " + "-" * 20 for _ in metrics))
        for label, get in ([("measured gap", lambda a: a["gap"])]
                           + [(c, (lambda c: lambda a: a["shares"].get(c, float("nan")))(c)) for c in causes]
                           + [("residual after all levers", lambda a: a["residual"])]):
            lines.append(label.ljust(width) + "".join(f"  {get(attribution[m]):>20.4g}" for m in metrics))
        regions = attribution[metrics[0]].get("regions")
        if regions:
            split = ", ".join(f"{k}: {v:.3g}" for k, v in regions["shares"].items())
            lines.append(f"precision by region ({metrics[0]}, other levers off): {split}")
    lines.append("")
    lines += [f"  {t}" for t in d["text"]]
    return "\n".join(lines)
