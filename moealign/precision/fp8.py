"""Simulated FP8 in plain torch: scaled casts to float8_e4m3fn / float8_e5m2 and fake quantisation.

No FP8 kernel is needed: values are divided by a scale, rounded by a real cast to the FP8 dtype
(round-to-nearest-even, saturated to the format's largest finite value), cast back and multiplied by the
scale. The matmul itself then runs in the compute dtype (bf16 or fp32), so what is simulated is FP8's
*rounding* of weights and inputs, the part that makes a FP8 rollout differ from a bf16 trainer.

Scaling (current scaling: the scale comes from the tensor being quantised, as in transformer-engine's
``tensorwise`` and ``blockwise`` recipes and vLLM's online FP8):

* per tensor: ``scale = amax(|x|) / fmax``, a 0-d float32 tensor;
* per block: one scale per ``(bm, bn)`` tile of the last two dimensions, shape
  ``[*lead, ceil(M / bm), ceil(N / bn)]`` (edge tiles are partial). Weights use 128x128 tiles,
  inputs 1x128 (per-token groups of 128 channels).

An all-zero tensor or tile gets scale 1 (it quantises to zeros); NaN or infinite input raises.

:func:`fake_quant_fp8_` applies this to a model in torchao's ``quantize_(model, config)`` style: the
selected modules' weights and first inputs are fake-quantised on every forward (gradients pass straight
through, so a fake-quantised model trains), and ``undo()`` restores the model exactly.
:class:`Fp8FakeQuantLinear` is the same thing as an ``nn.Linear`` subclass.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch
import torch.nn.functional as F

from ..errors import EngineError, InputError, InputTypeError
from ..handle import PatchHandle

__all__ = [
    "FP8_DTYPES",
    "fp8_max",
    "quantize_fp8",
    "dequantize_fp8",
    "fake_quantize_fp8",
    "Fp8FakeQuantConfig",
    "fp8_fake_quant_config",
    "Fp8FakeQuantLinear",
    "FakeQuantHandle",
    "fake_quant_fp8_",
]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _dtype(fmt: str) -> torch.dtype:
    try:
        return FP8_DTYPES[fmt]
    except KeyError:
        raise InputError(f"unknown FP8 format {fmt!r} (known: {sorted(FP8_DTYPES)})") from None


def fp8_max(fmt: str) -> float:
    """Largest finite value of the format (448 for e4m3, 57344 for e5m2)."""
    return float(torch.finfo(_dtype(fmt)).max)


def _check_block(x: torch.Tensor, block: Sequence[int] | None) -> tuple[int, int] | None:
    if block is None:
        return None
    if len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
        raise InputError(f"block must be two positive ints (rows, cols), got {block!r}")
    if x.dim() < 2:
        raise InputError(f"block scaling needs a tensor of at least 2 dimensions, got shape {tuple(x.shape)}")
    return int(block[0]), int(block[1])


def _tiles(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``x`` zero-padded to whole tiles and viewed as ``[*lead, Mb, bm, Nb, bn]``."""
    bm, bn = block
    M, N = x.shape[-2:]
    Mb, Nb = math.ceil(M / bm), math.ceil(N / bn)
    if Mb * bm != M or Nb * bn != N:
        x = F.pad(x, (0, Nb * bn - N, 0, Mb * bm - M))
    return x.reshape(*x.shape[:-2], Mb, bm, Nb, bn)


def _expand_scale(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """A block scale ``[*lead, Mb, Nb]`` broadcast to ``shape`` (``[*lead, M, N]``)."""
    bm, bn = block
    full = scale.repeat_interleave(bm, dim=-2).repeat_interleave(bn, dim=-1)
    return full[..., : shape[-2], : shape[-1]]


def quantize_fp8(x: torch.Tensor, fmt: Literal["e4m3", "e5m2"] = "e4m3",
                 block: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` in the FP8 dtype (shape of ``x``), ``scale`` float32 with ``x ~= q * scale``.

    ``block=None``: one scale (0-d). ``block=(bm, bn)``: scales ``[*lead, ceil(M/bm), ceil(N/bn)]``.
    """
    if not x.is_floating_point():
        raise InputTypeError(f"quantize_fp8 needs a floating tensor, got {x.dtype}")
    if x.dtype in FP8_DTYPES.values():
        raise InputTypeError(f"input is already FP8 ({x.dtype})")
    target = _dtype(fmt)
    fmax = fp8_max(fmt)
    blk = _check_block(x, block)
    xf = x.detach().float()
    if not bool(torch.isfinite(xf).all()):
        bad = "NaN" if bool(torch.isnan(xf).any()) else "infinite"
        raise InputError(f"cannot quantise to FP8: the input holds {bad} values")
    if blk is None:
        amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
        scale = amax / fmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        scaled = xf / scale
    else:
        tiles = _tiles(xf, blk)
        amax = tiles.abs().amax(dim=(-3, -1))                      # [*lead, Mb, Nb]
        scale = amax / fmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        scaled = xf / _expand_scale(scale, blk, xf.shape)
    q = scaled.clamp(-fmax, fmax).to(target)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: Sequence[int] | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (``block`` as given to :func:`quantize_fp8`)."""
    if q.dtype not in FP8_DTYPES.values():
        raise InputTypeError(f"dequantize_fp8 needs an FP8 tensor, got {q.dtype}")
    blk = _check_block(q, block)
    qf = q.float()
    if blk is None:
        if scale.dim() != 0:
            raise InputError(f"a per-tensor scale is 0-d, got shape {tuple(scale.shape)}")
        return (qf * scale).to(dtype)
    want = (*q.shape[:-2], math.ceil(q.shape[-2] / blk[0]), math.ceil(q.shape[-1] / blk[1]))
    if tuple(scale.shape) != want:
        raise InputError(f"block scales for shape {tuple(q.shape)} and block {blk} must have shape {want}, "
                         f"got {tuple(scale.shape)}")
    return (qf * _expand_scale(scale, blk, q.shape)).to(dtype)


def fake_quantize_fp8(x: torch.Tensor, fmt: Literal["e4m3", "e5m2"] = "e4m3",
                      block: Sequence[int] | None = None) -> torch.Tensor:
    """``x`` rounded through FP8 and back, in ``x``'s dtype. Differentiable as the identity
    (straight-through estimator), so a model with fake-quantised weights and inputs trains."""
    q, scale = quantize_fp8(x, fmt, block)
    xq = dequantize_fp8(q, scale, block, dtype=x.dtype)
    if x.requires_grad:
        return x + (xq - x).detach()
    return xq


# --------------------------------------------------------------------------------------------------
# model-level fake quantisation
# --------------------------------------------------------------------------------------------------

DEFAULT_SKIP = (r"(^|\.)lm_head$", r"(^|\.)(gate|router)$", r"(^|\.)output_layer$")


@dataclass(frozen=True)
class Fp8FakeQuantConfig:
    """What :func:`fake_quant_fp8_` quantises and how.

    ``scaling="tensor"``: one scale per weight tensor and per input tensor. ``"block"``: ``weight_block``
    tiles of every weight matrix (leading dimensions, e.g. experts, are batch) and ``act_block`` tiles of
    every input ``[..., tokens, channels]``. ``activations=False`` quantises weights only.

    Modules: every ``nn.Linear`` and every module holding a weight of 2 or more dimensions directly
    (e.g. stacked expert matrices), except ``nn.Embedding`` and modules whose qualified name matches one
    of ``skip`` (``re.search``; default: the LM head and the MoE routers). ``filter(name, module)``, when
    given, must also accept the module.
    """

    fmt: Literal["e4m3", "e5m2"] = "e4m3"
    scaling: Literal["tensor", "block"] = "tensor"
    weight_block: tuple[int, int] = (128, 128)
    act_block: tuple[int, int] = (1, 128)
    activations: bool = True
    skip: tuple[str, ...] = DEFAULT_SKIP
    filter: Callable[[str, torch.nn.Module], bool] | None = field(default=None, compare=False)

    def __post_init__(self):
        _dtype(self.fmt)
        if self.scaling not in ("tensor", "block"):
            raise InputError(f"scaling must be 'tensor' or 'block', got {self.scaling!r}")

    @classmethod
    def from_spec(cls, spec, **kwargs) -> "Fp8FakeQuantConfig":
        """From a policy's :class:`moealign.precision.policy.Fp8Spec`."""
        return cls(fmt=spec.fmt, scaling=spec.scaling, weight_block=tuple(spec.weight_block),
                   act_block=tuple(spec.act_block), activations=spec.activations, **kwargs)

    def quant_weight(self, w: torch.Tensor) -> torch.Tensor:
        return fake_quantize_fp8(w, self.fmt, self.weight_block if self.scaling == "block" else None)

    def quant_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaling == "block" and x.dim() == 1:
            x2 = fake_quantize_fp8(x.unsqueeze(0), self.fmt, self.act_block)
            return x2.squeeze(0)
        return fake_quantize_fp8(x, self.fmt, self.act_block if self.scaling == "block" else None)

    def selects(self, name: str, module: torch.nn.Module) -> bool:
        """Does FP8 apply to this module?"""
        if isinstance(module, torch.nn.Embedding) or any(re.search(p, name) for p in self.skip):
            return False
        if not _weight_names(module):
            return False
        return self.filter is None or bool(self.filter(name, module))


def fp8_fake_quant_config(policy, roles=None, **kwargs) -> Fp8FakeQuantConfig:
    """The fake-quant config of an FP8 policy (name or :class:`~moealign.precision.policy.PrecisionPolicy`):
    its format and scaling, sparing the modules named in ``roles`` (routers, LM head) and everything
    under them. The transformers adapter and :func:`moealign.precision.audit.audit` both use it."""
    from .policy import get_policy

    policy = get_policy(policy)
    if policy.fp8 is None:
        raise InputError(f"policy {policy.name!r} does not use FP8")
    spared = tuple(roles or ())

    def keep_wide(name: str, module: torch.nn.Module) -> bool:
        return not any(name == r or name.startswith(r + ".") for r in spared)

    return Fp8FakeQuantConfig.from_spec(policy.fp8, filter=keep_wide, **kwargs)


def _weight_names(module: torch.nn.Module) -> list[str]:
    """Directly held parameters of 2+ dimensions (the matrices a linear-like module multiplies by)."""
    return [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 2 and p.is_floating_point()]


class Fp8FakeQuantLinear(torch.nn.Linear):
    """``nn.Linear`` whose weight (and input) pass through FP8 on every forward."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 config: Fp8FakeQuantConfig = Fp8FakeQuantConfig(), device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.fp8_config = config

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, config: Fp8FakeQuantConfig = Fp8FakeQuantConfig()) -> "Fp8FakeQuantLinear":
        """A fake-quantising linear sharing ``linear``'s parameters (no copy)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.fp8_config = config
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.fp8_config
        if cfg.activations:
            x = cfg.quant_input(x)
        return F.linear(x, cfg.quant_weight(self.weight), self.bias)


class FakeQuantHandle(PatchHandle):
    """The hooks :func:`fake_quant_fp8_` installed (a :class:`~moealign.handle.PatchHandle`, scope
    ``"instance"``); ``undo()`` removes them (the model is as before). ``modules`` maps each quantised
    module's qualified name to its quantised weight names."""

    def __init__(self, config: Fp8FakeQuantConfig, target: str = "fp8 fake-quant"):
        super().__init__(target, "instance")
        self.config = config
        self.modules: dict[str, list[str]] = {}     # qualified module name -> quantised weight names

    def _quantise(self, name: str, module: torch.nn.Module, names: list[str]) -> None:
        """Mark ``module``, hook it, and register the undo of both (unmark, drop any shadowed weight)."""
        module.__dict__[FP8_MARK] = True

        def unmark() -> None:
            for n in names:
                module.__dict__.pop(n, None)
            module.__dict__.pop(FP8_MARK, None)

        self.add_callback(unmark)
        self.modules[name] = names
        self.add_hook(module.register_forward_pre_hook(_pre_hook(self.config, names)), f"{name or '<root>'}")
        self.add_hook(module.register_forward_hook(_post_hook(names), always_call=True))


FP8_MARK = "_moealign_fp8_fake_quant"


def _pre_hook(config: Fp8FakeQuantConfig, names: list[str]):
    def hook(module, args):
        # shadow the weights for this forward: an instance attribute wins over nn.Module.__getattr__,
        # so the module's own forward reads the fake-quantised tensor; the parameter stays untouched
        for n in names:
            module.__dict__[n] = config.quant_weight(module._parameters[n])
        if config.activations and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            return (config.quant_input(args[0]), *args[1:])
        return None
    return hook


def _post_hook(names: list[str]):
    def hook(module, args, output):
        for n in names:
            module.__dict__.pop(n, None)
        return None
    return hook


def fake_quant_fp8_(model: torch.nn.Module, config: Fp8FakeQuantConfig = Fp8FakeQuantConfig()) -> FakeQuantHandle:
    """Fake-quantise ``model``'s linear layers in place (hooks; parameters are not modified).

    Each selected module (see :class:`Fp8FakeQuantConfig`) gets a forward pre-hook that replaces its
    weights, for the duration of the forward, by their FP8-rounded values and its first positional
    input by its FP8-rounded value, and a forward hook (run even when the forward raises) that removes the
    replacement. Returns a :class:`FakeQuantHandle`; ``handle.undo()`` (or leaving ``with``) restores.
    """
    if not isinstance(config, Fp8FakeQuantConfig):
        raise InputTypeError(f"config must be an Fp8FakeQuantConfig, got {type(config).__name__}")
    handle = FakeQuantHandle(config)
    kinds: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, Fp8FakeQuantLinear) or not config.selects(name, module):
            continue
        names = _weight_names(module)
        if not names:
            raise InputError(f"module {name!r} was selected for FP8 but holds no weight matrix")
        if module.__dict__.get(FP8_MARK):
            handle.undo()
            raise EngineError(f"module {name!r} is already fake-quantised (undo the earlier fake_quant_fp8_ first)")
        handle._quantise(name, module, names)
        kinds.add(type(module).__name__)
    if not handle.modules:
        raise InputError("fake_quant_fp8_ found no module to quantise (check config.skip / config.filter)")
    what = f"{next(iter(kinds))} modules" if len(kinds) == 1 else f"modules ({', '.join(sorted(kinds))})"
    handle.target = f"fp8 {config.fmt} fake-quant on {len(handle.modules)} {what} of {type(model).__name__}"
    return handle
