"""Other engines' route formats into record route rows (and back where the format is a plain tensor layout).

Every payload is built the way the engine's own source builds it (the file is named at each builder); each test
compares the converted rows element by element with the routes the engine was given, checks which rows come out
missing, and has a refusal per check.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from moealign.errors import ConfigError, InputError, RecordMismatchError, RouteError
from moealign.record.formats import (
    RouteRows,
    nemo_rl_route_dtype,
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

LAYERS, TOP_K, EXPERTS = 4, 2, 16
MOE = (1, 3)     # layers 0 and 2 dense


def _draw(rows: int, layers: int = len(MOE), k: int = TOP_K, experts: int = EXPERTS, seed: int = 0) -> np.ndarray:
    """``rows`` distinct-per-token routes ``[rows, layers, k]`` (int64)."""
    gen = np.random.default_rng(seed)
    return np.argsort(gen.random((rows, layers, experts)), axis=-1)[..., :k].astype(np.int64)


def _all_layers(moe_rows: np.ndarray, filler: int) -> np.ndarray:
    """The MoE rows spread over every decoder layer, dense layers holding ``filler``."""
    out = np.full((moe_rows.shape[0], LAYERS, moe_rows.shape[2]), filler, dtype=np.int64)
    out[:, list(MOE)] = moe_rows
    return out


def _rows_equal(rows: RouteRows, want: np.ndarray, missing=()) -> None:
    """``rows`` hold ``want`` (MoE layers) at present rows, 0 at the ``missing`` ones, and say which are missing."""
    assert rows.routes.dtype == torch.uint8 and rows.routes.shape == want.shape
    mask = torch.zeros(want.shape[0], dtype=torch.bool)
    mask[list(missing)] = True
    assert torch.equal(rows.missing, mask)
    expect = torch.from_numpy(want).clone()
    expect[mask] = 0
    assert torch.equal(rows.routes.long(), expect)
    assert (rows.route_missing is None) == (not missing)


# --------------------------------------------------------------------------------------------------
# SGLang
# --------------------------------------------------------------------------------------------------


def _sglang_payload(array: np.ndarray, configured: str | None, start_len: int | None = None) -> dict:
    """What SGLang puts in meta_info (sglang/srt/managers/detokenizer_manager + routed_experts_capturer): the
    configured wire dtype, int32 when an id does not fit; no dtype field for a legacy sender (``configured=None``,
    int32 bytes); rows from ``routed_experts_start_len`` on."""
    if configured is None:
        out = {"routed_experts": base64.b64encode(array.astype(np.int32).tobytes()).decode()}
    else:
        target = np.dtype(configured)
        if target.kind == "u" and array.size and (array.min() < np.iinfo(target).min
                                                  or array.max() > np.iinfo(target).max):
            target = np.dtype(np.int32)
        out = {"routed_experts": base64.b64encode(array.astype(target).tobytes()).decode(),
               "routed_experts_dtype": target.name}
    if start_len is not None:
        out["routed_experts_start_len"] = start_len
    return out


def _read(meta_info, length, **kw):
    return routes_from_sglang(meta_info, num_hidden_layers=LAYERS, moe_layers=MOE, top_k=TOP_K, num_experts=EXPERTS,
                              length=length, **kw)


@pytest.mark.parametrize("configured,filler", [("int32", -1), ("uint16", 0), ("uint8", 0), ("uint8", -1), (None, -1)])
def test_sglang_payload_reads_the_moe_layers_by_number(configured, filler):
    moe = _draw(9)
    array = _all_layers(moe, filler)
    meta_info = _sglang_payload(array, configured)
    if configured == "uint8" and filler == -1:
        assert meta_info["routed_experts_dtype"] == "int32"      # the sentinel does not fit: SGLang keeps int32
    rows = _read(meta_info, 10)
    _rows_equal(rows, moe)
    # by number, not position: layers 1 and 3, never 0 and 1
    assert not torch.equal(rows.routes.long(), torch.from_numpy(array[:, :2]).clamp(min=0))


def test_sglang_start_len_marks_the_rows_before_it_missing():
    moe = _draw(9, seed=1)
    array = _all_layers(moe, -1)
    rows = _read(_sglang_payload(array[4:], "int32", start_len=4), 10)      # start from meta_info
    _rows_equal(rows, moe, missing=range(4))
    assert torch.equal(_read(_sglang_payload(array[4:], "int32"), 10, start_len=4).routes, rows.routes)
    with pytest.raises(InputError, match="holds 40 ids.*need 32"):
        _read(_sglang_payload(array[4:], "int32"), 10, start_len=5)     # the wrong start: row count disagrees
    with pytest.raises(InputError, match="not a position"):
        _read(_sglang_payload(array[:0], "int32"), 10, start_len=10)
    _rows_equal(_read(_sglang_payload(array[:0], "int32"), 10, start_len=9), moe, missing=range(9))


def test_sglang_refusals():
    array = _all_layers(_draw(9), -1)
    good = _sglang_payload(array, "int32")
    with pytest.raises(InputError, match="no 'routed_experts'"):
        _read({}, 10)
    with pytest.raises(InputError, match="holds 72 ids.*need 80"):
        _read(good, 11)                                            # one token more than the rows cover
    with pytest.raises(InputError, match="not one of"):
        _read({**good, "routed_experts_dtype": "float32"}, 10)
    with pytest.raises(InputError, match="base64"):
        _read({"routed_experts": "***"}, 10)
    with pytest.raises(InputError, match="whole number"):
        _read({"routed_experts": base64.b64encode(b"abc").decode()}, 10)
    shuffled = array.copy()
    shuffled[:, 2] = shuffled[:, 1]                                # a dense layer holding routes
    with pytest.raises(RecordMismatchError, match="layer 2 is not a MoE layer"):
        _read(_sglang_payload(shuffled, "int32"), 10)
    out_of_range = array.copy()
    out_of_range[4, 3, 0] = EXPERTS
    with pytest.raises(RouteError, match=r"\[4, 1, 0\] = 16"):      # the true row, MoE column 1 (layer 3)
        _read(_sglang_payload(out_of_range, "int32"), 10)
    repeated = array.copy()
    repeated[2, 1] = [5, 5]
    with pytest.raises(RouteError, match=r"row \[2, 0\] repeats expert 5"):
        _read(_sglang_payload(repeated, "int32"), 10)
    with pytest.raises(RecordMismatchError, match="outside"):
        routes_from_sglang(good, num_hidden_layers=LAYERS, moe_layers=(1, 4), top_k=TOP_K, num_experts=EXPERTS,
                           length=10)


# --------------------------------------------------------------------------------------------------
# vLLM 0.21
# --------------------------------------------------------------------------------------------------


class _Vllm021HostCache:
    """vLLM 0.21's per-request host cache (vllm/model_executor/layers/fused_moe/routed_experts_capturer.py,
    ``_RoutedExpertsHostCache``): int16 ``[positions, num_moe_layers, top_k]``, zero-initialised, grown to cover
    the largest position scattered, ``filled_len`` = largest position written + 1."""

    def __init__(self, layers: int, k: int, max_model_len: int = 1 << 12):
        self.layers, self.k, self.max_model_len = layers, k, max_model_len
        self.buf = None
        self.filled = 0

    def _grow(self, max_pos: int):
        need = max_pos + 1
        if self.buf is None:
            self.buf = np.zeros((need, self.layers, self.k), dtype=np.int16)
        elif self.buf.shape[0] < need:
            new = np.zeros((min(max(need, 2 * self.buf.shape[0]), self.max_model_len), self.layers, self.k),
                           dtype=np.int16)
            new[:self.buf.shape[0]] = self.buf
            self.buf = new

    def scatter(self, positions: np.ndarray, values: np.ndarray):
        """``_scatter_to_host`` for one request: ``buf[pos] = values`` at the scheduled positions."""
        self._grow(int(positions.max()))
        self.buf[positions] = values
        self.filled = max(self.filled, int(positions.max()) + 1)

    def get_routed_experts(self):
        return None if self.filled <= 0 else self.buf[:self.filled].copy()


def _vllm021_split(routed, prompt_len, num_output_tokens):
    """``split_routed_experts`` (same file): prompt rows ``[:P]``, generation rows ``[P:]`` clipped to the output
    tokens; an empty part becomes None."""
    prompt, gen = routed[:prompt_len], routed[prompt_len:]
    if num_output_tokens is not None and gen.shape[0] > num_output_tokens and num_output_tokens > 0:
        gen = gen[:num_output_tokens]
    return (None if prompt.size == 0 else prompt), (None if gen.size == 0 else gen)


def _vllm021_run(routes: np.ndarray, prompt_len: int, response_len: int, *, cached: int = 0, chunk: int = 3,
                 spec_extra: int = 0):
    """One request through vLLM 0.21's capture: prefill from ``cached`` (prefix-cache hits are never scheduled) in
    chunks, then one decode step per generated token except the last (never forwarded), ``spec_extra`` more
    positions written by a speculative step; returns (prompt_routed_experts, routed_experts)."""
    cache = _Vllm021HostCache(routes.shape[1], routes.shape[2])
    for lo in range(cached, prompt_len, chunk):
        pos = np.arange(lo, min(lo + chunk, prompt_len))
        cache.scatter(pos, routes[pos])
    for pos in range(prompt_len, prompt_len + response_len - 1 + spec_extra):
        cache.scatter(np.array([pos]), routes[[pos]])
    return _vllm021_split(cache.get_routed_experts(), prompt_len, response_len)


def _read_021(prompt_part, gen_part, prompt_len, length, moe=MOE, k=TOP_K, **kw):
    return routes_from_vllm_0_21(prompt_part, gen_part, prompt_len=prompt_len, length=length, moe_layers=moe,
                                 top_k=k, num_experts=EXPERTS, **kw)


def test_vllm021_prompt_and_generated_rows_are_joined():
    routes = _draw(11)                                  # P=6, R=5: rows 0..9 forwarded (10 = P + R - 1)
    prompt_part, gen_part = _vllm021_run(routes, 6, 5)
    assert prompt_part.dtype == np.int16 and prompt_part.shape == (6, 2, 2) and gen_part.shape == (4, 2, 2)
    _rows_equal(_read_021(prompt_part, gen_part, 6, 11), routes[:10])


def test_vllm021_one_token_response_and_speculative_surplus_row():
    routes = _draw(8, seed=2)
    prompt_part, gen_part = _vllm021_run(routes, 7, 1)                   # nothing generated was forwarded
    assert gen_part is None
    _rows_equal(_read_021(prompt_part, gen_part, 7, 8), routes[:7])
    prompt_part, gen_part = _vllm021_run(routes, 5, 3, spec_extra=1)     # the last token's row was captured too
    assert gen_part.shape[0] == 3                                        # clipped to the 3 output tokens
    _rows_equal(_read_021(prompt_part, gen_part, 5, 8), routes[:7])


def test_vllm021_prefix_cache_hits_are_missing():
    routes = _draw(12, seed=3)
    prompt_part, gen_part = _vllm021_run(routes, 8, 4, cached=4)
    assert not prompt_part[:4].any()                                     # never scheduled: still zero
    _rows_equal(_read_021(prompt_part, gen_part, 8, 12, num_cached_tokens=4), routes[:11], missing=range(4))
    # top_k > 1: an all-zero row cannot be a route, so the rows come out missing without num_cached_tokens too
    _rows_equal(_read_021(prompt_part, gen_part, 8, 12), routes[:11], missing=range(4))
    # top_k == 1: expert 0 is a route, so only num_cached_tokens tells the unwritten rows apart
    one = _draw(12, k=1, seed=4)
    one[5] = 0                                                           # a genuine route to expert 0
    prompt_part, gen_part = _vllm021_run(one, 8, 4, cached=2)
    _rows_equal(_read_021(prompt_part, gen_part, 8, 12, k=1, num_cached_tokens=2), one[:11], missing=range(2))
    rows = _read_021(prompt_part, gen_part, 8, 12, k=1)
    assert not bool(rows.missing.any()) and rows.routes[0].long().sum() == 0   # read as expert 0, as vLLM holds it


def test_vllm021_rows_vllm_never_wrote_are_missing():
    routes = _draw(10, seed=5)
    prompt_part, gen_part = _vllm021_run(routes, 6, 4)
    _rows_equal(_read_021(prompt_part, gen_part[:1], 6, 10), routes[:9], missing=(7, 8))


def test_vllm021_refusals():
    routes = _draw(10, seed=6)
    prompt_part, gen_part = _vllm021_run(routes, 6, 4)
    with pytest.raises(InputError, match="neither"):
        _read_021(None, None, 6, 10)
    with pytest.raises(InputError, match="7 rows for a 6-token prompt"):
        _read_021(np.concatenate([prompt_part, gen_part[:1]]), None, 6, 10)
    with pytest.raises(InputError, match="does not cover the 6 prompt rows"):
        _read_021(prompt_part[:5], gen_part, 6, 10)
    with pytest.raises(InputError, match="5 rows for 4 generated"):
        _read_021(prompt_part, np.concatenate([gen_part, gen_part[:2]]), 6, 10)
    with pytest.raises(RecordMismatchError, match="has 2 layers, expected 4"):
        _read_021(prompt_part, gen_part, 6, 10, moe=(0, 1, 2, 3))
    with pytest.raises(InputError, match="differ in layers or top_k"):
        _read_021(prompt_part, gen_part[:, :1], 6, 10)
    sentinel = prompt_part.copy()
    sentinel[2] = -1
    with pytest.raises(RouteError, match="no sentinel"):
        _read_021(sentinel, gen_part, 6, 10)
    with pytest.raises(InputError, match="prefix-cache hit"):
        _read_021(prompt_part, gen_part, 6, 10, num_cached_tokens=2)    # cached rows that hold routes
    half = prompt_part.copy()
    half[3, 0] = 0                                                      # one MoE layer unwritten: [0, 0]
    with pytest.raises(RouteError, match=r"row \[3, 0\] repeats expert 0"):
        _read_021(half, gen_part, 6, 10)


# --------------------------------------------------------------------------------------------------
# TensorRT-LLM
# --------------------------------------------------------------------------------------------------


def _trtllm_placement(num_slots: int, seed: int = 0) -> dict:
    """A ``MoeLoadBalancerConfig`` as examples/ep_load_balancer/generate_eplb_config.py writes it (and TensorRT-LLM
    docs/source/blogs/tech_blog/blog4 shows): ``initial_global_assignments`` {decoder layer: logical expert of each
    of ``num_slots`` global slots}, every expert placed at least once, the hot ones replicated."""
    gen = np.random.default_rng(seed)
    out = {}
    for layer in MOE:
        slots = np.concatenate([np.arange(EXPERTS), gen.integers(0, EXPERTS, num_slots - EXPERTS)])
        out[layer] = gen.permutation(slots).tolist()
    return {"num_slots": num_slots, "initial_global_assignments": out, "layer_updates_per_iter": 0}


def _trtllm_route(logical: np.ndarray, placement: dict, seed: int = 0) -> np.ndarray:
    """The physical slot ids the load balancer routes each logical id to (``_load_balancer_route``: one of the
    expert's replicas)."""
    gen = np.random.default_rng(seed)
    out = np.empty_like(logical)
    for col, layer in enumerate(MOE):
        slots = np.asarray(placement["initial_global_assignments"][layer])
        for index in np.ndindex(logical.shape[0], logical.shape[2]):
            replicas = np.flatnonzero(slots == logical[index[0], col, index[1]])
            out[index[0], col, index[1]] = gen.choice(replicas)
    return out


def _read_trt(array, length, **kw):
    return routes_from_trtllm(array, length=length, moe_layers=MOE, top_k=TOP_K, num_experts=EXPERTS, **kw)


@pytest.mark.parametrize("dtype", [np.int16, np.int32])
def test_trtllm_logical_ids_by_moe_ordinal(dtype):
    logical = _draw(9, seed=7)          # CompletionOutput.routed_experts: (seq_len - 1, num_moe_layers, top_k)
    _rows_equal(_read_trt(logical.astype(dtype), 10), logical)
    _rows_equal(_read_trt(torch.from_numpy(logical), 10), logical)


def test_trtllm_physical_slots_map_back_through_the_placement():
    logical = _draw(9, seed=8)
    placement = _trtllm_placement(24)
    physical = _trtllm_route(logical, placement)
    assert (physical >= EXPERTS).any()                                   # some ids are redundant slots
    _rows_equal(_read_trt(physical, 10, expert_ids="physical", eplb=placement), logical)
    # string keys (a JSON file) read the same
    as_json = {**placement, "initial_global_assignments": {str(k): v for k, v in
                                                           placement["initial_global_assignments"].items()}}
    _rows_equal(_read_trt(physical, 10, expert_ids="physical", eplb=as_json), logical)


def test_trtllm_refusals():
    logical = _draw(9, seed=9)
    placement = _trtllm_placement(24)
    physical = _trtllm_route(logical, placement)
    with pytest.raises(RouteError, match="physical slot ids"):
        _read_trt(physical, 10)                                          # slots read as experts: refused
    with pytest.raises(ConfigError, match="given for logical"):
        _read_trt(logical, 10, eplb=placement)
    with pytest.raises(ConfigError, match="need the run's EPLB placement"):
        _read_trt(physical, 10, expert_ids="physical")
    with pytest.raises(ConfigError, match="layer_updates_per_iter=2"):
        _read_trt(physical, 10, expert_ids="physical", eplb={**placement, "layer_updates_per_iter": 2})
    with pytest.raises(ConfigError, match="no experts for MoE layers \\[3\\]"):
        _read_trt(physical, 10, expert_ids="physical",
                  eplb={**placement, "initial_global_assignments": {1: placement["initial_global_assignments"][1]}})
    with pytest.raises(ConfigError, match="decoder layers \\[2\\], which are not MoE"):
        bad = {**placement["initial_global_assignments"], 2: placement["initial_global_assignments"][1]}
        _read_trt(physical, 10, expert_ids="physical", eplb={**placement, "initial_global_assignments": bad})
    short = {**placement, "initial_global_assignments": {1: list(range(EXPERTS)) + [0] * 8, 3: list(range(EXPERTS))}}
    with pytest.raises(ConfigError, match="places 16 slots, num_slots is 24"):
        _read_trt(physical, 10, expert_ids="physical", eplb=short)
    unplaced = {**placement, "initial_global_assignments": {1: [0] * 24, 3: placement["initial_global_assignments"][3]}}
    with pytest.raises(ConfigError, match="places no slot for experts"):
        _read_trt(physical, 10, expert_ids="physical", eplb=unplaced)
    with pytest.raises(RouteError, match="not a slot in \\[0, num_slots=24\\)"):
        over = physical.copy()
        over[3, 1, 0] = 24
        _read_trt(over, 10, expert_ids="physical", eplb=placement)
    with pytest.raises(RouteError, match="repeats expert"):               # two replicas of one expert in a row
        slots = np.asarray(placement["initial_global_assignments"][1])
        twin = [s for s in range(24) if slots[s] == slots[np.flatnonzero(slots == slots[16])[0]]]
        doubled = physical.copy()
        doubled[0, 0] = twin[:2]
        _read_trt(doubled, 10, expert_ids="physical", eplb=placement)
    with pytest.raises(InputError, match="has 9 rows, 11 tokens need 10"):
        _read_trt(logical, 11)
    with pytest.raises(ConfigError, match="'logical' or 'physical'"):
        _read_trt(logical, 10, expert_ids="slots")


# --------------------------------------------------------------------------------------------------
# NeMo-RL
# --------------------------------------------------------------------------------------------------


def _nemo_rl_align(prompt_routed, routed, *, valid_length: int, padded_length: int, num_experts: int = EXPERTS):
    """nemo_rl/models/generation/vllm/utils.py ``pad_and_align_routed_expert_indices``: prompt and generation
    routes joined, ``expected = min(valid_length - 1, padded_length)`` rows copied, rows vLLM did not return set to
    -1 (``R3_MISSING_ROUTE_SENTINEL``), every other row the default ``arange(topk)``, in
    ``resolve_routed_experts_dtype(num_experts)``."""
    dtype = nemo_rl_route_dtype(num_experts)
    parts = [torch.as_tensor(x).to(dtype) for x in (prompt_routed, routed) if x is not None]
    routes = torch.cat(parts)
    expected = min(max(valid_length - 1, 0), padded_length)
    full = torch.arange(routes.shape[2], dtype=dtype).view(1, 1, -1).expand(padded_length, routes.shape[1],
                                                                           routes.shape[2]).clone()
    n = min(expected, routes.shape[0])
    full[:n] = routes[:n]
    if routes.shape[0] < expected:
        full[n:expected] = -1
    return full


def _read_nemo(table, length, **kw):
    return routes_from_nemo_rl(table, length=length, num_hidden_layers=LAYERS, moe_layers=MOE, top_k=TOP_K,
                               num_experts=EXPERTS, **kw)


def test_nemo_rl_sentinel_rows_are_missing_padding_ignored():
    routes = _draw(11, seed=10)
    # vLLM returned the prompt and the first 2 generated rows only: rows 8..9 are -1
    full = _nemo_rl_align(routes[:6], routes[6:8], valid_length=11, padded_length=14)
    assert full.dtype == torch.int8 and bool((full[8:10] == -1).all()) and full[10:].tolist() == [[[0, 1]] * 2] * 4
    _rows_equal(_read_nemo(full, 11), routes[:10], missing=(8, 9))
    # the backfill of a message no generation covered (rollouts.py backfill_missing_routed_experts): all -1
    full[1:3] = -1
    _rows_equal(_read_nemo(full, 11), routes[:10], missing=(1, 2, 8, 9))


def test_nemo_rl_every_decoder_layer_layout():
    routes = _draw(7, seed=11)
    full = torch.from_numpy(_all_layers(routes, 0)).to(torch.int16)      # vLLM 0.25's all-layer rows, dense zero
    full = torch.cat([full, torch.full((2, LAYERS, TOP_K), -1, dtype=torch.int16)])
    _rows_equal(_read_nemo(full, 10), np.concatenate([routes, routes[:2]]), missing=(7, 8))


def test_nemo_rl_round_trip():
    routes = _draw(9, seed=12)
    rows = _read_nemo(_nemo_rl_align(routes[:5], routes[5:7], valid_length=10, padded_length=12), 10)
    written = routes_to_nemo_rl(rows, padded_length=12, num_experts=EXPERTS)
    assert torch.equal(written, _nemo_rl_align(routes[:5], routes[5:7], valid_length=10, padded_length=12))
    assert nemo_rl_route_dtype(200) == torch.int16 and nemo_rl_route_dtype(40000) == torch.int32


def test_nemo_rl_refusals():
    routes = _draw(9, seed=13)
    full = _nemo_rl_align(routes[:5], routes[5:], valid_length=10, padded_length=12)
    partial = full.clone()
    partial[3, 1] = -1                                   # one layer of a row: corruption, not a missing row
    with pytest.raises(InputError, match="row 3 is partly negative"):
        _read_nemo(partial, 10)
    with pytest.raises(InputError, match="has 12 rows, 14 tokens need 13"):
        _read_nemo(full, 14)
    with pytest.raises(RecordMismatchError, match="has 3 layers"):
        _read_nemo(full[:, :1].expand(-1, 3, -1), 10)
    with pytest.raises(InputError, match="not integer expert ids"):
        _read_nemo(full.float().numpy(), 10)
    with pytest.raises(ConfigError, match="shorter than"):
        routes_to_nemo_rl(_read_nemo(full, 10), padded_length=5, num_experts=EXPERTS)


# --------------------------------------------------------------------------------------------------
# verl
# --------------------------------------------------------------------------------------------------


def _verl_batch(samples, *, prompt_width: int, response_width: int):
    """verl/experimental/agent_loop/agent_loop.py ``_agent_loop_postprocess`` + ``_postprocess``: the prompt
    left-padded to ``prompt_width`` and the response right-padded (attention masks), the engine's routes (rows of
    the prompt + response minus the last token; any integer dtype) cast to int16 into zeros
    ``[1, prompt_width + response_width, layers, topk]`` from ``start_pos = prompt_width - len(prompt_ids)``, the
    samples concatenated."""
    masks, routed = [], []
    for prompt_len, response_len, engine_rows in samples:
        attention = torch.cat([torch.tensor([0] * (prompt_width - prompt_len) + [1] * prompt_len),
                               torch.tensor([1] * response_len + [0] * (response_width - response_len))])
        masks.append(attention.unsqueeze(0))
        total = prompt_width + response_width
        experts = torch.as_tensor(engine_rows).to(torch.int16)
        length, layer_num, topk_num = experts.shape
        out = torch.zeros(1, total, layer_num, topk_num, dtype=torch.int16)
        start = prompt_width - prompt_len
        out[:, start:min(start + length, total)] = experts.unsqueeze(0)
        routed.append(out)
    return torch.cat(routed), torch.cat(masks)


def _read_verl(routed, mask, prompt_width, **kw):
    return routes_from_verl(routed, mask, prompt_width=prompt_width, num_hidden_layers=LAYERS, moe_layers=MOE,
                            top_k=TOP_K, num_experts=EXPERTS, **kw)


def test_verl_batch_rows_per_sample():
    a, b = _draw(8, seed=14), _draw(5, seed=15)
    # vLLM >= 0.22 rows (every decoder layer, uint8, dense zero) and SGLang rows (int32, dense -1)
    routed, mask = _verl_batch([(4, 5, _all_layers(a, 0).astype(np.uint8)), (2, 4, _all_layers(b, -1))],
                               prompt_width=6, response_width=7)
    assert routed.shape == (2, 13, LAYERS, TOP_K) and routed.dtype == torch.int16
    rows = _read_verl(routed, mask, 6)
    _rows_equal(rows[0], a)
    _rows_equal(rows[1], b)


def test_verl_unrecorded_tail_is_missing_and_round_trip():
    a = _draw(9, seed=16)
    # a multi-turn loop that stopped recording at its last generation: the last 3 rows stay zero
    routed, mask = _verl_batch([(3, 7, _all_layers(a[:6], 0))], prompt_width=5, response_width=8)
    (rows,) = _read_verl(routed, mask, 5)
    _rows_equal(rows, a, missing=(6, 7, 8))
    back = routes_to_verl([rows], [3], prompt_width=5, response_width=8, num_hidden_layers=LAYERS, moe_layers=MOE)
    assert back.dtype == torch.int16 and torch.equal(back, routed)


def test_verl_moe_only_layout_and_refusals():
    a = _draw(6, seed=17)
    routed, mask = _verl_batch([(3, 4, a)], prompt_width=4, response_width=5)     # vLLM 0.21 rows: MoE layers
    _rows_equal(_read_verl(routed, mask, 4)[0], a)
    with pytest.raises(InputError, match="differ in batch or sequence size"):
        _read_verl(routed, mask[:, :-1], 4)
    holed = mask.clone()
    holed[0, 3] = 0
    with pytest.raises(InputError, match="has a hole"):
        _read_verl(routed, holed, 4)
    with pytest.raises(InputError, match="do not straddle"):
        _read_verl(routed, mask, 8)
    with pytest.raises(InputError, match="no tokens"):
        _read_verl(routed, torch.zeros_like(mask), 4)
    half = routed.clone()
    half[0, 2, 0] = 0                                    # one layer of a recorded row zero: not a missing row
    with pytest.raises(RouteError, match="repeats expert 0"):
        _read_verl(half, mask, 4)
    k1 = RouteRows(torch.zeros(4, 2, 1, dtype=torch.uint8), torch.tensor([False, True, False, False]))
    with pytest.raises(ConfigError, match="top_k=1"):
        routes_to_verl([k1], [2], prompt_width=3, response_width=3, num_hidden_layers=LAYERS, moe_layers=MOE)
    with pytest.raises(ConfigError, match="do not fit"):
        routes_to_verl([k1], [2], prompt_width=1, response_width=3, num_hidden_layers=LAYERS, moe_layers=MOE)


# --------------------------------------------------------------------------------------------------
# slime
# --------------------------------------------------------------------------------------------------


def _slime_sample_routes(turns, n_tokens: int):
    """slime/utils/types.py ``Sample._apply_meta_info`` per turn: SGLang's int32 payload decoded
    (``decode_int32_meta_array``), reshaped to ``(len(tokens) - 1 - start_len, num_layers, topk)``, the first turn
    taken as is, later turns appended after ``existing[:start_len]``."""
    existing = None
    for start_len, tokens_so_far, payload in turns:
        flat = torch.from_numpy(np.frombuffer(base64.b64decode(payload["routed_experts"]), dtype=np.int32).copy())
        rows = flat.reshape(tokens_so_far - 1 - start_len, LAYERS, TOP_K)
        existing = rows if start_len == 0 else torch.cat([existing[:start_len], rows])
    assert existing.shape[0] == n_tokens - 1
    return existing


def test_slime_rows_across_turns_and_round_trip():
    routes = _draw(11, seed=19)
    array = _all_layers(routes, -1)
    # turn 1: 8 tokens so far; turn 2 resends from routed_experts_start_len=7 up to 12 tokens
    turns = [(0, 8, _sglang_payload(array[:7], "int32")), (7, 12, _sglang_payload(array[7:], "int32"))]
    table = _slime_sample_routes(turns, 12)
    assert table.dtype == torch.int32
    rows = routes_from_slime(table, length=12, num_hidden_layers=LAYERS, moe_layers=MOE, top_k=TOP_K,
                             num_experts=EXPERTS)
    _rows_equal(rows, routes)
    back = routes_to_slime(rows, num_hidden_layers=LAYERS, moe_layers=MOE)
    assert back.dtype == torch.int32 and torch.equal(back, torch.from_numpy(_all_layers(routes, 0)).to(torch.int32))


def test_slime_refusals():
    routes = _draw(9, seed=20)
    table = torch.from_numpy(_all_layers(routes, 0))
    kw = dict(num_hidden_layers=LAYERS, moe_layers=MOE, top_k=TOP_K, num_experts=EXPERTS)
    with pytest.raises(InputError, match="has 9 rows, 9 tokens need 8"):
        routes_from_slime(table, length=9, **kw)
    with pytest.raises(RecordMismatchError, match="has 2 layers, expected 4"):
        routes_from_slime(table[:, list(MOE)], length=10, **kw)
    zero = table.clone()
    zero[4] = 0                                          # no missing-row marker: a zero row is a broken route
    with pytest.raises(RouteError, match="repeats expert 0"):
        routes_from_slime(zero, length=10, **kw)
    rows = RouteRows(torch.zeros(3, 2, 2, dtype=torch.uint8), torch.tensor([False, True, False]))
    with pytest.raises(ConfigError, match="row 1 is missing: slime has no missing-row marker"):
        routes_to_slime(rows, num_hidden_layers=LAYERS, moe_layers=MOE)


def test_route_rows_checks_its_fields():
    with pytest.raises(RouteError, match="bool \\[3\\]"):
        RouteRows(torch.zeros(3, 2, 2, dtype=torch.uint8), torch.zeros(2, dtype=torch.bool))
    with pytest.raises(RouteError, match="\\[rows, layers, k\\]"):
        RouteRows(torch.zeros(3, 2, dtype=torch.uint8), torch.zeros(3, dtype=torch.bool))
