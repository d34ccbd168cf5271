"""Dynamic loss scaling for fp16 training: scale the loss, unscale the gradients, skip overflow steps.

fp16's smallest normal value is 6e-5, so small gradients underflow to zero unless the loss is multiplied
by a large factor before ``backward()``. The scale is chosen dynamically (as in Megatron's
``DynamicGradScaler`` and torch's ``GradScaler``):

* after ``backward()`` the gradients are divided by the scale; if any is infinite or NaN the step
  **overflowed**: the optimizer step is skipped (parameters unchanged, gradients cleared) and, after
  ``hysteresis`` overflows, the scale is multiplied by ``backoff_factor`` (not below ``min_scale``);
* after ``growth_interval`` consecutive good steps the scale is multiplied by ``growth_factor``
  (not above ``max_scale``).

Usage::

    scaler = DynamicLossScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                 # optional: before gradient clipping
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    stepped = scaler.step(optimizer)           # False when the step overflowed and was skipped

Works on any device, with any ``torch.optim.Optimizer``; overflow detection costs one host sync per step.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from .._validate import check_positive_int
from ..errors import EngineError, InputError

__all__ = ["DynamicLossScaler", "has_overflow"]


class DynamicLossScaler:
    """Dynamic loss scale with overflow detection and step skipping (see the module docstring)."""

    def __init__(self, initial_scale: float = 2.0 ** 16, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 400, hysteresis: int = 1,
                 min_scale: float = 1.0, max_scale: float = 2.0 ** 32):
        for label, value in (("initial_scale", initial_scale), ("min_scale", min_scale), ("max_scale", max_scale)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise InputError(f"{label} must be a finite positive number, got {value!r}")
        if not growth_factor > 1:
            raise InputError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0 < backoff_factor < 1:
            raise InputError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        check_positive_int(growth_interval, "growth_interval", InputError)
        check_positive_int(hysteresis, "hysteresis", InputError)
        if min_scale > max_scale:
            raise InputError(f"min_scale {min_scale} exceeds max_scale {max_scale}")
        self.loss_scale = float(min(max(initial_scale, min_scale), max_scale))
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.good_steps = 0          # consecutive non-overflow steps since the last change of scale
        self.overflows_left = hysteresis
        self.steps = 0
        self.skipped_steps = 0
        self._unscaled: dict[int, bool] = {}   # id(optimizer) -> found overflow, for this step

    @classmethod
    def from_policy(cls, policy) -> "DynamicLossScaler":
        """From a :class:`moealign.precision.policy.PrecisionPolicy` (its ``loss_scaling``)."""
        ls = policy.loss_scaling
        if ls is None:
            raise InputError(f"policy {policy.name!r} does not use loss scaling")
        return cls(ls.initial_scale, growth_factor=ls.growth_factor, backoff_factor=ls.backoff_factor,
                   growth_interval=ls.growth_interval, hysteresis=ls.hysteresis, min_scale=ls.min_scale)

    # ---------------------------------------------------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (computed in float32, so the scaled loss itself cannot overflow fp16)."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InputError("scale() takes the scalar loss tensor")
        return loss.float() * self.loss_scale

    @staticmethod
    def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide ``optimizer``'s gradients by the scale (in place); return True if any is inf/NaN.
        Called by :meth:`step` when not called before it (once per step)."""
        key = id(optimizer)
        if key in self._unscaled:
            raise EngineError("unscale_() was already called for this optimizer since the last step()")
        grads = self._grads(optimizer)
        found = has_overflow(grads)
        if not found and grads:
            torch._foreach_mul_(grads, 1.0 / self.loss_scale)
            # a finite fp16 gradient stays finite when divided by a scale >= 1; below 1 re-check
            if self.loss_scale < 1.0:
                found = has_overflow(grads)
        self._unscaled[key] = found
        return found

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (if not done), then step ``optimizer`` unless the gradients overflowed; update the
        scale. Returns True when the optimizer stepped. On overflow the gradients are cleared."""
        key = id(optimizer)
        if key not in self._unscaled:
            self.unscale_(optimizer)
        found = self._unscaled.pop(key)
        self.steps += 1
        if found:
            optimizer.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            self._on_overflow()
            return False
        optimizer.step()
        self._on_good_step()
        return True

    def update(self, found_overflow: bool) -> None:
        """Advance the scale by one step's outcome (for loops that step the optimizer themselves)."""
        self.steps += 1
        if found_overflow:
            self.skipped_steps += 1
            self._on_overflow()
        else:
            self._on_good_step()

    def _on_overflow(self) -> None:
        self.good_steps = 0
        self.overflows_left -= 1
        if self.overflows_left <= 0:
            self.loss_scale = max(self.loss_scale * self.backoff_factor, self.min_scale)
            self.overflows_left = self.hysteresis

    def _on_good_step(self) -> None:
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.loss_scale = min(self.loss_scale * self.growth_factor, self.max_scale)
            self.good_steps = 0
            self.overflows_left = self.hysteresis

    # ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self.loss_scale, "good_steps": self.good_steps, "overflows_left": self.overflows_left,
                "steps": self.steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"loss_scale", "good_steps", "overflows_left", "steps", "skipped_steps"} - set(state)
        if missing:
            raise InputError(f"loss scaler state misses {sorted(missing)}")
        self.loss_scale = float(state["loss_scale"])
        self.good_steps = int(state["good_steps"])
        self.overflows_left = int(state["overflows_left"])
        self.steps = int(state["steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.loss_scale:g}, good_steps={self.good_steps}, "
                f"steps={self.steps}, skipped={self.skipped_steps})")


def has_overflow(tensors: Iterable[torch.Tensor]) -> bool:
    """True if any tensor holds inf or NaN (one host sync for all of them)."""
    tensors = list(tensors)
    if not tensors:
        return False
    flags = torch.stack([torch.isfinite(t).all() for t in tensors])
    return not bool(flags.all())
