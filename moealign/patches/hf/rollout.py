"""transformers adapter, rollout side: router decisions through forward hooks (:func:`capture_routes`) and
``generate()`` with routes, kept sets and processed log-probs recorded (:func:`generate_with_record`)."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, Iterator, Mapping, Sequence

import torch

from ..._validate import check_binary_mask, check_positive_int, check_token_ids
from ...errors import ConfigError, EngineError, InputError, InputTypeError, MoealignWarning, ReplayError
from ...handle import PatchHandle
from ...record import RolloutRecord, Sample, SamplingParams
from ...routing_replay.routes import compact_routes
from .model import MoEModelInfo, describe_model, record_meta

# --------------------------------------------------------------------------------------------------
# recording
# --------------------------------------------------------------------------------------------------


class RouteCapture(PatchHandle):
    """Router decisions seen through forward hooks: ``calls[i]`` is the list of ``[rows, k]`` int64 ids
    of MoE layer ``i`` (index into ``info.moe_layers``), one entry per router call.

    A :class:`~moealign.handle.PatchHandle` (scope ``"instance"``): :meth:`attach` adds one forward hook per
    router, ``undo()`` removes them (what was captured stays readable)."""

    def __init__(self, info: MoEModelInfo, keep_logits: bool = False):
        super().__init__(f"route capture on {len(info.routers)} {info.family.model_type} routers", "instance")
        self.info = info
        self.keep_logits = keep_logits
        self.calls: list[list[torch.Tensor]] = [[] for _ in info.routers]
        self.logits: list[list[torch.Tensor]] = [[] for _ in info.routers]

    def _hook(self, index: int):
        def hook(module, args, output):
            self.calls[index].append(output[2].detach())
            if self.keep_logits:
                self.logits[index].append(output[0].detach())
        return hook

    def attach(self) -> "RouteCapture":
        for index, (layer, module) in enumerate(self.info.routers):
            self.add_hook(module.register_forward_hook(self._hook(index)), f"router of layer {layer}")
        return self

    def clear(self) -> None:
        for lst in self.calls + self.logits:
            lst.clear()

    @property
    def num_calls(self) -> list[int]:
        return [len(c) for c in self.calls]

    def last_forward(self) -> torch.Tensor:
        """Routes of the most recent forward as ``[rows, n_layers, k]`` int64."""
        if not all(self.calls):
            raise ReplayError(f"no router call recorded in some layers (calls per layer: {self.num_calls})")
        rows = {c[-1].shape[0] for c in self.calls}
        if len(rows) != 1:
            raise ReplayError(f"MoE layers saw different row counts in the last forward: {sorted(rows)}")
        return torch.stack([c[-1] for c in self.calls], dim=1)


@contextlib.contextmanager
def capture_routes(model: torch.nn.Module, *, keep_logits: bool = False,
                   info: MoEModelInfo | None = None) -> Iterator[RouteCapture]:
    """Record every router decision of ``model`` while the block runs (hooks removed on exit)."""
    capture = RouteCapture(info or describe_model(model), keep_logits).attach()
    try:
        yield capture
    finally:
        capture.undo()


# kept-set masks buffered before one nonzero() turns them into ids (bounded memory for large vocabularies)
KEPT_SET_FLUSH_BYTES = 64 << 20


class _KeptSetCapture:
    """The last logits processor of ``generate()``: sees the processed scores sampling uses.

    It keeps each step's processed scores (a reference: transformers does not modify them after the
    processors) and, in chunks bounded by ``flush_bytes``, turns them into the kept sets (finite entries)
    and the sampled tokens' log-probs (``log_softmax(scores)[token]``), once the tokens are known. Per
    step the capture costs one list append; the work is a few large vector ops per chunk.
    """

    def __init__(self, prompt_width: int, flush_bytes: int = 64 << 20):
        self.prompt_width = prompt_width
        self.flush_bytes = flush_bytes
        self.steps = 0
        self.logprobs: list[torch.Tensor] = []             # per chunk [B, S_c]
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []   # (counts [B, S_c], ids int32 b-major)
        self._pending: list[torch.Tensor] = []             # per step float32 [B, V], not yet flushed
        self._flushed = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        if step != self.steps:
            raise ReplayError(f"kept-set capture saw step {step} after {self.steps} steps: generate() "
                              f"did not call the logits processors once per token")
        if self._pending and len(self._pending) * self._pending[0].numel() * 4 >= self.flush_bytes:
            self._flush(input_ids)   # the tokens of every pending step are in input_ids now
        self._pending.append(scores.to(torch.float32))
        self.steps += 1
        return scores

    def _flush(self, tokens: torch.Tensor) -> None:
        if not self._pending:
            return
        scores = torch.stack(self._pending, dim=1)                        # [B, S_c, V]
        lo = self.prompt_width + self._flushed
        sampled = tokens[:, lo:lo + scores.shape[1]].to(scores.device)    # [B, S_c]
        # log_softmax over the whole (processed) vocabulary row: the reduction length is V whatever the
        # kept set's size, so a trainer computing the same log_softmax on its own logits (kept set
        # applied as -inf) gets the same bits from the same logits (a fixed tree under batch_invariant_mode)
        logp = torch.log_softmax(scores, dim=-1)
        self.logprobs.append(logp.gather(-1, sampled.unsqueeze(-1)).squeeze(-1))
        kept = scores > float("-inf")
        self.chunks.append((kept.sum(dim=-1), kept.nonzero()[:, 2].to(torch.int32)))
        self._flushed += scores.shape[1]
        self._pending = []

    def raise_if_nonfinite(self, cause: BaseException) -> None:
        """After ``generate()`` failed: raise :class:`~moealign.errors.EngineError` naming the logits if the
        scores of the step it failed at hold NaN or +inf (torch's sampler only says "probability tensor
        contains either inf, nan or element < 0")."""
        if not self._pending:
            return
        scores = self._pending[-1]
        bad = torch.isnan(scores) | (scores == float("inf"))
        if bool(bad.any()):
            b, v = (int(i) for i in bad.nonzero()[0])
            raise EngineError(f"the model's logits at generated step {self.steps - 1} hold {float(scores[b, v])} "
                              f"(batch row {b}, vocabulary id {v}, {int(bad[b].sum())} such entries in that row): "
                              f"generate() cannot sample from them (check the weights and the precision policy)"
                              ) from cause

    def finish(self, sequences: torch.Tensor) -> None:
        self._flush(sequences)

    def kept_sets(self, resp_lens: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample, the CSR kept sets of its first ``resp_lens[b]`` steps."""
        chunks = [(c.cpu(), ids.cpu()) for c, ids in self.chunks]
        starts = [torch.cat([torch.zeros(1, dtype=torch.int64), c.sum(1).cumsum(0)]) for c, _ in chunks]
        out = []
        for b, R in enumerate(resp_lens):
            counts, ids, step0 = [], [], 0
            for (c, chunk_ids), start in zip(chunks, starts):
                n = max(0, min(c.shape[1], R - step0))
                if n:
                    counts.append(c[b, :n])
                    lo = int(start[b])
                    ids.append(chunk_ids[lo:lo + int(c[b, :n].sum())])
                step0 += c.shape[1]
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(counts).cumsum(0)])
            out.append((offsets, torch.cat(ids)))
        return out


def _append_logits_processor(model, processor, allowed: frozenset[str] | None = None) -> PatchHandle:
    """Make ``processor`` the last logits processor of ``model.generate`` (instance-level ``set_attr`` of
    ``_get_logits_processor``; a :class:`~moealign.handle.PatchHandle`, undone on ``undo()`` or ``with`` exit).

    ``allowed``: the class names of the processors ``generate()`` may build before it; any other one raises
    :class:`~moealign.errors.ConfigError` naming it (a processor the record cannot state)."""
    original = model._get_logits_processor     # bound: the class's, or one the instance already had

    def _get_logits_processor(*args, **kwargs):
        processors = original(*args, **kwargs)
        if allowed is not None:
            other = [type(p).__name__ for p in processors if type(p).__name__ not in allowed]
            if other:
                raise ConfigError(f"generate() built logits processors {other} that the record cannot state (it "
                                  f"states temperature, top_k, top_p and min_p only); refused rather than recording "
                                  f"log-probs the trainer cannot reproduce")
        processors.append(processor)
        return processors

    handle = PatchHandle(f"{type(processor).__name__} appended to {type(model).__name__}.generate's logits "
                         f"processors", "instance")
    handle.set_attr(model, "_get_logits_processor", _get_logits_processor)
    return handle


@contextlib.contextmanager
def _sampling_rng(generator: torch.Generator, device: torch.device) -> Iterator[None]:
    """Let ``generate()``'s sampling (``torch.multinomial`` on the default generator of ``device``) draw from
    ``generator``: the default generator is forked, set to ``generator``'s state, and after the block
    ``generator`` takes the advanced state back (as if sampling had drawn from it); the process's RNG states
    (CPU and ``device``) are as before, also on an exception."""
    if not isinstance(generator, torch.Generator):
        raise InputTypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise ConfigError(f"generator is on {generator.device} but sampling runs on {device}; "
                          f"pass torch.Generator(device={str(device)!r})")
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(generator.get_state())
            yield
            generator.set_state(torch.get_rng_state())
        return
    backend = torch.get_device_module(device.type)
    index = device.index if device.index is not None else backend.current_device()
    if generator.device.index is not None and generator.device.index != index:
        raise ConfigError(f"generator is on {generator.device} but sampling runs on {device.type}:{index}")
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        backend.set_rng_state(generator.get_state(), index)
        yield
        generator.set_state(backend.get_rng_state(index))


#: The processors the record's sampling parameters make ``generate()`` build (temperature, top-k, top-p, min-p).
SAMPLING_PROCESSORS = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
                                 "MinPLogitsWarper"})
#: Generation-config fields the record states (:class:`~moealign.record.SamplingParams`, ``do_sample=True``).
_STATED = ("do_sample", "temperature", "top_k", "top_p", "min_p")
#: Fields of a checkpoint's generation config that do not change what is sampled: special token ids (taken
#: from it), lengths (``max_new_tokens`` is an argument), cache and output settings (set here).
_NOT_SAMPLING = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "max_length",
                           "max_new_tokens", "use_cache", "cache_implementation", "cache_config", "max_cache_len",
                           "return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                           "output_hidden_states", "transformers_version", "_from_model_config", "compile_config",
                           "disable_compile", "max_time"})


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` as a bool; False where the comparison is not a plain bool (tensors, arrays)."""
    try:
        return bool(a == b)
    except Exception:
        return False


def _non_neutral(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a generation-config dict that would change sampling: not stated by the record, not in
    :data:`_NOT_SAMPLING`, and neither None nor transformers' global default (``repetition_penalty=1.0``)."""
    return {k: v for k, v in config.items()
            if k not in _STATED and k not in _NOT_SAMPLING and not k.startswith("_")
            and v is not None and not (k in defaults and _equal(v, defaults[k]))}


def _rollout_generation_config(model, sampling: SamplingParams, max_new_tokens: int, eos_ids: list[int],
                               pad_token_id: int, generate_kwargs: Mapping[str, Any]):
    """A fresh ``GenerationConfig`` holding exactly the record's sampling parameters (every other processor
    neutral) and the model's special token ids. The options of the model's own generation config it drops are
    warned about; the caller's ``generate_kwargs`` (or ``generation_config=``) that differ from it are refused."""
    own = model.generation_config
    cls = type(own)
    defaults = dict(getattr(cls, "_get_default_generation_params", dict)())
    fields = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
              "top_p": sampling.top_p, "min_p": sampling.min_p if sampling.min_p > 0 else None,
              "max_new_tokens": max_new_tokens, "eos_token_id": eos_ids or None, "pad_token_id": pad_token_id,
              "bos_token_id": own.bos_token_id, "use_cache": True, "num_beams": 1, "num_return_sequences": 1,
              "return_dict_in_generate": False}
    for key, value in generate_kwargs.items():
        if key == "generation_config" and value is not None:
            if not isinstance(value, cls):
                raise InputTypeError(f"generation_config must be a {cls.__name__}, got {type(value).__name__}")
            items = [(f"generation_config.{k}", k, v) for k, v in value.to_diff_dict().items()
                     if k != "transformers_version" and not k.startswith("_")]
        else:
            items = [(key, key, value)]
        for label, k, v in items:
            if k in fields:
                same = _equal(v, fields[k]) or (k == "eos_token_id" and _equal([v], fields[k])) or (
                    k == "min_p" and fields[k] is None and _equal(v, 0))
            else:
                same = v is None or (k in defaults and _equal(v, defaults[k]))
            if same:
                continue
            if k in _STATED:
                hint = f"the record states {k}={fields[k]!r}; pass sampling=SamplingParams(...)"
            elif k in fields:
                argument = k in ("max_new_tokens", "eos_token_id", "pad_token_id")
                hint = f"generate_with_record sets {k}={fields[k]!r} itself{' (its argument)' if argument else ''}"
            else:
                hint = ("it would add a logits processor or change the decoding strategy, which the record cannot "
                        "state and the trainer cannot replay (one sequence is sampled per prompt with the record's "
                        "temperature, top_k, top_p and min_p only)")
            raise ConfigError(f"generate option {label}={v!r} is refused by generate_with_record: {hint}")
    dropped = _non_neutral(own.to_dict(), defaults)
    if dropped:
        listed = ", ".join(f"{k}={v!r}" for k, v in sorted(dropped.items()))
        warnings.warn(f"the model's generation config sets {listed}: generate_with_record does not apply it (the "
                      f"rollout samples with exactly the record's sampling parameters, which the trainer replays; "
                      f"the record cannot state these)", MoealignWarning, stacklevel=3)
    return cls(**fields)


def _response_lengths(generated: torch.Tensor, eos_ids: Sequence[int]) -> list[int]:
    if not eos_ids:
        return [generated.shape[1]] * generated.shape[0]
    is_eos = torch.isin(generated, torch.tensor(list(eos_ids), device=generated.device))
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full_like(is_eos[:, 0], generated.shape[1], dtype=torch.long))
    return [int(x) for x in first]


def _check_prompts(input_ids, attention_mask, vocab_size: int) -> torch.Tensor:
    """The int64 0/1 attention mask of a valid left-padded prompt batch; errors name the argument."""
    check_token_ids(input_ids, "input_ids", vocab_size, InputError)
    if not isinstance(attention_mask, torch.Tensor):
        raise InputTypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ConfigError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                          f"must both be [batch, prompt_len]")
    if input_ids.shape[0] == 0:
        raise InputError(f"input_ids {tuple(input_ids.shape)} holds no prompt (batch of 0)")
    if attention_mask.device != input_ids.device:
        raise InputError(f"attention_mask is on {attention_mask.device}, input_ids on {input_ids.device}")
    check_binary_mask(attention_mask, "attention_mask", InputError)
    am = attention_mask.to(torch.int64)
    if bool((am.sum(1) == 0).any()):
        raise ConfigError(f"prompt rows {(am.sum(1) == 0).nonzero().flatten().tolist()} are empty (attention_mask "
                          f"all 0)")
    if not bool((am[:, 1:] >= am[:, :-1]).all()):
        raise ConfigError("prompts must be left-padded (attention_mask zeros then ones in every row); "
                          "set tokenizer.padding_side = 'left'")
    return am


def _token_id(value, name: str, vocab_size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ConfigError(f"{name} must be a token id in [0, vocab_size={vocab_size}), got {value!r}")
    return value


def _generated_routes(capture: RouteCapture, B: int, S0: int, steps: int, info: MoEModelInfo, *,
                      calls: int | None = None) -> torch.Tensor:
    """``[B, S0 + steps - 1, n_layers, k]`` compact routes of one ``generate()`` call (prefill + one call per
    decode step: ``calls`` defaults to ``steps``) or of one full-sequence forward over the same positions
    (``calls=1``), from the router calls ``capture`` saw."""
    calls = steps if calls is None else calls
    if any(n != calls for n in capture.num_calls):
        what = f"prefill + {steps - 1} decode steps" if calls == steps else "one full-sequence forward"
        raise ReplayError(f"expected {calls} router calls per MoE layer ({what}), saw {capture.num_calls}")
    per_layer = [torch.cat([c.reshape(B, -1, c.shape[-1]) for c in layer], dim=1) for layer in capture.calls]
    return compact_routes(torch.stack(per_layer, dim=2), info.num_experts).cpu()   # [B, S0 + steps - 1, L, k]


def _sample_routes(routes_bt: torch.Tensor, b: int, am_cpu: torch.Tensor, R: int) -> torch.Tensor:
    """Sample ``b``'s route rows (its prompt without padding, then ``R - 1`` response rows) in record order."""
    S0 = am_cpu.shape[1]
    valid = torch.cat([am_cpu[b].bool(), torch.ones(R - 1, dtype=torch.bool)])
    return routes_bt[b, :S0 + R - 1][valid]


def generate_with_record(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 64,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    record_routes: bool = True,
    record_kept_sets: bool = True,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    engine: str = "transformers",
    validate: bool = False,
    **generate_kwargs: Any,
) -> RolloutRecord:
    """Sample with ``model.generate()`` and return a :class:`RolloutRecord`.

    ``input_ids`` / ``attention_mask`` are a left-padded prompt batch (pad positions are dropped from
    the record). Log-probs and kept sets come from the processed scores sampling used; routes from
    the prefill and every decode step.

    Sampling uses exactly the record's sampling parameters (``sampling``: temperature, top-k, top-p, min-p),
    so a trainer that applies them to its own logits reproduces the recorded log-probs: ``generate()`` runs
    with a fresh generation config holding those (``do_sample=True``, every other processor neutral) and the
    model's special token ids. Options of the model's own ``generation_config`` (a checkpoint's
    ``generation_config.json``: repetition / presence penalties, ``no_repeat_ngram_size``, ``typical_p``,
    ``num_beams``, ...) are not applied, with a :class:`~moealign.errors.MoealignWarning` naming them.
    ``generate_kwargs`` (further ``generate()`` options, or ``generation_config=``) are accepted only where
    they change nothing; one that would add a logits processor or change the decoding strategy is refused
    (:class:`~moealign.errors.ConfigError` naming it), as is any processor ``generate()`` builds beyond
    :data:`SAMPLING_PROCESSORS`.

    Sampling draws from ``generator`` (a ``torch.Generator`` on the prompts' device; it is advanced, as any
    torch sampling function advances its generator) or, with ``seed``, from a fresh generator seeded with it
    (the same draws as ``torch.manual_seed(seed)`` then sampling); the process's global RNG is left as it
    was. With neither, sampling draws from (and advances) the global RNG.
    """
    info = describe_model(model)
    if not isinstance(sampling, SamplingParams):
        raise InputTypeError(f"sampling must be a moealign.record.SamplingParams, got {type(sampling).__name__} "
                             f"{sampling!r}")
    am = _check_prompts(input_ids, attention_mask, info.vocab_size)
    check_positive_int(max_new_tokens, "max_new_tokens", ConfigError)
    if seed is not None and generator is not None:
        raise ConfigError("pass seed or generator, not both")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
            raise ConfigError(f"seed must be an int in [0, 2**64), got {seed!r}")
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    gen_cfg = getattr(model, "generation_config", None)
    if gen_cfg is None:
        raise ConfigError(f"{type(model).__name__} has no generation_config: it cannot generate()")
    if eos_token_id is None:
        eos_token_id = gen_cfg.eos_token_id
    eos_ids = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    for i, e in enumerate(eos_ids):
        _token_id(e, "eos_token_id" if isinstance(eos_token_id, int) else f"eos_token_id[{i}]", info.vocab_size)
    if pad_token_id is None:
        pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    _token_id(pad_token_id, "pad_token_id", info.vocab_size)
    rollout_config = _rollout_generation_config(model, sampling, max_new_tokens, eos_ids, pad_token_id,
                                                generate_kwargs)

    S0 = input_ids.shape[1]
    kept = _KeptSetCapture(S0, KEPT_SET_FLUSH_BYTES)
    with contextlib.ExitStack() as stack:
        capture = stack.enter_context(capture_routes(model, info=info)) if record_routes else None
        stack.enter_context(_append_logits_processor(model, kept, SAMPLING_PROCESSORS))
        # generate() fills every unset field from model.generation_config: for the call, that is the fresh one
        swap = stack.enter_context(PatchHandle("the rollout's generation config", "instance"))
        swap.set_attr(model, "generation_config", rollout_config)
        if generator is not None:
            stack.enter_context(_sampling_rng(generator, input_ids.device))
        with torch.no_grad():
            try:
                sequences = model.generate(input_ids=input_ids, attention_mask=am, generation_config=rollout_config)
            except RuntimeError as exc:
                kept.raise_if_nonfinite(exc)
                raise
    kept.finish(sequences)
    generated = sequences[:, S0:]
    steps = generated.shape[1]
    if kept.steps != steps or sum(lp.shape[1] for lp in kept.logprobs) != steps:
        raise ReplayError(f"kept-set capture saw {kept.steps} steps for {steps} generated tokens")
    resp_lens = _response_lengths(generated, eos_ids)

    routes_bt = _generated_routes(capture, input_ids.shape[0], S0, steps, info) if capture is not None else None

    logprobs = torch.cat(kept.logprobs, dim=1).cpu()                  # [B, steps]
    kept_sets = kept.kept_sets(resp_lens) if record_kept_sets else None

    meta = record_meta(model, engine=engine, info=info)
    samples = []
    am_cpu, seq_cpu = am.cpu(), sequences.cpu()
    for b in range(input_ids.shape[0]):
        R = resp_lens[b]
        prompt = seq_cpu[b, :S0][am_cpu[b].bool()]
        token_ids = torch.cat([prompt, seq_cpu[b, S0:S0 + R]])
        routes = _sample_routes(routes_bt, b, am_cpu, R) if routes_bt is not None else None
        kept_offsets, kept_ids = kept_sets[b] if kept_sets is not None else (None, None)
        samples.append(Sample(token_ids=token_ids, prompt_len=int(prompt.numel()), logprobs=logprobs[b, :R].clone(),
                              routes=routes, kept_offsets=kept_offsets, kept_ids=kept_ids, sampling=sampling))
    # built by construction from what generate() did; RolloutRecord.validate() (also run by save/load
    # round trips and by the tests) checks the same invariants at a cost of ~1% of a generate() call
    return RolloutRecord(meta, samples, validate=validate)


# --------------------------------------------------------------------------------------------------
# re-scoring a record along the rollout's own path (teacher-forced generate)
# --------------------------------------------------------------------------------------------------


class _ForceTokens:
    """The only logits processor of a teacher-forced ``generate()``: it keeps the raw logits it is handed (the
    float32 copy ``generate()`` makes of the model's last-position logits, before any processor) and makes every
    row's scores 0 at the recorded token of this step and -inf elsewhere, so greedy decoding emits the record's
    tokens."""

    def __init__(self, prompt_width: int, forced: torch.Tensor):
        self.prompt_width = prompt_width
        self.forced = forced                     # [B, max_new_tokens]
        self.logits: list[torch.Tensor] = []     # per step [B, V] float32

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        self.logits.append(scores)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, self.forced[:, step:step + 1].to(scores.device), 0.0)


def _head_hook(model: torch.nn.Module, heads: "_HeadVariants") -> PatchHandle:
    """``heads`` as a forward pre-hook on ``model``'s LM head, registered first (before any precision cast)."""
    hook = PatchHandle("LM-head variants of the re-scoring", "instance")
    hook.add_hook(model.get_output_embeddings().register_forward_pre_hook(heads, with_kwargs=True, prepend=True),
                  "LM head")
    return hook


class _HeadVariants:
    """A forward pre-hook on the LM head (registered first, so it sees the head's input before any precision
    cast): for each variant ``(weight, bias)``, the logits the head would give holding that weight, its input cast
    to the weight's dtype as :func:`~moealign.patches.hf.precision.apply_precision`'s input cast does
    (``x.to(dtype)`` when the dtypes differ), then the float32 copy of the last position ``generate()`` takes.
    One entry per forward (prefill, then each decode step)."""

    def __init__(self, variants: Mapping[Any, tuple[torch.Tensor, torch.Tensor | None]], keep: slice | None = None):
        self.variants = dict(variants)
        self.keep = keep                         # positions kept per forward (None: the last, as generate() does)
        self.logits: dict[Any, list[torch.Tensor]] = {k: [] for k in self.variants}

    def __call__(self, module, args, kwargs):
        x = args[0] if args else kwargs["input"]
        grad = module.weight.requires_grad
        for key, (weight, bias) in self.variants.items():
            xin = x.to(weight.dtype) if x.is_floating_point() and x.dtype != weight.dtype else x
            # the weight's requires_grad as the head's own: aten's matmul folds a non-contiguous 3-D input (the
            # prefill's last-position view) into one mm only when the weight does not require grad, and the two
            # paths round differently, so a detached copy would not give the head's bits
            if weight.requires_grad != grad:
                weight = weight.detach().requires_grad_(grad)
                bias = None if bias is None else bias.detach().requires_grad_(grad)
                self.variants[key] = (weight, bias)
            out = torch.nn.functional.linear(xin, weight, bias)
            kept = out[:, -1] if self.keep is None else out[:, self.keep]
            self.logits[key].append(kept.to(copy=True, dtype=torch.float32))
        return None


@dataclasses.dataclass
class Rescored:
    """What :func:`rescore_decode_all` returns: per sample ``[response_len, V]`` float32 logits (``logits``),
    ``[rows, n_layers, k]`` routes in record row order (``routes``; None without ``record_routes``) and, per
    head variant key, per sample logits (``head_variants``)."""

    logits: list[torch.Tensor]
    routes: list[torch.Tensor] | None
    head_variants: dict = dataclasses.field(default_factory=dict)


def rescore_decode(model: torch.nn.Module, samples: Sequence[Sample], *, pad_token_id: int | None = None,
                   eos_token_id: int | Sequence[int] | None = None, record_routes: bool = True,
                   max_new_tokens: int | None = None, logits_device: str | torch.device | None = "cpu",
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The logits and routes ``model`` computes for ``samples``' responses along the rollout's own path: one
    ``generate()`` call over the batch (prompts left-padded as a rollout batch is, prefill then one decode step
    per token with the KV cache), forced to emit each sample's recorded tokens.

    Returns ``(logits, routes)``: per sample ``[response_len, V]`` float32 raw logits (the scores ``generate()``
    hands its logits processors) on ``logits_device`` (None: the model's device) and ``[rows, n_layers, k]``
    routes in record row order (``None`` without ``record_routes``). With the model, precision and batch the
    record was sampled with, ``kept_logprob`` of these logits (on the device the rollout computed its log-probs
    on) reproduces the record's log-probs and these routes its routes, bitwise: that is how the lever runs of
    :mod:`moealign.mismatch.levers` change one thing on the rollout side and keep the rest of its path.
    A response that ends before ``max_new_tokens`` ends with an EOS token (the model's ``eos_token_id``).
    ``max_new_tokens``: the rollout's (default: the longest response), so that ``generate()`` is called with the
    same lengths as the rollout was. See :func:`rescore_decode_all` for what the call mirrors."""
    out = rescore_decode_all(model, samples, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                             record_routes=record_routes, max_new_tokens=max_new_tokens, logits_device=logits_device)
    return out.logits, out.routes


def rescore_decode_all(model: torch.nn.Module, samples: Sequence[Sample], *, pad_token_id: int | None = None,
                       eos_token_id: int | Sequence[int] | None = None, record_routes: bool = True,
                       max_new_tokens: int | None = None, logits_device: str | torch.device | None = "cpu",
                       head_variants: Mapping[Any, tuple[torch.Tensor, torch.Tensor | None]] | None = None,
                       ) -> Rescored:
    """:func:`rescore_decode`, and with ``head_variants`` (``{key: (weight, bias)}``) also the logits of the same
    path with the LM head holding another weight (another precision of it): the rest of the network is the same
    for those, so it runs once (the head's input is shared, the head is applied once per variant per step, on
    exactly the tensor the model's own head gets).

    The call mirrors the rollout's ``generate()`` (:func:`generate_with_record`): the same batch, left-padded
    to its longest prompt with ``pad_token_id`` (the rollout tokenizer's), the same attention mask (hence the
    same position ids and cache positions ``generate()`` derives from it), a fresh generation config from
    :func:`_rollout_generation_config` (the same cache class, ``use_cache``, ``max_new_tokens`` when given,
    ``return_dict_in_generate=False``), so the prefill covers exactly the prompts and each decode step one token
    per row, finished rows fed ``pad_token_id`` as ``generate()`` feeds them; only the token choice differs
    (greedy over scores forced to the recorded token instead of sampling, which runs after the logits)."""
    fb = _forced_batch(model, samples, pad_token_id, eos_token_id, max_new_tokens)
    info, device, B, S0, lens, steps = fb.info, fb.device, fb.B, fb.S0, fb.lens, fb.steps
    input_ids, am, forced, eos_ids, pad_token_id = fb.input_ids, fb.am, fb.forced, fb.eos_ids, fb.pad_token_id
    max_new_tokens = forced.shape[1]
    config = _rollout_generation_config(model, SamplingParams(), max_new_tokens, eos_ids, pad_token_id, {})
    config.do_sample, config.temperature, config.top_k, config.top_p = False, None, None, None
    force = _ForceTokens(S0, forced)
    heads = _HeadVariants(head_variants) if head_variants else None
    with contextlib.ExitStack() as stack:
        capture = stack.enter_context(capture_routes(model, info=info)) if record_routes else None
        # the only processor (none built before it): it is handed generate()'s raw float32 logits
        stack.enter_context(_append_logits_processor(model, force, frozenset()))
        swap = stack.enter_context(PatchHandle("the re-scoring generation config", "instance"))
        swap.set_attr(model, "generation_config", config)
        if heads is not None:
            stack.enter_context(_head_hook(model, heads))
        # inference mode: the same kernels as no_grad (generate()'s own), less dispatch work per op
        with torch.inference_mode():
            sequences = model.generate(input_ids=input_ids.to(device), attention_mask=am.to(device),
                                       generation_config=config)
    generated = sequences[:, S0:].cpu()
    if generated.shape[1] != steps or not all(torch.equal(generated[b, :n], forced[b, :n]) for b, n in enumerate(lens)):
        raise ReplayError("the teacher-forced generate() did not reproduce the recorded responses (a response that "
                          "stops early without EOS, or an EOS inside a response)")
    return fb.rescored(torch.stack(force.logits[:steps], dim=1),
                       {k: torch.stack(v[:steps], dim=1) for k, v in heads.logits.items()} if heads else {},
                       _generated_routes(capture, B, S0, steps, info) if capture is not None else None, logits_device)


@dataclasses.dataclass
class _ForcedBatch:
    """One re-scoring batch laid out as the rollout's ``generate()`` laid it out: ``input_ids`` / ``am`` the
    prompts left-padded to ``S0`` and their mask, ``forced`` ``[B, max_new_tokens]`` the recorded responses
    (``pad_token_id`` after each)."""

    info: MoEModelInfo
    device: torch.device
    B: int
    S0: int
    lens: list[int]
    steps: int
    input_ids: torch.Tensor
    am: torch.Tensor
    forced: torch.Tensor
    eos_ids: list[int]
    pad_token_id: int

    def rescored(self, logits: torch.Tensor, variants: dict, routes_bt: torch.Tensor | None,
                 logits_device) -> Rescored:
        """Per-sample :class:`Rescored` from ``[B, steps, V]`` float32 logits (and per head variant) and the
        ``[B, S0 + steps - 1, L, k]`` routes."""
        target = self.device if logits_device is None else torch.device(logits_device)

        def per_sample(x: torch.Tensor) -> list[torch.Tensor]:
            return [x[b, :n].to(target) for b, n in enumerate(self.lens)]

        out = Rescored(per_sample(logits), None, {k: per_sample(v) for k, v in variants.items()})
        if routes_bt is not None:
            out.routes = [_sample_routes(routes_bt, b, self.am, n) for b, n in enumerate(self.lens)]
        return out


def _forced_batch(model: torch.nn.Module, samples: Sequence[Sample], pad_token_id: int | None,
                  eos_token_id: int | Sequence[int] | None, max_new_tokens: int | None) -> _ForcedBatch:
    info = describe_model(model)
    if not samples:
        raise ConfigError("rescore_decode: no samples")
    gen_cfg = model.generation_config
    if eos_token_id is None:
        eos_token_id = gen_cfg.eos_token_id
    eos_ids = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if pad_token_id is None:
        pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    S0 = max(s.prompt_len for s in samples)
    lens = [s.response_len for s in samples]
    steps = max(lens)
    if max_new_tokens is None:
        max_new_tokens = steps
    check_positive_int(max_new_tokens, "max_new_tokens", ConfigError)
    if max_new_tokens < steps:
        raise ConfigError(f"rescore_decode: max_new_tokens {max_new_tokens} is shorter than the longest response "
                          f"({steps} tokens)")
    B = len(samples)
    input_ids = torch.full((B, S0), pad_token_id, dtype=torch.long)
    am = torch.zeros(B, S0, dtype=torch.long)
    forced = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long)
    for b, s in enumerate(samples):
        input_ids[b, S0 - s.prompt_len:] = s.token_ids[:s.prompt_len]
        am[b, S0 - s.prompt_len:] = 1
        forced[b, :s.response_len] = s.token_ids[s.prompt_len:]
    return _ForcedBatch(info, next(model.parameters()).device, B, S0, lens, steps, input_ids, am, forced, eos_ids,
                        pad_token_id)


def _decode_positions(mask: torch.Tensor) -> torch.Tensor:
    """The position ids ``generate()`` derives from a left-padded attention mask (and extends by one per step)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def rescore_forward(model: torch.nn.Module, samples: Sequence[Sample], *, pad_token_id: int | None = None,
                    eos_token_id: int | Sequence[int] | None = None, record_routes: bool = True,
                    max_new_tokens: int | None = None, logits_device: str | torch.device | None = "cpu",
                    head_variants: Mapping[Any, tuple[torch.Tensor, torch.Tensor | None]] | None = None,
                    ) -> Rescored:
    """:func:`rescore_decode_all` in one full-sequence forward instead of a prefill and a decode step per token:
    the same left-padded batch (prompts, then the forced responses, ``pad_token_id`` after each), the attention
    mask ``generate()`` grows (the prompts' mask, then ones) and the position ids it derives from it, the
    logits of the positions each decode step ends at (``logits_to_keep``).

    Only under batch-invariant ops with the batch-invariant attention (:func:`~moealign.precision.batch_invariant.
    batch_invariant_mode`, ``attn_implementation="moealign_bi"``): there a row's result does not depend on the
    rows computed with it nor on the key length (every matmul in fixed row tiles, every reduction a fixed tree
    over the compacted valid keys), so this forward gives :func:`rescore_decode_all`'s bits for a fraction of its
    calls (``tests/test_rescore.py`` checks it bitwise against the decode; the lever runs confirm it on every
    run). Anywhere else the two differ, so it is refused (:class:`~moealign.errors.ConfigError`) rather than
    answered with other bits."""
    from ...precision.batch_invariant import is_batch_invariant_mode_enabled
    from .attention import BI_ATTENTION

    attention = getattr(model.config, "_attn_implementation", None)
    if not is_batch_invariant_mode_enabled() or attention != BI_ATTENTION:
        raise ConfigError(f"rescore_forward reproduces the decode only under batch-invariant ops and attention "
                          f"(batch-invariant mode {'on' if is_batch_invariant_mode_enabled() else 'off'}, attention "
                          f"{attention!r}, needs {BI_ATTENTION!r}): use rescore_decode_all")
    fb = _forced_batch(model, samples, pad_token_id, eos_token_id, max_new_tokens)
    steps = fb.steps
    ids = torch.cat([fb.input_ids, fb.forced[:, :steps - 1]], dim=1)          # what the decode steps were fed
    mask = torch.cat([fb.am, torch.ones(fb.B, steps - 1, dtype=fb.am.dtype)], dim=1)
    positions = _decode_positions(mask)
    heads = _HeadVariants(head_variants, keep=slice(None)) if head_variants else None
    with contextlib.ExitStack() as stack:
        capture = stack.enter_context(capture_routes(model, info=fb.info)) if record_routes else None
        if heads is not None:
            stack.enter_context(_head_hook(model, heads))
        stack.enter_context(torch.inference_mode())
        out = model(input_ids=ids.to(fb.device), attention_mask=mask.to(fb.device),
                    position_ids=positions.to(fb.device), use_cache=False, logits_to_keep=steps)
    # [B, steps, V] float32 as generate() copies them; copied here, outside inference mode, so callers get ordinary
    # tensors (as from the decode), not inference tensors they could not update in place
    logits = out.logits.to(torch.float32, copy=True)
    variants = {k: v[0].clone() for k, v in heads.logits.items()} if heads else {}
    routes = _generated_routes(capture, fb.B, fb.S0, steps, fb.info, calls=1) if capture is not None else None
    return fb.rescored(logits, variants, routes, logits_device)
