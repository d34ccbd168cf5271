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
from dataclasses import asdict, dataclass


from .._files import check_input_file, check_output_dir, check_output_path, check_outputs
from ..errors import ConfigError, EngineError, MoealignError
from ..embedded import MAX_PROMPTS_BYTES
from ..checkpoint_check import check_checkpoint_tensors
from ..model_config import read_model_config
from ..options import (
    TRAIN_PARALLEL_FIELDS,
    check_aligned_run,
    check_count,
    check_rollout_parallel,
    check_device,
    check_model,
    check_sampling,
    check_seed,
    check_train_parallel,
)
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

__all__ = ["MismatchConfig", "ALIGNED_ENGINES", "ROLLOUT_OPTIONS", "DEFAULTS", "check_output_path",
           "check_not_an_input",
           "check_prompts_file", "flag", "progress_bar", "open_engine", "make_rollout_engine",
           "rollout_prompts", "rollout_message", "generate_record", "load_record", "record_sampling", "finish_record"]


#: Options that only shape the rollout: with ``load_record`` the record states them, so giving one is an error.
ROLLOUT_OPTIONS = ("rollout_engine", "rollout_precision", "rollout_dtype", "num_prompts", "max_new_tokens", "seed",
                   "temperature", "top_p", "top_k", "min_p", "prompts_file", "rollout_tp",
                   "rollout_ep", "rollout_dp")
#: ``--aligned``: the engine pairs the canonical forward covers (rollout -> trainers): vLLM's CPU build and
#: transformers roll out, Megatron-core and transformers train (bindings in moealign/patches/{vllm,hf,megatron}/).
ALIGNED_ENGINES = {"vllm": ("megatron", "hf"), "hf": ("megatron", "hf")}
#: The value each option takes when it is not given (``None`` in the dataclass means "not given").
DEFAULTS = {"rollout_engine": "hf", "rollout_precision": "bf16", "train_precision": "fp32", "num_prompts": 32,
            "max_new_tokens": 48, "seed": 0, "temperature": 1.0, "top_p": 0.9, "top_k": 0, "min_p": 0.0,
            "train_tp": 1, "train_ep": 1, "train_pp": 1, "train_dispatcher": "alltoall"}


def flag(name: str) -> str:
    """The command-line flag of a :class:`MismatchConfig` field (errors name the flag a user typed)."""
    return {"prompts_file": "--prompts", "rollout_engine": "--rollout", "train_engine": "--train",
            "load_record": "--load-record", "save_record": "--save-record"}.get(name, "--" + name.replace("_", "-"))


def check_not_an_input(path: str, out_flag: str, inputs: dict[str, str | None]) -> None:
    """Refuse an output path that is one of the command's inputs (``{flag: path}``; a directory input, the
    checkpoint, covers every file in it): :func:`moealign._files.check_outputs` for one output."""
    check_outputs({out_flag: path}, inputs)


def check_prompts_file(path: str) -> None:
    """``--prompts`` names a regular file of at most :data:`MAX_PROMPTS_BYTES` (not a FIFO or ``/dev/zero``)."""
    check_input_file(path, "--prompts", max_bytes=MAX_PROMPTS_BYTES)


@dataclass
class MismatchConfig:
    model: str | None = None            # a local transformers MoE checkpoint; None: the embedded model
    # None = not given: the DEFAULTS value is filled in (and with load_record, a given rollout option is refused)
    rollout_engine: str | None = None   # default "hf"
    rollout_precision: str | None = None  # a moealign.precision.policy name; default "bf16"
    train_engine: str = "hf"
    train_precision: str | None = None  # default "fp32"
    rollout_dtype: str | None = None    # alias: fp32 / bf16 / fp16 (sets rollout_precision)
    train_dtype: str | None = None      # alias: fp32 / bf16 / fp16 (sets train_precision)
    batch_invariant: bool = False       # both sides under batch_invariant_mode ("bi" attention in hf engines)
    attention: str | None = None        # hf engines: "sdpa" / "eager" / "bi"; None: bi if batch_invariant else default
    num_prompts: int | None = None      # default 32
    max_new_tokens: int | None = None   # default 48
    seed: int | None = None             # default 0
    temperature: float | None = None    # default 1.0
    top_p: float | None = None          # default 0.9
    top_k: int | None = None            # default 0 (off)
    min_p: float | None = None          # default 0.0 (off)
    batch_size: int = 16
    prompts_file: str | None = None
    device: str = "auto"
    save_record: str | None = None
    load_record: str | None = None
    diagnose: bool = False              # lever runs, attribution, diagnosis, contracts, plot data
    report_dir: str | None = None       # write report.html + report.json there (implies diagnose)
    inject_fault: str | None = None     # a known fault (moealign.mismatch.faults), to check the diagnosis
    rollout_tp: int | None = None       # vLLM rollout: tensor-parallel size (default 1)
    aligned: bool = False               # the canonical forward on both engines (ALIGNED_ENGINES; bitwise)
    aligned_skip: tuple = ()            # canonical ops left stock (negative controls)
    rollout_ep: int | None = None       # vLLM expert parallelism (default 1; above 1 refused where it cannot run)
    rollout_dp: int | None = None       # vLLM data parallelism (default 1; above 1 refused where it cannot run)
    # the trainer's Megatron layout (default 1 each); any above 1: the sharded trainer, one process per rank
    train_tp: int | None = None
    train_ep: int | None = None
    train_pp: int | None = None
    train_dispatcher: str | None = None  # the sharded trainer's MoE token dispatcher: alltoall (default) / allgather

    def __post_init__(self):
        if self.load_record is not None:
            given = [flag(name) for name in ROLLOUT_OPTIONS if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"{', '.join(given)}: rollout option(s) given with --load-record, which scores the "
                                  f"record as it was sampled (its own sampling parameters and engine); drop them")
        if self.aligned is True:
            self._aligned_defaults()
        for name, value in DEFAULTS.items():
            if getattr(self, name) is None and not name.endswith("_precision"):   # precisions: after the aliases
                setattr(self, name, value)
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ConfigError(f"unknown rollout engine {self.rollout_engine!r}; choose one of {sorted(ROLLOUT_ENGINES)}")
        if self.train_engine not in TRAIN_ENGINES:
            raise ConfigError(f"unknown training engine {self.train_engine!r}; choose one of {sorted(TRAIN_ENGINES)}")
        for side in ("rollout", "train"):
            alias = getattr(self, f"{side}_dtype")
            if alias is not None:
                parse_dtype(alias)                 # "unknown dtype ..." for names outside fp32/bf16/fp16
                explicit = getattr(self, f"{side}_precision")
                if explicit is not None and explicit != alias:
                    raise ConfigError(f"{side}_dtype={alias!r} contradicts {side}_precision={explicit!r} "
                                      f"({flag(side + '_dtype')} {alias} vs {flag(side + '_precision')} {explicit}); "
                                      f"give one")
                setattr(self, f"{side}_precision", alias)
            elif getattr(self, f"{side}_precision") is None:
                setattr(self, f"{side}_precision", DEFAULTS[f"{side}_precision"])
            setattr(self, f"{side}_precision", resolve_precision(getattr(self, f"{side}_precision")).name)
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError(f"batch_invariant must be a bool, got {self.batch_invariant!r}")
        if self.rollout_engine == "vllm" and self.load_record is None and (self.batch_invariant
                                                                            or self.attention is not None):
            raise ConfigError("--batch-invariant / --attention are not available with --rollout vllm yet (vLLM runs "
                              "its own kernels); use --rollout hf")
        if self.attention is not None and self.attention not in ATTENTION:
            raise ConfigError(f"unknown attention {self.attention!r}; choose one of {list(ATTENTION)}")
        for name in ("num_prompts", "max_new_tokens", "batch_size"):
            check_count(name, getattr(self, name))
        check_seed(self.seed)
        check_sampling(self.temperature, self.top_p, self.top_k, self.min_p)
        check_device(self.device)
        config = check_model(self.model, self.model_path(), self.max_new_tokens)
        if self.load_record is not None:
            if not os.path.lexists(self.load_record):
                raise ConfigError(f"--load-record: no record file at {self.load_record}")
            check_input_file(self.load_record, "--load-record")
        if self.prompts_file is not None:
            check_prompts_file(self.prompts_file)
        if self.report_dir is not None:
            check_output_dir(self.report_dir, "--report")
        check_outputs(self.outputs(), self.inputs(), created_dirs=[self.report_dir])
        if self.rollout_tp is not None:
            check_count("rollout_tp", self.rollout_tp)
            if self.rollout_tp > 1 and self.rollout_engine != "vllm":
                raise ConfigError("--rollout-tp > 1 needs --rollout vllm (the transformers engine runs on one device)")
        if self.load_record is None:
            check_rollout_parallel(tp=self.rollout_tp or 1, ep=1 if self.rollout_ep is None else self.rollout_ep,
                                   dp=1 if self.rollout_dp is None else self.rollout_dp, device=self.resolved_device())
        if not isinstance(self.diagnose, bool):
            raise ConfigError(f"diagnose must be a bool, got {self.diagnose!r}")
        self.train_layout = check_train_parallel(self.model_path(), tp=self.train_tp, ep=self.train_ep,
                                                 pp=self.train_pp, dispatcher=self.train_dispatcher,
                                                 device=self.resolved_device())
        if self.train_sharded:
            self._check_sharded()
        self._check_aligned()
        if self.report_dir is not None:
            self.diagnose = True
        if self.inject_fault is not None:
            from .faults import parse_fault

            fault = parse_fault(self.inject_fault)
            if fault.kind == "weights" and (self.load_record is not None or self.rollout_engine != "hf"):
                raise ConfigError("--inject-fault weights perturbs the transformers rollout engine's weights: it needs "
                                  "--rollout hf and no --load-record")
            layers = read_model_config(self.model_path())["num_hidden_layers"] if fault.kind == "weights" else None
            if layers is not None and fault.layer >= layers:
                raise ConfigError(f"--inject-fault weights:layer={fault.layer}: the model has {layers} decoder layers "
                                  f"(0 .. {layers - 1})")
        check_checkpoint_tensors(self.model_path(), config)    # last: the options' own refusals come first

    @property
    def train_sharded(self) -> bool:
        """Any of ``train_tp`` / ``train_ep`` / ``train_pp`` above 1: the sharded Megatron trainer scores."""
        return self.train_layout.world > 1

    def train_parallel_kwargs(self) -> dict:
        """The training engine factory's layout arguments (none for a single rank)."""
        if not self.train_sharded:
            return {}
        return dict(tp=self.train_tp, ep=self.train_ep, pp=self.train_pp, dispatcher=self.train_dispatcher)

    def _check_sharded(self) -> None:
        """What the sharded trainer does not do yet, refused by name before any work (its layout was checked by
        :func:`~moealign.options.check_train_parallel`)."""
        from ..patches.megatron.sharded import precision_fields

        given = " ".join(f"{flag(name)} {getattr(self, name)}" for name in TRAIN_PARALLEL_FIELDS
                         if getattr(self, name) != 1)
        if self.train_engine != "megatron":
            raise ConfigError(f"{given} shards the Megatron trainer (--train megatron); the transformers trainer "
                              f"(--train {self.train_engine}) runs on one device")
        refused = [what for what, on in (
            ("--diagnose / --report (the lever runs rebuild the trainer per lever set; not on the sharded trainer "
             "yet)", self.diagnose or self.report_dir is not None),
            ("--batch-invariant (moealign's batch-invariant ops are not set up in the rank processes)",
             self.batch_invariant),
            ("--attention (a transformers-engine option)", self.attention is not None)) if on]
        if refused:
            raise ConfigError(f"{given}: the sharded Megatron trainer does not run {'; '.join(refused)}; drop "
                              f"{'them' if len(refused) > 1 else 'it'} or run the single-rank trainer")
        try:
            precision_fields(self.train_precision)
        except ConfigError as exc:
            raise ConfigError(f"--train-precision {self.train_precision} with {given}: {exc}") from None

    def _aligned_defaults(self) -> None:
        """``--aligned``: one precision for both sides (the one given, else bf16); the default engines."""
        given = {getattr(self, f"{side}_{kind}") for side in ("rollout", "train") for kind in ("precision", "dtype")}
        given.discard(None)
        if len(given) > 1:
            raise ConfigError(f"--aligned runs one precision on both engines; got {sorted(given)}")
        value = given.pop() if given else "bf16"
        for side in ("rollout", "train"):
            if getattr(self, f"{side}_dtype") is None:
                setattr(self, f"{side}_precision", value)

    def _check_aligned(self) -> None:
        """``--aligned``: what the canonical forward covers, checked before any work (each refusal names it)."""
        if not isinstance(self.aligned, bool):
            raise ConfigError(f"aligned must be a bool, got {self.aligned!r}")
        skip = tuple(self.aligned_skip or ())
        if not self.aligned:
            if skip:
                raise ConfigError("--aligned-skip leaves canonical ops stock: it needs --aligned")
            return
        from ..precision.canonical import OPS

        unknown = sorted(set(skip) - set(OPS))
        if unknown:
            raise ConfigError(f"--aligned-skip: unknown ops {unknown}; the canonical ops are {list(OPS)}")
        self.aligned_skip = tuple(op for op in OPS if op in skip)
        if self.load_record is not None:
            raise ConfigError("--aligned runs the canonical forward in the rollout engine too: it cannot score a "
                              "--load-record")
        if self.rollout_engine not in ALIGNED_ENGINES or self.train_engine not in ALIGNED_ENGINES[self.rollout_engine]:
            pairs = ", ".join(f"--rollout {r} --train {t}" for r, ts in ALIGNED_ENGINES.items() for t in ts)
            raise ConfigError(f"--aligned covers {pairs} (the canonical forward is installed in those engines), not "
                              f"--rollout {self.rollout_engine} --train {self.train_engine}")
        if "hf" in (self.rollout_engine, self.train_engine):
            from ..patches.hf.canonical import HF_FAMILIES

            family = read_model_config(self.model_path()).get("model_type")
            if family not in HF_FAMILIES:
                raise ConfigError(f"--aligned with a transformers engine (--rollout {self.rollout_engine} --train "
                                  f"{self.train_engine}) covers {list(HF_FAMILIES)} checkpoints; model_type {family!r} "
                                  f"is not covered there (its transformers ops have no canonical binding)")
        if self.batch_invariant or self.attention is not None:
            raise ConfigError("--aligned is the canonical forward; --batch-invariant / --attention select other ops")
        if self.report_dir is not None or self.inject_fault is not None:
            raise ConfigError("--aligned with --report / --inject-fault: --aligned --diagnose names the op a residual "
                              "comes from; --aligned-skip OP leaves an op stock (a negative control)")
        check_aligned_run(self.model_path(), rollout_precision=self.rollout_precision,
                          train_precision=self.train_precision, device=self.resolved_device(),
                          rollout_tp=self.rollout_tp or 1, train_tp=self.train_tp or 1,
                          rollout_engine=self.rollout_engine, train_sharded=self.train_sharded)

    def inputs(self) -> dict[str, str | None]:
        """``{flag: path}`` of every file or directory the run reads (outputs may not name one); ``--model`` is the
        embedded model's directory when none is given."""
        return {"--load-record": self.load_record, "--prompts": self.prompts_file, "--model": self.model_path()}

    def outputs(self) -> list[tuple[str, str | None]]:
        """``(flag, path)`` of every file the run writes: the record and the report's two files."""
        report = [] if self.report_dir is None else [
            ("--report", os.path.join(self.report_dir, name)) for name in ("report.json", "report.html")]
        return [("--save-record", self.save_record), *report]

    @property
    def fault(self):
        """The parsed ``inject_fault`` (:class:`moealign.mismatch.faults.Fault`) or None."""
        from .faults import parse_fault

        return parse_fault(self.inject_fault) if self.inject_fault is not None else None

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    def resolved_device(self) -> str:
        from ..embedded import resolve_device

        return resolve_device(self.device)

    def model_path(self) -> str:
        """The checkpoint both engines load: ``model``, else the embedded model's directory."""
        from ..embedded import checkpoint_path

        return checkpoint_path(self.model)

    def model_label(self) -> str:
        """The report's ``model``: ``"embedded:NAME"`` for an embedded model, else the checkpoint path."""
        from ..embedded import model_label

        return model_label(self.model)


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


def open_engine(factory, what: str, model_path: str, *args, **kwargs):
    """``factory(model_path, *args, **kwargs)``; a checkpoint its loader cannot read (an unknown architecture,
    a config transformers refuses, an unreadable weight file) becomes an :class:`EngineError` naming the
    checkpoint and the engine instead of the loader's traceback."""
    try:
        return factory(model_path, *args, **kwargs)
    except MoealignError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, ImportError) as exc:
        message = " ".join(str(exc).split())[:400] or type(exc).__name__
        raise EngineError(f"{what} could not load the checkpoint {model_path}: {type(exc).__name__}: "
                          f"{message}") from exc


def make_rollout_engine(cfg: MismatchConfig, model_path: str, device: str) -> RolloutEngine:
    """The rollout engine ``cfg`` names, loaded with its precision policy (the caller closes it)."""
    return open_engine(ROLLOUT_ENGINES[cfg.rollout_engine], f"the {cfg.rollout_engine} rollout engine", model_path,
                       cfg.rollout_precision, device, batch_invariant=cfg.batch_invariant, attention=cfg.attention,
                       **({"tp": cfg.rollout_tp} if cfg.rollout_tp not in (None, 1) else {}),
                       **({"aligned": True, "aligned_skip": cfg.aligned_skip} if cfg.aligned else {}))


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
    """The record saved at ``cfg.load_record``: ``(record, description)``; the description is what the record
    states (engine, its version, dtype, the file), never the command line's rollout options."""
    record = RolloutRecord.load(cfg.load_record)
    return record, {"engine": record.meta.engine, "engine_version": record.meta.engine_version, "precision": None,
                    "dtype": record.meta.dtype, "record": str(cfg.load_record)}


def record_sampling(record: RolloutRecord) -> dict:
    """The report's ``sampling``: the record's own parameters (one set, or ``{"per_sample": [...]}``)."""
    params = [s.sampling for s in record.samples]
    unique = list(dict.fromkeys(params))
    if len(unique) == 1:
        return asdict(unique[0])
    return {"per_sample": [asdict(p) for p in params]}


def finish_record(cfg: MismatchConfig, record: RolloutRecord) -> None:
    """Save the record to ``cfg.save_record`` (when set); refuse a record without routes or samples."""
    if cfg.save_record:
        record.save(cfg.save_record)
    if len(record) == 0:
        raise ConfigError("the rollout record has no samples: there is nothing to score")
    if not record.has_routes:
        raise ConfigError("the rollout record has no routes: routing replay cannot be measured")
