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

:func:`run_mismatch` runs three steps, one module each, and owns both engines (it closes them):

* :mod:`moealign.mismatch.rollout`: the configuration (:class:`MismatchConfig`), the rollout engine and the
  record it produces (or the record loaded from a file);
* :mod:`moealign.mismatch.scoring`: the training engine's forwards without and with replay, per-token
  log-probs, support mismatch and router flips;
* :mod:`moealign.mismatch.report`: the metrics of each run, the report, its tables, ``--fail-above``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from .engines import describe_engine
from .report import (
    ALIGNED_RUN,
    METRIC_NAMES,
    RUN_NAMES,
    build_report,
    check_fail_above,
    format_sweep,
    format_table,
    parse_fail_above,
)
from .rollout import (
    MismatchConfig,
    finish_record,
    generate_record,
    load_record,
    record_sampling,
    make_rollout_engine,
    rollout_message,
    rollout_prompts,
)
from .scoring import make_train_engine, score_record, train_message

__all__ = ["MismatchConfig", "RUN_NAMES", "ALIGNED_RUN", "METRIC_NAMES", "SWEEP", "run_mismatch", "run_sweep",
           "format_table", "format_sweep", "parse_fail_above", "check_fail_above"]


def run_mismatch(cfg: MismatchConfig, *, progress: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """Run the mismatch test; returns the JSON-ready report (see the CLI help for its schema)."""
    log = log or (lambda msg: None)
    t0 = time.perf_counter()
    device = cfg.resolved_device()
    model_path = cfg.model_path()

    # 1. the rollout record
    if cfg.load_record:
        record, rollout_desc = load_record(cfg)
    else:
        prompts = rollout_prompts(cfg)
        log(rollout_message(cfg, device, len(prompts)))
        rollout = make_rollout_engine(cfg, model_path, device)
        try:
            record, rollout_desc = generate_record(cfg, rollout, prompts, progress=progress)
        finally:
            rollout.close()
        del rollout
    finish_record(cfg, record)

    # 2. the training engine's scores, without and with routing replay
    log(train_message(cfg, record))
    trainer = make_train_engine(cfg, model_path, device)
    try:
        sides = score_record(record, trainer, batch_size=cfg.batch_size, batch_invariant=cfg.batch_invariant,
                             progress=progress)
    finally:
        trainer.close()

    # 3. the report
    return build_report(model=cfg.model_label(), record=record, sides=sides, rollout=rollout_desc,
                        train=describe_engine(trainer), sampling=record_sampling(record), batch_invariant=cfg.batch_invariant,
                        device=device, started=t0)


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
