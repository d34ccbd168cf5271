"""``moealign mismatch --aligned``: the report's ``aligned`` section, and with ``--diagnose`` the canonical ops as
levers.

The verdict: the fully aligned run (routing replay + the sampling mask) of a rollout and a trainer that both run the
canonical forward (:mod:`moealign.precision.canonical`) reproduces the rollout's log-probs bit for bit
(``torch.equal``), or it does not and the diagnosis says which op is still different.

The levers (``--diagnose``): the rollout cannot be re-run op by op (vLLM ran once), so each canonical op is a lever
on the trainer's side, re-scoring the record's fully aligned run with that op switched:

* an op canonical on both engines, switched to the trainer's stock op: the gap it opens (its negative control: a
  nonzero gap that names the op);
* an op left stock on both engines (``--aligned-skip``), switched to the canonical op on the trainer: the gap that
  remains; such an op is the residual's cause (each engine runs its own kernel for it), and when it is the only
  one, the whole residual is attributed to it.

A residual with every op canonical names no op: the section says so (an engine path the audit did not see).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..precision.canonical import OPS, log_softmax_mode

__all__ = ["aligned_section", "canonical_levers", "format_aligned", "score_fully_aligned"]


def _gap(trained: torch.Tensor, rollout: torch.Tensor) -> dict:
    diff = (trained.double() - rollout.double()).abs()
    return {"bitwise_equal": bool(torch.equal(trained, rollout)), "tokens_differing": int((diff > 0).sum()),
            "max_abs_logp_diff": float(diff.max()) if diff.numel() else 0.0,
            "mean_abs_logp_diff": float(diff.mean()) if diff.numel() else 0.0}


def _rollout_logprobs(record) -> torch.Tensor:
    return torch.cat([s.logprobs.float() for s in record.samples])


def aligned_section(cfg, record, sides: dict, trainer=None, *, log: Callable[[str], None] | None = None) -> dict:
    """The ops the canonical forward ran on both engines, those left stock, and the fully aligned run's verdict;
    with ``trainer`` (``--diagnose``) also :func:`canonical_levers`."""
    rollout_lp = _rollout_logprobs(record)
    section = {"ops": [op for op in OPS if op not in cfg.aligned_skip], "stock_ops": list(cfg.aligned_skip),
               "run": "routing_replay+sampling_mask" if record.has_kept_sets else "routing_replay",
               "num_tokens": int(rollout_lp.numel()), **_gap(sides[True].logprobs(record.has_kept_sets), rollout_lp)}
    if trainer is not None:
        section["levers"] = canonical_levers(record, trainer, cfg.aligned_skip, cfg.batch_size, log=log)
        section["diagnosis"] = _diagnose(section)
    return section


def score_fully_aligned(record, trainer, skip=(), batch_size: int = 16) -> torch.Tensor:
    """The trainer's fully aligned run (replay + the kept sets) with the canonical ops but ``skip``."""
    from .scoring import SideScores, score_batch

    trainer.set_canonical_ops([op for op in OPS if op not in skip])
    side = SideScores()
    for start in range(0, len(record), batch_size):
        indices = list(range(start, min(start + batch_size, len(record))))
        fwd = trainer.forward(record, indices, replay=True, capture=False)
        with (log_softmax_mode() if "log_softmax" not in skip else contextlib.nullcontext()):
            score_batch(record, indices, fwd, side)
    return side.logprobs(record.has_kept_sets)


def canonical_levers(record, trainer, skip, batch_size: int, *, log: Callable[[str], None] | None = None) -> list:
    """One entry per canonical op: the trainer's fully aligned run with that op switched (stock where both engines
    ran it canonical, canonical where both left it stock) against the rollout's log-probs."""
    log = log or (lambda msg: None)
    rollout_lp = _rollout_logprobs(record)
    levers = []
    try:
        for op in OPS:
            both_canonical = op not in skip
            switched = set(skip) | {op} if both_canonical else set(skip) - {op}
            log(f"canonical lever {op}: trainer {'stock' if both_canonical else 'canonical'}")
            gap = _gap(score_fully_aligned(record, trainer, switched, batch_size), rollout_lp)
            levers.append({"op": op, "both": "canonical" if both_canonical else "stock",
                           "trainer_switched_to": "stock" if both_canonical else "canonical", **gap})
    finally:
        trainer.set_canonical_ops([op for op in OPS if op not in skip])
    return levers


def _diagnose(section: dict) -> dict:
    if section["bitwise_equal"]:
        opened = [lv["op"] for lv in section["levers"] if lv["both"] == "canonical" and not lv["bitwise_equal"]]
        return {"residual_ops": [], "headline": "bitwise equal: no residual; each canonical op, left stock on the "
                f"trainer alone, opens a gap ({len(opened)} of {sum(lv['both'] == 'canonical' for lv in section['levers'])})"}
    stock = list(section["stock_ops"])
    if len(stock) == 1:
        headline = (f"the residual (max |dlogp| {section['max_abs_logp_diff']:.3g}) comes from {stock[0]}: left stock, "
                    f"each engine runs its own kernel for it; every other op is canonical on both")
    elif stock:
        headline = (f"the residual (max |dlogp| {section['max_abs_logp_diff']:.3g}) comes from the ops left stock: "
                    f"{', '.join(stock)} (their shares need the rollout re-run op by op, which vLLM does not allow)")
    else:
        headline = ("a residual with every op canonical: an engine path outside the audited ops ran; no op is named")
    return {"residual_ops": stock, "headline": headline}


def format_aligned(section: dict) -> str:
    """The report's ``aligned`` section as text (one line; with the levers, one line per op)."""
    stock = f"; left stock: {', '.join(section['stock_ops'])}" if section["stock_ops"] else ""
    verdict = ("bitwise equal (torch.equal)" if section["bitwise_equal"] else
               f"NOT bitwise equal: {section['tokens_differing']} of {section['num_tokens']} tokens differ, "
               f"max |dlogp| {section['max_abs_logp_diff']:.3g}")
    lines = [f"aligned: the canonical forward on both engines ({', '.join(section['ops'])}{stock}); "
             f"{section['run']}: {section['num_tokens']} log-probs {verdict}"]
    if "levers" in section:
        lines.append(f"diagnosis: {section['diagnosis']['headline']}")
        for lv in section["levers"]:
            lines.append(f"  canonical: {lv['op']:<12} (both {lv['both']}; trainer switched to {lv['trainer_switched_to']}): "
                         + ("bitwise equal" if lv["bitwise_equal"] else
                            f"max |dlogp| {lv['max_abs_logp_diff']:.3g}, {lv['tokens_differing']} tokens differ"))
    return "\n".join(lines)
