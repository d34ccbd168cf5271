"""The options ``moealign mismatch`` and ``moealign rl-check`` share: each flag defined once, each value checked once.

Both commands roll the same model out with vLLM and score it with Megatron, so they take the same flags for the
model, the sampling, the precisions, the rollout's TP size, the device, ``--aligned``, the outputs and the log
level, and the training side's parallel layout (``--train-tp`` / ``--train-ep`` / ``--train-pp``,
``--train-dispatcher``: :func:`check_train_parallel`). :func:`add_shared_options` adds them to a command's parser (every default ``None``: "not given", so each
command fills in its own defaults, and ``mismatch --load-record`` can refuse a rollout option that was given);
:func:`given_options` reads them back as config fields. The checks (:func:`check_device`, :func:`check_count`,
:func:`check_seed`, :func:`check_sampling`, :func:`check_model`) are the ones both configs
(:class:`moealign.mismatch.MismatchConfig`, :class:`moealign.rl.RLCheckConfig`) call, so a value means the same and
is refused with the same words in both.
"""

from __future__ import annotations

import argparse
import os
import pathlib

import torch

from ._files import check_input_file
from .errors import ConfigError, RecordError
from .model_config import check_max_new_tokens, read_model_config
from .record import SamplingParams

__all__ = ["SHARED_FIELDS", "COUNT_BOUNDS", "add_shared_options", "given_options", "check_device", "check_count", "check_seed",
           "check_sampling", "check_checkpoint", "check_model", "check_aligned_run", "TRAIN_PARALLEL_FIELDS",
           "check_train_parallel", "train_parallel_note", "check_rollout_parallel"]

#: ``(flag, config field)`` of every shared option that a config takes (``--json``, ``--fail-above``, ``-q``, ``-v``
#: are shared too, but the commands act on them themselves).
SHARED_FIELDS = (("--model", "model"), ("--rollout-precision", "rollout_precision"),
                 ("--train-precision", "train_precision"), ("--rollout-tp", "rollout_tp"),
                 ("--num-prompts", "num_prompts"), ("--max-new-tokens", "max_new_tokens"), ("--seed", "seed"),
                 ("--temperature", "temperature"), ("--top-p", "top_p"), ("--device", "device"),
                 ("--aligned", "aligned"), ("--report", "report_dir"), ("--train-tp", "train_tp"),
                 ("--train-ep", "train_ep"), ("--train-pp", "train_pp"), ("--train-dispatcher", "train_dispatcher"),
                 ("--rollout-ep", "rollout_ep"), ("--rollout-dp", "rollout_dp"))

#: The config fields of the training side's parallel sizes (``--train-tp`` / ``--train-ep`` / ``--train-pp``, default 1
#: each): any of them above 1 runs the sharded Megatron trainer
#: (:class:`~moealign.patches.megatron.sharded.ShardedMegatronTrainer`, one process per rank).
TRAIN_PARALLEL_FIELDS = ("train_tp", "train_ep", "train_pp")


def add_shared_options(p: argparse.ArgumentParser, *, defaults: dict, help: dict | None = None) -> None:
    """Add the shared flags to ``p``. ``defaults``: the command's default per config field (shown in the help
    only: the parser's own default is None, "not given"); ``help``: a command's own sentence for a field."""
    from .precision.policy import POLICIES

    text = dict(help or {})
    policies = ", ".join(sorted(POLICIES))

    def h(field: str, base: str) -> str:
        default = defaults.get(field)
        return text.get(field, base) + ("" if default is None else f" (default {default})")

    p.add_argument("--model", metavar="PATH",
                   help=h("model", "a local transformers MoE checkpoint (default: the embedded model)"))
    p.add_argument("--rollout-precision", metavar="NAME", help=h("rollout_precision",
                   f"the rollout engine's precision policy: {policies}"))
    p.add_argument("--train-precision", metavar="NAME", help=h("train_precision",
                   f"the training engine's precision policy: {policies}"))
    p.add_argument("--rollout-tp", type=int, metavar="N", help=h("rollout_tp", "vLLM tensor-parallel size"))
    p.add_argument("--num-prompts", type=int, metavar="N", help=h("num_prompts", "prompts from the prompt set"))
    p.add_argument("--max-new-tokens", type=int, metavar="N", help=h("max_new_tokens", "new tokens per completion"))
    p.add_argument("--seed", type=int, help=h("seed", "sampling seed"))
    p.add_argument("--temperature", type=float, help=h("temperature", "sampling temperature (at least 1e-5)"))
    p.add_argument("--top-p", type=float, help=h("top_p", "nucleus sampling (1 = off)"))
    p.add_argument("--device", help=h("device", "cpu, cuda, cuda:N or auto"))
    from .patches.megatron.sharded import DISPATCHERS

    p.add_argument("--rollout-ep", type=int, metavar="N", help=h("rollout_ep", "vLLM expert parallelism "
                   "(enable_expert_parallel over N = TP x DP ranks); refused where it cannot run: docs/scale.md"))
    p.add_argument("--rollout-dp", type=int, metavar="N", help=h("rollout_dp", "vLLM data-parallel size; refused "
                   "where it cannot run: docs/scale.md"))
    p.add_argument("--train-tp", type=int, metavar="N", help=h("train_tp", "Megatron tensor-parallel size of the trainer "
                   "(any of --train-tp / --train-ep / --train-pp above 1: the sharded trainer, one process per rank; "
                   "docs/scale.md)"))
    p.add_argument("--train-ep", type=int, metavar="N", help=h("train_ep", "Megatron expert-parallel size of the trainer "
                   "(the data-parallel size is the smallest Megatron accepts: EP)"))
    p.add_argument("--train-pp", type=int, metavar="N", help=h("train_pp", "Megatron pipeline-parallel size of the "
                   "trainer (Megatron's pipeline schedule over micro-batches)"))
    p.add_argument("--train-dispatcher", choices=DISPATCHERS, help=h("train_dispatcher",
                   "the sharded trainer's MoE token dispatcher (Megatron's moe_token_dispatcher_type)"))
    p.add_argument("--aligned", action="store_true", default=None, help=text.get("aligned",
                   "the canonical forward on both engines: bitwise equal log-probs; one precision on both sides"))
    p.add_argument("--json", metavar="PATH", help=text.get("json", "write the report as JSON"))
    p.add_argument("--report", metavar="DIR", help=text.get("report_dir",
                   "write DIR/report.html (self-contained, plots) and DIR/report.json"))
    p.add_argument("--fail-above", action="append", metavar="METRIC=VALUE",
                   help=text.get("fail_above", "exit 3 when METRIC exceeds VALUE (repeatable)"))
    p.add_argument("-q", "--quiet", action="store_true", help="no progress or log lines on stderr")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show the engines' expected start-up warnings (Megatron's transformer-engine / Apex "
                   "fallbacks)")


def given_options(args: argparse.Namespace) -> dict:
    """``{config field: value}`` of the shared options given on the command line (the others are left to the
    config's defaults). ``mismatch --contract`` with a sharded trainer (any ``--train-tp`` / ``--train-ep`` /
    ``--train-pp`` above 1) is refused here, the one place that sees both: the sharded trainer has no execution
    contract yet."""
    given = {field: getattr(args, field if field != "report_dir" else "report")
             for _, field in SHARED_FIELDS
             if getattr(args, field if field != "report_dir" else "report", None) is not None}
    if getattr(args, "contract", False) and any(given.get(field, 1) != 1 for field in TRAIN_PARALLEL_FIELDS):
        raise ConfigError("--contract with --train-tp / --train-ep / --train-pp above 1: the sharded Megatron trainer "
                          "has no execution contract yet (its weight digests are spread over its ranks); run --contract "
                          "with the single-rank trainer (the same checkpoint, the same precision)")
    return given


def check_device(value) -> str:
    """``--device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` of a GPU this machine has (parsed by torch, never
    prefix-matched)."""
    if value == "auto":
        return value
    if not isinstance(value, str):
        raise ConfigError(f"--device must be a string (cpu, cuda, cuda:N or auto), got {value!r}")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"--device {value!r}: not a device (cpu, cuda, cuda:N or auto)") from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {value!r}: moealign runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {value!r}: CUDA is not available on this machine (use cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {value!r}: this machine has {torch.cuda.device_count()} GPUs")
    return value


def _flag(field: str) -> str:
    return {"report_dir": "--report"}.get(field, "--" + field.replace("_", "-"))


#: ``(low, high)`` of the shared integer options (``--max-new-tokens`` is also bounded by the model's positions).
COUNT_BOUNDS = {"num_prompts": (1, 100_000), "max_new_tokens": (1, 100_000), "rollout_tp": (1, 4096),
                "train_tp": (1, 4096), "train_ep": (1, 4096), "train_pp": (1, 4096), "rollout_ep": (1, 4096),
                "rollout_dp": (1, 4096)}


def check_count(field: str, value, low: int | None = None, high: int | None = None) -> int:
    """An integer option (``--num-prompts``, ``--max-new-tokens``, ``--rollout-tp``, ...) in ``[low, high]``; a
    shared option's bounds are :data:`COUNT_BOUNDS` (the same in every command) unless given."""
    if low is None and high is None:
        low, high = COUNT_BOUNDS.get(field, (1, None))
    low = 1 if low is None else low
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{_flag(field)} must be an integer {span}, got {value!r}")
    return value


def check_seed(value) -> int:
    """``--seed``: an integer in ``[0, 2**63)``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 63:
        raise ConfigError(f"--seed must be an integer in [0, 2**63), got {value!r}")
    return value


def check_sampling(temperature, top_p, top_k=0, min_p=0.0) -> SamplingParams:
    """The sampling options as the record states them (:class:`~moealign.record.SamplingParams`'s bounds), each
    error naming the flag."""
    for field, value in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{_flag(field)} must be a number, got {value!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ConfigError(f"--top-k must be an integer, got {top_k!r}")
    try:
        return SamplingParams(temperature=float(temperature), top_k=top_k, top_p=float(top_p), min_p=float(min_p))
    except RecordError as exc:           # SamplingParams names the field; the command line names the flag
        name = next((n for n in ("temperature", "top_k", "top_p", "min_p") if f"sampling {n} " in str(exc)), None)
        raise ConfigError(f"{_flag(name) + ': ' if name else ''}{exc}") from None


def check_checkpoint(path: str) -> dict:
    """Check a local checkpoint before any work starts and return its ``config.json``: the directory exists
    (moealign never goes to the network), ``config.json`` is a JSON object, and every safetensors file has a
    readable header whose tensors lie inside the file (a truncated download is named, not met as a loader's
    traceback minutes later)."""
    root = pathlib.Path(path)
    if not root.is_dir() or not os.path.lexists(root / "config.json"):
        raise ConfigError(f"--model {path}: not a local checkpoint directory with a config.json (moealign loads local "
                          f"checkpoints only, never from the network)")
    config = read_model_config(path)
    weights = sorted(root.glob("*.safetensors"))
    if not weights and not any(root.glob("*.bin")):
        raise ConfigError(f"--model {path}: no weights (*.safetensors) in the checkpoint directory")
    for file in weights:
        _check_safetensors(file)
    return config


def _check_safetensors(file: pathlib.Path) -> None:
    """safetensors' own header check (it refuses a header that does not parse or tensors the file does not
    cover, reading the header only)."""
    from safetensors import safe_open

    check_input_file(file, "--model:")                      # a FIFO named *.safetensors must not block
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: all mean "not loadable"
        raise ConfigError(f"--model: {file} is truncated or not a safetensors file ({exc})") from None


def check_model(model: str | None, model_path: str, max_new_tokens: int) -> dict:
    """``--model`` (None: the embedded model at ``model_path``) and ``--max-new-tokens`` against it: the checkpoint
    checked (:func:`check_checkpoint`), its ``config.json`` returned, the new tokens within its positions. The
    tensors are checked against the config by the caller, last (:func:`moealign.checkpoint_check.
    check_checkpoint_tensors`), so the options' own refusals come first."""
    config = check_checkpoint(model) if model is not None else read_model_config(model_path)
    check_max_new_tokens(config, max_new_tokens, "the model" if model else "the embedded model")
    return config


def check_aligned_run(model_path: str, *, rollout_precision: str, train_precision: str, device: str,
                      rollout_tp: int, train_tp: int = 1, rollout_engine: str = "vllm",
                      train_sharded: bool = False) -> None:
    """``--aligned``, the checks every command makes (each refusal names its reason): one plain precision on both
    sides (fp32 or bf16), a checkpoint whose every op the canonical forward covers
    (:func:`~moealign.precision.canonical.check_canonical_model`) and rollout and trainer TP sizes its trees cut
    (:func:`~moealign.precision.canonical.check_canonical_tp`; the sharded trainer's EP and PP need no cut:
    :mod:`moealign.patches.megatron.canonical`). On CUDA (the Triton kernels, ``canonical_triton``): the transformers
    rollout engine only (``rollout_engine="hf"``; vLLM's CUDA build cannot be installed beside the project's torch),
    a family with a kernel for every op (:data:`~moealign.precision.canonical.TRITON_FAMILIES`), one trainer rank and
    what :func:`~moealign.precision.canonical_triton.check_canonical_cuda` refuses (no Triton, an older GPU, TF32)."""
    from .precision.canonical import TRITON_FAMILIES, check_canonical_model, check_canonical_tp, default_backend

    default_backend()                        # MOEALIGN_CANONICAL_BACKEND, if set, names a backend
    if rollout_precision != train_precision or rollout_precision not in ("fp32", "bf16"):
        raise ConfigError(f"--aligned covers one plain precision on both sides (fp32 or bf16), not rollout "
                          f"{rollout_precision} / train {train_precision}")
    cuda = device != "cpu"
    if cuda and rollout_engine != "hf":
        raise ConfigError(f"--aligned --rollout {rollout_engine} on {device}: vLLM's CUDA build pins another torch "
                          "(vLLM 0.33's wheel needs torch 2.14) and cannot be installed beside the project's GPU torch; "
                          "no vLLM CUDA binding of the canonical kernels exists (use --rollout hf on a GPU, or "
                          "--device cpu)")
    config = read_model_config(model_path)
    check_canonical_model(config)
    check_canonical_tp(config, rollout_tp, "--rollout-tp", rollout=rollout_engine == "vllm")
    check_canonical_tp(config, train_tp, "--train-tp")
    if not cuda:
        return
    family = config.get("model_type")
    if family not in TRITON_FAMILIES:
        raise ConfigError(f"--aligned on {device} covers {list(TRITON_FAMILIES)} checkpoints; model_type {family!r} is "
                          f"not covered there (DeepSeek-V3's sigmoid grouped router, MLA's rope and value head dim have "
                          f"no Triton kernels; use --device cpu)")
    if train_tp > 1 or train_sharded:
        raise ConfigError(f"--aligned on {device} runs the trainer on one rank: TP > 1 on CUDA needs each shard's "
                          "tree_linear_partial roots added by tree_all_reduce over NCCL, and the sharded trainer has "
                          "not run the Triton kernels (drop --train-tp / --train-ep / --train-pp)")
    from .precision.canonical_triton import check_canonical_cuda

    check_canonical_cuda(device, {"fp32": torch.float32, "bf16": torch.bfloat16}[rollout_precision])


def check_train_parallel(model_path: str, *, tp, ep, pp, dispatcher, device: str):
    """``--train-tp`` / ``--train-ep`` / ``--train-pp`` / ``--train-dispatcher``, checked before any process starts:
    each size an integer in :data:`COUNT_BOUNDS`, a dispatcher Megatron has, and a layout Megatron can build for the
    checkpoint (:func:`~moealign.patches.megatron.checkpoint.check_parallel_layout`: EP dividing the experts and the
    data-parallel x tensor-parallel ranks, PP the layers, TP the heads and widths; one
    :class:`~moealign.errors.ConfigError` naming the flags and the reason); on CUDA one GPU per rank. Returns the
    :class:`~moealign.patches.megatron.checkpoint.ParallelLayout` (``as_dict()`` is the report's ``train.parallel``)."""
    from .patches.megatron.checkpoint import check_parallel_layout
    from .patches.megatron.sharded import DISPATCHERS

    sizes = {"train_tp": tp, "train_ep": ep, "train_pp": pp}
    for field, value in sizes.items():
        check_count(field, value)
    if dispatcher not in DISPATCHERS:
        raise ConfigError(f"--train-dispatcher must be one of {', '.join(DISPATCHERS)}, got {dispatcher!r}")
    if tp == ep == pp == 1:                          # one rank: nothing to carve (any family, any train engine)
        from .patches.megatron.checkpoint import ParallelLayout

        return ParallelLayout()
    given = " ".join(f"{_flag(field)} {value}" for field, value in sizes.items() if value != 1)
    try:
        layout = check_parallel_layout(read_model_config(model_path), tp=tp, ep=ep, pp=pp)
    except ConfigError as exc:
        raise ConfigError(f"{given}: Megatron cannot build this layout: {exc}") from None
    if layout.world > 1 and device != "cpu":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if layout.world > count:
            raise ConfigError(f"{given}: {layout} needs one GPU per rank ({layout.world}); this machine has {count}")
    return layout


def train_parallel_note(layout, device: str) -> str | None:
    """The one log line of a sharded trainer with more rank processes than CPU cores (it runs, slowly), else None."""
    cores = os.cpu_count() or 1
    if layout.world > 1 and device == "cpu" and layout.world > cores:
        return (f"train: {layout}: {layout.world} rank processes on {cores} CPU cores; it runs, but it will be slow "
                f"(the ranks share the cores)")
    return None


def check_rollout_parallel(*, tp: int, ep: int, dp: int, device: str) -> None:
    """``--rollout-ep`` / ``--rollout-dp`` (vLLM's ``enable_expert_parallel`` and ``data_parallel_size``), checked
    before any engine starts. 1 (the default) runs as before. Above 1 each is refused, naming why: on vLLM's CPU build
    (0.32, tried on the embedded model) expert parallelism crashes its fused-MoE CPU kernel (SIGSEGV in
    ``csrc/cpu/cpu_fused_moe.cpp`` on the first forward) and ``LLM(data_parallel_size=N)`` is refused by vLLM itself
    in one process; on a GPU build moealign's route recording and forcing have not run under vLLM's expert map yet
    (docs/scale.md says what it would need)."""
    for field, value in (("rollout_ep", ep), ("rollout_dp", dp)):
        check_count(field, value)
    if ep > 1 and ep != tp * dp:
        raise ConfigError(f"--rollout-ep {ep}: vLLM's expert-parallel size is its TP x DP ranks (--rollout-tp {tp} x "
                          f"--rollout-dp {dp} = {tp * dp}); give --rollout-tp {ep}")
    cpu = device == "cpu"
    if dp > 1:
        raise ConfigError(f"--rollout-dp {dp}: " + (
            "vLLM refuses LLM(data_parallel_size=N) in one process (\"not supported for single-process usage and may "
            "hang\"): data parallelism needs one engine process per DP rank, which moealign does not launch yet"
            if cpu else "vLLM's data parallelism needs one engine process per DP rank (LLM(data_parallel_size=N) is "
            "refused in one process); moealign does not launch them yet"))
    if ep > 1:
        raise ConfigError(f"--rollout-ep {ep}: " + (
            "vLLM's CPU build cannot run expert parallelism: its fused-MoE CPU kernel (csrc/cpu/cpu_fused_moe.cpp) "
            "crashes with SIGSEGV on the first forward under an expert map (tried: --rollout-tp 2 with "
            "enable_expert_parallel=True); a CUDA build is needed" if cpu else
            "route recording and forced routes have not run under vLLM's expert map on a GPU build yet (the routers "
            "are replicated, the experts' ids become local ids per rank); not enabled until they are tested there"))
