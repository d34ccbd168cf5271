"""SGLang's routed-experts wire format into a record route table, on payloads built the way SGLang builds them:
a flat row-major ``[rows, num_hidden_layers, top_k]`` array, cast to the configured wire dtype unless an id does
not fit (then int32), base64 of its bytes, the dtype named in ``routed_experts_dtype`` (absent: legacy int32)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from moealign.errors import ConfigError, InputError, RecordMismatchError, RouteError
from moealign.routing_replay.formats import routes_from_sglang

LAYERS, TOP_K, EXPERTS = 4, 2, 16
MOE = (1, 3)     # layers 0 and 2 dense


def _sglang_payload(array: np.ndarray, configured: str | None) -> dict:
    """What SGLang puts in meta_info: the configured wire dtype, int32 when an id does not fit; no dtype field for
    a legacy sender (``configured=None``, int32 bytes)."""
    if configured is None:
        return {"routed_experts": base64.b64encode(array.astype(np.int32).tobytes()).decode()}
    target = np.dtype(configured)
    if target.kind == "u" and array.size and (array.min() < np.iinfo(target).min or array.max() > np.iinfo(target).max):
        target = np.dtype(np.int32)
    return {"routed_experts": base64.b64encode(array.astype(target).tobytes()).decode(),
            "routed_experts_dtype": target.name}


def _engine_array(length: int, filler: int = -1, seed: int = 0) -> np.ndarray:
    gen = np.random.default_rng(seed)
    out = np.full((length - 1, LAYERS, TOP_K), filler, dtype=np.int64)
    for layer in MOE:
        out[:, layer] = np.argsort(gen.random((length - 1, EXPERTS)), axis=-1)[:, :TOP_K]
    return out


def _read(meta_info, length, **kw):
    return routes_from_sglang(meta_info, num_hidden_layers=LAYERS, moe_layers=MOE, top_k=TOP_K, num_experts=EXPERTS,
                              length=length, **kw)


@pytest.mark.parametrize("configured,filler", [("int32", -1), ("uint16", 0), ("uint8", 0), ("uint8", -1), (None, -1)])
def test_sglang_payload_reads_the_moe_layers_by_number(configured, filler):
    array = _engine_array(10, filler)
    meta_info = _sglang_payload(array, configured)
    if configured == "uint8" and filler == -1:
        assert meta_info["routed_experts_dtype"] == "int32"      # the sentinel does not fit: SGLang keeps int32
    routes = _read(meta_info, 10)
    assert routes.dtype == torch.uint8 and routes.shape == (9, 2, 2)
    assert torch.equal(routes.long(), torch.from_numpy(array[:, list(MOE)]))
    # by number, not position: layers 1 and 3, never 0 and 1
    assert not torch.equal(routes.long(), torch.from_numpy(array[:, :2]).clamp(min=0))


def test_sglang_refusals():
    array = _engine_array(10)
    good = _sglang_payload(array, "int32")
    with pytest.raises(InputError, match="no 'routed_experts'"):
        _read({}, 10)
    with pytest.raises(ConfigError, match="start at position 3"):
        _read(good, 10, start_len=3)
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
    with pytest.raises(RouteError):
        _read(_sglang_payload(out_of_range, "int32"), 10)
    repeated = array.copy()
    repeated[2, 1] = [5, 5]
    with pytest.raises(RouteError):
        _read(_sglang_payload(repeated, "int32"), 10)
    with pytest.raises(RecordMismatchError, match="outside"):
        routes_from_sglang(good, num_hidden_layers=LAYERS, moe_layers=(1, 4), top_k=TOP_K, num_experts=EXPERTS,
                           length=10)
