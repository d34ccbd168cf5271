"""The ``moealign`` command."""

from __future__ import annotations

import argparse
import json
import os  # noqa: F401 - kept for the commands added beside these
import sys

from . import __version__
from .command_output import check_json_path, finish_command
from .errors import ConfigError, MoealignError
from .options import add_shared_options, given_options


def _cmd_info(args: argparse.Namespace) -> int:
    from .info import collect_info, format_info

    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _cmd_mismatch(args: argparse.Namespace) -> int:
    from .mismatch import (
        MismatchConfig,
        check_fail_above,
        format_sweep,
        format_table,
        parse_fail_above,
        run_mismatch,
        run_sweep,
    )

    bounds = parse_fail_above(args.fail_above)
    below = parse_fail_above(args.fail_below, below=True)
    if args.sweep and (args.load_record or args.save_record):
        raise ConfigError("--sweep runs its own rollouts: it cannot be combined with --load-record / --save-record")
    # the main job's engines are the ones RL runs use: vLLM rolls out, Megatron trains
    rollout = args.rollout or (None if args.load_record else CLI_ROLLOUT)
    train = args.train or CLI_TRAIN
    hf_only = [flag for flag, given in (("--sweep", args.sweep), ("--batch-invariant", args.batch_invariant),
                                        ("--attention", args.attention is not None)) if given]
    if hf_only and not (args.rollout and args.train) and (rollout == "vllm" or train == "megatron"):
        raise ConfigError(f"{', '.join(hf_only)}: transformers-engine options (batch-invariant attention, the "
                          f"precision sweep); the default engines are --rollout {CLI_ROLLOUT} --train {CLI_TRAIN}: add "
                          f"--rollout hf --train hf")
    cfg = MismatchConfig(
        **given_options(args), rollout_engine=rollout, train_engine=train, rollout_dtype=args.rollout_dtype,
        train_dtype=args.train_dtype, batch_invariant=args.batch_invariant, attention=args.attention,
        top_k=args.top_k, min_p=args.min_p, batch_size=args.batch_size, prompts_file=args.prompts,
        save_record=args.save_record, load_record=args.load_record, diagnose=bool(args.diagnose),
        inject_fault=args.inject_fault, aligned_skip=_aligned_skip(args.aligned_skip))
    if args.sweep and (args.diagnose or args.report or args.inject_fault):
        raise ConfigError("--sweep runs one configuration after another: --diagnose / --report / --inject-fault apply "
                          "to one mismatch test; drop --sweep")
    check_json_path(args.json, cfg.inputs(), cfg.outputs(), created_dirs=[cfg.report_dir])
    progress = not args.quiet and sys.stderr.isatty()
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.contract:
        return _mismatch_contract(cfg, args, log)
    if args.sweep:
        sweep = run_sweep(cfg, progress=progress, log=log)
        report = sweep["configs"][-1]["report"]          # the gates judge the fully aligned config
    else:
        report = run_mismatch(cfg, progress=progress, log=log)
    table = format_sweep(sweep) if args.sweep else format_table(report)
    if not args.sweep and "aligned" in report:
        from .mismatch.aligned import format_aligned

        table += "\n" + format_aligned(report["aligned"])
    if not args.sweep and "diagnosis" in report:
        from .mismatch.report import format_diagnosis

        table += "\n\n" + format_diagnosis(report)
    if args.sweep:
        warned = [f"{c['label']}: {w}" for c in sweep["configs"] for w in c["report"].get("warnings", [])]
    else:
        warned = report.get("warnings", [])
    return finish_command("mismatch", table,
                   sweep if args.sweep else report, args.json, check_fail_above(report, bounds, below), warned)


def _mismatch_contract(cfg, args: argparse.Namespace, log) -> int:
    """``mismatch --contract``: both sides' execution contracts compared; exit 3 naming each gap field."""
    from .contract import format_contract, gap_lines
    from .mismatch.contract_check import run_contract_check

    other = [f for f, given in (("--sweep", args.sweep), ("--save-record", args.save_record),
                                ("--fail-above", args.fail_above), ("--fail-below", args.fail_below),
                                ("--diagnose", args.diagnose), ("--report", args.report),
                                ("--inject-fault", args.inject_fault)) if given]
    if other:
        raise ConfigError(f"{', '.join(other)}: --contract compares the two sides' configurations and scores nothing; "
                          f"drop {'them' if len(other) > 1 else 'it'}")
    result = run_contract_check(cfg, log=log)
    return finish_command("mismatch", format_contract(result["fields"]), result, args.json, gap_lines(result["fields"]))


def _aligned_skip(text: str | None) -> tuple:
    """``--aligned-skip attention,rope`` -> ``("attention", "rope")`` (checked by MismatchConfig)."""
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


#: The engines of ``moealign mismatch`` when --rollout / --train are not given (the API's MismatchConfig keeps
#: transformers on both sides).
CLI_ROLLOUT, CLI_TRAIN = "vllm", "megatron"


def _add_mismatch(sub) -> None:
    from .mismatch.report import HIGHER_IS_BETTER, LOWER_IS_BETTER, TWO_SIDED
    from .mismatch.engines import DTYPES, ROLLOUT_ENGINES, TRAIN_ENGINES

    p = sub.add_parser(
        "mismatch",
        help="same checkpoint, same inputs: rollout engine vs training engine, per alignment lever",
        description="Zero-staleness mismatch test. The rollout engine samples responses (recording log-probs, "
        "routes and kept sets); the training engine recomputes the same tokens' log-probs without alignment, "
        "with routing replay, with the sampling mask, and with both. With no arguments it runs the embedded "
        "tiny MoE model on CPU, vLLM rolling out and Megatron-core training (the engines RL runs use).")
    add_shared_options(p, defaults={"rollout_precision": "bf16", "train_precision": "fp32", "rollout_tp": 1,
                                    "num_prompts": 32, "max_new_tokens": 48, "seed": 0, "temperature": 1.0,
                                    "top_p": 0.9, "device": "auto"}, help={
        "rollout_tp": "--rollout vllm: tensor-parallel size (stock reductions unless the vLLM plugin's tree reductions "
                      "are on: MOEALIGN_VLLM_PATCHES=tree)",
        "aligned": "the canonical forward on both engines (--rollout vllm|hf, --train megatron|hf; CPU, or CUDA with "
                   "--rollout hf): "
                   "every op (linear, norm, "
                   "RoPE, attention, router, experts, LM head, log-softmax) one moealign implementation, so the fully "
                   "aligned run is bitwise equal; one precision on both sides (default bf16)",
        "json": "write the report as JSON (with --sweep: every configuration's)",
        "report_dir": "write DIR/report.html (self-contained, plots) and DIR/report.json; implies --diagnose",
        "fail_above": "exit 3 when the fully aligned run's METRIC exceeds VALUE (repeatable; with --sweep: the fully "
                      "aligned configuration's; a record without kept sets: the routing_replay run); metrics where "
                      "lower is better: " + ", ".join(LOWER_IS_BETTER + TWO_SIDED)})
    p.add_argument("--rollout", choices=sorted(ROLLOUT_ENGINES),
                   help=f"rollout engine (default {CLI_ROLLOUT}; hf: transformers generate())")
    p.add_argument("--rollout-dtype", choices=sorted(DTYPES), help="alias of --rollout-precision for plain dtypes")
    p.add_argument("--train", choices=sorted(TRAIN_ENGINES),
                   help=f"training engine (default {CLI_TRAIN}; hf: a transformers full-sequence forward)")
    p.add_argument("--train-dtype", choices=sorted(DTYPES), help="alias of --train-precision for plain dtypes")
    p.add_argument("--batch-invariant", action="store_true",
                   help="run rollout and training under batch-invariant ops (fixed-tile matmuls, fixed-tree "
                   "reductions; batch-invariant attention in the transformers engines)")
    p.add_argument("--attention", choices=["sdpa", "eager", "bi"],
                   help="attention of the transformers engines (default: bi, the batch-invariant attention, with "
                   "--batch-invariant, else transformers' default, sdpa); --batch-invariant --attention sdpa or "
                   "eager leaves a decode-vs-full gap")
    p.add_argument("--aligned-skip", metavar="OPS",
                   help="with --aligned: leave these canonical ops stock (comma-separated; a negative control)")
    p.add_argument("--sweep", action="store_true",
                   help="run the standard precision configurations on the same prompts (bf16 vs fp32, fp16 vs "
                   "fp16, fp8 aligned, fp8 vs bf16, fp32 vs fp32, fully aligned) and print one compact table; "
                   "the precision options are ignored")
    p.add_argument("--top-k", type=int, help="0 = off (default)")
    p.add_argument("--min-p", type=float, help="0 = off (default)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per generate() / training forward")
    p.add_argument("--prompts", metavar="FILE", help="a JSON list of prompt strings (default: the shipped set)")
    p.add_argument("--save-record", metavar="PATH", help="also write the rollout record (safetensors)")
    p.add_argument("--load-record", metavar="PATH",
                   help="skip the rollout; score a saved record with its own sampling parameters (rollout options "
                   "such as --temperature or --rollout-precision are refused with it)")
    p.add_argument("--diagnose", action="store_true",
                   help="score the record with every combination of levers (sampling mask, routing replay, precision "
                   "per region, batch-invariant ops, weights), attribute the gap to its causes (Shapley values), "
                   "compare both sides' execution contracts, and print the diagnosis: the lever to turn on first, "
                   "what remains, the correction preset for it")
    p.add_argument("--inject-fault", metavar="SPEC",
                   help="inject a known fault to check the diagnosis names it: weights:layer=L[,scale=S] (the rollout "
                   "side's layer L perturbed; --rollout hf) or replay-off (the trainer's replay does nothing)")
    p.add_argument("--fail-below", action="append", metavar="METRIC=VALUE",
                   help="exit 3 when the judged run's METRIC is below VALUE (repeatable); metrics where higher is "
                   "better: " + ", ".join(HIGHER_IS_BETTER + TWO_SIDED))
    p.add_argument("--contract", action="store_true",
                   help="score nothing: compare the two sides' execution contracts (engine, region dtypes, kernels, "
                   "TP/EP/SP/CP, switches, sampling, weight digests) field by field; exit 3 naming each field known "
                   "to cause a gap (the rollout side's from the record with --load-record)")
    p.set_defaults(func=_cmd_mismatch)


def _cmd_tp_check(args: argparse.Namespace) -> int:
    from .tp_check import format_results, parse_world_sizes, run_tp_check, run_vllm_tp_check, tree_failures

    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    check_json_path(args.json, {"--model": args.model})
    if args.engine == "vllm":
        if args.repeats is not None:
            raise ConfigError("--repeats times the op-level check; --engine vllm times one generate per run")
        sizes = parse_world_sizes(args.world_sizes or "2")
        report = run_vllm_tp_check(sizes, model=args.model, dtype=args.dtype or "bf16",
                                   seed=0 if args.seed is None else args.seed, log=log)
    else:
        given = [flag for flag, value in (("--model", args.model), ("--dtype", args.dtype)) if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} only apply with --engine vllm (the op-level check builds its "
                              "own inputs)")
        report = run_tp_check(parse_world_sizes(args.world_sizes or "1,2,4"),
                              seed=0 if args.seed is None else args.seed,
                              repeats=3 if args.repeats is None else args.repeats, log=log)
    return finish_command("tp-check", format_results(report), report, args.json, tree_failures(report))


def _add_tp_check(sub) -> None:
    p = sub.add_parser(
        "tp-check",
        help="tree vs stock TP reductions: bitwise equal to TP=1? (real gloo processes, or vLLM itself)",
        description="--engine torch (default): spawns torch.distributed gloo processes per world size and runs "
        "the row-parallel linear (fp32, bf16), the vocab-parallel selected-token log-prob and a sharded sum, each "
        "through the TP-invariant tree path and the stock path (per-shard op + all_reduce SUM, the negative "
        "control). --engine vllm: the whole model in vLLM at each TP size (CPU: one core per rank) against TP=1, "
        "stock vLLM and with moealign's tree forward in every worker; compares prompt log-probs and sampled "
        "tokens / log-probs. Reports per op and world size whether every result equals TP=1 bitwise, and the "
        "time. Exit code 3 when a tree result differs.")
    p.add_argument("--engine", choices=("torch", "vllm"), default="torch",
                   help="torch: the ops in gloo processes (default); vllm: the model in vLLM")
    p.add_argument("--world-sizes", default=None, metavar="LIST",
                   help="comma-separated powers of two (default 1,2,4; --engine vllm: 2)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="--engine vllm: local checkpoint (default: the embedded model)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"), help="--engine vllm: default bf16")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--seed", type=int, default=None, help="default 0")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per op (default 3; the fastest counts)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show the engines' expected start-up warnings (Megatron's transformer-engine / Apex fallbacks)")
    p.set_defaults(func=_cmd_tp_check)


def _cmd_record_inspect(args: argparse.Namespace) -> int:
    from .record import RolloutRecord
    from .record.inspect import format_inspection, inspect_record

    check_json_path(args.json, {"record": args.file, "--model": args.model})
    model_layers = check = None
    if args.model is not None:
        from functools import partial

        from .mismatch.router_check import router_check
        from .model_config import moe_layers, read_model_config

        model_layers = moe_layers(read_model_config(args.model), f"--model {args.model}")
        check = partial(router_check, model_path=args.model)
    result = inspect_record(RolloutRecord.load(args.file), model_moe_layers=model_layers, router_check=check)
    failures = [f"{f['check']}: {f['detail']}" for f in result["findings"]]
    return finish_command("record inspect", format_inspection(result), result, args.json, failures)


def _cmd_record_convert(args: argparse.Namespace) -> int:
    from .record.convert import run

    print(run(args))
    return 0


def _add_record_convert(rsub) -> None:
    from .record.convert import FORMATS, WRITABLE

    c = rsub.add_parser(
        "convert", help="another engine's rollout outputs -> a record (--from), or a record -> a batch file (--to)",
        description="--from FORMAT INPUT --model DIR -o OUT.safetensors: read INPUT, an engine's or framework's "
        "rollout outputs, into a record for the model of DIR (config.json: MoE layers, experts, top-k; the router "
        "signature from its safetensors files when present); route rows the engine did not report are marked "
        "missing, never filled. INPUT per format: sglang: a JSON list of {input_ids, meta_info} (the /generate "
        "responses' meta_info with routed_experts and output_token_logprobs); vllm-0.21: a JSON list of vLLM 0.21 "
        "OpenAI-server responses (return_token_ids, logprobs; prompt_routed_experts and per-choice routed_experts); "
        "trtllm: a JSON list of {prompt_token_ids, outputs: [{token_ids, logprobs, routed_experts}]} (TensorRT-LLM's "
        "LLM API results); nemo-rl: a .pt/.safetensors/.npz dict of NeMo-RL's generation batch (output_ids, "
        "logprobs, generation_lengths, unpadded_sequence_lengths, routed_experts); verl: the same with a verl "
        "batch's tensors (prompts, responses, attention_mask, rollout_log_probs, routed_experts); slime: slime's "
        "--save-debug-rollout-data file or a train_data dict (torch.save). JSON entries may carry sampling_params; "
        "otherwise --temperature/--top-p/--top-k/--min-p apply. --to FORMAT RECORD -o OUT.pt: write a record as "
        f"the batch of {', '.join(WRITABLE)} (torch.save). Exit code 2 on any bad input, with one line naming it.")
    c.add_argument("input", metavar="INPUT", help="the file to convert (--from: the engine's outputs; --to: a record)")
    c.add_argument("--from", dest="from_format", choices=sorted(FORMATS), help="the format of INPUT")
    c.add_argument("--to", dest="to_format", choices=WRITABLE, help="write the record INPUT in this format")
    c.add_argument("-o", "--output", required=True, metavar="PATH", help="the file to write (atomically)")
    c.add_argument("--model", metavar="DIR", help="--from: the checkpoint the outputs come from (config.json)")
    c.add_argument("--engine-version", metavar="V", help="--from: the record's engine_version (default: vllm-0.21: "
                   "0.21, else unknown)")
    c.add_argument("--dtype", metavar="NAME", help="--from: the dtype the engine ran (default: config.json's)")
    c.add_argument("--temperature", type=float, help="--from: sampling temperature of entries without "
                   "sampling_params (default 1.0)")
    c.add_argument("--top-p", type=float, help="--from: default 1.0 (off)")
    c.add_argument("--top-k", type=int, help="--from: default 0 (off)")
    c.add_argument("--min-p", type=float, help="--from: default 0.0 (off)")
    c.add_argument("--expert-ids", choices=("logical", "physical"), default="logical",
                   help="trtllm: the ids are logical experts (TensorRT-LLM's Router Replay, default) or EPLB slots")
    c.add_argument("--eplb", metavar="FILE", help="trtllm with --expert-ids physical: the run's MoeLoadBalancerConfig "
                   "(JSON or YAML: initial_global_assignments, num_slots)")
    c.set_defaults(func=_cmd_record_convert)


def _add_record(sub) -> None:
    p = sub.add_parser("record", help="rollout records: inspect, convert")
    rsub = p.add_subparsers(dest="record_command", metavar="ACTION")
    q = rsub.add_parser(
        "inspect", help="what a record holds, and the patterns of a broken route capture",
        description="Prints the record's engine, model, layers, experts, rows, route dtype, missing-row fraction "
        "and kept sets, and checks it for the patterns of a broken capture: all-zero route rows, a layer that "
        "routes every token alike, every layer identical, one expert set everywhere, and (with --model) routes "
        "for layers the model runs dense. Exit code 3 when any is found, 2 when the file does not load (corrupt, "
        "rows that do not match the tokens, ids out of range). With --model the checkpoint's routers also run on the "
        "record's tokens (transformers, fp32, no generation): a record whose expert sets are the model's own on fewer "
        "than half the (row, layer) pairs (foreign_routes: shifted or permuted rows, another model's record) or "
        "that does not fit the checkpoint (other_model) is a finding.")
    q.add_argument("file", metavar="FILE", help="a record (.safetensors) written by moealign")
    q.add_argument("--model", metavar="DIR", default=None, help="the checkpoint it was recorded from (its config "
                   "decides which layers are MoE; its routers, when it holds weights, are run on the record's tokens)")
    q.add_argument("--json", metavar="PATH", help="write the summary and findings as JSON")
    q.set_defaults(func=_cmd_record_inspect)
    _add_record_convert(rsub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``moealign mismatch: error: ...`` and exit code 2, no usage dump."""

    def error(self, message: str):
        raise _UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


class _UsageError(ConfigError):
    """A bad command line (argparse's complaint), printed as it is."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moealign",
        description="Make MoE RL runs on-policy: routing replay, sampling-mask replay, precision alignment, "
        "invariant reductions and rollout correction.",
    )
    parser.add_argument("--version", action="version", version=f"moealign {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_info = sub.add_parser("info", help="torch, engines (versions or why not importable), GPUs via NVML")
    p_info.add_argument("--json", action="store_true", help="print the report as JSON")
    p_info.add_argument("-v", "--verbose", action="store_true",
                        help="also show the engines' import-time warnings (Megatron's transformer-engine / Apex fallbacks)")
    p_info.set_defaults(func=_cmd_info)
    _add_mismatch(sub)
    _add_tp_check(sub)
    _add_record(sub)
    from .rl.cli import add_rl_check

    add_rl_check(sub)
    return parser


def _resolve_embedded(args: argparse.Namespace) -> None:
    """``--model embedded:NAME`` (every command that takes ``--model``) -> the embedded model's directory."""
    model = getattr(args, "model", None)
    if isinstance(model, str):
        from .embedded import EMBEDDED_PREFIX, checkpoint_path

        if model.startswith(EMBEDDED_PREFIX):
            args.model = checkpoint_path(model)


def main(argv: list[str] | None = None) -> int:
    """Run one command. Bad arguments and every :class:`~moealign.errors.MoealignError` end in one line on
    stderr and exit code 2 (never a traceback); ``--fail-above`` violations exit 3."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    restore = lambda: None                          # noqa: E731
    if not getattr(args, "verbose", False):         # the engines' expected start-up output (shown with -v)
        from .patches.megatron.version import quiet_fallback_warnings
        from .patches.vllm.engine import quiet_expected_warnings

        quiet_fallback_warnings()
        restore = quiet_expected_warnings()
    try:
        _resolve_embedded(args)
        return args.func(args)
    except MoealignError as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"moealign {args.command}: error: {type(exc).__name__}: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moealign {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
