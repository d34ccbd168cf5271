"""Known faults injected into a mismatch test, to check that the diagnosis names them (``--inject-fault``).

A diagnosis is only worth trusting if it finds a fault one put there on purpose. Two faults are injected
here; the others of the acceptance list are configurations (``--rollout-precision bf16-fp32-head`` for a
one-sided fp32 LM head):

* ``weights:layer=L[,scale=S]``: the rollout side's weights of decoder layer ``L`` perturbed (every floating
  parameter ``W`` of the layer but its router gets ``W + S * std(W) * noise``, seeded noise; ``S`` defaults to
  0.05): a stale or wrongly converted layer on one side. The router is left as it is: a record whose routers
  differ from the trainer's is already refused by the record's fingerprint, before any diagnosis.
* ``replay-off``: the training side's routing replay silently does nothing (its forwards run the router's own
  top-k when replay is asked for): a replay that was switched off, or patched at a place the engine no
  longer calls.

Pure torch (no engine import): a fault acts on a ``torch.nn.Module`` or wraps an engine object.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..handle import PatchHandle

__all__ = ["Fault", "parse_fault", "apply_fault", "ReplayOffTrainer", "FAULT_KINDS"]

FAULT_KINDS = ("weights", "replay-off")


@dataclass(frozen=True)
class Fault:
    kind: str
    layer: int | None = None
    scale: float = 0.05
    seed: int = 1234

    def describe(self) -> str:
        if self.kind == "weights":
            return f"rollout-side weights of layer {self.layer} perturbed (scale {self.scale:g})"
        return "routing replay switched off on the training side"


def parse_fault(text: str) -> Fault:
    """``"weights:layer=2"``, ``"weights:layer=2,scale=0.1"`` or ``"replay-off"``."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"--inject-fault: expected one of {FAULT_KINDS}, got {text!r}")
    kind, _, rest = text.strip().partition(":")
    if kind == "replay-off":
        if rest:
            raise ConfigError(f"--inject-fault replay-off takes no options, got {rest!r}")
        return Fault("replay-off")
    if kind != "weights":
        raise ConfigError(f"--inject-fault: unknown fault {kind!r}; choose one of {FAULT_KINDS}")
    opts = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in ("layer", "scale", "seed"):
            raise ConfigError(f"--inject-fault weights: unknown option {item!r} (layer=L, scale=S, seed=N)")
        opts[key] = value
    if "layer" not in opts:
        raise ConfigError("--inject-fault weights needs layer=L (the decoder layer to perturb)")
    try:
        layer, scale, seed = int(opts["layer"]), float(opts.get("scale", 0.05)), int(opts.get("seed", 1234))
    except ValueError:
        raise ConfigError(f"--inject-fault {text!r}: layer and seed must be integers, scale a number") from None
    if not 0 <= seed < 2 ** 63:
        raise ConfigError(f"--inject-fault {text!r}: seed must be in [0, 2**63), got {seed}")
    if layer < 0 or not 0 < scale < 10:
        raise ConfigError(f"--inject-fault {text!r}: layer must be >= 0 and scale in (0, 10)")
    return Fault("weights", layer, scale, seed)


def apply_fault(model: torch.nn.Module, fault: Fault) -> PatchHandle:
    """Perturb decoder layer ``fault.layer`` of ``model`` (parameters named ``...layers.L....``) in place, in the
    dtype each parameter is held in; ``undo()`` puts the original values back."""
    if fault.kind != "weights":
        raise ConfigError(f"apply_fault perturbs weights; fault {fault.kind!r} wraps the training engine instead")
    pattern = re.compile(rf"(^|\.)layers\.{fault.layer}\.")
    router = re.compile(r"\.(gate|router)\.")
    params = [(n, p) for n, p in model.named_parameters()
              if pattern.search(n) and not router.search(n) and p.is_floating_point()]
    if not params:
        raise ConfigError(f"--inject-fault weights:layer={fault.layer}: the model has no decoder layer {fault.layer}")
    handle = PatchHandle(f"weights of layer {fault.layer} perturbed", "instance")
    gen = torch.Generator().manual_seed(fault.seed)
    originals = []
    with torch.no_grad():
        for name, p in params:
            originals.append((p, p.detach().clone()))
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device)
            std = p.detach().float().std() if p.numel() > 1 else p.detach().float().abs()
            p.add_((fault.scale * std * noise).to(p.dtype))

    def restore() -> None:
        with torch.no_grad():
            for p, value in originals:
                p.copy_(value)

    handle.add_callback(restore, f"{len(params)} parameters of layer {fault.layer}")
    return handle


class ReplayOffTrainer:
    """A training engine whose routing replay does nothing: ``forward(..., replay=True)`` runs the router's own
    top-k (the ``replay-off`` fault). Everything else is the wrapped engine's."""

    def __init__(self, engine):
        self._engine = engine

    def forward(self, record, indices, *, replay: bool):
        return self._engine.forward(record, indices, replay=False)

    def __getattr__(self, name):
        return getattr(self._engine, name)
