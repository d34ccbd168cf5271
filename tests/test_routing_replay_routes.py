"""Route tables: storage dtypes, validation (one test per bad input), compact/expand round trips."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moealign.routing_replay as rr
from moealign.routing_replay import (
    RouteError,
    compact_routes,
    expand_routes,
    route_dtype,
    validate_routes,
)


def test_route_error_is_a_value_error():
    assert issubclass(RouteError, ValueError)


@pytest.mark.parametrize("num_experts, dtype", [
    (1, torch.uint8), (8, torch.uint8), (128, torch.uint8), (256, torch.uint8),
    (257, torch.int16), (384, torch.int16), (32767, torch.int16),
])
def test_route_dtype(num_experts, dtype):
    assert route_dtype(num_experts) == dtype


@pytest.mark.parametrize("num_experts, fragment", [
    (32768, "at most 32767"),
    (0, "must be >= 1"),
    (-3, "must be >= 1"),
    (8.0, "must be an int"),
    (True, "must be an int"),
])
def test_route_dtype_errors(num_experts, fragment):
    with pytest.raises(RouteError, match=fragment):
        route_dtype(num_experts)


def test_largest_ids_survive_compaction():
    # 255 is the largest uint8 id (256 experts); 32766 the largest int16 one (32767 experts)
    ids = torch.tensor([[255, 0, 254]])
    stored = compact_routes(ids, 256)
    assert stored.dtype == torch.uint8
    assert torch.equal(expand_routes(stored), ids)
    ids = torch.tensor([[32766, 0], [300, 1]])
    stored = compact_routes(ids, 32767)
    assert stored.dtype == torch.int16
    out = expand_routes(stored)
    assert out.dtype == torch.int64 and torch.equal(out, ids)


def test_compact_routes_validates():
    with pytest.raises(RouteError, match="not an expert id"):
        compact_routes(torch.tensor([[1, 8]]), 8)


@given(
    num_experts=st.sampled_from([4, 64, 256, 257, 1000, 32767]),
    tokens=st.integers(0, 6),
    layers=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=30, deadline=None)
def test_compact_expand_round_trip(num_experts, tokens, layers, seed):
    g = torch.Generator().manual_seed(seed)
    k = min(4, num_experts)
    ids = torch.rand(tokens, layers, num_experts, generator=g).argsort(dim=-1)[..., :k]
    stored = compact_routes(ids, num_experts)
    assert stored.dtype == route_dtype(num_experts)
    assert torch.equal(expand_routes(stored), ids)


def test_valid_routes_pass():
    validate_routes(torch.tensor([[0, 7], [7, 0], [3, 4]], dtype=torch.uint8), 8)
    validate_routes(torch.tensor([[[5]]], dtype=torch.int16), 6)
    validate_routes(torch.empty(0, 2, dtype=torch.int64), 4)  # no tokens is fine
    validate_routes(torch.tensor([3, 2, 1, 0]), 4)  # k == num_experts


@pytest.mark.parametrize("ids, fragment", [
    (torch.tensor([[0.0, 1.0]]), "integer tensor, got dtype torch.float32"),
    (torch.tensor([[True, False]]), "integer tensor, got dtype torch.bool"),
    (torch.tensor(3), "0-d tensor"),
    (torch.empty(4, 0, dtype=torch.int64), "k = 0"),
    (torch.tensor([[0, 1, 2, 3, 4]]), "k = 5 experts per token but there are only num_experts = 4"),
    (torch.tensor([[0, 1], [2, 4]]), r"routes\[1, 1\] = 4 is not an expert id in \[0, 4\)"),
    (torch.tensor([[0, 1], [-1, 2]]), r"routes\[1, 0\] = -1 is not an expert id"),
    (torch.tensor([[[0, 1], [2, 3]], [[1, 2], [3, 3]]]), r"row \[1, 1\] repeats expert 3"),
    (torch.tensor([[0, 1], [2, 2], [1, 1]], dtype=torch.uint8), r"row \[1\] repeats expert 2"),
])
def test_validate_routes_errors(ids, fragment):
    with pytest.raises(RouteError, match=fragment):
        validate_routes(ids, 4)


def test_validate_routes_names_the_tensor():
    with pytest.raises(RouteError, match=r"^ids\[0, 1\] = 9"):
        validate_routes(torch.tensor([[1, 9]]), 4, name="ids")


def test_validate_routes_reports_the_first_offender():
    ids = torch.tensor([[0, 1], [1, 0], [3, 7], [9, 2]])
    with pytest.raises(RouteError, match=r"\[2, 1\] = 7"):
        validate_routes(ids, 4)
    ids = torch.tensor([[0, 1], [2, 0], [3, 3], [2, 2]])
    with pytest.raises(RouteError, match=r"row \[2\]"):
        validate_routes(ids, 4)


def test_validate_routes_rejects_non_tensor():
    with pytest.raises(RouteError, match="must be a torch.Tensor"):
        validate_routes([[0, 1]], 4)


def test_expand_routes_rejects_floats():
    with pytest.raises(RouteError, match="integer tensor"):
        expand_routes(torch.tensor([1.0]))


def test_validate_routes_is_vectorised_enough():
    # 64K tokens x 4 layers x 8 of 128 experts: must be far under a second (no Python loop over rows)
    import time

    start = torch.randint(128, (65536, 4, 1), generator=torch.Generator().manual_seed(0))
    ids = ((start + torch.arange(8)) % 128).to(torch.uint8)  # 8 distinct experts per row
    start = time.perf_counter()
    validate_routes(ids, 128)
    assert time.perf_counter() - start < 1.0


def test_package_imports_only_torch_numpy_stdlib():
    allowed = {"torch", "numpy", "__future__", "math", "dataclasses", "collections", "typing", "itertools",
               "functools", "time", "contextlib", "base64", "binascii"}
    root = pathlib.Path(rr.__file__).parent
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative import inside the package
                    continue
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
