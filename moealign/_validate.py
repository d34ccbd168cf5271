"""Small argument and tensor checks, dtype sets and the compute dtype shared by the pure packages
(``precision``, ``routing_replay``, ``correction``); no engine imports. The error class is the caller's."""

from __future__ import annotations

import torch

__all__ = ["FLOAT_DTYPES", "LOG_PROB_TOLERANCE", "POLICY_DTYPES", "check_binary_mask", "check_devices",
           "check_float_matrix", "check_log_prob_max", "check_positive_int", "check_token_ids", "compute_dtype"]

#: Floating dtypes the batch-invariant kernels and attention compute in.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Dtypes a precision policy may name (no float64: no engine computes a model in it), in the order error
#: messages list them.
POLICY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_positive_int(value: object, name: str, error_cls: type[Exception], *, noun: str = "int") -> int:
    """``value`` if it is an int >= 1 (bools are refused), else ``error_cls("<name> must be a positive <noun>,
    got <value!r>")``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error_cls(f"{name} must be a positive {noun}, got {value!r}")
    return value


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 when any of ``tensors`` is float64, else float32: the dtype log-probs and ratios are computed in
    (half-precision inputs are upcast, float64 inputs keep their precision)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_token_ids(x, name: str, vocab_size: int, error_cls: type[Exception]) -> torch.Tensor:
    """``x`` if it is an integer (not bool) tensor of token ids in ``[0, vocab_size)``, else ``error_cls`` naming
    ``name``, the first bad position and its value (one reduction and one host sync on valid input)."""
    if not isinstance(x, torch.Tensor):
        raise error_cls(f"{name} must be a torch.Tensor of token ids, got {type(x).__name__}")
    if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise error_cls(f"{name} must hold integer token ids, got dtype {x.dtype}")
    bad = (x < 0) | (x >= vocab_size)
    if x.numel() and bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise error_cls(f"{name}{list(where)} = {int(x[where])} is not a token id in [0, vocab_size={vocab_size})")
    return x


def check_binary_mask(x, name: str, error_cls: type[Exception]) -> torch.Tensor:
    """``x`` if it is a tensor of 0/1 values (any real dtype; bool passes as is), else ``error_cls`` naming ``name``,
    the first other value and its position (a fractional or weighted mask is not a padding mask)."""
    if not isinstance(x, torch.Tensor):
        raise error_cls(f"{name} must be a torch.Tensor of 0/1 values, got {type(x).__name__}")
    if x.dtype == torch.bool:
        return x
    if x.is_complex():
        raise error_cls(f"{name} must hold 0/1 values, got dtype {x.dtype}")
    bad = (x != 0) & (x != 1)
    if x.numel() and bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise error_cls(f"{name} must hold only 0 and 1 (1 = token, 0 = padding), got {x[where].item()!r} at "
                        f"{list(where)}")
    return x


def check_float_matrix(x, name: str, error_cls: type[Exception], *, shape: str,
                       empty: str | None = None) -> torch.Tensor:
    """``x`` if it is a floating ``[rows, cols]`` tensor with ``cols >= 1``, else ``error_cls`` naming the problem.

    ``shape`` is how the message spells the expected shape (``"[N, V] with V >= 1"``). ``empty``: the message
    for zero columns (``"<name> <empty> (shape ...)"``, checked after the dtype); None folds that case into the
    shape message.
    """
    if not isinstance(x, torch.Tensor):
        raise error_cls(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or (empty is None and x.shape[1] == 0):
        raise error_cls(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise error_cls(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if x.shape[1] == 0:
        raise error_cls(f"{name} {empty} (shape {tuple(x.shape)})")
    return x


#: Largest value accepted as a log-probability. A float32 ``x - logsumexp(x)`` can come out a few ulps of the
#: logsumexp above 0 for a near-certain token (ulp(1000) = 6e-5 in float32); probabilities (mostly far above
#: 1e-4) and negative log-likelihoods (positive) are well past it.
LOG_PROB_TOLERANCE = 1e-4


def check_offsets(values, name: str, error_cls: type[Exception]) -> torch.Tensor:
    """``values`` (a tensor or a sequence) as a 1-D int64 CPU tensor of at least two non-decreasing offsets
    starting at 0 (``cu_seqlens``-style). Fractional, boolean or non-numeric values are refused, never
    truncated."""
    try:
        t = torch.as_tensor(values).detach().cpu()
    except (TypeError, ValueError, RuntimeError) as exc:
        raise error_cls(f"{name} must be a 1-D sequence of integer offsets, got {values!r} ({exc})") from None
    if t.dtype == torch.bool or t.is_complex():
        raise error_cls(f"{name} must hold integer offsets, got {t.dtype}")
    if t.is_floating_point():
        if not bool(torch.isfinite(t).all()) or not bool((t == t.round()).all()):
            raise error_cls(f"{name} must hold integer offsets, got {t.tolist()}")
    t = t.to(torch.int64)
    if t.dim() != 1 or t.numel() < 2 or int(t[0]) != 0 or bool((t[1:] < t[:-1]).any()):
        raise error_cls(f"{name} must be a non-decreasing 1-D tensor starting at 0, got {t.tolist()}")
    return t


def check_log_prob_max(max_value: float, name: str, error_cls: type[Exception], *, where: str = "") -> None:
    """Raise ``error_cls`` naming ``name`` when ``max_value`` (the largest entry of a log-prob tensor at the
    positions that count, already on the host) is above :data:`LOG_PROB_TOLERANCE`: the tensor holds
    probabilities or negative log-likelihoods, not log-probabilities. NaN passes (a finiteness check reports it)."""
    if max_value > LOG_PROB_TOLERANCE:
        raise error_cls(f"{name} has positive entries{where} (max {max_value:.6g}): pass log-probabilities "
                        f"(<= 0), not probabilities or negative log-likelihoods")


def check_devices(tensors, error_cls: type[Exception]) -> torch.device:
    """The common device of ``tensors`` (a mapping name -> tensor; None values skipped), else ``error_cls``
    naming each tensor's device. The meta device (shapes without data) is refused: nothing can be computed
    from it."""
    items = [(name, t) for name, t in tensors.items() if t is not None]
    devices = {t.device for _, t in items}
    if len(devices) > 1:
        listed = ", ".join(f"{name} on {t.device}" for name, t in items)
        raise error_cls(f"tensors on different devices: {listed}")
    for name, t in items:
        if t.device.type == "meta":
            raise error_cls(f"{name} is on the meta device (a shape without data): move the inputs to a real "
                            f"device (cpu or cuda) first")
    return items[0][1].device if items else torch.device("cpu")


def short_repr(value, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters (with ``...``): a bad value named in an error without printing
    all of it."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
