"""``moealign rl-check``: the argparse side (the parser entry :func:`add_rl_check`, the command :func:`cmd_rl_check`)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_rl_check", "cmd_rl_check"]


def cmd_rl_check(args: argparse.Namespace) -> int:
    from ..command_output import finish_command
    from ..options import given_options
    from .config import RLCheckConfig, parse_fail_above
    from .loop import run_rl_check
    from .report import check_steps, format_steps, write_report_dir

    bounds = parse_fail_above(args.fail_above)
    cfg = RLCheckConfig(**given_options(args), steps=args.steps, group_size=args.group_size, lr=args.lr,
                        levers=args.levers, correction=args.correction, staleness=args.staleness,
                        verify=not args.no_verify, json=args.json, fail_above=bounds, compare=args.compare)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    report = run_rl_check(cfg, log=log)
    failures = check_steps(report, bounds)
    if cfg.report_dir:
        paths = write_report_dir(report, cfg.report_dir)
        log(f"report: {paths['html']}")
    return finish_command("rl-check", format_steps(report), report, args.json, failures)


def add_rl_check(sub) -> None:
    from ..correction.config import PRESETS
    from ..options import add_shared_options
    from .config import DEFAULT_CORRECTION, LEVERS

    p = sub.add_parser(
        "rl-check",
        help="K steps of RL (vLLM rollouts, Megatron training, in-place refits): mismatch measured and refit "
             "verified at every step",
        description="Certify alignment through weight refits. Each step: vLLM samples --group-size completions per "
        "prompt (routes and kept sets recorded); a verifiable reward (balanced brackets) and group-relative "
        "advantages; Megatron-core re-computes the log-probs with the chosen --levers, applies the rollout "
        "correction and takes an Adam step; the weights are refit into the running vLLM engine in place and "
        "verified (every worker's tensors against the trainer's, and a probe forward within the step-0 bound). "
        "With no arguments it runs the embedded model on CPU.")
    add_shared_options(p, defaults={"rollout_precision": "bf16", "train_precision": "fp32", "rollout_tp": 1,
                                    "num_prompts": 32, "max_new_tokens": 32, "seed": 0, "temperature": 1.0,
                                    "top_p": 0.9, "device": "auto"}, help={
        "aligned": "the canonical forward on both engines (moealign mismatch --aligned): the trainer's log-probs "
                   "bitwise equal to the rollout's at every step, through the refits; one precision (default bf16)",
        "json": "write the report (header + one object per step) as JSON",
        "report_dir": "write DIR/report.html (plots over steps) and DIR/report.json",
        "fail_above": "exit 3 when METRIC (one rl-check reports per step, e.g. kl_k3, router_flip_rate) exceeds VALUE "
                      "at any step of the judged (aligned) run; a failed refit verification also exits 3"})
    p.add_argument("--steps", type=int, default=8, help="RL steps (default 8)")
    p.add_argument("--group-size", type=int, default=4, help="completions per prompt (default 4, at least 2)")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (default 2e-3; 0: a no-op "
                   "update, the weights never change)")
    p.add_argument("--levers", choices=list(LEVERS), default="all",
                   help="alignment levers of the trainer: routing replay, the sampling mask, both (default) or none")
    p.add_argument("--correction", default=DEFAULT_CORRECTION, metavar="PRESET",
                   help=f"rollout-correction preset (default {DEFAULT_CORRECTION}): "
                   + ", ".join(sorted(n for n in PRESETS if not n.startswith("bypass"))))
    p.add_argument("--staleness", type=int, default=0, metavar="N",
                   help="rollouts from the weights of N steps earlier (asynchronous RL; default 0)")
    p.add_argument("--no-verify", action="store_true", help="skip the refit verification (for overhead benchmarks)")
    p.add_argument("--compare", action="store_true",
                   help="run the stock loop (levers none) and the aligned loop from the same seed, side by side")
    p.set_defaults(func=cmd_rl_check)
