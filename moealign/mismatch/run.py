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

import torch

from ..contract import name_layers, weight_difference
from ..errors import UnsupportedConversionError
from ..options import train_parallel_note
from ..routing_replay.flips import foreign_routes
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
from . import plots as plots_mod
from .diagnose import diagnose
from .faults import ReplayOffTrainer
from .levers import ATTRIBUTED_METRICS, CAUSES, LeverRunner
from .scoring import make_train_engine, score_record, train_message

__all__ = ["MismatchConfig", "RUN_NAMES", "ALIGNED_RUN", "METRIC_NAMES", "SWEEP", "run_mismatch", "run_sweep",
           "format_table", "format_sweep", "parse_fail_above", "check_fail_above"]


def run_mismatch(cfg: MismatchConfig, *, progress: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """Run the mismatch test; returns the JSON-ready report (see the CLI help for its schema). With
    ``cfg.diagnose`` (or ``cfg.report_dir``) the report also holds the lever runs, the attribution, the
    diagnosis, both sides' execution contracts and the plot data (:func:`diagnosis_sections`); with
    ``cfg.report_dir`` it is written there as ``report.html`` + ``report.json``. ``report["warnings"]``: what
    makes the numbers meaningless although the run completed (:func:`route_warnings`, :func:`weights_warnings`), one
    sentence each."""
    log = log or (lambda msg: None)
    t0 = time.perf_counter()
    device = cfg.resolved_device()
    model_path = cfg.model_path()
    fault = cfg.fault
    check_train_family(cfg)
    slow = train_parallel_note(cfg.train_layout, device)
    if slow:
        log(slow)

    # 1. the rollout record
    rollout_contract, pad_token_id = None, None
    if cfg.load_record:
        record, rollout_desc = load_record(cfg)
        rollout_contract = record.contract
    else:
        prompts = rollout_prompts(cfg)
        log(rollout_message(cfg, device, len(prompts)))
        rollout = make_rollout_engine(cfg, model_path, device)
        try:
            if fault is not None and fault.kind == "weights":
                from .faults import apply_fault

                log(f"fault injected: {fault.describe()}")
                apply_fault(rollout.model, fault)
            record, rollout_desc = generate_record(cfg, rollout, prompts, progress=progress)
            if cfg.diagnose or cfg.save_record:
                rollout_contract = rollout.contract(cfg.sampling)
                record.contract = rollout_contract
            pad_token_id = getattr(getattr(rollout, "tokenizer", None), "pad_token_id", None)
        finally:
            rollout.close()
        del rollout
    finish_record(cfg, record)
    from .vllm_levers import rescore_first

    rescored = rescore_first(cfg, record, device, log=log)      # --diagnose on vLLM -> Megatron: before Megatron opens

    # 2. the training engine's scores, without and with routing replay
    log(train_message(cfg, record) + (f", sharded: {cfg.train_layout}, {cfg.train_dispatcher} dispatcher"
                                       if cfg.train_sharded else ""))
    try:
        trainer = make_train_engine(cfg, model_path, device)
    except UnsupportedConversionError as exc:          # a feature of this config Megatron's local spec lacks
        raise UnsupportedConversionError(_train_hf_hint(str(exc), _model_type(cfg))) from None
    if fault is not None and fault.kind == "replay-off":
        log(f"fault injected: {fault.describe()}")
        trainer = ReplayOffTrainer(trainer)
    try:
        sides = score_record(record, trainer, batch_size=cfg.batch_size, batch_invariant=cfg.batch_invariant,
                             progress=progress,
                             canonical_log_softmax=cfg.aligned and "log_softmax" not in cfg.aligned_skip)
        train_desc = describe_train(cfg, trainer)
        extra = {}
        if cfg.aligned:
            from .aligned import aligned_section

            extra = {"aligned": aligned_section(cfg, record, sides, trainer if cfg.diagnose else None, log=log)}
        elif cfg.diagnose:
            extra = diagnosis_sections(cfg, record, trainer, rollout_contract=rollout_contract,
                                       pad_token_id=pad_token_id, log=log, sides=sides, rescored=rescored)
        warned = weights_warnings(rollout_contract, trainer, (extra.get("contract") or {}).get("train"))
    finally:
        trainer.close()

    # 3. the report
    report = build_report(model=cfg.model_label(), record=record, sides=sides, rollout=rollout_desc,
                          train=train_desc, sampling=record_sampling(record), batch_invariant=cfg.batch_invariant,
                          device=device, started=t0)
    report.update(extra)
    report["warnings"] = route_warnings(sides) + warned
    if fault is not None:
        report["injected_fault"] = fault.describe()
    report["elapsed_s"] = round(time.perf_counter() - t0, 3)
    if cfg.report_dir:
        from .html_report import write_report_dir

        paths = write_report_dir(report, cfg.report_dir)
        log(f"report: {paths['html']}")
    return report


def describe_train(cfg: MismatchConfig, trainer) -> dict:
    """The report's ``train``: :func:`~moealign.mismatch.engines.describe_engine`, plus ``parallel`` (the layout that
    ran: ``{"tp", "ep", "pp", "dp", "world"}``, all 1 for a single rank) and, sharded, ``dispatcher``."""
    desc = describe_engine(trainer)
    layout = getattr(trainer, "layout", None) or cfg.train_layout
    desc["parallel"] = layout.as_dict()
    if layout.world > 1:
        desc["dispatcher"] = getattr(trainer, "dispatcher", cfg.train_dispatcher)
    return desc


def _model_type(cfg: MismatchConfig):
    from ..model_config import read_model_config

    return read_model_config(cfg.model_path())["model_type"]


def _train_hf_hint(message: str, model_type) -> str:
    """``message`` + where the transformers trainer runs ``model_type`` (a registered family: every one runs there)."""
    from ..families import FAMILIES

    if model_type not in FAMILIES or "--train hf" in message:
        return message
    return f"{message}; the transformers trainer runs {model_type} models: --train hf"


def check_train_family(cfg: MismatchConfig) -> None:
    """``--train megatron`` with a checkpoint whose family has no Megatron conversion (OLMoE): refused before any
    work, the message naming ``--train hf`` (:class:`~moealign.errors.UnsupportedConversionError`)."""
    if cfg.train_engine != "megatron":
        return
    from ..patches.megatron.checkpoint import check_family_convertible

    model_type = _model_type(cfg)
    try:
        check_family_convertible(model_type)
    except UnsupportedConversionError as exc:
        raise UnsupportedConversionError(_train_hf_hint(str(exc), model_type)) from None


def route_warnings(sides: dict) -> list[str]:
    """The report's warnings about the record's routes: the trainer's own top-k (the baseline run) disagreeing with
    them on more (token, layer) pairs than any engine pair does
    (:func:`~moealign.routing_replay.flips.foreign_routes`)."""
    flips = sides[False].flips
    foreign = foreign_routes(flips.router_flip_rate, pairs=flips.num_tokens * flips.num_layers)
    return [f"baseline run: {foreign}"] if foreign else []


def weights_warnings(record_contract: dict | None, trainer, train_contract: dict | None = None) -> list[str]:
    """The report's warning when the record's contract weight digests (``record_contract``, the rollout side's) and
    the trainer's weights differ, naming the layers: a record of another checkpoint. The trainer's digests are
    ``train_contract``'s (``--diagnose`` took it) or taken now at the record's rounding dtypes only (one pass over
    the weights); no warning when either side has none or no rounding is common to both."""
    rollout_weights = (record_contract or {}).get("weights") or {}
    roundings = sorted(rollout_weights.get("digests") or {})
    if not roundings:
        return []
    if train_contract is not None:
        train_weights = train_contract.get("weights")
    else:
        digests = getattr(trainer, "weight_digests", None)
        train_weights = digests(roundings) if digests is not None else None
    diff = weight_difference(rollout_weights, train_weights)
    if not diff or not diff[1]:
        return []
    rounding, layers = diff
    return [f"weights: the record's contract and the {trainer.name} trainer's checkpoint differ in "
            f"{name_layers(layers)} (digests at {rounding} rounding): the record was made from another checkpoint (or "
            f"this one changed since); its log-probs and routes are not this model's"]


def _shown_runs(runner: LeverRunner) -> dict:
    """The lever runs the report's plots show: the baseline, each lever alone (by its cause), all levers."""
    runs = {"baseline": runner.run(frozenset())}
    for player in runner.players:
        runs[CAUSES[player] if player in CAUSES else player] = runner.run(frozenset({player}))
    runs["all levers"] = runner.run(frozenset(runner.players))
    return runs


def diagnosis_sections(cfg: MismatchConfig, record, trainer, *, rollout_contract: dict | None = None,
                       pad_token_id: int | None = None, log: Callable[[str], None] | None = None,
                       sides: dict | None = None, rescored=None) -> dict:
    """``{"levers", "attribution", "diagnosis", "contract", "plots"}`` of the report: every lever set scored
    on ``record`` (:class:`~moealign.mismatch.levers.LeverRunner`), its Shapley attribution, the diagnosis
    (:func:`~moealign.mismatch.diagnose.diagnose`), both sides' contracts compared, the plots' numbers.
    ``sides``: :func:`score_record`'s passes of ``trainer`` over ``record`` (reused, not run again); ``rescored``:
    vLLM's re-scorings of the record (:func:`~moealign.mismatch.vllm_levers.rescore_first`: vLLM -> Megatron)."""
    from ..contract import compare_contracts
    from .scoring import make_train_engine

    log = log or (lambda msg: None)
    device = cfg.resolved_device()
    fault = cfg.fault

    def factory(bi: bool):
        one = dataclasses.replace(cfg, batch_invariant=bi, attention=None if bi else cfg.attention,
                                  save_record=None, load_record=None, report_dir=None, diagnose=False,
                                  inject_fault=None)
        engine = make_train_engine(one, cfg.model_path(), device)
        return ReplayOffTrainer(engine) if fault is not None and fault.kind == "replay-off" else engine

    from .vllm_levers import pair_runner

    runner = pair_runner(cfg, record, trainer, device=device, sides=sides, rescorer=rescored, log=log) or LeverRunner(
                         record=record, trainer=trainer, trainer_factory=factory, model_path=cfg.model_path(),
                         device=device, rollout_policy=cfg.rollout_precision, train_policy=cfg.train_precision,
                         batch_size=cfg.batch_size, batch_invariant=cfg.batch_invariant, attention=cfg.attention,
                         rescorable=cfg.rollout_engine == "hf" and not cfg.load_record,
                         fault=fault if fault is not None and fault.kind == "weights" else None,
                         pad_token_id=pad_token_id, max_new_tokens=None if cfg.load_record else cfg.max_new_tokens,
                         base_sides=sides, log=log)
    try:
        t0 = time.perf_counter()
        if runner.rescorable:
            exact = runner.check_base()
            log(f"levers: the record re-scored along the rollout's path {'bitwise' if exact else 'NOT'} equal")
        log(f"levers: players {runner.players}" + (f", precision regions {runner.regions}" if runner.regions else ""))
        attribution = runner.attribution()
        shown = _shown_runs(runner)
        kl = {}
        for name in ("baseline", "all levers"):
            levers = frozenset() if name == "baseline" else frozenset(runner.players)
            values = runner.full_vocab_kl(levers)
            if values is not None:
                kl[name] = values
        log(f"levers: {len(runner.runs)} lever sets scored in {time.perf_counter() - t0:.1f} s")
        train_contract = trainer.contract(cfg.sampling) if hasattr(trainer, "contract") else None
        rows = compare_contracts(rollout_contract, train_contract) if rollout_contract and train_contract else None
        runs_metrics = {name: r.metrics for name, r in shown.items()}
        runs_metrics["routing_replay"] = runner.run(frozenset({"routing_replay"})).metrics
        verdict = runner.verdict() if hasattr(runner, "verdict") else None      # vLLM -> Megatron (vllm_levers.py)
        diagnosis = diagnose(runs=runs_metrics, attribution=attribution, contract_rows=rows, notes=runner.notes,
                             verdict=verdict)
        decode = _decoder(cfg)
        kept_sizes = None
        if record.has_kept_sets:
            kept_sizes = torch.cat([s.kept_offsets[1:] - s.kept_offsets[:-1] for s in record.samples])
        lengths = [s.response_len for s in record.samples]
        plots = {
            "flip_rate": plots_mod.flip_rate(shown, record.meta.moe_layers),
            "logp_hist": plots_mod.logp_hist(shown),
            "position": plots_mod.by_position(shown, lengths),
            "is_tail": plots_mod.is_tail(shown),
            "kept_set": plots_mod.kept_set_support(shown, kept_sizes),
            "worst_tokens": plots_mod.worst_tokens(shown["baseline"], record, decode),
            "full_vocab_kl": {
                "positions": list(range(max(lengths))),
                "series": {k: plots_mod.position_means(v, lengths) for k, v in kl.items()},
                "summary": {k: {"mean": float(v.mean()), "max": float(v.max())} for k, v in kl.items()},
            } if kl else {},
        }
        levers = {"players": runner.players, "regions": runner.regions, "notes": runner.notes, "work": runner.work,
                  "decode_workers": runner.workers, **({"verdict": verdict} if verdict else {}),
                  "runs": [{"label": r.label, "levers": sorted(r.levers), "metrics": r.metrics}
                           for r in runner.runs]}
        return {"levers": levers, "attribution": {"primary": ATTRIBUTED_METRICS[0], "metrics": attribution},
                "diagnosis": diagnosis, "plots": plots,
                "contract": {"rollout": rollout_contract, "train": train_contract, "fields": rows or []}}
    finally:
        runner.close()


def _decoder(cfg: MismatchConfig):
    try:
        from ..patches.hf.loading import load_tokenizer

        tokenizer = load_tokenizer(cfg.model_path())
    except Exception:  # noqa: BLE001 - token ids are shown instead
        return None
    return lambda ids: tokenizer.decode(ids)


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
                                  save_record=None, load_record=None, report_dir=None, diagnose=False)
        out.append({"label": label, "rollout_precision": one.rollout_precision,
                    "train_precision": one.train_precision, "batch_invariant": bi,
                    "report": run_mismatch(one, progress=progress, log=log)})
    return {"configs": out}
