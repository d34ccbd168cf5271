"""Find host syncs in moealign's code on a CPU machine: a context that makes every device -> host read that
moealign's own code makes (``Tensor.item`` / ``tolist`` / ``__bool__`` / ``__int__`` / ``__float__`` / ``__index__``
/ ``cpu`` / ``numpy`` / ``nonzero``, boolean-mask indexing, ``torch.equal`` / ``allclose`` / ``nonzero``) raise
:class:`HostSync` (``mode="raise"``) or be counted per call site (``mode="count"``).

On a GPU each of these waits for the device (``torch.cuda.set_sync_debug_mode`` catches them there); on a CPU they
cost nothing, so a CPU test can only see them this way. A call counts when the first frame outside torch that
leads to it is in the ``moealign`` package (the model's own code, transformers' or Megatron's, is not ours to
judge: a plain forward of transformers' MoE blocks reads ``nonzero`` itself)::

    with host_syncs("raise"):
        model(input_ids)          # a replayed forward: raises HostSync naming moealign's file and line
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from typing import Iterator

import torch

_ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "moealign") + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_TENSOR_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")
_TORCH_FUNCTIONS = ("equal", "allclose", "nonzero")


class HostSync(AssertionError):
    """moealign's code read a tensor value back to the host where it must not."""


def _culprit() -> str | None:
    """``file:line`` of the first non-torch frame above the caller when it is moealign's, else None."""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name == os.path.abspath(__file__) or name.startswith(_TORCH):
            frame = frame.f_back
            continue
        return f"{name[len(_ROOT):]}:{frame.f_lineno}" if name.startswith(_ROOT) else None
    return None


class _State:
    def __init__(self, mode: str):
        self.mode = mode
        self.counts: collections.Counter = collections.Counter()
        self.busy = False

    def hit(self, what: str) -> None:
        if self.busy:
            return
        self.busy = True
        try:
            where = _culprit()
        finally:
            self.busy = False
        if where is None:
            return
        self.counts[f"{what} at moealign/{where}"] += 1
        if self.mode == "raise":
            raise HostSync(f"host sync inside the guarded region: {what} at moealign/{where}")


@contextlib.contextmanager
def host_syncs(mode: str = "raise") -> Iterator[collections.Counter]:
    """Within the context, moealign's device -> host reads raise :class:`HostSync` (``"raise"``) or are counted
    (``"count"``: the yielded Counter maps ``"what at file:line"`` to calls)."""
    if mode not in ("raise", "count"):
        raise ValueError(f"mode must be 'raise' or 'count', got {mode!r}")
    state = _State(mode)
    saved: list[tuple[object, str, object, bool]] = []

    def wrap(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            state.hit(f"{getattr(owner, '__name__', owner)}.{name}")
            return original(*args, **kwargs)
        saved.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, wrapper)

    original_getitem = torch.Tensor.__getitem__

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            state.hit("boolean-mask indexing")
        return original_getitem(self, index)

    try:
        for name in _TENSOR_METHODS:
            wrap(torch.Tensor, name)
        for name in _TORCH_FUNCTIONS:
            wrap(torch, name)
        saved.append((torch.Tensor, "__getitem__", original_getitem, "__getitem__" in vars(torch.Tensor)))
        torch.Tensor.__getitem__ = getitem
        yield state.counts
    finally:
        for owner, name, original, own in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
