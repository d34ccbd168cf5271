"""vLLM 0.33's own outputs into a record (``moealign.patches.vllm.harvest.record_from_outputs``).

The outputs are built with vLLM's real classes (``RequestOutput``, ``CompletionOutput``, ``SamplingMask``,
``Logprob`` / ``FlatLogprobs``, ``SamplingParams``), filled the way vLLM 0.33's Model Runner V2 fills them:
``routed_experts`` a read-only numpy array ``[P + R - 1 - routed_experts_prompt_start, num_hidden_layers, top_k]``
over every decoder layer (dense ones all zero), uint8 up to 256 experts and uint16 above; ``sampling_mask`` one
ascending id list per generated token; ``logprobs`` a dict per token holding the sampled one. Each converted record
is compared element by element with the rows it must hold; every refusal has a test that fails without its check
(run with ``validate=False``, so the record's own validation cannot stand in for it).

The round trip: a child process (vLLM keeps process-wide state) records a rollout of the embedded model with the CPU
recorder (``generate_with_record``) and keeps the ``RequestOutput`` objects vLLM returned; the test rebuilds
vLLM-0.33-style outputs from them (``routed_experts`` / ``sampling_mask`` from the record's rows) and converts them
back: the record must come out identical, tensor for tensor. Skipped only where vLLM is not installed.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import sys

import numpy as np
import pytest
import torch

from moealign._optional import probe
from moealign.errors import (
    ConfigError,
    EngineError,
    InputError,
    InputTypeError,
    MoealignError,
    RecordError,
    RecordMismatchError,
    RouteError,
)
from moealign.record import RecordMeta, RolloutRecord, SamplingParams
import warm

VLLM = probe("vllm")
pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(not VLLM.available, reason=f"vLLM is not installed: {VLLM.error}")]

ROUND_TRIP_SAMPLING = SamplingParams(temperature=0.9, top_p=0.9, top_k=50)


# --------------------------------------------------------------------------------------------------
# building vLLM 0.33 outputs
# --------------------------------------------------------------------------------------------------


def _meta(num_layers=4, moe_layers=(0, 2, 3), num_experts=16, top_k=4, vocab_size=64) -> RecordMeta:
    return RecordMeta(engine="vllm", engine_version="0.33.0", model_fingerprint="0123456789abcdef",
                      num_layers=num_layers, moe_layers=moe_layers, num_experts=num_experts, top_k=top_k,
                      vocab_size=vocab_size, dtype="bfloat16")


def _case(meta: RecordMeta, prompt_len: int, response_len: int, seed: int) -> dict:
    """The rows a record sample must hold (routes in the record's dtype, kept sets ascending, each holding its
    sampled token, float32 log-probs), drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    V, E, k, n = meta.vocab_size, meta.num_experts, meta.top_k, len(meta.moe_layers)
    L = prompt_len + response_len
    token_ids = torch.randint(0, V, (L,), generator=g)
    routes = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range((L - 1) * n)]).view(L - 1, n, k)
    counts, ids = [], []
    for t in token_ids[prompt_len:].tolist():
        others = [x for x in torch.randperm(V, generator=g)[:int(torch.randint(0, 6, (1,), generator=g))].tolist()
                  if x != t]
        row = sorted({t, *others})
        counts.append(len(row))
        ids += row
    logprobs = -torch.rand(response_len, generator=g) * 4
    return dict(token_ids=token_ids, prompt_len=prompt_len, routes=routes.to(meta.route_dtype),
                kept_offsets=torch.tensor([0] + counts).cumsum(0), kept_ids=torch.tensor(ids, dtype=torch.int32),
                logprobs=logprobs.to(torch.float32))


def _all_layers(meta: RecordMeta, routes: torch.Tensor, start: int = 0) -> np.ndarray:
    """vLLM 0.33's ``routed_experts``: every decoder layer (dense ones zero), uint8 / uint16, rows from ``start``,
    read-only (vLLM reads it out of its block store with ``np.frombuffer``)."""
    dtype = np.uint8 if meta.num_experts <= 256 else np.uint16
    out = np.zeros((routes.shape[0] - start, meta.num_layers, meta.top_k), dtype=dtype)
    out[:, list(meta.moe_layers)] = routes[start:].to(torch.int64).numpy().astype(dtype)
    out.setflags(write=False)
    return out


def _kept_lists(case: dict) -> list[list[int]]:
    off, ids = case["kept_offsets"].tolist(), case["kept_ids"].tolist()
    return [ids[off[j]:off[j + 1]] for j in range(len(off) - 1)]


def _logprobs(case: dict, vocab_size: int, flat: bool = False):
    """One dict per generated token; another token's entry comes first (the sampled token must be looked up)."""
    from vllm.logprobs import FlatLogprobs, Logprob

    out = FlatLogprobs() if flat else []
    P = case["prompt_len"]
    for j, (t, lp) in enumerate(zip(case["token_ids"][P:].tolist(), case["logprobs"].tolist())):
        other = (t + 1 + j) % vocab_size
        out.append({other: Logprob(logprob=-50.0, rank=2), t: Logprob(logprob=lp, rank=1)})
    return out


def _completion(case: dict, meta: RecordMeta, *, index: int = 0, start: int = 0, flat: bool = False, **changes):
    from vllm.outputs import CompletionOutput, SamplingMask

    P = case["prompt_len"]
    fields = dict(index=index, text="", token_ids=case["token_ids"][P:].tolist(),
                  cumulative_logprob=float(case["logprobs"].sum()), logprobs=_logprobs(case, meta.vocab_size, flat),
                  routed_experts=_all_layers(meta, case["routes"], start), finish_reason="length",
                  sampling_mask=SamplingMask(_kept_lists(case)))
    fields.update(changes)
    return CompletionOutput(**fields)


def _request(prompt: list[int], completions: list, request_id: str = "req-0", finished: bool = True):
    from vllm.outputs import RequestOutput

    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=prompt, prompt_logprobs=None,
                         outputs=completions, finished=finished)


def _output(case: dict, meta: RecordMeta, request_id: str = "req-0", **changes):
    return _request(case["token_ids"][:case["prompt_len"]].tolist(), [_completion(case, meta, **changes)], request_id)


def _assert_sample(sample, case: dict, sampling: SamplingParams, meta: RecordMeta, *, routes=True, kept=True):
    assert torch.equal(sample.token_ids, case["token_ids"]) and sample.token_ids.dtype == torch.int64
    assert sample.prompt_len == case["prompt_len"]
    assert torch.equal(sample.logprobs, case["logprobs"]) and sample.logprobs.dtype == torch.float32
    if routes:
        assert sample.routes.dtype == meta.route_dtype
        assert torch.equal(sample.routes, case["routes"])
    else:
        assert sample.routes is None
    if kept:
        assert sample.kept_offsets.dtype == torch.int64 and sample.kept_ids.dtype == torch.int32
        assert torch.equal(sample.kept_offsets, case["kept_offsets"])
        assert torch.equal(sample.kept_ids, case["kept_ids"])
    else:
        assert sample.kept_offsets is None and sample.kept_ids is None
    assert sample.sampling == sampling


# --------------------------------------------------------------------------------------------------
# conversions
# --------------------------------------------------------------------------------------------------


def test_uint8_routes_dense_layer_and_kept_sets_element_by_element(tmp_path):
    from moealign.patches.vllm import record_from_outputs

    meta = _meta()                                          # decoder layer 1 is dense
    cases = [_case(meta, P, R, seed) for seed, (P, R) in enumerate([(5, 3), (9, 1), (1, 6)])]
    outputs = [_output(c, meta, f"req-{i}") for i, c in enumerate(cases)]
    assert outputs[0].outputs[0].routed_experts.dtype == np.uint8
    assert outputs[0].outputs[0].routed_experts.shape == (7, 4, 4)       # P + R - 1 rows, all 4 decoder layers
    sampling = SamplingParams(temperature=0.7, top_k=6)
    record = record_from_outputs(outputs, meta, sampling=sampling)
    assert isinstance(record, RolloutRecord) and record.meta == meta and len(record) == 3
    for sample, case in zip(record.samples, cases):
        _assert_sample(sample, case, sampling, meta)
    # layers are picked by decoder-layer number: columns 0, 2, 3 of vLLM's array, never the first three
    array = outputs[0].outputs[0].routed_experts
    assert torch.equal(record.samples[0].routes, torch.from_numpy(array[:, [0, 2, 3]].copy()))
    assert not torch.equal(record.samples[0].routes, torch.from_numpy(array[:, :3].copy()))
    # the record is a record: it saves, loads and validates
    record.save(tmp_path / "r.safetensors")
    again = RolloutRecord.load(tmp_path / "r.safetensors")
    for a, b in zip(again.samples, record.samples):
        assert torch.equal(a.routes, b.routes) and torch.equal(a.kept_ids, b.kept_ids)


def test_uint16_routes_of_300_experts_become_int16():
    from moealign.patches.vllm import record_from_outputs

    meta = _meta(num_layers=3, moe_layers=(1, 2), num_experts=300, top_k=8, vocab_size=512)   # layer 0 dense
    cases = [_case(meta, 6, 4, 10), _case(meta, 3, 2, 11)]
    assert max(int(c["routes"].max()) for c in cases) >= 256                   # ids a uint8 cannot hold
    outputs = [_output(c, meta, f"r{i}") for i, c in enumerate(cases)]
    assert outputs[0].outputs[0].routed_experts.dtype == np.uint16
    record = record_from_outputs(outputs, meta, sampling=SamplingParams(top_p=0.8, top_k=40))
    for sample, case in zip(record.samples, cases):
        assert sample.routes.dtype == torch.int16
        _assert_sample(sample, case, SamplingParams(top_p=0.8, top_k=40), meta)
        assert torch.equal(sample.routes.to(torch.int64), case["routes"].to(torch.int64))


def test_vllm_sampling_params_flat_logprobs_and_several_completions():
    from vllm import SamplingParams as VllmSamplingParams

    from moealign.patches.vllm.harvest import record_from_outputs

    meta = _meta()
    a, b, c = _case(meta, 4, 3, 20), _case(meta, 4, 5, 21), _case(meta, 7, 2, 22)
    b["token_ids"][:4] = a["token_ids"][:4]                # two completions of one prompt (n = 2)
    first = _request(a["token_ids"][:4].tolist(), [_completion(a, meta, index=0, flat=True),
                                                   _completion(b, meta, index=1, flat=True)], "n2")
    second = _output(c, meta, "n1")
    params = [VllmSamplingParams(n=2, temperature=0.6, top_k=-1, top_p=0.95, min_p=0.05, seed=1, logprobs=0),
              VllmSamplingParams(temperature=1.3, top_k=7, logprobs=0)]
    record = record_from_outputs([first, second], meta, sampling=params)
    assert len(record) == 3
    want = [SamplingParams(temperature=0.6, top_k=0, top_p=0.95, min_p=0.05)] * 2 + [SamplingParams(1.3, 7)]
    for sample, case, sampling in zip(record.samples, (a, b, c), want):
        _assert_sample(sample, case, sampling, meta)


def test_routes_or_kept_sets_left_out():
    from moealign.patches.vllm import record_from_outputs

    meta = _meta()
    case = _case(meta, 5, 4, 30)
    bare = _output(case, meta, routed_experts=None, sampling_mask=None)
    record = record_from_outputs([bare], meta, sampling=SamplingParams(), record_routes=False,
                                 record_kept_sets=False)
    _assert_sample(record.samples[0], case, SamplingParams(), meta, routes=False, kept=False)
    assert not record.has_routes and not record.has_kept_sets
    only_routes = record_from_outputs([_output(case, meta, sampling_mask=None)], meta, sampling=SamplingParams(),
                                      record_kept_sets=False)
    _assert_sample(only_routes.samples[0], case, SamplingParams(), meta, kept=False)


def test_kept_sets_come_out_ascending():
    from vllm.outputs import SamplingMask

    from moealign.patches.vllm import record_from_outputs

    meta = _meta()
    case = _case(meta, 3, 5, 40)
    shuffled = SamplingMask([row[::-1] for row in _kept_lists(case)])
    assert any(len(row) > 1 for row in shuffled.token_ids)
    record = record_from_outputs([_output(case, meta, sampling_mask=shuffled)], meta, sampling=SamplingParams())
    assert torch.equal(record.samples[0].kept_ids, case["kept_ids"])


def _assert_started(sample, case: dict, start: int) -> None:
    """The rows from ``start`` are the case's routes; the rows before it are missing and hold 0 (never made up)."""
    want = case["routes"].clone()
    want[:start] = 0
    assert sample.routes.dtype == case["routes"].dtype and torch.equal(sample.routes, want)
    assert torch.equal(sample.route_missing, torch.arange(want.shape[0]) < start)


def test_prompt_start_marks_the_rows_before_it_missing_and_is_read_from_vllm_params():
    from vllm import SamplingParams as VllmSamplingParams

    from moealign.patches.vllm import record_from_outputs

    meta = _meta()
    case = _case(meta, 6, 3, 50)
    out = _output(case, meta, start=4)                     # vLLM 0.33 with routed_experts_prompt_start=4
    assert out.outputs[0].routed_experts.shape[0] == 6 + 3 - 1 - 4
    params = VllmSamplingParams(temperature=0.8, top_k=5, routed_experts_prompt_start=4)
    record = record_from_outputs([out], meta, sampling=params)
    _assert_started(record.samples[0], case, 4)
    assert record.samples[0].routed_rows.tolist() == [False] * 4 + [True] * 4
    record = record_from_outputs([out], meta, sampling=SamplingParams(), prompt_starts=4)
    _assert_started(record.samples[0], case, 4)
    # the rows are read from the start on: a wrong start does not fit the rows vLLM sent
    with pytest.raises(InputError, match=r"routed_experts has 4 rows, expected 5"):
        record_from_outputs([out], meta, sampling=SamplingParams(), prompt_starts=3, validate=False)
    # the whole prompt left out (start = P): every prompt row missing, the generated rows kept
    whole = _output(case, meta, start=6)
    _assert_started(record_from_outputs([whole], meta, sampling=SamplingParams(), prompt_starts=6).samples[0], case, 6)
    # without routes the rest converts
    record = record_from_outputs([out], meta, sampling=params, record_routes=False)
    _assert_sample(record.samples[0], case, SamplingParams(temperature=0.8, top_k=5), meta, routes=False)
    # an explicit start must agree with the vLLM parameters'; a start outside the prompt is refused
    with pytest.raises(ConfigError, match=r"prompt_starts gives 0.*routed_experts_prompt_start=4"):
        record_from_outputs([out], meta, sampling=params, prompt_starts=0, record_routes=False)
    with pytest.raises(ConfigError, match=r"outside \[0, prompt length 6\]"):
        record_from_outputs([out], meta, sampling=SamplingParams(), prompt_starts=7, record_routes=False)
    with pytest.raises(ConfigError, match=r"must be an int"):
        record_from_outputs([out], meta, sampling=SamplingParams(), prompt_starts=1.0, record_routes=False)
    # start 0 from the vLLM parameters: routes convert
    full = _output(case, meta)
    record = record_from_outputs([full], meta, sampling=VllmSamplingParams(temperature=0.8, top_k=5,
                                                                          routed_experts_prompt_start=0))
    _assert_sample(record.samples[0], case, SamplingParams(temperature=0.8, top_k=5), meta)


def test_sampling_options_a_record_cannot_state_are_refused():
    from vllm import SamplingParams as VllmSamplingParams

    from moealign.patches.vllm import record_from_outputs

    meta = _meta()
    out = _output(_case(meta, 4, 2, 60), meta)
    for changed in (dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(frequency_penalty=0.2),
                    dict(min_tokens=1), dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[1, 2, 3]),
                    dict(bad_words=["x"])):
        name = next(iter(changed))
        with pytest.raises(ConfigError, match=rf"{name}="):
            record_from_outputs([out], meta, sampling=VllmSamplingParams(temperature=0.9, top_k=5, **changed))
    with pytest.raises(ConfigError, match=r"greedy"):
        record_from_outputs([out], meta, sampling=VllmSamplingParams(temperature=0.0))
    with pytest.raises(RecordError, match=r"at least 1e-05"):    # below the greedy threshold: no record states it
        record_from_outputs([out], meta, sampling=SamplingParams(temperature=1e-6))


def test_argument_checks():
    from moealign.patches.vllm import record_from_outputs

    meta = _meta()
    out = _output(_case(meta, 4, 2, 70), meta)
    with pytest.raises(InputTypeError, match=r"list of vllm.RequestOutput"):
        record_from_outputs(out, meta, sampling=SamplingParams())
    with pytest.raises(InputError, match=r"empty"):
        record_from_outputs([], meta, sampling=SamplingParams())
    with pytest.raises(InputTypeError, match=r"RecordMeta"):
        record_from_outputs([out], {"num_layers": 4}, sampling=SamplingParams())
    with pytest.raises(InputTypeError, match=r"outputs\[1\] must be a vllm.RequestOutput"):
        record_from_outputs([out, out.outputs[0]], meta, sampling=SamplingParams())
    with pytest.raises(InputTypeError, match=r"sampling\[0\] must be"):
        record_from_outputs([out], meta, sampling={"temperature": 1.0})
    with pytest.raises(ConfigError, match=r"sampling has 2 entries for 1 outputs"):
        record_from_outputs([out], meta, sampling=[SamplingParams(), SamplingParams()])
    with pytest.raises(ConfigError, match=r"record_routes must be True or False"):
        record_from_outputs([out], meta, sampling=SamplingParams(), record_routes=1)


# --------------------------------------------------------------------------------------------------
# refusals: each mutates one field of a valid output
# --------------------------------------------------------------------------------------------------


def _set(array: np.ndarray, index, value) -> np.ndarray:
    out = array.copy()
    out[index] = value
    return out


def _mask(rows):
    from vllm.outputs import SamplingMask

    return SamplingMask(rows)


def _drop_sampled(case):
    """The kept sets with the sampled token of the first row of two or more ids taken out."""
    rows = _kept_lists(case)
    P = case["prompt_len"]
    j = next(j for j, row in enumerate(rows) if len(row) > 1)
    rows[j] = [x for x in rows[j] if x != int(case["token_ids"][P + j])]
    return rows


# name -> (meta kwargs, change to the completion (case, meta, completion) -> dict, error, message)
REFUSALS = {
    "routed_experts None": ({}, lambda c, m, o: dict(routed_experts=None), EngineError,
                            r"no routed_experts; routes need vLLM >= 0.33 on Model Runner V2.*"
                            r"enable_return_routed_experts=True"),
    "one row too many": ({}, lambda c, m, o: dict(routed_experts=np.concatenate([o.routed_experts,
                                                                                  o.routed_experts[:1]])),
                         InputError, r"routed_experts has 9 rows, expected 8 = 5 prompt \+ 4 generated tokens - 1"),
    "one row too few": ({}, lambda c, m, o: dict(routed_experts=o.routed_experts[1:]), InputError,
                        r"routed_experts has 7 rows, expected 8"),
    "layer count": ({}, lambda c, m, o: dict(routed_experts=o.routed_experts[:, [0, 2, 3]]), RecordMismatchError,
                    r"covers 3 decoder layers.*num_layers=4"),
    "top_k axis": ({}, lambda c, m, o: dict(routed_experts=o.routed_experts[:, :, :3]), RecordMismatchError,
                   r"top_k=3 experts per token.*top_k=4"),
    "expert id 16 of 16": ({}, lambda c, m, o: dict(routed_experts=_set(o.routed_experts, (5, 2, 1), 16)), RouteError,
                           r"routed_experts\[5, 2, 1\] = 16 \(input token 5, decoder layer 2\) is not an expert id "
                           r"in \[0, 16\)"),
    "expert id 300 of 300": (dict(num_layers=3, moe_layers=(1, 2), num_experts=300, vocab_size=512),
                             lambda c, m, o: dict(routed_experts=_set(o.routed_experts, (3, 1, 0), 300)), RouteError,
                             r"routed_experts\[3, 1, 0\] = 300 .*not an expert id in \[0, 300\)"),
    "uint16 id past int16": (dict(num_layers=3, moe_layers=(1, 2), num_experts=300, vocab_size=512),
                             lambda c, m, o: dict(routed_experts=_set(o.routed_experts, (0, 2, 3), 40000)), RouteError,
                             r"= 40000 .*not an expert id"),
    "dense layer not zero": ({}, lambda c, m, o: dict(routed_experts=_set(o.routed_experts, (6, 1, 2), 3)),
                             RecordMismatchError, r"decoder layer 1 is dense in the record meta \(moe_layers "
                             r"\[0, 2, 3\]\), but vLLM's routed_experts\[6, 1, 2\] = 3"),
    "repeated expert": ({}, lambda c, m, o: dict(routed_experts=_set(o.routed_experts, (4, 3, 1),
                                                                     o.routed_experts[4, 3, 0])),
                        RouteError, r"routed_experts\[4, 3\] = .* repeats an expert"),
    "float routes": ({}, lambda c, m, o: dict(routed_experts=o.routed_experts.astype(np.float32)), InputError,
                     r"dtype float32"),
    "2-d routes": ({}, lambda c, m, o: dict(routed_experts=o.routed_experts[:, 0]), InputError, r"shape \(8, 4\)"),
    "routes not an array": ({}, lambda c, m, o: dict(routed_experts=o.routed_experts.tolist()), InputTypeError,
                            r"numpy array"),
    "sampling_mask None": ({}, lambda c, m, o: dict(sampling_mask=None), EngineError,
                           r"no sampling_mask; kept sets need .*return_sampling_mask=True"),
    "mask one list short": ({}, lambda c, m, o: dict(sampling_mask=_mask(_kept_lists(c)[:-1])), InputError,
                            r"3 kept sets for 4 generated tokens"),
    "sampled token not kept": ({}, lambda c, m, o: dict(sampling_mask=_mask(_drop_sampled(c))), InputError,
                               r"the sampled token \d+ at response position \d+ is not in its kept set"),
    "empty kept set": ({}, lambda c, m, o: dict(sampling_mask=_mask(_kept_lists(c)[:2] + [[]] + _kept_lists(c)[3:])),
                       InputError, r"kept set of response position 2 is empty"),
    "kept id outside vocab": ({}, lambda c, m, o: dict(sampling_mask=_mask([r + [64] for r in _kept_lists(c)])),
                              InputError, r"holds 64, not a token id in \[0, vocab_size=64\)"),
    "kept id twice": ({}, lambda c, m, o: dict(sampling_mask=_mask([r + r[:1] for r in _kept_lists(c)])), InputError,
                      r"kept set of response position 0 holds token \d+ twice"),
    "mask not a SamplingMask": ({}, lambda c, m, o: dict(sampling_mask=_kept_lists(c)), InputTypeError,
                                r"SamplingMask"),
    "logprobs None": ({}, lambda c, m, o: dict(logprobs=None), EngineError, r"no log-probs.*processed_logprobs"),
    "logprobs short": ({}, lambda c, m, o: dict(logprobs=o.logprobs[:-1]), InputError,
                       r"3 log-prob positions for 4 generated tokens"),
    "sampled token without log-prob": ({}, lambda c, m, o: dict(logprobs=[{k: v for k, v in d.items() if v.rank != 1}
                                                                          for d in o.logprobs]),
                                       InputError, r"response position 0 do not hold its sampled token"),
    "log-prob -inf": ({}, lambda c, m, o: dict(logprobs=_with_logprob(o.logprobs, 2, float("-inf"))), InputError,
                      r"response position 2 has log-prob -inf"),
    "log-prob > 0": ({}, lambda c, m, o: dict(logprobs=_with_logprob(o.logprobs, 1, 0.5)), InputError,
                     r"response position 1 has log-prob 0.5 > 0"),
    "token outside vocab": ({}, lambda c, m, o: dict(token_ids=list(o.token_ids[:-1]) + [64]), InputError,
                            r"token 64 at position 8 is not a token id in \[0, vocab_size=64\)"),
    "no generated token": ({}, lambda c, m, o: dict(token_ids=[]), InputError, r"no generated token"),
    "completion not finished": ({}, lambda c, m, o: dict(finish_reason=None), EngineError,
                                r"not finished \(finish_reason None\)"),
}


def _with_logprob(entries, j, value):
    from vllm.logprobs import Logprob

    out = [dict(d) for d in entries]
    token = next(t for t, v in out[j].items() if v.rank == 1)
    out[j][token] = Logprob(logprob=value, rank=1)
    return out


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals(name):
    from moealign.patches.vllm import record_from_outputs

    meta_kwargs, change, error, message = REFUSALS[name]
    meta = _meta(**meta_kwargs)
    case = _case(meta, 5, 4, 80)
    good = _output(case, meta)
    record_from_outputs([good], meta, sampling=SamplingParams(), validate=False)   # the unchanged output converts
    bad = _output(case, meta, **change(case, meta, good.outputs[0]))
    with pytest.raises(error, match=message) as info:
        record_from_outputs([good, bad], meta, sampling=SamplingParams(), validate=False)
    assert isinstance(info.value, MoealignError)
    assert "output 1 (request 'req-0')" in str(info.value)       # the message names the output


def test_request_level_refusals():
    from moealign.patches.vllm import record_from_outputs

    meta = _meta()
    case = _case(meta, 5, 4, 90)
    completion = _completion(case, meta)
    prompt = case["token_ids"][:5].tolist()
    with pytest.raises(EngineError, match=r"not finished: vLLM sets routed_experts on the final output only"):
        record_from_outputs([_request(prompt, [completion], finished=False)], meta, sampling=SamplingParams())
    with pytest.raises(InputError, match=r"no prompt token ids"):
        record_from_outputs([_request(None, [completion])], meta, sampling=SamplingParams())
    with pytest.raises(InputError, match=r"holds no completion"):
        record_from_outputs([_request(prompt, [])], meta, sampling=SamplingParams())
    with pytest.raises(InputTypeError, match=r"completions must be vllm.CompletionOutput"):
        record_from_outputs([_request(prompt, [{"token_ids": [1]}])], meta, sampling=SamplingParams())


# --------------------------------------------------------------------------------------------------
# round trip through the CPU recorder on a real engine
# --------------------------------------------------------------------------------------------------


def _child(out_dir: str) -> None:
    """Record a rollout of the embedded model with ``generate_with_record`` (4 prompts, chunked prefill), keep the
    ``RequestOutput`` objects and ``vllm.SamplingParams`` of the ``llm.generate`` call it made, save both."""
    from moealign.embedded import default_prompts, embedded_model_path
    from moealign.patches.vllm.engine import open_llm
    from moealign.patches.vllm.rollout import generate_with_record

    llm = open_llm(str(embedded_model_path()), dtype="fp32", max_num_seqs=3, max_num_batched_tokens=16,
                   max_model_len=256, enable_prefix_caching=False)
    calls = []
    generate = llm.generate

    def keep(*args, **kwargs):
        result = generate(*args, **kwargs)
        calls.append((args[1], result))
        return result
    llm.generate = keep
    prompts = [p[:n] for p, n in zip(default_prompts()[:4], (40, 90, 25, 60))]
    record = generate_with_record(llm, prompts, sampling=ROUND_TRIP_SAMPLING, max_new_tokens=10, seed=7)
    record.save(os.path.join(out_dir, "record.safetensors"))
    params, outputs = calls[-1]
    with open(os.path.join(out_dir, "outputs.pkl"), "wb") as fh:
        pickle.dump((params, outputs), fh)
    print("RESULT ok")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_harvest")
    from moealign.patches.vllm.engine import vllm_environment

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(vllm_environment())           # set before the child imports vLLM (this file's probe does)
    env["PYTHONPATH"] = str(pathlib.Path(__file__).resolve().parents[1])
    proc = warm.run([sys.executable, __file__, str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "RESULT ok" in proc.stdout, proc.stderr[-3000:]
    record = RolloutRecord.load(out / "record.safetensors")
    with open(out / "outputs.pkl", "rb") as fh:
        params, outputs = pickle.load(fh)
    return record, params, outputs


def _as_vllm_033(record: RolloutRecord, outputs: list, start: int = 0) -> list:
    """vLLM's own outputs with what vLLM 0.33 adds: ``routed_experts`` (every decoder layer, uint8, rows from
    ``start``) and ``sampling_mask`` from the record's rows."""
    from vllm.outputs import CompletionOutput, RequestOutput, SamplingMask

    rebuilt = []
    for out, sample in zip(outputs, record.samples):
        (c,) = out.outputs
        lists = _kept_lists(dict(kept_offsets=sample.kept_offsets, kept_ids=sample.kept_ids))
        completion = CompletionOutput(index=c.index, text=c.text, token_ids=c.token_ids,
                                      cumulative_logprob=c.cumulative_logprob, logprobs=c.logprobs,
                                      routed_experts=_all_layers(record.meta, sample.routes, start),
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      sampling_mask=SamplingMask(lists))
        rebuilt.append(RequestOutput(request_id=out.request_id, prompt=out.prompt,
                                     prompt_token_ids=out.prompt_token_ids, prompt_logprobs=None,
                                     outputs=[completion], finished=out.finished))
    return rebuilt


def test_round_trip_through_the_cpu_recorder(recorded):
    from moealign.patches.vllm import record_from_outputs

    record, params, outputs = recorded
    assert len(record) == len(outputs) == 4 and record.has_routes and record.has_kept_sets
    assert record.meta.num_layers == 4 and record.samples[0].routes.dtype == torch.uint8
    converted = record_from_outputs(_as_vllm_033(record, outputs), record.meta, sampling=params)
    assert converted.meta == record.meta
    for a, b in zip(converted.samples, record.samples):
        assert a.prompt_len == b.prompt_len and a.sampling == b.sampling == ROUND_TRIP_SAMPLING
    # token ids and log-probs come from vLLM's own outputs, routes and kept sets from the 0.33 arrays: the record the
    # CPU recorder built, tensor for tensor (the file tensors: every sample's rows, concatenated)
    ours, theirs = converted._tensors(), record._tensors()
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name


def test_round_trip_prompt_start(recorded):
    from moealign.patches.vllm import record_from_outputs

    record, params, outputs = recorded
    started = [p.clone() for p in params]
    for p in started:
        p.routed_experts_prompt_start = 2
    rebuilt = _as_vllm_033(record, outputs, start=2)
    converted = record_from_outputs(rebuilt, record.meta, sampling=started)
    for a, b in zip(converted.samples, record.samples):
        assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logprobs, b.logprobs)
        assert torch.equal(a.kept_offsets, b.kept_offsets) and torch.equal(a.kept_ids, b.kept_ids)
        # rows 0 and 1 are missing (vLLM left them out), every later row is the recorder's
        assert torch.equal(a.route_missing, torch.arange(b.length - 1) < 2)
        assert not bool(a.routes[:2].any()) and torch.equal(a.routes[2:], b.routes[2:])
    without = record_from_outputs(rebuilt, record.meta, sampling=started, record_routes=False)
    assert not without.has_routes


if __name__ == "__main__":
    _child(sys.argv[1])
