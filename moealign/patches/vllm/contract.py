"""The execution contract (:mod:`moealign.contract`) of a vLLM engine (``vllm.LLM``), read in its workers.

Region dtypes from the parameters as the workers hold them (routers: each MoE block's ``gate``; attention: each
``self_attn``; experts: each ``experts`` module; LM head: ``lm_head``); the logits dtype measured by
:func:`~moealign.patches.vllm.precision.audit_vllm` (one generated token); TP / EP sizes from the worker's
``VllmConfig``. Weight digests: vLLM's stacked parameters are un-fused back to the transformers names
(``qkv_proj`` -> ``q_proj`` / ``k_proj`` / ``v_proj``, ``gate_up_proj`` -> ``gate_proj`` / ``up_proj``, the experts'
``w13_weight`` / ``w2_weight`` -> ``gate_up_proj`` / ``down_proj``, whether vLLM holds them on the ``mlp.experts``
module or on its ``mlp.experts.routed_experts`` child) for the qwen3_moe family at TP = 1; another family or TP > 1
states ``"digests": {}`` with a note saying why.

Digests are of the weights *as loaded*, never of a kernel's re-laid-out copy: vLLM's CPU build prepacks the experts'
``w13_weight`` / ``w2_weight`` after loading (same shape, the elements in another order) and moves the linear layers
into oneDNN kernels (parameters left empty). The tree / canonical forward (``MOEALIGN_VLLM_PATCHES=tree``,
``--aligned``) keeps the linear layers as loaded and a copy of each experts module's weights taken before the
prepack (``_moealign_tree_weights``, what its experts compute with): those are digested. Experts held only in a
kernel's layout, or empty parameters, give no digests (a note says why) rather than digests of other bytes.
"""

from __future__ import annotations

import os
import re

import torch

from ...contract import check_contract, weight_digests
from ...errors import ConfigError
from ...families import verified_families
from ...precision.policy import PrecisionPolicy, get_policy

__all__ = ["contract_of", "hf_named_tensors", "as_loaded"]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


from ...contract import bulk_dtype as _bulk


_EXPERTS_RE = re.compile(r"^(.*\.mlp\.experts)(?:\.routed_experts)?\.(w13_weight|w2_weight)$")
_EXPERTS_HF = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}


def hf_named_tensors(named, hf_config: dict):
    """``(transformers name, tensor)`` of a qwen3_moe vLLM model's ``named_parameters()`` at TP = 1 (the experts'
    ``[mlp.experts.][routed_experts.]w13_weight`` / ``w2_weight`` become ``mlp.experts.gate_up_proj`` /
    ``down_proj``, transformers 5's fused experts; the tensors are taken as given, see :func:`as_loaded`)."""
    heads, kv = int(hf_config["num_attention_heads"]), int(hf_config.get("num_key_value_heads") or 0)
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    kv = kv or heads
    for name, t in named:
        t = t.detach()
        if name.endswith("self_attn.qkv_proj.weight") or name.endswith("self_attn.qkv_proj.bias"):
            base, kind = name.rsplit(".qkv_proj.", 1)
            q, k, v = torch.split(t, [heads * head_dim, kv * head_dim, kv * head_dim], dim=0)
            yield from ((f"{base}.q_proj.{kind}", q), (f"{base}.k_proj.{kind}", k), (f"{base}.v_proj.{kind}", v))
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name[:-len("gate_up_proj.weight")]
            gate, up = t.chunk(2, dim=0)
            yield from ((f"{base}gate_proj.weight", gate), (f"{base}up_proj.weight", up))
        elif _EXPERTS_RE.match(name):
            base, leaf = _EXPERTS_RE.match(name).groups()
            yield f"{base}.{_EXPERTS_HF[leaf]}", t
        else:
            yield name, t


def as_loaded(model: torch.nn.Module, named) -> tuple[list, str | None]:
    """``(named, why_not)``: ``named`` (``(name, parameter)`` of ``model``) with each experts module's ``w13_weight``
    / ``w2_weight`` replaced by the copy taken before vLLM re-laid them out (``_moealign_tree_weights``, kept by the
    tree / canonical forward), or ``why_not``: the first parameter held in a kernel's layout (an experts module
    without that copy, or an empty parameter: a linear layer moved into a packed kernel), with ``named`` unusable."""
    modules = dict(model.named_modules())
    out = []
    for name, t in named:
        module_name, _, leaf = name.rpartition(".")
        if leaf in _EXPERTS_HF:
            copy = getattr(modules.get(module_name), "_moealign_tree_weights", None)
            if copy is None:
                return [], (f"vLLM holds the experts' weights in its MoE kernel's layout (e.g. {name}; its CPU build "
                            f"prepacks them after loading), so the weights as loaded cannot be read back; the tree or "
                            f"canonical forward (MOEALIGN_VLLM_PATCHES=tree, --aligned) keeps a copy as loaded")
            t = copy[0] if leaf == "w13_weight" else copy[1]
        elif t.numel() == 0:
            packed = [n for n, p in named if p.numel() == 0]
            return [], (f"vLLM re-laid out {len(packed)} parameters after loading (its kernels hold them packed, e.g. "
                        f"{packed[0]}), so the weights as loaded cannot be read back")
        out.append((name, t))
    return out, None


def _attention_backend(runner) -> str | None:
    for groups in (getattr(runner, "attn_groups", None) or []):
        for group in groups:
            backend = getattr(group, "backend", None)
            if backend is not None and hasattr(backend, "get_name"):
                return str(backend.get_name())
    return None


def _rpc_contract(worker) -> dict:
    """In a vLLM worker: this rank's dtypes, sizes, kernels and (TP = 1, a digest family) weight digests."""
    from .rollout import worker_runner

    runner = worker_runner(worker)
    model = runner.model
    config = runner.vllm_config
    hf_config = config.model_config.hf_config.to_dict()
    parallel = config.parallel_config
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    named = list(model.named_parameters())
    modules = dict(model.named_modules())
    experts = [m for n, m in modules.items() if n.endswith("mlp.experts")]
    moe = None
    if experts:
        method = getattr(experts[0], "quant_method", None)
        moe = type(method).__name__ if method is not None else type(experts[0]).__name__
    dtypes = {"router": _bulk(p for n, p in named if n.endswith("mlp.gate.weight")),
              "attention": _bulk(p for n, p in named if ".self_attn." in n),
              "experts": _bulk(p for n, p in named if ".mlp.experts." in n),
              "lm_head": _bulk(p for n, p in named if n.startswith("lm_head."))}
    family = hf_config.get("model_type")
    if tp != 1:
        weights = {"dtype": _bulk(p for _, p in named), "algorithm": "sha256", "digests": {},
                   "note": f"no digests at TP={tp}: each worker holds a slice (un-fusing is written for TP=1)"}
    elif family not in verified_families("vllm_digests"):
        weights = {"dtype": _bulk(p for _, p in named), "algorithm": "sha256", "digests": {},
                   "note": f"no digests for the {family} family: un-fusing vLLM's stacked parameters is written for "
                           f"{', '.join(verified_families('vllm_digests'))}"}
    else:
        loaded, why_not = as_loaded(model, named)
        if why_not is not None:
            weights = {"dtype": _bulk(p for _, p in named), "algorithm": "sha256", "digests": {},
                       "note": f"no digests: {why_not}"}
        else:
            state = dict(hf_named_tensors(loaded, hf_config))
            vocab = int(hf_config["vocab_size"])
            for key in ("model.embed_tokens.weight", "lm_head.weight"):   # vLLM pads the vocabulary rows at TP = 1
                if key in state and state[key].shape[0] > vocab:
                    state[key] = state[key][:vocab]
            if hf_config.get("tie_word_embeddings") and "lm_head.weight" not in state:
                state["lm_head.weight"] = state["model.embed_tokens.weight"]
            weights = weight_digests(state.items(), int(hf_config["num_hidden_layers"]))
    return {"dtypes": dtypes, "kernels": {"attention": _attention_backend(runner), "moe": moe},
            "parallel": {"tp": tp, "ep": tp if getattr(parallel, "enable_expert_parallel", False) else 1, "sp": 1,
                         "cp": int(getattr(parallel, "decode_context_parallel_size", 1) or 1)},
            "weights": weights}


def contract_of(llm, policy: str | PrecisionPolicy, *, sampling: dict | None = None, router_compute=None) -> dict:
    """The contract of a loaded ``vllm.LLM`` running precision ``policy`` (see the module docstring); rank 0's
    reading. ``sampling``: the sampling parameters this side samples with (``None``: not stated).
    ``router_compute``: see :func:`~moealign.patches.vllm.precision.audit_vllm` (the canonical router)."""
    from .engine import vllm_version
    from .precision import audit_vllm

    if sampling is not None and not isinstance(sampling, dict):
        raise ConfigError(f"sampling must be a dict or None, got {type(sampling).__name__}")
    policy = get_policy(policy)
    part = llm.collective_rpc(_rpc_contract)[0]
    computed = audit_vllm(llm, policy, router_compute=router_compute).get("computed", {})
    logits = [d for name, d in computed.items() if name.endswith("logits_processor")]
    part["dtypes"]["logits"] = (logits[0].replace("torch.", "") if logits else part["dtypes"]["lm_head"])
    patches = os.environ.get("MOEALIGN_VLLM_PATCHES", "")
    batch_invariant = os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")
    return check_contract({
        "engine": "vllm",
        "engine_version": str(vllm_version()),
        **{k: part[k] for k in ("dtypes", "kernels", "parallel")},
        "switches": {"batch_invariant": batch_invariant, "tree_reductions": "tree" in patches.split(",")},
        "sampling": None if sampling is None else dict(sampling),
        "weights": part["weights"],
    })
