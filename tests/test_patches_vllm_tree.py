"""The vLLM all-reduce tree patch at import level (vllm 0.33 imports on CPU without its kernels).

The main venv has no vllm (it pins torch 2.14 and CUDA packages): this test skips there and runs in the
venv of ``bash tools/test_vllm_import.sh``."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed in this environment (tools/test_vllm_import.sh)")

from moealign.patches.vllm import tree_reduce as tr  # noqa: E402


def test_vllm_all_reduce_patch_import_level():
    from vllm.distributed import parallel_state

    original = parallel_state.GroupCoordinator._all_reduce_out_place
    with tr.patch_vllm_all_reduce() as handle:
        assert parallel_state.GroupCoordinator._all_reduce_out_place is tr._tree_all_reduce_out_place
        assert handle.patched == ["GroupCoordinator (class)"]
    assert parallel_state.GroupCoordinator._all_reduce_out_place is original


def test_vllm_patch_refuses_missing_target(monkeypatch):
    from vllm.distributed import parallel_state

    from moealign.patches import UnsupportedEngineError

    monkeypatch.delattr(parallel_state.GroupCoordinator, "_all_reduce_out_place")
    with pytest.raises(UnsupportedEngineError, match="_all_reduce_out_place"):
        tr.patch_vllm_all_reduce()
