"""The diagnosis: why the two engines disagree, which lever to turn on first, what remains, which correction.

Inputs: the lever runs' metrics (the gap with no lever, with every lever), the attribution
(:meth:`moealign.mismatch.levers.LeverRunner.attribution`) and the contract rows
(:func:`moealign.contract.compare_contracts`). The steps follow the decision tree of the off-policy drift
survey ("Diagnosing and fixing off-policy drift: a decision tree", thresholds as given there):

1. *Symptom* of the gap as configured (no lever): Pearson of the probabilities >= 0.99, ppl ratio ~ 1 and
   KL < 0.02 is no meaningful drift; Pearson < 0.95, a ppl ratio far from 1 or KL > 0.05 on the same
   checkpoint is Cause A (precision / kernel / engine mismatch: systems first, correction cannot rescue it);
   otherwise chi2_token > 0.3 with ESS >= 0.5 is moderate token drift (Cause C), chi2_token > 1 or ESS < 0.5 an
   IS-variance blow-up (Cause D).
2. *Faults* found by construction come first, ahead of any share: weights whose digests differ (a stale or
   wrongly converted checkpoint: no lever fixes that), a routing replay that leaves routes flipping (switched
   off, or patched where the engine no longer calls), a one-sided fp32 LM head or router, TP sizes that differ
   with stock reductions. Then the causes by their attributed share of the primary metric; the first lever is
   the first fault's, else the largest share's (ties in the survey's fix order: precision, TP, kernels,
   routing replay, sampling mask).
3. *Residual* after every lever, classified the same way, picks the :mod:`moealign.correction` preset:
   bitwise zero needs none (``disabled``); Cause A left over needs a systems fix (no preset rescues it);
   the escalation rule first: chi2_token in (2, 4] or an RS mask rate of 10-25% (with ESS >= 0.3) ->
   ``decoupled_geo_rs_token_tis``; then chi2_token > 1 or ESS < 0.5 -> ``decoupled_token_icepop`` (band [0.5, 5];
   past a 25% mask rate the correction is at its limit); chi2_token > 0.3 -> ``decoupled_geo_rs``
   (``0.99_1.01``); no meaningful drift
   -> ``disabled``, unless single tokens still leave the IcePop band (the max |delta log p| spike the survey
   warns not to average away) -> ``decoupled_token_icepop``.
"""

from __future__ import annotations

import math

from .levers import CAUSES

__all__ = ["diagnose", "aligned_switch", "classify", "choose_preset", "FIX_ORDER", "ICEPOP_LOW", "ICEPOP_HIGH"]

#: The survey's fix order for Cause A, used to break ties between equal shares.
FIX_ORDER = ("weights", "precision", "tree_reductions", "canonical", "batch_invariant", "prefill", "routing_replay",
             "sampling_mask")
ICEPOP_LOW, ICEPOP_HIGH = 0.5, 5.0


def _kl(m: dict) -> float:
    return max(abs(m.get("kl_k1", 0.0)), m.get("kl_k3", 0.0))


def classify(m: dict) -> tuple[str, str]:
    """``(class, why)`` of one run's metrics: ``"aligned"`` (bitwise equal), ``"none"`` (no meaningful drift),
    ``"A"``, ``"C"``, ``"D"`` or ``"mild"`` (drift below every threshold of the tree but not nothing)."""
    pearson, ppl, kl = m.get("pearson_prob", float("nan")), m.get("ppl_ratio", 1.0), _kl(m)
    chi2, ess = m.get("chi2_token", 0.0), m.get("ess", 1.0)
    if m.get("max_abs_logp_diff", 1.0) == 0.0:
        return "aligned", "bitwise equal log-probs"
    if (not math.isnan(pearson) and pearson < 0.95) or abs(ppl - 1.0) > 0.05 or kl > 0.05:
        return "A", (f"Pearson {pearson:.4f}, ppl ratio {ppl:.4f}, KL {kl:.3g} on the same checkpoint: precision / "
                     f"kernel / engine mismatch (Cause A)")
    if chi2 > 1.0 or ess < 0.5:
        return "D", f"chi2_token {chi2:.3g}, ESS {ess:.3f}: IS variance blow-up (Cause D)"
    if chi2 > 0.3:
        return "C", f"chi2_token {chi2:.3g} > 0.3 with ESS {ess:.3f} >= 0.5: moderate token drift (Cause C)"
    if (math.isnan(pearson) or pearson >= 0.99) and abs(ppl - 1.0) <= 0.01 and kl < 0.02:
        return "none", f"Pearson {pearson:.4f}, ppl ratio {ppl:.4f}, KL {kl:.3g}: no meaningful drift"
    return "mild", (f"Pearson {pearson:.4f}, ppl ratio {ppl:.4f}, KL {kl:.3g}: small drift, below the tree's "
                    f"thresholds for Causes A, C and D")


def choose_preset(m: dict) -> tuple[str | None, str]:
    """``(preset name or None, why)`` for the residual metrics ``m`` (the decision tree's step 2 and its
    escalation rule)."""
    cls, why = classify(m)
    chi2 = m.get("chi2_token", 0.0)
    rs = m.get("geo_rs_masked_fraction", 0.0)
    icepop = m.get("icepop_masked_fraction", 0.0)
    spike = m.get("max_abs_logp_diff", 0.0) > math.log(ICEPOP_HIGH)
    if cls == "aligned":
        return "disabled", "the log-probs agree bitwise: nothing to correct (RolloutCorrectionConfig.disabled())"
    if cls == "A":
        return None, (f"{why}: a systems fix is needed; algorithmic correction cannot rescue this (the tree's "
                      f"Cause A: rebuild the engine path)")
    if (2.0 < chi2 <= 4.0 or 0.10 <= rs <= 0.25) and m.get("ess", 1.0) >= 0.3:
        return "decoupled_geo_rs_token_tis", f"{why}: RS alone is past its range, add token TIS"
    if cls == "D":
        limit = " - its mask rate is past 25%: the correction is at its limit, fix the gap" if icepop > 0.25 else ""
        return "decoupled_token_icepop", f"{why}: IcePop band [{ICEPOP_LOW}, {ICEPOP_HIGH}] masks the outliers{limit}"
    if cls == "C":
        return "decoupled_geo_rs", f"{why}: geometric RS (0.99_1.01) strips outliers without distorting the rest"
    if spike:
        return "decoupled_token_icepop", (f"{why}, but single tokens leave the IcePop band (max |delta log p| "
                                          f"{m.get('max_abs_logp_diff', 0.0):.3g} > ln {ICEPOP_HIGH:g}): mask them "
                                          f"rather than average them away")
    return "disabled", f"{why}: continue without correction (RolloutCorrectionConfig.disabled())"


def _faults(runs: dict, contract_rows: list[dict] | None) -> list[dict]:
    """Faults found by construction, most serious first: ``{"field", "severity", "message", "lever"}``."""
    found = []
    rows = contract_rows or []
    weights = [r for r in rows if r.get("status") == "gap" and str(r.get("field", "")).startswith("weights")]
    for r in weights:
        found.append({"field": r["field"], "severity": "gap", "lever": "weights", "cause": CAUSES["weights"],
                      "message": r.get("message") or "the two sides hold different weights"})
    replay = runs.get("routing_replay")
    if replay is not None and replay.get("router_flip_rate", 0.0) > 0:
        found.append({"field": "routing_replay", "severity": "gap", "lever": "routing_replay",
                      "cause": "routing replay switched off",
                      "message": f"with routing replay on, {replay['router_flip_rate']:.2%} of the routes still differ "
                                 f"from the record's: the replay is switched off or does not reach the router the "
                                 f"engine calls"})
    for r in rows:
        if r.get("status") != "gap" or str(r.get("field", "")).startswith("weights"):
            continue
        message = r.get("message") or ""
        field = str(r.get("field", ""))
        if "one-sided" in message:
            region = field.split(".", 1)[-1]
            lever = f"precision:{region}" if region in ("router", "lm_head") else "precision"
            found.append({"field": field, "severity": "gap", "lever": lever,
                          "cause": CAUSES.get(lever, "precision") + " (one-sided fp32)", "message": message})
        elif field.startswith("parallel.tp"):
            found.append({"field": field, "severity": "gap", "lever": "tree_reductions",
                          "cause": "reduction order / TP", "message": message})
    return found


def _findings(faults: list[dict], contract_rows: list[dict] | None) -> list[dict]:
    """The faults, then every other contract row that differs (gaps: the configuration under test, such as
    bf16 against fp32, which the attribution measures; info rows: differences not known to cause a gap)."""
    out = [{k: f[k] for k in ("field", "severity", "message", "lever", "cause")} for f in faults]
    for r in contract_rows or []:
        if r.get("status") in ("gap", "info") and not any(f["field"] == r.get("field") for f in out):
            out.append({"field": r.get("field"), "severity": r["status"], "lever": None, "cause": None,
                        "message": r.get("message") or f"{r.get('field')} differs"})
    return out


def aligned_switch(verdict: dict | None) -> str | None:
    """The sentence naming the switch that makes the pair bitwise and what it costs (``verdict["aligned"]``, from
    :meth:`moealign.mismatch.vllm_levers.VllmLeverRunner.verdict`); None without one."""
    aligned = (verdict or {}).get("aligned")
    if not aligned:
        return None
    cost = aligned.get("cost") or {}
    parts = []
    if "rollout_ratio" in cost:
        parts.append(f"the rollout's forward {cost['rollout_ratio']:.1f}x")
    if "train_ratio" in cost:
        parts.append(f"the trainer's forward {cost['train_ratio']:.1f}x")
    priced = f"; measured cost on this run: {', '.join(parts)} the stock one" if parts else ""
    if aligned["bitwise_equal"]:
        return f"{aligned['switch']} makes the pair bitwise equal (residual 0){priced}"
    return (f"{aligned['switch']} leaves max |delta log p| {aligned['metrics']['max_abs_logp_diff']:.3g}: "
            f"{verdict.get('residual_cause')}{priced}")


def diagnose(*, runs: dict, attribution: dict | None, contract_rows: list[dict] | None = None,
             primary: str = "mean_abs_logp_diff", notes: list[str] | None = None, verdict: dict | None = None) -> dict:
    """The diagnosis section of the report (see the module docstring).

    ``runs``: ``{label: metrics}`` of the lever runs, with at least ``"baseline"`` (no lever) and
    ``"all levers"``; ``attribution``: ``{metric: {"gap", "residual", "levers": {lever: share}, ...}}`` (None
    when no lever ran); ``contract_rows``: the compared contracts (None when not stated)."""
    base = runs["baseline"]
    final = runs.get("all levers", base)
    symptom, symptom_why = classify(base)
    faults = _faults(runs, contract_rows)
    ranked = []
    if attribution and primary in attribution:
        a = attribution[primary]
        gap = a["gap"]
        for lever, share in a["levers"].items():
            ranked.append({"cause": CAUSES.get(lever, lever), "lever": lever, "share": share,
                           "fraction": share / gap if gap else float("nan")})
        order = {lever: i for i, lever in enumerate(FIX_ORDER)}
        ranked.sort(key=lambda r: (-round(r["share"], 12), order.get(r["lever"].split(":")[0], len(order))))
        regions = a.get("regions")
        if regions:
            for r in ranked:
                if r["lever"] == "precision":
                    split = sorted(regions["shares"].items(), key=lambda kv: -kv[1])
                    total = sum(v for _, v in split) or float("nan")
                    r["regions"] = {k: v for k, v in split}
                    r["cause"] = "precision (" + ", ".join(f"{k.split(': ', 1)[-1]} {v / total:.0%}"
                                                           for k, v in split) + ")"
    if faults:
        first = faults[0]
        first_cause, first_lever = first["cause"] or first["field"], first["lever"]
        headline = f"{first_cause}: {first['message']}"
    elif ranked and ranked[0]["share"] > 0:
        first_cause, first_lever = ranked[0]["cause"], ranked[0]["lever"]
        headline = (f"{first_cause} is the largest cause: {ranked[0]['fraction']:.0%} of the mean |delta log p| gap; "
                    f"turn on {first_lever} first")
    elif symptom == "aligned":
        first_cause, first_lever = None, None
        headline = "the two sides agree bitwise: nothing to fix"
    else:
        first_cause, first_lever = None, None
        headline = f"no lever removes the gap ({symptom_why})"
    deployed = (verdict or {}).get("deployed")
    preset, preset_why = choose_preset(deployed["metrics"] if deployed else final)
    switch = aligned_switch(verdict)
    text = [f"Symptom (as configured): {symptom_why}."]
    for f in faults:
        text.append(f"Fault: {f['field']}: {f['message']}.")
    if ranked:
        a = attribution[primary]
        parts = ", ".join(f"{r['cause']} {r['share']:.3g} ({r['fraction']:.0%})" for r in ranked)
        text.append(f"Attribution of the mean |delta log p| gap {a['gap']:.3g} (Shapley values over the lever "
                    f"runs): {parts}; residual after all levers {a['residual']:.3g}"
                    + (f" ({a['residual_cause']})" if a.get("residual_cause") else "") + ".")
    if first_lever:
        text.append(f"Turn on first: {first_lever} ({first_cause}).")
    final_cls, final_why = classify(final)
    text.append(f"After all levers: {final_why}.")
    if switch:
        text.append(f"Bitwise: {switch}.")
    ops = (verdict or {}).get("canonical_ops")
    if ops:
        text.append("Canonical ops, each switched back to stock on the trainer alone (negative controls): "
                    + ", ".join(f"{lv['op']} " + ("bitwise (opens no gap)" if lv["bitwise_equal"] else
                                                  f"max |delta log p| {lv['max_abs_logp_diff']:.3g}") for lv in ops)
                    + ".")
    if deployed:
        text.append(f"Correction for the setting you run ({deployed['label']}, the rollout's own decode): "
                    f"{preset or 'none (systems fix)'}: {preset_why}.")
    else:
        text.append(f"Correction for the residual: {preset or 'none (systems fix)'}: {preset_why}.")
    for note in notes or []:
        text.append(f"Note: {note}.")
    return {"headline": headline, "symptom": symptom, "first_cause": first_cause, "first_lever": first_lever,
            "residual_class": final_cls, "preset": preset, "preset_reason": preset_why, "ranked": ranked,
            "aligned_switch": switch, "preset_for": deployed["label"] if deployed else "all levers",
            "findings": _findings(faults, contract_rows),
            "text": text}
