"""TP-invariant tree all-reduce swapped into vLLM's ``GroupCoordinator`` (see :mod:`moealign.precision.tree`)."""

from __future__ import annotations

import inspect

import torch

from ...errors import InputTypeError
from ...precision.tree import (
    TreeReducePatch,
    tree_all_reduce,
)
from .._version import (
    UnsupportedEngineError,
    check_engine_version,
    engine_version,
    require_attr,
)

SUPPORTED_VLLM = ">=0.8,<0.34"


# --------------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------------


def _tree_all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
    """Replacement body of ``GroupCoordinator._all_reduce_out_place``: the tree all-reduce (a new tensor)."""
    return tree_all_reduce(input_, self.device_group).clone()


def patch_vllm_all_reduce(group_coordinator=None) -> TreeReducePatch:
    """Route vLLM's all-reduce through the tree all-reduce.

    With ``group_coordinator=None`` the ``GroupCoordinator`` class is patched (every group, including TP);
    otherwise only that instance (e.g. ``vllm.distributed.get_tp_group()``). Raises
    :class:`UnsupportedEngineError` for vLLM versions outside :data:`SUPPORTED_VLLM` or when
    ``_all_reduce_out_place(self, input_)`` is missing or has another signature.
    """
    _, version = engine_version("vllm", "moealign.patches.tree_reduce.patch_vllm_all_reduce needs vLLM")
    check_engine_version("vllm", version, SUPPORTED_VLLM)
    from vllm.distributed import parallel_state

    cls = require_attr(parallel_state, "GroupCoordinator", "vllm.distributed.parallel_state")
    original = require_attr(cls, "_all_reduce_out_place", "vllm GroupCoordinator")
    params = list(inspect.signature(original).parameters)
    if params != ["self", "input_"]:
        raise UnsupportedEngineError(f"vllm GroupCoordinator._all_reduce_out_place{tuple(params)} has a signature "
                                     "this patch was not written for, nothing was patched")
    if group_coordinator is None:
        handle = TreeReducePatch("vLLM GroupCoordinator._all_reduce_out_place -> tree all-reduce (every group)",
                                 "class")
        handle.set_attr(cls, "_all_reduce_out_place", _tree_all_reduce_out_place, "GroupCoordinator (class)")
    else:
        if not isinstance(group_coordinator, cls):
            raise InputTypeError(f"expected a vllm GroupCoordinator, got {type(group_coordinator).__name__}")
        require_attr(group_coordinator, "device_group", "vllm GroupCoordinator instance")
        handle = TreeReducePatch(f"vLLM all-reduce -> tree all-reduce on GroupCoordinator "
                                 f"{getattr(group_coordinator, 'unique_name', '?')!r}", "instance")
        handle.set_attr(group_coordinator, "_all_reduce_out_place",
                    _tree_all_reduce_out_place.__get__(group_coordinator), "GroupCoordinator (instance)")
    return handle
