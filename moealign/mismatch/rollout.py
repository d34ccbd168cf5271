"""The mismatch test, step 1: the configuration, and the rollout record (produced by a rollout engine or
loaded from a file).

:class:`MismatchConfig` holds every option of ``moealign mismatch`` and validates them up front.
:func:`make_rollout_engine` opens the rollout engine and :func:`generate_record` samples the prompts of
:func:`rollout_prompts` with it; :func:`load_record` reads a saved record instead; :func:`finish_record` saves
the record when asked and checks that it can measure routing replay. The caller
(:func:`moealign.mismatch.run.run_mismatch`) owns the engine and closes it.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..record import RolloutRecord, SamplingParams
from .engines import (
    ATTENTION,
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    RolloutEngine,
    describe_engine,
    parse_dtype,
    resolve_precision,
)

__all__ = ["MismatchConfig", "progress_bar", "make_rollout_engine", "rollout_prompts", "rollout_message",
           "generate_record", "load_record", "finish_record"]


def check_output_path(path: str, flag: str) -> None:
    """Refuse an output path before any work starts: a directory, a special file (FIFO, device), or a
    missing or unwritable parent directory."""
    target = pathlib.Path(path)
    if target.exists() and not target.is_file():
        raise ConfigError(f"{flag} {path}: exists and is not a regular file (refusing to replace it)")
    parent = target.parent if str(target.parent) else pathlib.Path(".")
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: the directory {parent} is not writable")


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
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63:
            raise ConfigError(f"--seed must be an integer in [0, 2**63), got {self.seed!r}")
        self._check_device()
        if self.model is not None:
            path = pathlib.Path(self.model)
            if not path.is_dir() or not (path / "config.json").is_file():
                raise ConfigError(f"--model {self.model}: not a local checkpoint directory with a config.json (the "
                                  f"mismatch test loads local checkpoints only, never from the network)")
        if self.load_record is not None and not pathlib.Path(self.load_record).is_file():
            raise ConfigError(f"--load-record: no record file at {self.load_record}")
        if self.prompts_file is not None and not pathlib.Path(self.prompts_file).is_file():
            raise ConfigError(f"--prompts: cannot read prompts from {self.prompts_file}: no such file")
        if self.save_record is not None:
            check_output_path(self.save_record, "--save-record")

    def _check_device(self) -> None:
        if self.device == "auto":
            return
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"--device {self.device!r}: not a device (cpu, cuda, cuda:N or auto)") from exc
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r}: the mismatch test runs on cpu or cuda")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(f"--device {self.device!r}: CUDA is not available on this machine (use cpu)")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ConfigError(f"--device {self.device!r}: this machine has {torch.cuda.device_count()} GPUs")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    def resolved_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def model_path(self) -> str:
        """The checkpoint both engines load: ``model``, else the embedded model's directory."""
        if self.model:
            return str(self.model)
        from ..embedded import embedded_model_path

        return str(embedded_model_path())

    def model_label(self) -> str:
        """The report's ``model``: ``"embedded:tiny_moe"`` or the checkpoint path."""
        return self.model_path() if self.model else "embedded:tiny_moe"


def progress_bar(total: int, desc: str, enabled: bool):
    """``(bar, update)``: a tqdm bar (``None`` when disabled or tqdm is missing) and its ``update(n)``."""
    if not enabled:
        return None, lambda n: None
    try:
        from tqdm.auto import tqdm
    except Exception:  # noqa: BLE001 - tqdm is optional
        return None, lambda n: None
    bar = tqdm(total=total, desc=desc, unit="seq", leave=False)
    return bar, bar.update


def make_rollout_engine(cfg: MismatchConfig, model_path: str, device: str) -> RolloutEngine:
    """The rollout engine ``cfg`` names, loaded with its precision policy (the caller closes it)."""
    return ROLLOUT_ENGINES[cfg.rollout_engine](model_path, cfg.rollout_precision, device,
                                               batch_invariant=cfg.batch_invariant, attention=cfg.attention)


def rollout_prompts(cfg: MismatchConfig) -> list[str]:
    """The first ``cfg.num_prompts`` prompts of ``cfg.prompts_file`` (default: the embedded prompt set)."""
    from ..embedded import default_prompts

    prompts = default_prompts(cfg.prompts_file)
    if cfg.num_prompts > len(prompts):
        raise ConfigError(f"--num-prompts {cfg.num_prompts} exceeds the {len(prompts)} prompts available")
    return prompts[:cfg.num_prompts]


def rollout_message(cfg: MismatchConfig, device: str, num_prompts: int) -> str:
    return (f"rollout: {cfg.rollout_engine} {cfg.rollout_precision} on {device}, {num_prompts} prompts x "
            f"{cfg.max_new_tokens} new tokens{', batch-invariant' if cfg.batch_invariant else ''}")


def generate_record(cfg: MismatchConfig, engine: RolloutEngine, prompts: list[str], *,
                    progress: bool = False) -> tuple[RolloutRecord, dict]:
    """Sample ``prompts`` with ``engine`` (``cfg``'s sampling, seed, lengths, batch size):
    ``(record, the report's description of the engine)``."""
    bar, update = progress_bar(len(prompts), "rollout", progress)
    record = engine.generate(prompts, sampling=cfg.sampling, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                             batch_size=cfg.batch_size, progress=update)
    if bar is not None:
        bar.close()
    return record, describe_engine(engine)


def load_record(cfg: MismatchConfig) -> tuple[RolloutRecord, dict]:
    """The record saved at ``cfg.load_record``: ``(record, description)`` (engine and dtype from its meta)."""
    record = RolloutRecord.load(cfg.load_record)
    return record, {"engine": record.meta.engine, "precision": None, "dtype": record.meta.dtype}


def finish_record(cfg: MismatchConfig, record: RolloutRecord) -> None:
    """Save the record to ``cfg.save_record`` (when set); refuse a record without routes."""
    if cfg.save_record:
        record.save(cfg.save_record)
    if not record.has_routes:
        raise ConfigError("the rollout record has no routes: routing replay cannot be measured")
