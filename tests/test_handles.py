"""One patch handle (moealign.handle.PatchHandle) for every patch the package applies.

* the primitives (set_attr / set_item / add_hook / add_callback / add_handle), undo order, idempotence,
  error handling, repr, and the subclass patterns the replay adapters use;
* a walk over every public apply_* / patch_* / register_* / enable_* function of the package (found by
  importing every module, so a new one cannot be forgotten) and the other patching entry points: each
  returns a PatchHandle whose repr names its target and scope, undo() restores the originals (identity),
  a second undo() is harmless, and the handle works as a context manager;
* generate_with_record's ``generator=``: the global RNG is untouched, equal generators give equal records,
  ``seed=`` gives what ``torch.manual_seed(seed)`` gave.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import pkgutil
import re
import sys
import types
import warnings

import pytest
import torch

import moealign
from moealign.errors import ConfigError, InputTypeError, MoealignError
from moealign.handle import SCOPES, PatchHandle

# --------------------------------------------------------------------------------------------------------
# the handle itself


class _Owner:
    def method(self):
        return "class"

    @staticmethod
    def static():
        return "static"


def test_set_attr_restores_own_and_deletes_inherited():
    obj = _Owner()
    obj.own = "mine"
    original_static = vars(_Owner)["static"]
    h = PatchHandle("three attributes", "instance")
    h.set_attr(obj, "own", "patched")
    h.set_attr(obj, "method", lambda: "instance")         # inherited from the class: deleted again
    h.set_attr(obj, "missing", 1, "a new attribute")      # absent: deleted again
    h.set_attr(_Owner, "static", staticmethod(lambda: "patched"))
    assert (obj.own, obj.method(), obj.missing, _Owner.static()) == ("patched", "instance", 1, "patched")
    assert h.patched == ["_Owner.own", "_Owner.method", "a new attribute", "_Owner.static"]
    h.undo()
    assert obj.own == "mine" and obj.method() == "class" and not hasattr(obj, "missing")
    assert "method" not in vars(obj)
    assert vars(_Owner)["static"] is original_static       # the raw staticmethod, not the function
    assert h.patched == [] and not h.active


def test_set_item_restores_or_removes_entries():
    registry = {"kept": 1}
    original = registry["kept"]
    with PatchHandle("registry", "process") as h:
        h.set_item(registry, "kept", 2)
        h.set_item(registry, "new", 3, "registry['new']")
        assert registry == {"kept": 2, "new": 3}
        assert h.patched == ["['kept']", "registry['new']"]
    assert registry == {"kept": 1} and registry["kept"] is original


def test_undo_is_reverse_ordered_idempotent_and_runs_every_step():
    order = []
    h = PatchHandle("steps", "module")
    h.add_callback(lambda: order.append(1), "first")
    h.add_callback(lambda: (_ for _ in ()).throw(RuntimeError("step 2 failed")), "second")
    h.add_callback(lambda: order.append(3), "third")
    with pytest.raises(RuntimeError, match="step 2 failed"):
        h.undo()
    assert order == [3, 1]                                  # reverse order; step 1 still ran after 2 raised
    assert not h.active and "undone" in repr(h)
    h.undo()                                                # nothing left: harmless
    assert order == [3, 1]


def test_add_hook_and_nested_handles():
    module = torch.nn.Linear(2, 2)
    child = PatchHandle("child", "instance")
    child.add_hook(module.register_forward_hook(lambda m, a, o: None), "hook")
    parent = PatchHandle("parent", "instance")
    assert parent.add_handle(child) is child
    assert parent.patched == ["child"] and len(module._forward_hooks) == 1
    parent.undo()
    assert not child.active and not module._forward_hooks
    with pytest.raises(InputTypeError, match="remove"):
        parent.add_hook(object())
    with pytest.raises(InputTypeError, match="callable"):
        parent.add_callback(42)
    with pytest.raises(InputTypeError, match="PatchHandle"):
        parent.add_handle(lambda: None)


def test_scope_is_checked_and_repr_names_target_scope_and_state():
    with pytest.raises(ConfigError, match="scope must be one of") as info:
        PatchHandle("x", "global")
    assert isinstance(info.value, MoealignError)
    h = PatchHandle("fp8 fake-quant on 42 Linear modules of Qwen3MoeForCausalLM", "instance")
    assert repr(h) == "PatchHandle(fp8 fake-quant on 42 Linear modules of Qwen3MoeForCausalLM, scope=instance, " \
                      "nothing patched)"
    h.add_callback(lambda: None, "x")
    assert repr(h).endswith("scope=instance, active)")
    h.undo()
    assert repr(h).endswith("scope=instance, undone)")


class _ReplayLike(PatchHandle):
    """The pattern of a patch with extra state: a subclass that registers its cleanup through the primitives."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(f"replay on {type(model).__name__}", "instance")
        self.targets = None
        self.add_callback(self.clear, "replay targets")     # registered first: runs last
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                self.set_attr(module, "forward", lambda x, m=module: torch.zeros(x.shape[:-1] + (m.out_features,)),
                              f"{name}.forward")

    def clear(self):
        self.targets = None


@dataclasses.dataclass(eq=False, repr=False)
class _DataclassHandle(PatchHandle):
    model: torch.nn.Module
    counter: int = 0

    def __post_init__(self):
        PatchHandle.__init__(self, f"dataclass patch on {type(self.model).__name__}", "instance")


def test_subclass_patterns_for_adapters():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(5, 3)
    ref = model(x)
    with _ReplayLike(model) as replay:
        replay.targets = "routes"
        assert torch.equal(model(x), torch.zeros(5, 2))
        assert replay.patched == ["replay targets", "0.forward", "2.forward"]
    assert replay.targets is None and torch.equal(model(x), ref)
    assert not any("forward" in vars(m) for m in model.modules())
    d = _DataclassHandle(model)
    d.set_attr(model[0], "forward", lambda x: x)
    assert "dataclass patch on Sequential, scope=instance, active" in repr(d)
    d.undo()
    assert "forward" not in vars(model[0]) and torch.equal(model(x), ref)


# --------------------------------------------------------------------------------------------------------
# the walk over every patching entry point


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b))


@dataclasses.dataclass
class Case:
    make: object            # () -> PatchHandle
    probe: object           # () -> tuple of what the patch changes (compared by identity / equality)
    scope: str
    words: tuple[str, ...]  # what the repr must name
    changes: bool = True    # False where the process already had what the patch would set up


_VOCAB = 512


def _tiny_moe(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=_VOCAB, intermediate_size=128,
        num_experts_per_tok=2, head_dim=16, eos_token_id=2, bos_token_id=1, pad_token_id=0, num_hidden_layers=2,
        num_experts=8, moe_intermediate_size=32)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20.0)
        model.lm_head.weight.mul_(15.0)
        model(torch.tensor([[5, 6]]), use_cache=False)      # transformers installs its own hooks now
    return model


def _hooks(model: torch.nn.Module) -> tuple:
    return tuple((name, tuple(m._forward_hooks), tuple(m._forward_pre_hooks)) for name, m in model.named_modules())


def _instance_dicts(model: torch.nn.Module) -> tuple:
    return tuple(sorted(k for m in model.modules() for k in vars(m) if not k.startswith("_") or "moealign" in k
                        or k == "_get_logits_processor"))


def case_fake_quant_fp8_(mp, stack):
    from moealign.precision.fp8 import fake_quant_fp8_

    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    return Case(lambda: fake_quant_fp8_(model), lambda: (*_hooks(model), *_instance_dicts(model)), "instance",
                ("fp8 e4m3 fake-quant on 2 Linear modules of Sequential",))


def case_apply_precision(mp, stack):
    from moealign.patches.hf.precision import apply_precision

    model = _tiny_moe()

    def probe():
        return (*_hooks(model), *((n, p, p.dtype) for n, p in model.named_parameters()),
                *((n, b.dtype) for n, b in model.named_buffers()))

    return Case(lambda: apply_precision(model, "fp16-fp32-router-head", keep_original=True), probe, "instance",
                ("precision policy 'fp16-fp32-router-head' on Qwen3MoeForCausalLM",))


def case_apply_fault(mp, stack):
    import hashlib

    from moealign.mismatch.faults import Fault, apply_fault

    model = _tiny_moe()

    def probe():   # the values of every parameter (a digest: tensors compare by identity here)
        h = hashlib.sha256()
        for n, p in model.named_parameters():
            h.update(n.encode() + p.detach().float().numpy().tobytes())
        return (h.hexdigest(),)

    return Case(lambda: apply_fault(model, Fault("weights", 0, 0.1)), probe, "instance", ("layer 0",))


def case_apply_bi_attention(mp, stack):
    pytest.importorskip("transformers")
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from moealign.patches.hf import attention as ha

    # a previous entry (say, an older registration) must come back as it was, by identity
    before = (lambda *a, **k: None), (lambda *a, **k: None)
    mp.setitem(AttentionInterface._global_mapping, ha.BI_ATTENTION, before[0])
    mp.setitem(AttentionMaskInterface._global_mapping, ha.BI_ATTENTION, before[1])

    def make():
        handle = ha.apply_bi_attention()
        assert handle.name == ha.BI_ATTENTION and ha.is_bi_attention_registered()
        return handle

    return Case(make, lambda: (AttentionInterface._global_mapping[ha.BI_ATTENTION],
                               AttentionMaskInterface._global_mapping[ha.BI_ATTENTION]),
                "process", ("transformers attention 'moealign_bi'",))


def case_enable_batch_invariant(mp, stack):
    from moealign.precision import batch_invariant as bi

    a = torch.randn(3, 5, dtype=torch.float64)

    def probe():
        return bi.is_batch_invariant_mode_enabled(), bi._ModeState.library, bi._ModeState.depth

    def make():
        handle = bi.enable_batch_invariant()
        torch.testing.assert_close(torch.log_softmax(a, -1), bi.bi_log_softmax(a, -1), rtol=0, atol=0)
        return handle

    return Case(make, probe, "process", ("batch-invariant aten kernels", "mm", "_log_softmax", "CPU"))


def case_batch_invariant_mode(mp, stack):
    from moealign.precision import batch_invariant as bi

    def make():   # the context manager keeps working, and yields the handle
        cm = bi.batch_invariant_mode()
        handle = cm.__enter__()
        handle.add_callback(lambda: cm.__exit__(None, None, None))
        return handle

    return Case(make, lambda: (bi.is_batch_invariant_mode_enabled(), bi._ModeState.library), "process",
                ("batch-invariant aten kernels",))


def _megatron_cpu_only():
    """The Megatron cases run Megatron's CPU mode, pinned (pin_cpu / device="cpu") on any machine."""
    pytest.importorskip("megatron.core")


def case_enable_megatron_cpu(mp, stack):
    _megatron_cpu_only()
    import megatron.core.tensor_parallel.random as mrandom

    from moealign.patches.megatron import world

    def probe():
        return (torch.cuda.current_device, torch.cuda.get_rng_state, torch.cuda.manual_seed,
                mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)

    return Case(lambda: world.enable_megatron_cpu(pin_cpu=True), probe, "module", ("Megatron-core CPU mode",))


def case_enable_megatron_without_te(mp, stack):
    pytest.importorskip("megatron.core")
    import megatron.core.transformer.moe.moe_utils as moe_utils

    from moealign.patches.megatron import world

    for name in world.TE_ONLY_MOE_UTILS_NAMES:      # the module as 0.16.1 leaves it without transformer-engine
        mp.delattr(moe_utils, name, raising=False)

    def probe():
        return tuple(vars(moe_utils).get(name, _Owner) for name in world.TE_ONLY_MOE_UTILS_NAMES)

    return Case(world.enable_megatron_without_te, probe, "module", ("without transformer-engine",))


def case_init_single_process(mp, stack):
    _megatron_cpu_only()
    import torch.distributed as dist
    from megatron.core import parallel_state

    from moealign.patches.megatron import world

    def probe():
        return dist.is_initialized(), parallel_state.model_parallel_is_initialized(), torch.cuda.current_device

    already = dist.is_initialized() or parallel_state.model_parallel_is_initialized()
    return Case(lambda: world.init_single_process(device="cpu"), probe, "process",
                ("one-process Megatron world", "gloo"),
                changes=not already)


def case_patch_megatron_row_parallel(mp, stack):
    _megatron_cpu_only()
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from moealign.patches.megatron import tree_reduce, world

    stack.enter_context(world.init_single_process(device="cpu"))
    cfg = ModelParallelConfig(tensor_model_parallel_size=1, use_cpu_initialization=True,
                              perform_initialization=False, gradient_accumulation_fusion=False)
    outer = torch.nn.Module()
    outer.proj = RowParallelLinear(128, 16, config=cfg, init_method=lambda t: None, bias=True,
                                   input_is_parallel=True, skip_bias_add=False)
    return Case(lambda: tree_reduce.patch_megatron_row_parallel(outer),
                lambda: (*_instance_dicts(outer), type(outer.proj).forward), "instance",
                ("TP-invariant tree forward on 1 RowParallelLinear of Module",))


def case_patch_megatron_vocab_parallel_cross_entropy(mp, stack):
    pytest.importorskip("megatron.core")
    import megatron.core.tensor_parallel as tp_pkg
    import megatron.core.tensor_parallel.cross_entropy as ce_mod

    from moealign.patches.megatron import tree_reduce

    return Case(tree_reduce.patch_megatron_vocab_parallel_cross_entropy,
                lambda: (ce_mod.vocab_parallel_cross_entropy, tp_pkg.vocab_parallel_cross_entropy), "module",
                ("vocab_parallel_cross_entropy",))


def _fake_vllm(mp):
    """Just enough of vllm.distributed.parallel_state for the import-level patch (vllm is not installed here)."""
    from moealign.patches.vllm import tree_reduce

    class GroupCoordinator:
        unique_name = "tp:0"
        device_group = None

        def _all_reduce_out_place(self, input_):
            return input_

    pkg, dist, ps = (types.ModuleType(n) for n in ("vllm", "vllm.distributed", "vllm.distributed.parallel_state"))
    ps.GroupCoordinator, dist.parallel_state, pkg.distributed = GroupCoordinator, ps, dist
    for module in (pkg, dist, ps):
        mp.setitem(sys.modules, module.__name__, module)
    mp.setattr(tree_reduce, "engine_version", lambda *a, **k: (pkg, "0.33.0"))
    mp.setattr(tree_reduce, "check_engine_version", lambda *a, **k: None)
    return tree_reduce, GroupCoordinator


def case_patch_vllm_all_reduce(mp, stack):
    tree_reduce, cls = _fake_vllm(mp)
    return Case(tree_reduce.patch_vllm_all_reduce, lambda: (vars(cls)["_all_reduce_out_place"],), "class",
                ("GroupCoordinator._all_reduce_out_place",))


def case_patch_vllm_all_reduce_instance(mp, stack):
    tree_reduce, cls = _fake_vllm(mp)
    group = cls()
    return Case(lambda: tree_reduce.patch_vllm_all_reduce(group),
                lambda: ("_all_reduce_out_place" in vars(group), group._all_reduce_out_place.__func__), "instance",
                ("GroupCoordinator 'tp:0'",))


def case_apply_tree_reductions(mp, stack):
    pytest.importorskip("vllm")
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers import linear, vocab_parallel_embedding
    from vllm.model_executor.layers.fused_moe import routed_experts, unquantized_fused_moe_method
    from vllm.model_executor.layers.fused_moe.runner import moe_runner

    from moealign.patches.vllm.tree_reduce import apply_tree_reductions

    targets = [(linear.UnquantizedLinearMethod, "apply"), (linear.UnquantizedLinearMethod, "process_weights_after_loading"),
               (vocab_parallel_embedding.UnquantizedEmbeddingMethod, "apply"),
               (vocab_parallel_embedding.UnquantizedEmbeddingMethod, "process_weights_after_loading"),
               (linear.RowParallelLinear, "forward"),
               (unquantized_fused_moe_method.UnquantizedFusedMoEMethod, "process_weights_after_loading"),
               (routed_experts.RoutedExperts, "forward_modular"), (moe_runner.MoERunner, "_maybe_reduce_final_output"),
               (parallel_state.GroupCoordinator, "_all_reduce_out_place")]
    return Case(apply_tree_reductions, lambda: tuple(getattr(cls, name) for cls, name in targets), "process",
                ("vLLM TP-invariant tree forward",))


def case_apply_vllm_precision(mp, stack):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers import vocab_parallel_embedding
    from vllm.model_executor.layers.fused_moe.router import gate_linear

    from moealign.patches.vllm.precision import apply_precision

    return Case(lambda: apply_precision("fp16-fp32-router-head"),
                lambda: (gate_linear.GateLinear.__init__, vocab_parallel_embedding.ParallelLMHead.__init__), "process",
                ("vLLM precision policy 'fp16-fp32-router-head'",))


def case_apply_cpu_experts_prepack(mp, stack):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method

    from moealign.patches.vllm.refit import apply_cpu_experts_prepack

    cls = unquantized_fused_moe_method.UnquantizedFusedMoEMethod
    return Case(apply_cpu_experts_prepack, lambda: (vars(cls)["_setup_kernel"],), "class",
                ("UnquantizedFusedMoEMethod._setup_kernel",))


def case_route_capture(mp, stack):
    from moealign.patches.hf.model import describe_model
    from moealign.patches.hf.rollout import RouteCapture

    model = _tiny_moe()
    return Case(lambda: RouteCapture(describe_model(model)).attach(), lambda: _hooks(model), "instance",
                ("route capture on 2 qwen3_moe routers",))


def case_append_logits_processor(mp, stack):
    from moealign.patches.hf.rollout import _append_logits_processor

    model = _tiny_moe()
    own = model._get_logits_processor       # an instance-level wrapper someone installed: kept by identity
    mp.setattr(model, "_get_logits_processor", lambda *a, **k: own(*a, **k))
    processor = lambda ids, scores: scores  # noqa: E731
    return Case(lambda: _append_logits_processor(model, processor),
                lambda: (vars(model)["_get_logits_processor"],), "instance",
                ("appended to Qwen3MoeForCausalLM.generate's logits processors",))


def case_apply_vllm_canonical(mp, stack):
    pytest.importorskip("vllm")
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers import layernorm, linear
    from vllm.model_executor.layers.fused_moe.router import cpu_router, gate_linear
    from vllm.model_executor.layers.rotary_embedding import base as rope_base
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.sample.ops import topk_topp_sampler

    from moealign.patches.vllm.canonical import apply_canonical_forward

    targets = [(layernorm.RMSNorm, "forward"), (rope_base.RotaryEmbedding, "forward"),
               (cpu_attn.CPUAttentionBackendImpl, "forward"), (cpu_attn.CPUAttentionBackendImpl, "do_kv_cache_update"),
               (gate_linear.GateLinear, "forward"), (cpu_router.CPURouter, "_compute_routing"),
               (topk_topp_sampler.TopKTopPSampler, "forward_cpu"), (linear.UnquantizedLinearMethod, "apply"),
               (parallel_state.GroupCoordinator, "_all_reduce_out_place")]
    return Case(apply_canonical_forward, lambda: tuple(getattr(cls, name) for cls, name in targets), "process",
                ("vLLM canonical forward",))


def _megatron_canonical_case(stack, make):
    _megatron_cpu_only()
    from megatron.core.transformer import attention as mg_attention

    from moealign.embedded import embedded_model_path
    from moealign.mismatch.engines import MegatronTrainEngine

    engine = MegatronTrainEngine(str(embedded_model_path()), "fp32", "cpu")
    stack.callback(engine.close)
    return Case(lambda: make(engine), lambda: (*_instance_dicts(engine.model), mg_attention.apply_rotary_pos_emb),
                "module", ("Megatron canonical forward", "GPTModel"))


def case_apply_megatron_canonical(mp, stack):
    from moealign.patches.megatron.canonical import apply_canonical_forward

    return _megatron_canonical_case(stack, lambda e: apply_canonical_forward(e.model, rope_base=10000.0,
                                                                             max_positions=512))


def case_apply_megatron_canonical_from_hf(mp, stack):
    from moealign.patches.megatron.canonical import apply_canonical_forward_from_hf

    return _megatron_canonical_case(stack, lambda e: apply_canonical_forward_from_hf(e.model, e._hf_config))


def case_apply_hf_canonical(mp, stack):
    from moealign.patches.hf.canonical import apply_canonical_forward

    model = _tiny_moe()
    return Case(lambda: apply_canonical_forward(model),
                lambda: (*_hooks(model), *_instance_dicts(model), model.config._attn_implementation), "instance",
                ("transformers canonical forward", "Qwen3MoeForCausalLM"))


CASES = {
    "moealign.precision.fp8.fake_quant_fp8_": case_fake_quant_fp8_,
    "moealign.patches.hf.canonical.apply_canonical_forward": case_apply_hf_canonical,
    "moealign.patches.vllm.canonical.apply_canonical_forward": case_apply_vllm_canonical,
    "moealign.patches.megatron.canonical.apply_canonical_forward": case_apply_megatron_canonical,
    "moealign.patches.megatron.canonical.apply_canonical_forward_from_hf": case_apply_megatron_canonical_from_hf,
    "moealign.patches.hf.precision.apply_precision": case_apply_precision,
    "moealign.patches.hf.attention.apply_bi_attention": case_apply_bi_attention,
    "moealign.mismatch.faults.apply_fault": case_apply_fault,
    "moealign.precision.batch_invariant.enable_batch_invariant": case_enable_batch_invariant,
    "moealign.precision.batch_invariant.batch_invariant_mode": case_batch_invariant_mode,
    "moealign.patches.megatron.world.enable_megatron_cpu": case_enable_megatron_cpu,
    "moealign.patches.megatron.world.init_single_process": case_init_single_process,
    "moealign.patches.megatron.world.enable_megatron_without_te": case_enable_megatron_without_te,
    "moealign.patches.vllm.refit.apply_cpu_experts_prepack": case_apply_cpu_experts_prepack,
    "moealign.patches.megatron.tree_reduce.patch_megatron_row_parallel": case_patch_megatron_row_parallel,
    "moealign.patches.megatron.tree_reduce.patch_megatron_vocab_parallel_cross_entropy":
        case_patch_megatron_vocab_parallel_cross_entropy,
    "moealign.patches.vllm.tree_reduce.patch_vllm_all_reduce": case_patch_vllm_all_reduce,
    "moealign.patches.vllm.tree_reduce.patch_vllm_all_reduce[instance]": case_patch_vllm_all_reduce_instance,
    "moealign.patches.vllm.tree_reduce.apply_tree_reductions": case_apply_tree_reductions,
    "moealign.patches.vllm.precision.apply_precision": case_apply_vllm_precision,
    "moealign.patches.hf.rollout.RouteCapture.attach": case_route_capture,
    "moealign.patches.hf.rollout._append_logits_processor": case_append_logits_processor,
}

# Public functions with a patching name that do not return a PatchHandle, and why.
EXEMPT = {
    "moealign.patches.hf.attention.register_bi_attention":
        "apply_bi_attention for the process's lifetime; returns the attn_implementation name the engines load with",
    "moealign.precision.policy.register_policy": "adds a named policy to moealign's own policy table",
    "moealign.families.register_family": "adds a model family to moealign's own family table",
    "moealign.mismatch.engines.register_rollout_engine": "adds an engine factory to moealign's own engine table",
    "moealign.mismatch.engines.register_train_engine": "adds an engine factory to moealign's own engine table",
    "moealign.correction.is_weights.apply_is_mode": "arithmetic (applies an IS mode to weights), patches nothing",
}

_PATCH_NAME = re.compile(r"^(apply|patch|register|enable|install|attach)_")


def _patching_functions() -> set[str]:
    found = set()
    for info in pkgutil.walk_packages(moealign.__path__, "moealign."):
        if info.name.endswith("__main__"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(info.name)
        except ImportError as exc:      # an optional dependency (triton, an engine) that is not installed
            if (getattr(exc, "name", None) or "").startswith("moealign"):
                raise
            continue
        for name, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == module.__name__ and _PATCH_NAME.match(name):
                found.add(f"{module.__name__}.{name}")
    return found


def test_every_patching_function_is_walked():
    found = _patching_functions()
    walked = {name.split("[")[0] for name in CASES}
    assert not found - walked - set(EXEMPT), "patching functions neither walked nor exempt"
    assert not set(EXEMPT) - found, "stale exemptions"
    assert {n for n in walked if _PATCH_NAME.match(n.rsplit(".", 1)[1])} <= found


@pytest.mark.parametrize("name", list(CASES))
def test_patch_returns_one_handle(name, monkeypatch):
    with contextlib.ExitStack() as stack:
        case = CASES[name](monkeypatch, stack)
        before = case.probe()

        handle = case.make()
        assert isinstance(handle, PatchHandle), type(handle)
        assert handle.scope == case.scope and handle.scope in SCOPES
        text = repr(handle)
        assert text.startswith(f"{type(handle).__name__}({handle.target}, scope={case.scope}, ")
        for word in case.words:
            assert word in handle.target, (word, text)
        if case.changes:
            assert handle.active and text.endswith(", active)") and handle.patched
            assert not _same(case.probe(), before), "nothing was patched"
        handle.undo()
        assert _same(case.probe(), before), "undo() did not restore the originals"
        assert not handle.active and handle.patched == []
        handle.undo()                                           # twice: harmless
        assert _same(case.probe(), before)

        with case.make() as again:                              # a context manager
            if case.changes:
                assert again.active and not _same(case.probe(), before)
        assert not again.active and _same(case.probe(), before)

        with pytest.raises(RuntimeError, match="boom"), case.make():   # undone on an exception too
            raise RuntimeError("boom")
        assert _same(case.probe(), before)


def test_fake_quant_refusal_leaves_nothing_behind():
    from moealign.precision.fp8 import Fp8FakeQuantConfig, fake_quant_fp8_

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with fake_quant_fp8_(model, Fp8FakeQuantConfig(filter=lambda name, m: name == "1")):
        before = (_hooks(model), _instance_dicts(model))
        with pytest.raises(RuntimeError, match="already fake-quantised"):
            fake_quant_fp8_(model)                  # module 0 gets hooked, then module 1 refuses: 0 undone
        assert (_hooks(model), _instance_dicts(model)) == before


def test_megatron_world_close_is_undo():
    _megatron_cpu_only()
    from moealign.patches.megatron import world

    w = world.init_single_process(device="cpu")
    assert "scope=process" in repr(w)
    w.close()
    assert not w.active and w.cpu_mode is None and not w.owns_process_group and not w.owns_parallel_state


# --------------------------------------------------------------------------------------------------------
# generate_with_record(generator=...)


def _prompts():
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros((3, 7), dtype=torch.int64)
    am = torch.zeros_like(ids)
    for b, length in enumerate((7, 4, 2)):
        ids[b, 7 - length:] = torch.randint(3, _VOCAB, (length,), generator=g)
        am[b, 7 - length:] = 1
    return ids, am


def _tokens(record):
    return [s.token_ids for s in record.samples]


def _equal(a, b) -> bool:
    return all(torch.equal(x.token_ids, y.token_ids) and torch.equal(x.logprobs, y.logprobs)
               and torch.equal(x.routes, y.routes) and torch.equal(x.kept_ids, y.kept_ids)
               for x, y in zip(a.samples, b.samples, strict=True))


@pytest.fixture(scope="module")
def moe():
    return _tiny_moe()


def test_generator_leaves_global_rng_alone_and_equal_generators_agree(moe):
    from moealign.patches import hf
    from moealign.record import SamplingParams

    ids, am = _prompts()
    kw = dict(sampling=SamplingParams(top_p=0.9), max_new_tokens=5)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = hf.generate_with_record(moe, ids, am, generator=g1, **kw)
    assert torch.equal(torch.get_rng_state(), state)                   # the global RNG is as it was
    b = hf.generate_with_record(moe, ids, am, generator=g2, **kw)
    assert _equal(a, b)
    assert torch.equal(g1.get_state(), g2.get_state())
    assert not torch.equal(g1.get_state(), torch.Generator().manual_seed(7).get_state())   # drawn from
    c = hf.generate_with_record(moe, ids, am, generator=g1, **kw)      # advanced: other draws (control)
    assert not _equal(a, c)
    d = hf.generate_with_record(moe, ids, am, seed=7, **kw)            # seed= is a generator seeded with it
    assert _equal(a, d)
    assert torch.equal(torch.get_rng_state(), state)


def test_seed_gives_what_manual_seed_gave(moe):
    from moealign.patches import hf
    from moealign.record import SamplingParams

    ids, am = _prompts()
    kw = dict(sampling=SamplingParams(temperature=1.0, top_k=50), max_new_tokens=4)
    torch.manual_seed(11)
    old = hf.generate_with_record(moe, ids, am, **kw)                 # no seed: the global RNG, as before
    new = hf.generate_with_record(moe, ids, am, seed=11, **kw)
    assert _equal(old, new)


def test_generator_errors(moe):
    from moealign.patches import hf

    ids, am = _prompts()
    with pytest.raises(ConfigError, match="seed or generator"):
        hf.generate_with_record(moe, ids, am, max_new_tokens=1, seed=1, generator=torch.Generator())
    with pytest.raises(InputTypeError, match="torch.Generator"):
        hf.generate_with_record(moe, ids, am, max_new_tokens=1, generator=7)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="generate failed"):
        with pytest.MonkeyPatch.context() as mp:
            def boom(*a, **k):
                torch.rand(3)                   # consumes the forked RNG: must not leak out
                raise RuntimeError("generate failed")
            mp.setattr(moe, "generate", boom)
            hf.generate_with_record(moe, ids, am, max_new_tokens=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), state)
    assert "_get_logits_processor" not in vars(moe)
