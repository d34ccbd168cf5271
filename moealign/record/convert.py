"""``moealign record convert``: other engines' rollout outputs into a rollout record, and a record back into the
plain tensor layouts of the frameworks that have one.

``--from FORMAT INPUT --model DIR -o OUT.safetensors`` reads ``INPUT`` (the file form of each format below),
takes the model from ``DIR/config.json`` (its family: MoE layers, experts, top-k, vocabulary; the router signature
from the checkpoint's safetensors when there are any) and writes the record (``meta.engine`` = the format's engine;
route rows the engine did not report are marked missing, :attr:`moealign.record.Sample.route_missing`).
``--to FORMAT RECORD -o OUT.pt`` writes a record in a writable format (``nemo-rl``, ``verl``, ``slime``).

File forms (the route rows themselves are read by :mod:`moealign.record.formats`, which documents each
engine's layout and where it comes from):

* ``sglang``: a JSON list, one entry per request: ``input_ids`` (the request's prompt ids) and ``meta_info`` (the
  ``/generate`` response's, with ``routed_experts`` [+ ``routed_experts_dtype``, ``routed_experts_start_len``] and
  ``output_token_logprobs`` ``[[logprob, token_id, text], ...]``: the request had ``return_logprob`` and
  ``return_routed_experts``); the response's ``output_ids``, when kept, must agree.
* ``vllm-0.21``: a JSON list of vLLM 0.21 OpenAI-server responses (``/v1/completions`` or ``/v1/chat/completions``
  requested with ``return_token_ids`` and ``logprobs``): ``prompt_routed_experts``, per choice ``routed_experts``,
  ``token_ids`` and the log-probs; prompt ids from ``prompt_token_ids`` (the chat response's, the completion
  choice's); ``usage.prompt_tokens_details.cached_tokens`` (prefix-cache hits) when the server reports it.
* ``trtllm``: a JSON list, one entry per request, TensorRT-LLM's LLM API result fields: ``prompt_token_ids`` and
  ``outputs`` (``token_ids``, ``logprobs`` as floats or ``{token_id: logprob}`` dicts, ``routed_experts`` nested
  ``(seq_len - 1, num_moe_layers, top_k)``). ``--expert-ids physical --eplb FILE`` (the run's
  ``MoeLoadBalancerConfig`` as JSON/YAML) when the ids are EPLB slots.
* ``nemo-rl``: a tensor file (``.pt`` dict of tensors / ``.safetensors`` / ``.npz``) with NeMo-RL's
  ``GenerationOutputSpec`` batch: ``output_ids`` ``[B, T]``, ``logprobs`` ``[B, T]``, ``generation_lengths``,
  ``unpadded_sequence_lengths`` ``[B]``, ``routed_experts`` ``[B, T, layers, top_k]``.
* ``verl``: a tensor file with a verl batch's tensors (``dict(data.batch.items())``): ``prompts`` ``[B, Sp]`` (left
  padded), ``responses`` ``[B, Sr]`` (right padded), ``attention_mask`` ``[B, Sp + Sr]``, ``rollout_log_probs``
  ``[B, Sr]``, ``routed_experts`` ``[B, Sp + Sr, layers, top_k]``; ``input_ids`` / ``response_mask`` checked when
  present (a response holding tool tokens, ``response_mask`` 0, is refused: their log-probs are placeholders).
* ``slime``: a ``torch.save`` file: slime's ``--save-debug-rollout-data`` dump (``{"samples": [Sample.to_dict()]}``)
  or a ``train_data`` dict (``tokens``, ``response_lengths``, ``rollout_log_probs``, ``rollout_routed_experts``);
  samples with non-trainable tokens (``loss_mask`` 0) are refused. Read with ``torch.load(weights_only=True)``.

Every JSON entry may carry ``sampling_params`` (``temperature``, ``top_p``, ``top_k``, ``min_p``; the engines do not
echo them); otherwise, and for the tensor forms, ``--temperature`` / ``--top-p`` / ``--top-k`` / ``--min-p`` (default:
temperature 1, no truncation). Every problem raises a :class:`~moealign.errors.MoealignError` naming the file, the
entry and what is wrong.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .._files import (
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    atomic_write,
    check_input_file,
    check_outputs,
    json_depth,
    parse_json,
    read_input_bytes,
    read_json_file,
)
from ..errors import (
    ConfigError,
    InputError,
    MoealignError,
    RecordError,
    UnsupportedModelError,
)
from ..families import get_family
from ..model_config import ConfigView, config_fingerprint, moe_layers, read_model_config
from .formats import (
    RouteRows,
    routes_from_nemo_rl,
    routes_from_sglang,
    routes_from_slime,
    routes_from_trtllm,
    routes_from_verl,
    routes_from_vllm_0_21,
    routes_to_nemo_rl,
    routes_to_slime,
    routes_to_verl,
)
from .meta import RecordMeta, SamplingParams, router_samples, router_signature
from .rollout import RolloutRecord
from .sample import Sample

__all__ = ["FORMATS", "WRITABLE", "convert_to_record", "model_info", "write_format"]

#: format -> the engine the record names
FORMATS = {"sglang": "sglang", "vllm-0.21": "vllm", "trtllm": "tensorrt-llm", "nemo-rl": "nemo-rl",
           "verl": "verl", "slime": "slime"}
#: formats a record can be written back in (plain tensor layouts)
WRITABLE = ("nemo-rl", "verl", "slime")
#: vLLM's chat logprob for a token outside the distribution (-inf clamped): never a sampled token's
VLLM_LOGPROB_FLOOR = -9999.0
_GATE_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight$")


# --------------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------------


def model_info(model_dir: str | os.PathLike, *, dtype: str | None = None) -> RecordMeta:
    """The record metadata of the model of ``model_dir/config.json`` (read by
    :func:`moealign.model_config.read_model_config`; ``engine`` a placeholder the converter replaces; its family from
    :mod:`moealign.families`); the router signature from ``model_dir/*.safetensors`` when they hold every MoE layer's
    router (gate) weight."""
    config = read_model_config(model_dir)
    layers = moe_layers(config, f"--model {os.fspath(model_dir)}")
    view = ConfigView(**config)
    family = get_family(config.get("model_type"))
    try:
        num_experts = int(family.num_experts(view))
        top_k = int(view.num_experts_per_tok)
        num_layers = int(view.num_hidden_layers)
        vocab_size = int(view.vocab_size)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"--model {model_dir}: config.json lacks a field the {family.model_type} family needs "
                          f"({type(exc).__name__}: {exc})") from None
    if not layers:
        raise UnsupportedModelError(f"--model {model_dir}: no MoE layer in config.json (a dense model has no routes)")
    name = dtype or config.get("torch_dtype") or config.get("dtype") or "float32"
    try:
        weights = _router_weights(Path(model_dir), layers, num_experts)
        return RecordMeta(engine="checkpoint", engine_version="", model_fingerprint=config_fingerprint(config),
                          num_layers=num_layers, moe_layers=layers, num_experts=num_experts, top_k=top_k,
                          vocab_size=vocab_size, dtype=str(name).replace("torch.", ""),
                          router_signature=router_signature(weights) if weights else (),
                          router_samples=router_samples(weights) if weights else (),
                          model_name=str(config.get("_name_or_path") or os.fspath(model_dir)))
    except RecordError as exc:
        raise ConfigError(f"--model {model_dir}: {exc}") from None


def _router_weights(root: Path, layers: Sequence[int], num_experts: int) -> list[torch.Tensor]:
    """The gate weights of ``layers`` from the checkpoint's safetensors files, or [] when they are not all there."""
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return []
    from safetensors import safe_open

    found: dict[int, torch.Tensor] = {}
    for file in files:
        check_input_file(file, f"--model {root}:")          # a FIFO named *.safetensors must not block
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    match = _GATE_RE.search(key)
                    if match and int(match.group(1)) in layers:
                        found[int(match.group(1))] = f.get_tensor(key)
    except Exception as exc:    # noqa: BLE001 - safetensors raises its own error types for a bad file
        raise ConfigError(f"--model {root}: a safetensors file does not read ({type(exc).__name__}: {exc})") from None
    if any(layer not in found for layer in layers):
        return []
    weights = [found[layer] for layer in layers]
    if any(w.dim() != 2 or w.shape[0] != num_experts for w in weights):
        raise ConfigError(f"--model {root}: the router weights are not [num_experts={num_experts}, hidden]")
    return weights


# --------------------------------------------------------------------------------------------------
# input files
# --------------------------------------------------------------------------------------------------


def _load_json_list(path: str, what: str) -> list:
    data = read_json_file(path, "input", error_cls=InputError)
    if not isinstance(data, list) or not data:
        raise InputError(f"{path}: expected a non-empty JSON list of {what}, got "
                         f"{type(data).__name__ if not isinstance(data, list) else 'an empty list'}")
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise InputError(f"{path}: entry {i} is a {type(entry).__name__}, expected an object ({what})")
    return data


def _load_tensors(path: str, *, nested: bool = False) -> dict:
    """A ``.pt`` (``torch.load(weights_only=True)``), ``.safetensors`` or ``.npz`` file as a dict."""
    check_input_file(path, "input", error_cls=InputError)
    suffix = Path(path).suffix
    try:
        if suffix == ".safetensors" and not nested:
            from safetensors.torch import load_file

            data = load_file(path)
        elif suffix == ".npz" and not nested:
            with np.load(path, allow_pickle=False) as npz:
                data = {k: torch.from_numpy(np.array(npz[k])) for k in npz.files}
        else:
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:    # noqa: BLE001 - each loader raises its own types for a bad file
        message = " ".join(str(exc).split())[:300]
        raise InputError(f"{path}: does not load as a tensor file ({type(exc).__name__}: {message})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: holds a {type(data).__name__}, expected a dict of tensors")
    return data


def _obj(value, where: str) -> dict:
    """An optional JSON object: ``{}`` for a missing one, else it must be an object."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _clip(value, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _need(data: dict, key: str, where: str):
    if key not in data or data[key] is None:
        raise InputError(f"{where}: no {key!r}")
    return data[key]


def _ids(value, where: str, vocab_size: int) -> list[int]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    elif isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise InputError(f"{where}: expected a list of token ids")
    bad = [x for x in value if not 0 <= x < vocab_size]
    if bad:
        raise InputError(f"{where}: token {bad[0]} is not an id in [0, vocab_size={vocab_size})")
    return list(value)


def _logprob(value, where: str) -> float:
    if isinstance(value, dict):
        value = value.get("logprob")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InputError(f"{where}: log-prob {value!r} is not a finite number")
    if value <= VLLM_LOGPROB_FLOOR:
        raise InputError(f"{where}: log-prob {value} is vLLM's floor for -inf: the token lies outside the "
                         f"distribution it was sampled from")
    return float(value)


#: sampling_params keys a record states
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")
#: keys that do not change the distribution a token is sampled from (lengths, stops, seeds, output options)
_SAMPLING_INERT = frozenset({
    "max_tokens", "max_new_tokens", "max_completion_tokens", "stop", "stop_token_ids", "stop_str", "seed", "n",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "logprobs",
    "prompt_logprobs", "return_logprob", "detokenize", "no_stop_trim", "best_of", "output_kind"})
#: keys that change the distribution, with their neutral value (accepted only at it)
_PENALTIES = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {},
              "min_tokens": 0, "bad_words": [], "no_repeat_ngram_size": 0, "allowed_token_ids": None,
              "length_penalty": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def _sampling(entry: dict, default: SamplingParams, where: str) -> SamplingParams:
    params = entry.get("sampling_params")
    if params is None:
        return default
    if not isinstance(params, dict):
        raise InputError(f"{where}: sampling_params is not an object")
    for key, value in params.items():
        if key in _SAMPLING_KEYS or key in _SAMPLING_INERT:
            continue
        if key in _PENALTIES:
            if value in (None, _PENALTIES[key]) or value == []:   # the neutral value changes nothing
                continue
            raise InputError(f"{where}: sampling_params {key}={_clip(value)}: the engine sampled from a penalised "
                             f"distribution a record cannot state (its log-probs are not the model's); convert "
                             f"rollouts sampled without {', '.join(sorted(_PENALTIES))}")
        raise InputError(f"{where}: sampling_params has the unknown key {_clip(repr(key))} (known: "
                         f"{', '.join(_SAMPLING_KEYS)}; accepted without effect on the distribution: "
                         f"{', '.join(sorted(_SAMPLING_INERT))})")
    try:
        top_k = params.get("top_k", 0)
        return SamplingParams(temperature=params.get("temperature", 1.0),
                              top_k=0 if isinstance(top_k, numbers.Real) and top_k < 0 else top_k,  # -1: off
                              top_p=params.get("top_p", 1.0), min_p=params.get("min_p", 0.0))
    except (ValueError, TypeError) as exc:
        raise InputError(f"{where}: sampling_params: {exc}") from None


@dataclass
class _Args:
    """What a reader gets besides the file."""

    model: RecordMeta
    sampling: SamplingParams
    expert_ids: str = "logical"
    eplb: dict | None = None

    @property
    def kw(self) -> dict:
        return dict(moe_layers=self.model.moe_layers, top_k=self.model.top_k, num_experts=self.model.num_experts)


def _sample(prompt: list[int], response: list[int], logprobs: list[float], rows: RouteRows, sampling,
            where: str) -> Sample:
    if not prompt or not response:
        raise InputError(f"{where}: an empty {'prompt' if not prompt else 'response'} (a record sample needs both)")
    if len(logprobs) != len(response):
        raise InputError(f"{where}: {len(logprobs)} log-probs for {len(response)} response tokens")
    return Sample(token_ids=torch.tensor(prompt + response, dtype=torch.int64), prompt_len=len(prompt),
                  logprobs=torch.tensor(logprobs, dtype=torch.float32), routes=rows.routes, sampling=sampling,
                  route_missing=rows.route_missing)


# --------------------------------------------------------------------------------------------------
# readers
# --------------------------------------------------------------------------------------------------


def _read_sglang(path: str, a: _Args) -> list[Sample]:
    out = []
    for i, entry in enumerate(_load_json_list(path, "SGLang /generate results")):
        where = f"{path}: entry {i}"
        prompt = _ids(_need(entry, "input_ids", where), f"{where}: input_ids", a.model.vocab_size)
        meta_info = _need(entry, "meta_info", where)
        if not isinstance(meta_info, dict):
            raise InputError(f"{where}: meta_info is not an object")
        pairs = _need(meta_info, "output_token_logprobs", f"{where}: meta_info (request return_logprob=True)")
        if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) >= 2 for p in pairs):
            raise InputError(f"{where}: meta_info.output_token_logprobs is not a list of [logprob, token_id, ...]")
        response = _ids([p[1] for p in pairs], f"{where}: output_token_logprobs token ids", a.model.vocab_size)
        if entry.get("output_ids") is not None and _ids(entry["output_ids"], f"{where}: output_ids",
                                                         a.model.vocab_size) != response:
            raise InputError(f"{where}: output_ids and the token ids of output_token_logprobs differ")
        logprobs = [_logprob(p[0], f"{where}: output_token_logprobs[{j}]") for j, p in enumerate(pairs)]
        start = meta_info.get("routed_experts_start_len", entry.get("routed_experts_start_len", 0))
        rows = routes_from_sglang(meta_info, num_hidden_layers=a.model.num_layers, length=len(prompt) + len(response),
                                  start_len=start, **a.kw)
        out.append(_sample(prompt, response, logprobs, rows, _sampling(entry, a.sampling, where), where))
    return out


def _read_vllm_0_21(path: str, a: _Args) -> list[Sample]:
    out = []
    for i, entry in enumerate(_load_json_list(path, "vLLM 0.21 OpenAI-server responses")):
        where = f"{path}: response {i}"
        kind = entry.get("object")
        if kind not in ("text_completion", "chat.completion"):
            raise InputError(f"{where}: object {kind!r} is not a completion ('text_completion' / 'chat.completion')")
        details = _obj(_obj(entry.get("usage"), f"{where}: usage").get("prompt_tokens_details"),
                       f"{where}: usage.prompt_tokens_details")
        cached = details.get("cached_tokens") or 0
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise InputError(f"{where}: usage.prompt_tokens_details.cached_tokens must be an integer >= 0, got "
                             f"{cached!r}")
        choices = _need(entry, "choices", where)
        if not isinstance(choices, list) or not choices:
            raise InputError(f"{where}: no choices")
        for c, choice in enumerate(choices):
            cw = f"{where}, choice {c}"
            source = entry if kind == "chat.completion" else choice
            prompt = _ids(_need(source, "prompt_token_ids", f"{cw} (request return_token_ids=true)"),
                          f"{cw}: prompt_token_ids", a.model.vocab_size)
            response = _ids(_need(choice, "token_ids", f"{cw} (request return_token_ids=true)"), f"{cw}: token_ids",
                            a.model.vocab_size)
            lp = _need(choice, "logprobs", f"{cw} (request logprobs)")
            if kind == "chat.completion":
                content = lp.get("content") if isinstance(lp, dict) else None
                if not isinstance(content, list):
                    raise InputError(f"{cw}: logprobs.content is not a list")
                values = [x.get("logprob") if isinstance(x, dict) else x for x in content]
            else:
                values = lp.get("token_logprobs") if isinstance(lp, dict) else None
                if not isinstance(values, list):
                    raise InputError(f"{cw}: logprobs.token_logprobs is not a list")
            logprobs = [_logprob(v, f"{cw}: logprob {j}") for j, v in enumerate(values)]
            rows = routes_from_vllm_0_21(entry.get("prompt_routed_experts"), choice.get("routed_experts"),
                                         prompt_len=len(prompt), length=len(prompt) + len(response),
                                         num_cached_tokens=cached, **a.kw)
            out.append(_sample(prompt, response, logprobs, rows, _sampling(entry, a.sampling, cw), cw))
    return out


def _read_trtllm(path: str, a: _Args) -> list[Sample]:
    out = []
    for i, entry in enumerate(_load_json_list(path, "TensorRT-LLM generation results")):
        where = f"{path}: entry {i}"
        prompt = _ids(_need(entry, "prompt_token_ids", where), f"{where}: prompt_token_ids", a.model.vocab_size)
        outputs = _need(entry, "outputs", where)
        if not isinstance(outputs, list) or not outputs:
            raise InputError(f"{where}: no outputs")
        for c, completion in enumerate(outputs):
            cw = f"{where}, output {c}"
            if not isinstance(completion, dict):
                raise InputError(f"{cw}: not an object")
            response = _ids(_need(completion, "token_ids", cw), f"{cw}: token_ids", a.model.vocab_size)
            values = _need(completion, "logprobs", f"{cw} (request logprobs)")
            if not isinstance(values, list):
                raise InputError(f"{cw}: logprobs is not a list")
            logprobs = []
            for j, v in enumerate(values):
                if isinstance(v, dict) and "logprob" not in v:      # {token_id: Logprob} of the LLM API
                    key = str(response[j]) if j < len(response) else None
                    picked = {str(k): x for k, x in v.items()}.get(key)
                    if picked is None:
                        raise InputError(f"{cw}: logprobs[{j}] has no entry for the sampled token {key}")
                    v = picked
                logprobs.append(_logprob(v, f"{cw}: logprobs[{j}]"))
            rows = routes_from_trtllm(_need(completion, "routed_experts", f"{cw} (Router Replay enabled)"),
                                      length=len(prompt) + len(response), expert_ids=a.expert_ids, eplb=a.eplb,
                                      **a.kw)
            out.append(_sample(prompt, response, logprobs, rows, _sampling(entry, a.sampling, cw), cw))
    return out


def _int_1d(data: dict, key: str, where: str, n: int | None = None) -> list[int]:
    value = _need(data, key, where)
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype.is_floating_point:
        raise InputError(f"{where}: {key} must be a 1-D integer tensor")
    if n is not None and value.shape[0] != n:
        raise InputError(f"{where}: {key} has {value.shape[0]} entries for a batch of {n}")
    return [int(x) for x in value]


def _tensor(data: dict, key: str, where: str, dims: int) -> torch.Tensor:
    value = _need(data, key, where)
    if not isinstance(value, torch.Tensor) or value.dim() != dims:
        raise InputError(f"{where}: {key} must be a {dims}-D tensor, got "
                         f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
    return value


def _read_nemo_rl(path: str, a: _Args) -> list[Sample]:
    data = _load_tensors(path)
    ids = _tensor(data, "output_ids", path, 2)
    logprobs = _tensor(data, "logprobs", path, 2)
    routed = _tensor(data, "routed_experts", f"{path} (router_replay enabled)", 4)
    B, T = ids.shape
    if tuple(logprobs.shape) != (B, T) or tuple(routed.shape[:2]) != (B, T):
        raise InputError(f"{path}: output_ids {tuple(ids.shape)}, logprobs {tuple(logprobs.shape)} and routed_experts "
                         f"{tuple(routed.shape)} do not share [batch, tokens]")
    lengths = _int_1d(data, "unpadded_sequence_lengths", path, B)
    generated = _int_1d(data, "generation_lengths", path, B)
    out = []
    for b in range(B):
        where = f"{path}: sample {b}"
        L, R = lengths[b], generated[b]
        if not 0 < R < L <= T:
            raise InputError(f"{where}: {L} tokens of which {R} generated do not fit {T} positions")
        tokens = _ids(ids[b, :L], f"{where}: output_ids", a.model.vocab_size)
        rows = routes_from_nemo_rl(routed[b], length=L, num_hidden_layers=a.model.num_layers, **a.kw)
        values = [_logprob(float(v), f"{where}: logprobs[{L - R + j}]") for j, v in enumerate(logprobs[b, L - R:L])]
        out.append(_sample(tokens[:L - R], tokens[L - R:], values, rows, a.sampling, where))
    return out


def _read_verl(path: str, a: _Args) -> list[Sample]:
    data = _load_tensors(path)
    prompts = _tensor(data, "prompts", path, 2)
    responses = _tensor(data, "responses", path, 2)
    mask = _tensor(data, "attention_mask", path, 2)
    logprobs = _tensor(data, "rollout_log_probs", f"{path} (rollout log-probs recorded)", 2)
    routed = _tensor(data, "routed_experts", f"{path} (enable_rollout_routing_replay)", 4)
    B, Sp = prompts.shape
    Sr = responses.shape[1]
    if (responses.shape[0] != B or tuple(mask.shape) != (B, Sp + Sr) or tuple(logprobs.shape) != (B, Sr)
            or tuple(routed.shape[:2]) != (B, Sp + Sr)):
        raise InputError(f"{path}: prompts {tuple(prompts.shape)}, responses {tuple(responses.shape)}, attention_mask "
                         f"{tuple(mask.shape)}, rollout_log_probs {tuple(logprobs.shape)} and routed_experts "
                         f"{tuple(routed.shape)} do not fit one verl batch")
    input_ids = torch.cat([prompts, responses], dim=1)
    if "input_ids" in data and not torch.equal(_tensor(data, "input_ids", path, 2).to(torch.int64),
                                               input_ids.to(torch.int64)):
        raise InputError(f"{path}: input_ids is not prompts followed by responses")
    rows = routes_from_verl(routed, mask, prompt_width=Sp, num_hidden_layers=a.model.num_layers, **a.kw)
    response_mask = data.get("response_mask")
    if response_mask is not None:
        response_mask = _tensor(data, "response_mask", path, 2)
        if tuple(response_mask.shape) != (B, Sr):
            raise InputError(f"{path}: response_mask has shape {tuple(response_mask.shape)}, the responses "
                             f"{(B, Sr)}: a mask that does not cover every response token would leave tokens unread")
    out = []
    for b in range(B):
        where = f"{path}: sample {b}"
        valid = mask[b].nonzero().flatten()
        start, end = int(valid[0]), int(valid[-1]) + 1
        R = end - Sp
        if response_mask is not None and not bool((response_mask[b, :R] == 1).all()):
            j = int((response_mask[b, :R] != 1).nonzero()[0, 0])
            raise InputError(f"{where}: response token {j} has response_mask 0 (a tool or environment token): its "
                             f"log-prob is a placeholder and a record has no per-token loss mask")
        tokens = _ids(input_ids[b, start:end], f"{where}: tokens", a.model.vocab_size)
        values = [_logprob(float(v), f"{where}: rollout_log_probs[{j}]") for j, v in enumerate(logprobs[b, :R])]
        out.append(_sample(tokens[:Sp - start], tokens[Sp - start:], values, rows[b], a.sampling, where))
    return out


def _read_slime(path: str, a: _Args) -> list[Sample]:
    data = _load_tensors(path, nested=True)
    if "samples" in data:
        entries = data["samples"]
        if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
            raise InputError(f"{path}: 'samples' is not a non-empty list of Sample.to_dict() objects")
    else:
        keys = ("tokens", "response_lengths", "rollout_log_probs", "rollout_routed_experts")
        columns = [_need(data, k, f"{path} (a slime train_data dict or a debug rollout dump)") for k in keys]
        if len({len(c) for c in columns}) != 1:
            raise InputError(f"{path}: {', '.join(f'{k} has {len(c)}' for k, c in zip(keys, columns))} entries")
        entries = [dict(tokens=t, response_length=r, rollout_log_probs=lp, rollout_routed_experts=e)
                   for t, r, lp, e in zip(*columns)]
    out = []
    for i, entry in enumerate(entries):
        where = f"{path}: sample {i}"
        tokens = _ids(_need(entry, "tokens", where), f"{where}: tokens", a.model.vocab_size)
        R = entry.get("response_length")
        if isinstance(R, torch.Tensor) and R.numel() == 1:
            R = int(R)
        if isinstance(R, bool) or not isinstance(R, int) or not 0 < R < len(tokens):
            raise InputError(f"{where}: response_length {R!r} does not fit {len(tokens)} tokens")
        loss_mask = entry.get("loss_mask")
        if loss_mask is not None:
            loss_mask = loss_mask.tolist() if isinstance(loss_mask, torch.Tensor) else loss_mask
            if (not isinstance(loss_mask, list) or len(loss_mask) != R
                    or not all(isinstance(x, (int, float)) and x in (0, 1) for x in loss_mask)):
                raise InputError(f"{where}: loss_mask must be a list of {R} zeros and ones (one per response token), "
                                 f"got {_clip(loss_mask)}")
        if loss_mask is not None and not all(int(x) == 1 for x in loss_mask):
            raise InputError(f"{where}: loss_mask holds 0 (non-trainable tokens, e.g. tool output): their log-probs "
                             f"are placeholders and a record has no per-token loss mask")
        values = _need(entry, "rollout_log_probs", where)
        values = values.tolist() if isinstance(values, torch.Tensor) else values
        if not isinstance(values, list):
            raise InputError(f"{where}: rollout_log_probs is not a list")
        logprobs = [_logprob(v, f"{where}: rollout_log_probs[{j}]") for j, v in enumerate(values)]
        rows = routes_from_slime(_need(entry, "rollout_routed_experts", f"{where} (--use-rollout-routing-replay)"),
                                 length=len(tokens), num_hidden_layers=a.model.num_layers, **a.kw)
        out.append(_sample(tokens[:-R], tokens[-R:], logprobs, rows, a.sampling, where))
    return out


_READERS: dict[str, Callable[[str, _Args], list[Sample]]] = {
    "sglang": _read_sglang, "vllm-0.21": _read_vllm_0_21, "trtllm": _read_trtllm, "nemo-rl": _read_nemo_rl,
    "verl": _read_verl, "slime": _read_slime}


def _load_eplb(path: str) -> dict:
    data = read_input_bytes(path, "--eplb", max_bytes=MAX_JSON_BYTES)
    if Path(path).suffix in (".yaml", ".yml"):
        from .._optional import require

        yaml = require("yaml", "reading a YAML EPLB config (--eplb)")
        try:
            data = yaml.safe_load(data)
        except RecursionError:
            raise ConfigError(f"--eplb {path}: YAML nested too deeply") from None
        except (yaml.YAMLError, ValueError) as exc:
            raise ConfigError(f"--eplb {path}: not YAML ({' '.join(str(exc).split())[:200]})") from None
        if json_depth(data) > MAX_JSON_DEPTH:
            raise ConfigError(f"--eplb {path}: YAML nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    else:
        data = parse_json(data, f"--eplb {path}")
    if not isinstance(data, dict):
        raise ConfigError(f"--eplb {path}: not a MoeLoadBalancerConfig object")
    return data


def convert_to_record(fmt: str, path: str, model: RecordMeta, *, engine_version: str = "unknown",
                      sampling: SamplingParams = SamplingParams(), expert_ids: str = "logical",
                      eplb: dict | None = None) -> RolloutRecord:
    """The :class:`RolloutRecord` of ``path`` in format ``fmt`` (:data:`FORMATS`), for the model ``model``."""
    if fmt not in FORMATS:
        raise ConfigError(f"format {fmt!r} is not one of {sorted(FORMATS)}")
    if fmt != "trtllm" and (expert_ids != "logical" or eplb is not None):
        raise ConfigError("--expert-ids / --eplb apply to the trtllm format only")
    try:
        samples = _READERS[fmt](path, _Args(model, sampling, expert_ids, eplb))
    except MoealignError:
        raise
    except (TypeError, AttributeError, IndexError, KeyError, ValueError, OverflowError, RuntimeError,
            RecursionError) as exc:
        # the input boundary: a field of a type no check above foresaw is still the input's fault, never a traceback
        raise InputError(f"{path}: a malformed {fmt} field ({type(exc).__name__}: "
                         f"{_clip(' '.join(str(exc).split()))})") from None
    meta = dataclasses.replace(model, engine=FORMATS[fmt], engine_version=engine_version)
    try:
        return RolloutRecord(meta, samples)
    except RecordError as exc:
        raise type(exc)(f"{path}: {exc}") from None


# --------------------------------------------------------------------------------------------------
# writers
# --------------------------------------------------------------------------------------------------


def _rows_of(record: RolloutRecord) -> list[RouteRows]:
    if not record.has_routes:
        raise ConfigError("the record has no routes: nothing to write in a route format")
    return [RouteRows(s.routes, s.route_missing if s.route_missing is not None
                      else torch.zeros(s.length - 1, dtype=torch.bool)) for s in record.samples]


def _nemo_rl_batch(record: RolloutRecord) -> dict:
    rows = _rows_of(record)
    T = max(s.length for s in record.samples)
    B = len(record)
    ids = torch.zeros(B, T, dtype=torch.int64)
    logprobs = torch.zeros(B, T, dtype=torch.float32)
    for b, s in enumerate(record.samples):
        ids[b, :s.length] = s.token_ids
        logprobs[b, s.prompt_len:s.length] = s.logprobs.to(torch.float32)
    routed = torch.stack([routes_to_nemo_rl(r, padded_length=T, num_experts=record.meta.num_experts) for r in rows])
    return {"output_ids": ids, "logprobs": logprobs,
            "generation_lengths": torch.tensor([s.response_len for s in record.samples], dtype=torch.int64),
            "unpadded_sequence_lengths": torch.tensor([s.length for s in record.samples], dtype=torch.int64),
            "routed_experts": routed}


def _verl_batch(record: RolloutRecord) -> dict:
    rows = _rows_of(record)
    Sp = max(s.prompt_len for s in record.samples)
    Sr = max(s.response_len for s in record.samples)
    B = len(record)
    prompts = torch.zeros(B, Sp, dtype=torch.int64)
    responses = torch.zeros(B, Sr, dtype=torch.int64)
    mask = torch.zeros(B, Sp + Sr, dtype=torch.int64)
    logprobs = torch.zeros(B, Sr, dtype=torch.float32)
    for b, s in enumerate(record.samples):
        P, R = s.prompt_len, s.response_len
        prompts[b, Sp - P:] = s.token_ids[:P]
        responses[b, :R] = s.token_ids[P:]
        mask[b, Sp - P:Sp + R] = 1
        logprobs[b, :R] = s.logprobs.to(torch.float32)
    routed = routes_to_verl(rows, [s.prompt_len for s in record.samples], prompt_width=Sp, response_width=Sr,
                            num_hidden_layers=record.meta.num_layers, moe_layers=record.meta.moe_layers)
    return {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": mask[:, Sp:].clone(), "rollout_log_probs": logprobs, "routed_experts": routed}


def _slime_dump(record: RolloutRecord) -> dict:
    rows = _rows_of(record)
    samples = []
    for i, (s, r) in enumerate(zip(record.samples, rows)):
        try:
            routed = routes_to_slime(r, num_hidden_layers=record.meta.num_layers, moe_layers=record.meta.moe_layers)
        except ConfigError as exc:
            raise ConfigError(f"sample {i}: {exc}") from None
        samples.append({"index": i, "tokens": s.token_ids.tolist(), "response_length": s.response_len,
                        "rollout_log_probs": s.logprobs.to(torch.float32).tolist(),
                        "rollout_routed_experts": routed, "status": "completed"})
    return {"rollout_id": 0, "samples": samples}


_WRITERS = {"nemo-rl": _nemo_rl_batch, "verl": _verl_batch, "slime": _slime_dump}


def write_format(fmt: str, record: RolloutRecord, path: str | os.PathLike) -> None:
    """Write ``record`` in format ``fmt`` (:data:`WRITABLE`) to ``path`` with ``torch.save``, atomically."""
    if fmt not in WRITABLE:
        raise ConfigError(f"format {fmt!r} cannot be written (writable: {', '.join(WRITABLE)})")
    data = _WRITERS[fmt](record)
    atomic_write(path, lambda tmp: torch.save(data, tmp), flag="-o")


# --------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------


def run(args: Any) -> str:
    """``moealign record convert`` (the parsed arguments); returns the one-line summary."""
    if (args.from_format is None) == (args.to_format is None):
        raise ConfigError("give exactly one of --from FORMAT (engine output -> record) or --to FORMAT "
                          "(record -> a framework's batch file)")
    check_outputs({"-o": args.output}, {"input": args.input, "--model": args.model, "--eplb": args.eplb})
    if args.to_format is not None:
        given = [flag for flag, value in (("--model", args.model), ("--eplb", args.eplb),
                                          ("--engine-version", args.engine_version), ("--dtype", args.dtype))
                 if value is not None]
        given += [f"--{n.replace('_', '-')}" for n in ("temperature", "top_p", "top_k", "min_p")
                  if getattr(args, n) is not None]
        if args.expert_ids != "logical":
            given.append("--expert-ids")
        if given:
            raise ConfigError(f"{', '.join(given)}: options of --from (the record carries its model and sampling)")
        record = RolloutRecord.load(args.input)
        write_format(args.to_format, record, args.output)
        return (f"wrote {args.output}: {len(record)} samples of {args.input} in {args.to_format}'s layout")
    if args.model is None:
        raise ConfigError("--from needs --model DIR (the checkpoint whose config.json says which layers are MoE)")
    check_input_file(args.input, "input", error_cls=InputError)
    try:
        sampling = SamplingParams(temperature=1.0 if args.temperature is None else args.temperature,
                                  top_k=0 if args.top_k is None else args.top_k,
                                  top_p=1.0 if args.top_p is None else args.top_p,
                                  min_p=0.0 if args.min_p is None else args.min_p)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.from_format != "trtllm" and (args.expert_ids != "logical" or args.eplb is not None):
        raise ConfigError("--expert-ids / --eplb apply to the trtllm format only")
    if args.expert_ids == "physical" and args.eplb is None:
        raise ConfigError("--expert-ids physical needs --eplb FILE (the run's MoeLoadBalancerConfig)")
    eplb = _load_eplb(args.eplb) if args.eplb is not None else None
    model = model_info(args.model, dtype=args.dtype)
    version = args.engine_version or ("0.21" if args.from_format == "vllm-0.21" else "unknown")
    record = convert_to_record(args.from_format, args.input, model, engine_version=version, sampling=sampling,
                               expert_ids=args.expert_ids, eplb=eplb)
    record.save(args.output)
    rows = sum(s.length - 1 for s in record.samples)
    missing = sum(int(s.route_missing.sum()) for s in record.samples if s.route_missing is not None)
    return (f"wrote {args.output}: {len(record)} samples, {record.num_response_tokens} response tokens, {rows} route "
            f"rows ({missing} missing), engine {record.meta.engine}")

