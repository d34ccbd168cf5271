"""vLLM adapter, GPU harvest: :func:`record_from_outputs` turns what vLLM >= 0.33 returns by itself (Model Runner V2
on GPU: ``CompletionOutput.routed_experts`` and ``CompletionOutput.sampling_mask``) into the
:class:`~moealign.record.RolloutRecord` that :func:`moealign.patches.vllm.generate_with_record` records on the CPU
path: the same rows, dtypes and kept-set CSR, so either record feeds the trainer unchanged.

What vLLM 0.33 fills in, per completion (``LLM(..., enable_return_routed_experts=True, return_sampling_mask=True,
logprobs_mode="processed_logprobs")`` and requests with ``logprobs=0``):

* ``routed_experts``: numpy ``[P + R - 1 - routed_experts_prompt_start, num_hidden_layers, top_k]``, uint8 when the
  model has <= 256 experts, else uint16. Row ``i`` is the routing of input token ``routed_experts_prompt_start + i``
  (the last sampled token is never forwarded), **every** decoder layer is there and dense layers are all zero. It
  is set on the finished output only.
* ``sampling_mask``: ``SamplingMask(token_ids: list[list[int]])``, one list per generated token: the token ids whose
  processed logit (after temperature, min-p, top-k, top-p) is finite, i.e. the kept set the token was drawn from.
* ``logprobs``: per generated token a dict holding at least the sampled token; in ``processed_logprobs`` mode its
  value is the log-prob under the kept-set distribution at temperature T (the one a record states).

The conversion, per completion (one record sample each; ``n > 1`` completions of a request in their order):

* **routes**: the record's MoE layers (``meta.moe_layers``, decoder-layer numbers) are picked from the all-layer
  array by layer number, never by position among MoE layers; every layer the meta calls dense must be all zero
  (anything else means the meta's layer mapping is not the model vLLM ran: :class:`RecordMismatchError`); ids
  are checked in ``[0, num_experts)`` and distinct per token (:class:`RouteError`) and stored in the record's route
  dtype (``uint8`` up to 256 experts, ``int16`` above: vLLM's uint16 is cast only after the range check). With
  ``routed_experts_prompt_start > 0`` vLLM leaves out the routes of the first prompt tokens: those rows are marked
  missing (``Sample.route_missing``; they hold 0 and are never replayed), never filled in.
* **kept sets**: the lists become the record's CSR (``kept_offsets`` int64, ``kept_ids`` int32 ascending per row);
  every row must be non-empty, hold distinct ids in ``[0, vocab_size)`` and contain its sampled token.
* **log-probs**: the sampled token's entry of each position (float32); all finite and <= 0.

Every bad input raises a :class:`~moealign.errors.MoealignError` subclass naming the output, the request and the
problem: a field vLLM did not fill (``routed_experts`` / ``sampling_mask`` / ``logprobs`` None, an unfinished
output): :class:`EngineError`; shapes, lengths and ids that do not fit the tokens: :class:`InputError`; a layer or
top-k axis that is not the meta's model, or a non-zero dense layer: :class:`RecordMismatchError`; expert ids out of
range or repeated: :class:`RouteError`; sampling options a record cannot state: :class:`ConfigError`.

vLLM is imported lazily, inside the functions (the outputs are vLLM objects, so it is installed wherever they are).
"""

from __future__ import annotations

import itertools
import numbers
from typing import Any, Sequence

import numpy as np
import torch

from ..._optional import require
from ..._validate import LOG_PROB_TOLERANCE, short_repr
from ...errors import (
    ConfigError,
    EngineError,
    InputError,
    InputTypeError,
    RecordMismatchError,
    RouteError,
)
from ...record import MIN_TEMPERATURE, RecordMeta, RolloutRecord, Sample, SamplingParams
from ...routing_replay.sampling_mask import check_tokens_in_kept

__all__ = ["record_from_outputs", "samples_from_output"]

#: vLLM sampling options that change the distribution a token is drawn from beyond temperature / top-k / top-p /
#: min-p, with their neutral value; a record cannot state them (the trainer would recompute another distribution).
_NEUTRAL_VALUES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}
#: ... and those that are neutral when unset (None or empty).
_NEUTRAL_UNSET = ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs", "thinking_token_budget",
                  "trace_decode_token_ids", "logits_processors")

_NEEDS_ROUTES = ("routes need vLLM >= 0.33 on Model Runner V2 (GPU) opened with enable_return_routed_experts=True "
                 "(LLM(..., enable_return_routed_experts=True)); older vLLM and the V1 model runner (vLLM's CPU "
                 "build) do not fill it, record there with moealign.patches.vllm.generate_with_record, or convert "
                 "without routes (record_routes=False)")
_NEEDS_MASK = ("kept sets need vLLM >= 0.33 on Model Runner V2 (GPU) opened with return_sampling_mask=True, every "
               "request with temperature > 0 and top_k > 0; or convert without kept sets (record_kept_sets=False)")


# --------------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------------


def _per_output(value, n: int, name: str) -> list:
    """``value`` once per output: a list / tuple of ``n`` entries, or one value for all."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"{name} has {len(value)} entries for {n} outputs (give one per output, or one for all)")
        return list(value)
    return [value] * n


def _record_sampling(sampling, index: int) -> tuple[SamplingParams, int | None]:
    """The record's sampling parameters of output ``index`` and, from a vLLM ``SamplingParams``, its
    ``routed_experts_prompt_start`` (``None`` for a moealign :class:`SamplingParams`)."""
    where = f"sampling[{index}]"
    if isinstance(sampling, SamplingParams):
        if sampling.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"{where}: temperature {sampling.temperature} is below vLLM's greedy threshold "
                              f"{MIN_TEMPERATURE}: vLLM sampled greedily, which a record cannot state")
        return sampling, None
    vllm_sampling = require("vllm.sampling_params", "reading vLLM sampling parameters")
    if not isinstance(sampling, vllm_sampling.SamplingParams):
        raise InputTypeError(f"{where} must be a moealign.record.SamplingParams or a vllm.SamplingParams, got "
                             f"{type(sampling).__name__}")
    temperature = float(sampling.temperature)
    if temperature < MIN_TEMPERATURE:
        raise ConfigError(f"{where}: vLLM temperature {temperature} is below its greedy threshold {MIN_TEMPERATURE}: "
                          f"vLLM sampled greedily, which a record cannot state")
    changed = [f"{name}={getattr(sampling, name)!r}" for name, neutral in _NEUTRAL_VALUES.items()
               if getattr(sampling, name, neutral) != neutral]
    changed += [f"{name}={short_repr(getattr(sampling, name))}" for name in _NEUTRAL_UNSET
                if not _unset(getattr(sampling, name, None))]
    if changed:
        raise ConfigError(f"{where}: the vLLM request changed the sampling distribution beyond temperature / top-k / "
                          f"top-p / min-p ({', '.join(changed)}); a record states only those four, so the trainer "
                          f"would score another distribution than the one sampled")
    top_k = int(sampling.top_k)
    params = SamplingParams(temperature=temperature, top_k=top_k if top_k > 0 else 0, top_p=float(sampling.top_p),
                            min_p=float(sampling.min_p))
    return params, _check_int(getattr(sampling, "routed_experts_prompt_start", 0),
                              f"{where}.routed_experts_prompt_start")


def _unset(value) -> bool:
    return value is None or (isinstance(value, (list, tuple, dict, set)) and not value)


def _check_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    return int(value)


def _np_route_dtype(dtype: torch.dtype):
    return {torch.uint8: np.uint8, torch.int16: np.int16}[dtype]


# --------------------------------------------------------------------------------------------------
# one completion
# --------------------------------------------------------------------------------------------------


def _logprobs(completion, response: list[int], where: str) -> torch.Tensor:
    entries = completion.logprobs
    if entries is None:
        raise EngineError(f"{where}: vLLM returned no log-probs; request SamplingParams(logprobs=0) from an LLM opened "
                          f"with logprobs_mode='processed_logprobs' (the log-prob a record states)")
    if len(entries) != len(response):
        raise InputError(f"{where}: {len(entries)} log-prob positions for {len(response)} generated tokens")
    values = []
    for j, token in enumerate(response):
        entry = entries[j]
        logprob = entry.get(token) if entry else None
        if logprob is None:
            raise InputError(f"{where}: the log-probs of response position {j} do not hold its sampled token {token}")
        values.append(logprob.logprob)
    try:
        out = torch.tensor(values, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputError(f"{where}: log-probs are not numbers: {exc}") from None
    finite = torch.isfinite(out)
    if not bool(finite.all()):
        j = int((~finite).nonzero()[0, 0])
        raise InputError(f"{where}: the sampled token {response[j]} at response position {j} has log-prob "
                         f"{float(out[j])} (outside the distribution it was sampled from)")
    if float(out.max()) > LOG_PROB_TOLERANCE:
        j = int(out.argmax())
        raise InputError(f"{where}: response position {j} has log-prob {float(out[j])} > 0: not a log-probability")
    return out


def _routes(array, meta: RecordMeta, *, rows: int, start: int, prompt_len: int, response_len: int,
            where: str) -> torch.Tensor:
    """The record's route rows ``[rows, len(meta.moe_layers), top_k]`` (route dtype) of vLLM's all-layer array."""
    if not isinstance(array, np.ndarray):
        raise InputTypeError(f"{where}: routed_experts must be a numpy array (vLLM's format), got "
                             f"{type(array).__name__}")
    if array.dtype.kind not in "iu":
        raise InputError(f"{where}: routed_experts has dtype {array.dtype}, vLLM returns integer expert ids (uint8 "
                         f"or uint16)")
    if array.ndim != 3:
        raise InputError(f"{where}: routed_experts has shape {array.shape}, vLLM returns [tokens, num_hidden_layers, "
                         f"top_k]")
    n_rows, n_layers, k = array.shape
    if n_rows != rows:
        raise InputError(f"{where}: routed_experts has {n_rows} rows, expected {rows} = {prompt_len} prompt + "
                         f"{response_len} generated tokens - 1 (the last token is never forwarded) - "
                         f"routed_experts_prompt_start {start}")
    if n_layers != meta.num_layers:
        raise RecordMismatchError(f"{where}: routed_experts covers {n_layers} decoder layers, the record meta's model "
                                  f"has num_layers={meta.num_layers} (vLLM returns every decoder layer): the outputs "
                                  f"come from another model than the meta describes")
    if k != meta.top_k:
        raise RecordMismatchError(f"{where}: routed_experts has top_k={k} experts per token, the record meta's model "
                                  f"has top_k={meta.top_k}")
    moe = list(meta.moe_layers)
    moe_set = set(moe)
    for layer in range(n_layers):
        if layer in moe_set:
            continue
        nonzero = np.flatnonzero(array[:, layer])
        if nonzero.size:
            row, slot = divmod(int(nonzero[0]), k)
            raise RecordMismatchError(
                f"{where}: decoder layer {layer} is dense in the record meta (moe_layers {moe}), but vLLM's "
                f"routed_experts[{row}, {layer}, {slot}] = {int(array[row, layer, slot])} (vLLM leaves dense layers "
                f"all zero): the meta's layer mapping is not the model vLLM ran")
    picked = array[:, moe]                     # a copy: vLLM's array may be a read-only view of its block store
    if picked.size:
        E = meta.num_experts
        if int(picked.max()) >= E or int(picked.min()) < 0:
            wide = picked.astype(np.int64)
            row, col, slot = (int(i) for i in np.argwhere((wide < 0) | (wide >= E))[0])
            raise RouteError(f"{where}: routed_experts[{row}, {moe[col]}, {slot}] = {int(wide[row, col, slot])} (input "
                             f"token {start + row}, decoder layer {moe[col]}) is not an expert id in [0, {E})")
        if k > 1:
            ordered = np.sort(picked, axis=-1)
            repeated = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)
            if repeated.any():
                row, col = (int(i) for i in np.argwhere(repeated)[0])
                raise RouteError(f"{where}: routed_experts[{row}, {moe[col]}] = {picked[row, col].tolist()} (input "
                                 f"token {start + row}, decoder layer {moe[col]}) repeats an expert (a token's "
                                 f"top_k experts are distinct)")
    return torch.from_numpy(np.ascontiguousarray(picked.astype(_np_route_dtype(meta.route_dtype), copy=False)))


def _kept_sets(mask, response: torch.Tensor, vocab_size: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``SamplingMask`` as the record's CSR: offsets int64 ``[R + 1]``, ids int32 ascending per row."""
    rows = getattr(mask, "token_ids", None)
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in rows):
        raise InputTypeError(f"{where}: sampling_mask must be a vLLM SamplingMask holding token_ids: list[list[int]], "
                             f"got {type(mask).__name__}")
    R = int(response.numel())
    if len(rows) != R:
        raise InputError(f"{where}: sampling_mask has {len(rows)} kept sets for {R} generated tokens (one per token)")
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    if bool((counts == 0).any()):
        raise InputError(f"{where}: the kept set of response position {int((counts == 0).nonzero()[0, 0])} is empty")
    try:
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(counts.sum()))
    except (TypeError, ValueError, OverflowError) as exc:
        raise InputError(f"{where}: sampling_mask holds something other than token ids: {exc}") from None
    ids = torch.from_numpy(flat)
    row_of = torch.repeat_interleave(torch.arange(R), counts)
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        j = int(bad.nonzero()[0, 0])
        raise InputError(f"{where}: the kept set of response position {int(row_of[j])} holds {int(ids[j])}, not a "
                         f"token id in [0, vocab_size={vocab_size})")
    keys = (row_of * vocab_size + ids).sort().values     # rows stay in order, ids ascend within each row
    repeated = keys[1:] == keys[:-1]
    if bool(repeated.any()):
        key = int(keys[1:][repeated][0])
        raise InputError(f"{where}: the kept set of response position {key // vocab_size} holds token "
                         f"{key % vocab_size} twice")
    kept_ids = (keys - row_of * vocab_size).to(torch.int32)
    kept_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    try:
        check_tokens_in_kept(kept_offsets, kept_ids, response)
    except RouteError as exc:
        if not hasattr(exc, "row"):
            raise
        raise InputError(f"{where}: the sampled token {exc.token} at response position {exc.row} is not in its kept "
                         f"set (sampling_mask.token_ids[{exc.row}], {int(counts[exc.row])} ids)") from None
    return kept_offsets, kept_ids


def samples_from_output(
    output: Any,
    meta: RecordMeta,
    *,
    sampling,
    prompt_start: int | None = None,
    record_routes: bool = True,
    record_kept_sets: bool = True,
    index: int = 0,
) -> list[Sample]:
    """The record samples of one finished ``vllm.RequestOutput``, one per completion (in order).

    ``sampling``: a moealign :class:`~moealign.record.SamplingParams`, or the ``vllm.SamplingParams`` the request ran
    with (its temperature / top-k / top-p / min-p, and its ``routed_experts_prompt_start``; options a record cannot
    state are refused). ``prompt_start``: the request's ``routed_experts_prompt_start`` (default: the vLLM
    parameters', else 0; both given must agree). ``index`` only names the output in error messages. See
    :func:`record_from_outputs`.
    """
    outputs_module = require("vllm.outputs", "converting vLLM outputs into a rollout record")
    if not isinstance(meta, RecordMeta):
        raise InputTypeError(f"meta must be a moealign.record.RecordMeta, got {type(meta).__name__}")
    if not isinstance(output, outputs_module.RequestOutput):
        raise InputTypeError(f"outputs[{index}] must be a vllm.RequestOutput, got {type(output).__name__}")
    params, start_of_params = _record_sampling(sampling, index)
    if prompt_start is None:
        start = 0 if start_of_params is None else start_of_params
    else:
        start = _check_int(prompt_start, f"prompt_starts[{index}]")
        if start_of_params is not None and start_of_params != start:
            raise ConfigError(f"output {index}: prompt_starts gives {start}, its vLLM SamplingParams "
                              f"routed_experts_prompt_start={start_of_params}")
    request = f"output {index} (request {output.request_id!r})"
    prompt = output.prompt_token_ids
    if prompt is None or len(prompt) == 0:
        raise InputError(f"{request}: no prompt token ids (prompt embeddings cannot be recorded)")
    prompt = list(prompt)
    P = len(prompt)
    if not 0 <= start <= P:
        raise ConfigError(f"{request}: routed_experts_prompt_start {start} is outside [0, prompt length {P}]")
    if not output.finished:
        raise EngineError(f"{request} is not finished: vLLM sets routed_experts on the final output only; convert the "
                          f"finished outputs (LLM.generate, or a stream's last output)")
    if not output.outputs:
        raise InputError(f"{request} holds no completion")
    samples = []
    for completion in output.outputs:
        if not isinstance(completion, outputs_module.CompletionOutput):
            raise InputTypeError(f"{request}: completions must be vllm.CompletionOutput, got "
                                 f"{type(completion).__name__}")
        where = f"{request}, completion {completion.index}"
        if completion.finish_reason is None:
            raise EngineError(f"{where} is not finished (finish_reason None): vLLM sets routed_experts on the final "
                              f"output only")
        response = list(completion.token_ids)
        if not response:
            raise InputError(f"{where}: no generated token (a record sample needs a response)")
        try:
            token_ids = torch.tensor(prompt + response, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise InputError(f"{where}: token ids are not integers: {exc}") from None
        bad = (token_ids < 0) | (token_ids >= meta.vocab_size)
        if bool(bad.any()):
            p = int(bad.nonzero()[0, 0])
            raise InputError(f"{where}: token {int(token_ids[p])} at position {p} is not a token id in "
                             f"[0, vocab_size={meta.vocab_size})")
        L, R = int(token_ids.numel()), len(response)
        logprobs = _logprobs(completion, response, where)
        routes = route_missing = None
        if record_routes:
            if completion.routed_experts is None:
                raise EngineError(f"{where}: vLLM returned no routed_experts; {_NEEDS_ROUTES}")
            routes = _routes(completion.routed_experts, meta, rows=L - 1 - start, start=start, prompt_len=P,
                             response_len=R, where=where)
            if start > 0:             # vLLM left out input tokens 0..start-1: those rows are missing, held as 0
                routes = torch.cat([routes.new_zeros(start, *routes.shape[1:]), routes])
                route_missing = torch.arange(L - 1) < start
        kept_offsets = kept_ids = None
        if record_kept_sets:
            if completion.sampling_mask is None:
                raise EngineError(f"{where}: vLLM returned no sampling_mask; {_NEEDS_MASK}")
            kept_offsets, kept_ids = _kept_sets(completion.sampling_mask, token_ids[P:], meta.vocab_size, where)
        samples.append(Sample(token_ids=token_ids, prompt_len=P, logprobs=logprobs, routes=routes,
                              kept_offsets=kept_offsets, kept_ids=kept_ids, sampling=params,
                              route_missing=route_missing))
    return samples


# --------------------------------------------------------------------------------------------------
# the record
# --------------------------------------------------------------------------------------------------


def record_from_outputs(
    outputs: Sequence[Any],
    meta: RecordMeta,
    *,
    sampling,
    prompt_starts: int | Sequence[int] | None = None,
    record_routes: bool = True,
    record_kept_sets: bool = True,
    validate: bool = True,
) -> RolloutRecord:
    """The :class:`~moealign.record.RolloutRecord` of finished ``vllm.RequestOutput`` objects of vLLM >= 0.33
    (Model Runner V2, ``enable_return_routed_experts=True``, ``return_sampling_mask=True``,
    ``logprobs_mode="processed_logprobs"``, requests with ``logprobs=0``): the rows
    :func:`moealign.patches.vllm.generate_with_record` records on the CPU path, one sample per completion (request
    order, then completion order).

    ``meta``: the :class:`~moealign.record.RecordMeta` of the model vLLM ran (its ``num_layers`` decoder layers,
    ``moe_layers`` by decoder-layer number, ``num_experts``, ``top_k``, ``vocab_size``); the record carries it.
    ``sampling``: per output (a list) or for all, a moealign :class:`~moealign.record.SamplingParams` or the
    ``vllm.SamplingParams`` the request ran with (then its ``routed_experts_prompt_start`` is read, and options a
    record cannot state, such as penalties or a logit bias, are refused). ``prompt_starts``: per output or for all,
    the requests' ``routed_experts_prompt_start`` (default: from vLLM's parameters, else 0); the route rows before a
    start above 0 are marked missing (``Sample.route_missing``). ``record_routes`` /
    ``record_kept_sets``: convert ``routed_experts`` / ``sampling_mask`` (required then) or leave them out.
    ``validate``: also run the record's full validation (every check above runs either way).
    """
    if isinstance(outputs, (str, bytes, dict)) or not isinstance(outputs, Sequence):
        raise InputTypeError(f"outputs must be a list of vllm.RequestOutput, got {type(outputs).__name__}")
    if not outputs:
        raise InputError("outputs is empty (a record needs at least one sample)")
    if not isinstance(meta, RecordMeta):
        raise InputTypeError(f"meta must be a moealign.record.RecordMeta, got {type(meta).__name__}")
    for flag, value in (("record_routes", record_routes), ("record_kept_sets", record_kept_sets),
                        ("validate", validate)):
        if not isinstance(value, bool):
            raise ConfigError(f"{flag} must be True or False, got {value!r}")
    samplings = _per_output(sampling, len(outputs), "sampling")
    starts = _per_output(prompt_starts, len(outputs), "prompt_starts")
    samples: list[Sample] = []
    for b, output in enumerate(outputs):
        samples += samples_from_output(output, meta, sampling=samplings[b], prompt_start=starts[b],
                                       record_routes=record_routes, record_kept_sets=record_kept_sets, index=b)
    return RolloutRecord(meta, samples, validate=validate)

