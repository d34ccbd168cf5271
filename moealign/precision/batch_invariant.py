"""Batch-invariant matmul, log_softmax, mean and RMSNorm, and a mode that swaps them into aten.

*Batch-invariant* means: the value computed for one row (one token) does not depend on how many other rows
were computed with it, nor on their values. Stock kernels are not: a CPU matmul of one row takes a GEMV
path while a batch takes GEMM (different K order), and a CPU sum/mean over a long dim splits the reduction
across threads only when there are few rows. In RL the rollout engine batches tokens differently from the
trainer, so such kernels make the two disagree on bit level even with identical weights.

How each op gets a reduction order fixed per row (on any device, pure torch):

* **matmul** (:func:`bi_matmul`, :func:`bi_linear`): rows are computed in tiles of a *fixed* size
  (``row_tile``, default :data:`DEFAULT_ROW_TILE`); the last tile is zero-padded. Every GEMM call the
  library sees therefore has the same shape ``[row_tile, K] x [K, N]`` whatever the batch size, so it picks
  the same kernel, blocking and K order, and a row's result does not depend on its tile mates. Tiles
  are passed 64-byte aligned (some BLAS choose code paths by alignment). The weight (``b``) is used as
  given: its layout is part of the computation, the same for every batch size.
* **sum-type reductions** (:func:`bi_mean`, :func:`bi_log_softmax`, :func:`bi_rms_norm`): a fixed
  pairwise tree built only from element-wise adds (:func:`fixed_tree_sum`). Element-wise adds are exact
  IEEE operations whatever the threading or vectorisation, so the result depends only on the row's
  values and length. Zero tail padding leaves the tree's result unchanged (the tree already pads to a
  power of two), so a row padded to a longer length sums the same. Half-precision inputs accumulate in
  fp32, fp64 in fp64. ``max`` needs no care (it is exact in any order).

On CUDA the direct functions use the Triton kernels of :mod:`moealign.precision.batch_invariant_triton`
when triton is installed (``backend="auto"``), else the torch implementations above (cuBLAS on fixed tiles).
The two backends are each batch-invariant but do not agree with each other bitwise: the rollout engine and
the trainer must use the same one.

:func:`enable_batch_invariant` (a :class:`~moealign.handle.PatchHandle`, scope ``"process"``) and the context
manager :func:`batch_invariant_mode` register these implementations as the CPU (and CUDA, when present) kernels
of ``aten::mm``, ``aten::addmm``, ``aten::bmm``, ``aten::_grouped_mm``, ``aten::_log_softmax`` and
``aten::mean.dim`` through ``torch.library`` (as thinking-machines-lab/batch_invariant_ops does), so
unmodified model code (``nn.Linear``, ``torch.log_softmax``, transformers' RMSNorm built on ``mean``) becomes
batch-invariant. Autograd formulas are untouched (the override sits below the autograd key). Calls with
``out=`` keep the stock kernels, and so do dtypes the override does not cover (integers, complex).
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
import warnings
from collections.abc import Iterator, Sequence

import torch

from .._validate import FLOAT_DTYPES as _FLOAT_DTYPES
from .._validate import check_positive_int
from ..errors import BatchInvariantError, InputTypeError
from ..handle import PatchHandle

__all__ = [
    "DEFAULT_ROW_TILE",
    "kept_first",
    "BatchInvariantError",
    "batch_invariant_mode",
    "bi_linear",
    "bi_log_softmax",
    "bi_matmul",
    "bi_mean",
    "bi_rms_norm",
    "enable_batch_invariant",
    "fixed_tree_sum",
    "is_batch_invariant_mode_enabled",
    "triton_available",
]

#: Rows per GEMM call in the torch matmul path. Any fixed value is batch-invariant; the rollout engine and
#: the trainer must use the same one (different tiles may pick different BLAS kernels).
DEFAULT_ROW_TILE = 32

_ALIGN_BYTES = 64
_BACKENDS = ("auto", "torch", "triton")


# --------------------------------------------------------------------------------------------------------
# helpers


def _check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _check_float(x: torch.Tensor, name: str) -> None:
    if x.dtype not in _FLOAT_DTYPES:
        raise BatchInvariantError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for half types and fp32, fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_row_tile(row_tile: int | None) -> int:
    if row_tile is None:
        return DEFAULT_ROW_TILE
    return check_positive_int(row_tile, "row_tile", BatchInvariantError)


def _check_backend(backend: str) -> str:
    if backend not in _BACKENDS:
        raise BatchInvariantError(f"unknown backend {backend!r}; expected one of {_BACKENDS}")
    return backend


def _norm_dim(dim: int, ndim: int, name: str = "dim") -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise BatchInvariantError(f"{name} must be an int, got {dim!r}")
    rank = max(ndim, 1)
    if not -rank <= dim < rank:
        raise BatchInvariantError(f"{name}={dim} is out of range for a tensor with {ndim} dims")
    return dim % rank


def triton_available() -> bool:
    """True when CUDA is usable and triton is installed (the Triton kernels can run)."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _triton_kernels():
    """The Triton module, imported lazily (it imports triton at import time)."""
    from . import batch_invariant_triton

    return batch_invariant_triton


def _use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if not x.is_cuda:
            raise BatchInvariantError(f"backend='triton' needs CUDA tensors, got a tensor on {x.device}")
        if not triton_available():
            raise BatchInvariantError("backend='triton' requested but triton is not installed")
        return True
    return x.is_cuda and triton_available()


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % _ALIGN_BYTES == 0


def _fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous copy (a fresh allocation, hence allocator-aligned)."""
    return t.clone(memory_format=torch.contiguous_format)


class _FastForward(torch.autograd.Function):
    """Forward value from a batch-invariant kernel, gradient from a plain differentiable reference.

    The kernels write through ``out=`` or Triton, which autograd cannot see; the reference computes the
    same math with differentiable torch ops. Backward needs no batch invariance (the on-policy log-prob
    is a forward quantity), so its numerics are the reference's.
    """

    @staticmethod
    def forward(ctx, fast_fn, reference_fn, *tensors):
        ctx.reference_fn = reference_fn
        ctx.save_for_backward(*[t if t is not None else None for t in tensors])
        return fast_fn(*tensors)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        saved = ctx.saved_tensors
        inputs = [None if t is None else t.detach().requires_grad_(ctx.needs_input_grad[i + 2])
                  for i, t in enumerate(saved)]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        with torch.enable_grad():
            out = ctx.reference_fn(*inputs)
            grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True))
        return (None, None, *[next(grads) if t is not None and t.requires_grad else None for t in inputs])


def _differentiable(fast_fn, reference_fn, *tensors):
    """``fast_fn(*tensors)``, made differentiable through ``reference_fn`` when a gradient is needed.

    The value is ``fast_fn``'s either way, so grad mode never changes the forward bits.
    """
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _FastForward.apply(fast_fn, reference_fn, *tensors)
    return fast_fn(*tensors)


# --------------------------------------------------------------------------------------------------------
# matmul: fixed row tiles


def _row_tiled(a: torch.Tensor, n_cols: int, row_tile: int, gemm) -> torch.Tensor:
    """Compute ``out[M, n_cols]`` by calling ``gemm(a_tile, out_tile)`` on fixed ``[row_tile, K]`` tiles.

    ``gemm`` writes the product for its (contiguous, aligned) tile into ``out_tile``. The last partial tile
    is zero-padded to ``row_tile`` rows, so every call has the same shape.
    """
    m, k = a.shape
    out = torch.empty((m, n_cols), dtype=a.dtype, device=a.device)
    if not _aligned(a):
        a = _fresh_copy(a)
    full = (m // row_tile) * row_tile
    for start in range(0, full, row_tile):
        a_tile = a[start:start + row_tile]
        if not _aligned(a_tile):
            a_tile = _fresh_copy(a_tile)
        o_tile = out[start:start + row_tile]
        if _aligned(o_tile):
            gemm(a_tile, o_tile)
        else:
            scratch = torch.empty((row_tile, n_cols), dtype=a.dtype, device=a.device)
            gemm(a_tile, scratch)
            o_tile.copy_(scratch)
    if full < m:
        a_tile = a.new_zeros((row_tile, k))
        a_tile[: m - full] = a[full:]
        scratch = torch.empty((row_tile, n_cols), dtype=a.dtype, device=a.device)
        gemm(a_tile, scratch)
        out[full:] = scratch[: m - full]
    return out


def _mm_plain(a: torch.Tensor, b: torch.Tensor, row_tile: int) -> torch.Tensor:
    """Batch-invariant ``a @ b`` for 2-D float tensors on the torch path (stock ``mm.out`` per tile).

    ``aten::mm.out`` is a separate operator from ``aten::mm``, so this does not re-enter the override.
    """
    return _row_tiled(a, b.shape[1], row_tile, lambda a_t, o_t: torch.ops.aten.mm.out(a_t, b, out=o_t))


def _bias_is_row_broadcast(bias: torch.Tensor, n: int) -> bool:
    """True when ``bias`` is the same for every row (shape ``[N]``, ``[1, N]``, scalar-like)."""
    if bias.dim() == 0:
        return True
    if bias.dim() == 1:
        return bias.shape[0] in (1, n)
    return bias.dim() == 2 and bias.shape[0] == 1 and bias.shape[1] in (1, n)


def _addmm_plain(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta, alpha, row_tile: int) -> torch.Tensor:
    """Batch-invariant ``beta * bias + alpha * (a @ b)``.

    A row-broadcast bias (the ``nn.Linear`` case) goes into the stock ``addmm.out`` of every tile, so the
    numerics are the stock ones (one rounding at the end); a full ``[M, N]`` bias is added row-wise after
    a tiled ``mm``, in the accumulation dtype.
    """
    m, n = a.shape[0], b.shape[1]
    if _bias_is_row_broadcast(bias, n):
        tile_bias = bias.reshape(1, -1) if bias.dim() else bias
        tile_bias = tile_bias.expand(row_tile, n)
        return _row_tiled(a, n, row_tile, lambda a_t, o_t: torch.ops.aten.addmm.out(
            tile_bias, a_t, b, beta=beta, alpha=alpha, out=o_t))
    prod = _mm_plain(a, b, row_tile)
    acc = _acc_dtype(prod.dtype)
    res = prod.to(acc)
    if alpha != 1:
        res = res * alpha
    if beta != 0:
        res = res + bias.to(acc).expand(m, n) * beta
    return res.to(prod.dtype)


def _mm_dispatch(a: torch.Tensor, b: torch.Tensor, row_tile: int, backend: str) -> torch.Tensor:
    if _use_triton(a, backend) and a.dtype != torch.float64:
        return _triton_kernels().matmul(a, b)
    return _mm_plain(a, b, row_tile)


def _addmm_dispatch(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta, alpha, row_tile: int,
                    backend: str) -> torch.Tensor:
    if not (_use_triton(a, backend) and a.dtype != torch.float64):
        return _addmm_plain(bias, a, b, beta, alpha, row_tile)
    kernels = _triton_kernels()
    if beta == 1 and alpha == 1 and bias.dim() == 1 and bias.shape[0] == b.shape[1]:
        return kernels.matmul(a, b, bias=bias)  # bias added to the fp32 accumulator
    acc = _acc_dtype(a.dtype)
    res = kernels.matmul(a, b).to(acc) * alpha
    if beta != 0:
        res = res + bias.to(acc).expand_as(res) * beta
    return res.to(a.dtype)


def _check_mm_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    _check_float(a, "a")
    if b.dtype != a.dtype:
        raise BatchInvariantError(f"a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if b.device != a.device:
        raise BatchInvariantError(f"a and b must be on one device, got {a.device} and {b.device}")


def bi_matmul(a: torch.Tensor, b: torch.Tensor, *, row_tile: int | None = None,
              backend: str = "auto") -> torch.Tensor:
    """Batch-invariant matrix product.

    Shapes: ``a [..., K] @ b [K, N] -> [..., N]`` (all leading dims of ``a`` are rows; a 1-D ``a`` is one
    row), or batched ``a [B, M, K] @ b [B, K, N] -> [B, M, N]``. Row ``i`` of the result is bitwise the
    same whatever the other rows are and however many there are.
    """
    _check_tensor(a, "a")
    _check_tensor(b, "b")
    row_tile = _check_row_tile(row_tile)
    backend = _check_backend(backend)
    _check_mm_pair(a, b)
    if b.dim() == 3:
        if a.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
            raise BatchInvariantError(f"batched matmul needs a [B, M, K] and b [B, K, N], got {tuple(a.shape)} "
                                      f"and {tuple(b.shape)}")
        return _differentiable(lambda a_, b_: _bmm_plain(a_, b_, row_tile, backend), torch.bmm, a, b)
    if b.dim() != 2 or a.dim() < 1:
        raise BatchInvariantError(f"bi_matmul needs a [..., K] with b [K, N] (or 3-D a and b), got "
                                  f"{tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] != b.shape[0]:
        raise BatchInvariantError(f"inner dims differ: a has K={a.shape[-1]}, b has K={b.shape[0]}")
    rows = a.reshape(-1, a.shape[-1])
    if rows.shape[0] == 0 or b.shape[1] == 0 or b.shape[0] == 0:
        out = torch.mm(rows, b)
    else:
        out = _differentiable(lambda a_, b_: _mm_dispatch(a_, b_, row_tile, backend), torch.mm, rows, b)
    return out.reshape(*a.shape[:-1], b.shape[1])


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              row_tile: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Batch-invariant ``F.linear``: ``x [..., K]``, ``weight [N, K]``, ``bias [N]`` -> ``[..., N]``.

    Same numerics as ``F.linear`` under :func:`batch_invariant_mode` (which reaches ``addmm`` / ``mm``).
    """
    _check_tensor(x, "x")
    _check_tensor(weight, "weight")
    if weight.dim() != 2:
        raise BatchInvariantError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise BatchInvariantError(f"x [..., K] must end in K={weight.shape[1]}, got shape {tuple(x.shape)}")
    row_tile = _check_row_tile(row_tile)
    backend = _check_backend(backend)
    _check_mm_pair(x, weight)
    if bias is None:
        return bi_matmul(x, weight.t(), row_tile=row_tile, backend=backend)
    _check_tensor(bias, "bias")
    if bias.shape != (weight.shape[0],) or bias.dtype != x.dtype:
        raise BatchInvariantError(f"bias must be [{weight.shape[0]}] of dtype {x.dtype}, got "
                                  f"{tuple(bias.shape)} {bias.dtype}")
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))
    out = _differentiable(lambda r_, w_, b_: _addmm_dispatch(b_, r_, w_.t(), 1, 1, row_tile, backend),
                          torch.nn.functional.linear, rows, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _bmm_plain(a: torch.Tensor, b: torch.Tensor, row_tile: int, backend: str) -> torch.Tensor:
    """Batched product, one fixed-tile matmul per batch entry (independent of B and M)."""
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
    if out.numel() == 0 or a.shape[2] == 0:
        return torch.ops.aten.bmm.out(a, b, out=out)
    for i in range(a.shape[0]):
        out[i] = _mm_dispatch(a[i], b[i], row_tile, backend)
    return out


# --------------------------------------------------------------------------------------------------------
# reductions: fixed pairwise tree of element-wise adds


def fixed_tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` with a pairwise tree whose shape depends only on ``x.shape[dim]``.

    The length ``L`` is (virtually) zero-padded to the next power of two ``P``; level by level the second
    half is added onto the first (``y[i] = y[i] + y[i + P/2]``). Only element-wise adds are used, so each
    output is bitwise independent of the other rows, of the thread count and of vectorisation. Summing a
    row padded with trailing zeros gives the same result. Computes in ``x``'s dtype (upcast before
    calling for fp32 accumulation).
    """
    _check_tensor(x, "x")
    d = _norm_dim(dim, x.dim())
    if x.dim() == 0:
        return x.clone()
    y = x.movedim(d, -1)
    length = y.shape[-1]
    if length == 0:
        return y.new_zeros(y.shape[:-1])
    if length > 1:
        half = 1 << ((length - 1).bit_length() - 1)  # P / 2: the largest power of two below `length`
        first = _fresh_copy(y[..., :half])
        first[..., : length - half] += y[..., half:]
        y = first
        while half > 1:
            half //= 2
            y = y[..., :half] + y[..., half:]
    return y[..., 0].clone()


def _reduced_dims(dim: int | Sequence[int] | None, ndim: int) -> list[int]:
    if dim is None:
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) and not isinstance(dim, bool) else list(dim)
    if not dims:
        return list(range(ndim))
    out = [_norm_dim(d, ndim) for d in dims]
    if len(set(out)) != len(out):
        raise BatchInvariantError(f"dim {dim!r} names a dimension twice")
    return sorted(out)


def _bi_mean_plain(x: torch.Tensor, dims: list[int], keepdim: bool, out_dtype: torch.dtype) -> torch.Tensor:
    acc = x.to(_acc_dtype(out_dtype))
    if x.dim() == 0:
        return acc.to(out_dtype)
    kept = [d for d in range(x.dim()) if d not in dims]
    count = 1
    for d in dims:
        count *= x.shape[d]
    flat = acc.permute(*kept, *dims).reshape(*[x.shape[d] for d in kept], count)
    mean = fixed_tree_sum(flat, -1) / count
    if keepdim:
        mean = mean.reshape([1 if d in dims else x.shape[d] for d in range(x.dim())])
    return mean.to(out_dtype)


def bi_mean(x: torch.Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False, *,
            dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """Batch-invariant ``torch.mean``: each output element is a fixed tree sum divided by the count.

    ``dim=None`` (or ``[]``) reduces all dims. Half inputs accumulate in fp32; the output has ``x``'s
    dtype (or ``dtype``, which ``x`` is first cast to, as ``torch.mean`` does).
    """
    _check_tensor(x, "x")
    backend = _check_backend(backend)
    if dtype is not None:
        if dtype not in _FLOAT_DTYPES:
            raise BatchInvariantError(f"dtype must be a float dtype, got {dtype}")
        x = x.to(dtype)
    _check_float(x, "x")
    dims = _reduced_dims(dim, x.dim())
    if _use_triton(x, backend) and x.dtype != torch.float64 and x.dim() > 0:
        return _differentiable(lambda x_: _triton_kernels().mean(x_, dims, keepdim),
                               lambda x_: _bi_mean_plain(x_, dims, keepdim, x.dtype), x)
    return _bi_mean_plain(x, dims, keepdim, x.dtype)


def bi_log_softmax(x: torch.Tensor, dim: int = -1, *, dtype: torch.dtype | None = None,
                   backend: str = "auto") -> torch.Tensor:
    """Batch-invariant ``torch.log_softmax``: ``x - max - log(fixed_tree_sum(exp(x - max)))``.

    The max is exact in any order; the sum is :func:`fixed_tree_sum` in fp32 (fp64 for fp64). The output
    has ``x``'s dtype, or ``dtype`` (e.g. fp32 log-probs from bf16 logits).
    """
    _check_tensor(x, "x")
    backend = _check_backend(backend)
    _check_float(x, "x")
    out_dtype = x.dtype if dtype is None else dtype
    if out_dtype not in _FLOAT_DTYPES:
        raise BatchInvariantError(f"dtype must be a float dtype, got {dtype}")
    d = _norm_dim(dim, x.dim())
    if x.dim() == 0:
        return torch.zeros_like(x, dtype=out_dtype)
    if _use_triton(x, backend) and x.dtype != torch.float64 and out_dtype != torch.float64:
        return _differentiable(lambda x_: _triton_kernels().log_softmax(x_, d, out_dtype),
                               lambda x_: _log_softmax_plain(x_, d, out_dtype), x)
    return _log_softmax_plain(x, d, out_dtype)


def _log_softmax_plain(x: torch.Tensor, d: int, out_dtype: torch.dtype) -> torch.Tensor:
    acc = x.to(_acc_dtype(out_dtype if out_dtype == torch.float64 else x.dtype))
    shifted = acc - torch.amax(acc, dim=d, keepdim=True)
    log_norm = torch.log(fixed_tree_sum(torch.exp(shifted), d)).unsqueeze(d)
    return (shifted - log_norm).to(out_dtype)


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                backend: str = "auto") -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dim, in transformers' (Llama / Qwen) convention.

    ``y = (x32 * rsqrt(mean(x32 ** 2) + eps)).to(x.dtype) * weight`` with ``x32`` the fp32 (fp64 for
    fp64) copy of ``x`` and the mean a :func:`fixed_tree_sum`. ``weight`` is ``[H]`` (or ``None``).
    With :func:`batch_invariant_mode` on, transformers' own RMSNorm module gives the same bits.
    """
    _check_tensor(x, "x")
    backend = _check_backend(backend)
    _check_float(x, "x")
    if x.dim() == 0:
        raise BatchInvariantError("bi_rms_norm needs at least one dim (the normalised last dim)")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise BatchInvariantError(f"eps must be a non-negative number, got {eps!r}")
    if weight is not None:
        _check_tensor(weight, "weight")
        if weight.shape != (x.shape[-1],):
            raise BatchInvariantError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
        if weight.device != x.device:
            raise BatchInvariantError(f"weight is on {weight.device}, x on {x.device}")
    if _use_triton(x, backend) and x.dtype != torch.float64:
        return _differentiable(lambda x_, w_: _triton_kernels().rms_norm(x_, w_, float(eps)),
                               lambda x_, w_: _rms_norm_plain(x_, w_, eps), x, weight)
    return _rms_norm_plain(x, weight, eps)


def _rms_norm_plain(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    acc = x.to(_acc_dtype(x.dtype))
    variance = fixed_tree_sum(acc.pow(2), -1).unsqueeze(-1) / x.shape[-1]
    y = (acc * torch.rsqrt(variance + eps)).to(x.dtype)
    return y if weight is None else weight * y


# --------------------------------------------------------------------------------------------------------
# aten overrides (installed by batch_invariant_mode)


def _aten_mm(a, b):
    if a.dtype in _FLOAT_DTYPES and b.dtype == a.dtype and a.numel() and b.numel():
        return _mm_dispatch(a, b, DEFAULT_ROW_TILE, "auto")
    return torch.ops.aten.mm.out(a, b, out=a.new_empty((a.shape[0], b.shape[1])))


def _aten_addmm(bias, a, b, *, beta=1, alpha=1):
    if a.dtype in _FLOAT_DTYPES and b.dtype == a.dtype and bias.dtype == a.dtype and a.numel() and b.numel():
        return _addmm_dispatch(bias, a, b, beta, alpha, DEFAULT_ROW_TILE, "auto")
    out = a.new_empty((a.shape[0], b.shape[1]))
    return torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)


def _aten_bmm(a, b):
    if a.dtype in _FLOAT_DTYPES and b.dtype == a.dtype and a.numel() and b.numel():
        return _bmm_plain(a, b, DEFAULT_ROW_TILE, "auto")
    return torch.ops.aten.bmm.out(a, b, out=a.new_empty((a.shape[0], a.shape[1], b.shape[2])))


def _aten_log_softmax(x, dim, half_to_float):
    out_dtype = torch.float32 if half_to_float else x.dtype
    if x.dtype in _FLOAT_DTYPES and x.dim() > 0:
        return bi_log_softmax(x, dim, dtype=out_dtype)
    out = torch.empty_like(x, dtype=out_dtype)
    return torch.ops.aten._log_softmax.out(x, dim, half_to_float, out=out)


def _aten_mean_dim(x, dim, keepdim=False, *, dtype=None):
    src_dtype = dtype if dtype is not None else x.dtype
    if src_dtype in _FLOAT_DTYPES and x.dim() > 0 and not x.is_complex():
        return bi_mean(x, dim, keepdim, dtype=dtype)
    # Anything else (complex, 0-d, integers without dtype: the stock error) goes to the stock kernel.
    dims = _reduced_dims(dim, x.dim()) if x.dim() else []
    if keepdim:
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
    else:
        shape = [s for d, s in enumerate(x.shape) if d not in dims]
    out = x.new_empty(shape, dtype=src_dtype)
    return torch.ops.aten.mean.out(x, dim, keepdim, dtype=dtype, out=out)


def _group_bounds(offs: torch.Tensor, total: int) -> list[tuple[int, int]]:
    ends = [int(e) for e in offs.tolist()]
    bounds, start = [], 0
    for end in ends:
        if not start <= end <= total:
            raise BatchInvariantError(f"_grouped_mm offsets must be non-decreasing and <= {total}, got {ends}")
        bounds.append((start, end))
        start = end
    return bounds


def _aten_grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    """``aten::_grouped_mm`` (the MoE expert GEMM): every group is a fixed-tile matmul.

    The number of tokens routed to an expert changes with the batch, so a stock grouped GEMM that picks
    its kernel from the group size is not batch-invariant; here each group's rows go through the same
    fixed row tiles as ``mm``. Layouts: ``[T, K] x [G, K, N]`` with ``offs`` over rows (the forward),
    ``[G, M, K] x [G, K, N]`` without ``offs``, and the two layouts autograd uses for gradients
    (``[M, T] x [T, N]`` grouped over ``T``; ``[G, M, K] x [K, N]`` grouped over ``N``).
    """
    dtype = a.dtype
    if dtype not in _FLOAT_DTYPES or b.dtype != dtype:
        raise BatchInvariantError(f"_grouped_mm under batch_invariant_mode needs matching float dtypes, got "
                                  f"{a.dtype} and {b.dtype}")

    def mm(x, y):
        if x.shape[0] == 0 or y.shape[1] == 0 or x.shape[1] == 0:
            return torch.zeros((x.shape[0], y.shape[1]), dtype=dtype, device=x.device)
        return _mm_dispatch(x, y, DEFAULT_ROW_TILE, "auto")

    if a.dim() == 2 and b.dim() == 3:
        if offs is None:
            raise BatchInvariantError("_grouped_mm of [T, K] x [G, K, N] needs offs")
        out = torch.zeros((a.shape[0], b.shape[2]), dtype=dtype, device=a.device)
        for g, (s, e) in enumerate(_group_bounds(offs, a.shape[0])):
            if e > s:
                out[s:e] = mm(a[s:e], b[g])
                if bias is not None:
                    out[s:e] += bias[g]
    elif a.dim() == 3 and b.dim() == 3 and offs is None:
        out = torch.stack([mm(a[g], b[g]) for g in range(a.shape[0])]) if a.shape[0] else \
            a.new_zeros((0, a.shape[1], b.shape[2]))
        if bias is not None:
            out = out + bias.unsqueeze(1)
    elif a.dim() == 2 and b.dim() == 2 and offs is not None:
        bounds = _group_bounds(offs, a.shape[1])
        out = torch.zeros((len(bounds), a.shape[0], b.shape[1]), dtype=dtype, device=a.device)
        for g, (s, e) in enumerate(bounds):
            if e > s:
                out[g] = mm(a[:, s:e], b[s:e])
    elif a.dim() == 3 and b.dim() == 2 and offs is not None:
        out = torch.zeros((a.shape[1], b.shape[1]), dtype=dtype, device=a.device)
        for g, (s, e) in enumerate(_group_bounds(offs, b.shape[1])):
            if e > s:
                out[:, s:e] = mm(a[g], b[:, s:e])
    else:
        raise BatchInvariantError(f"_grouped_mm layout {tuple(a.shape)} x {tuple(b.shape)} with offs="
                                  f"{'set' if offs is not None else 'None'} is not supported")
    return out if out_dtype is None else out.to(out_dtype)


_OVERRIDES = {
    "_grouped_mm": _aten_grouped_mm,
    "mm": _aten_mm,
    "addmm": _aten_addmm,
    "bmm": _aten_bmm,
    "_log_softmax": _aten_log_softmax,
    "mean.dim": _aten_mean_dim,
}


class _ModeState:
    """Process-wide registration: one ``torch.library.Library`` alive while any mode is entered."""

    lock = threading.Lock()
    depth = 0
    library: torch.library.Library | None = None


def _dispatch_keys() -> list[str]:
    keys = ["CPU"]
    if torch.cuda.is_available():
        keys.append("CUDA")
    return keys


def _install() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # torch warns (once per process) that an existing kernel is being overridden: that is the point.
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        try:
            for key in _dispatch_keys():
                for op, fn in _OVERRIDES.items():
                    lib.impl(op, fn, key)
        except Exception:
            lib._destroy()
            raise
    return lib


def is_batch_invariant_mode_enabled() -> bool:
    """True while at least one :func:`enable_batch_invariant` handle (or :func:`batch_invariant_mode`) is active."""
    return _ModeState.depth > 0


def _release() -> None:
    with _ModeState.lock:
        _ModeState.depth -= 1
        if _ModeState.depth == 0 and _ModeState.library is not None:
            _ModeState.library._destroy()
            _ModeState.library = None


def enable_batch_invariant() -> PatchHandle:
    """Swap batch-invariant kernels in for ``aten::mm/addmm/bmm/_grouped_mm/_log_softmax/mean.dim``.

    Returns a :class:`~moealign.handle.PatchHandle` (scope ``"process"``: every thread sees the kernels);
    ``undo()`` (or leaving ``with``) releases it. Handles nest: they share one ``torch.library``
    registration, removed when the last active handle is undone. The CUDA kernels are overridden too when
    CUDA is available (Triton kernels if triton is installed).
    """
    with _ModeState.lock:
        if _ModeState.depth == 0:
            _ModeState.library = _install()
        _ModeState.depth += 1
    keys = _dispatch_keys()
    handle = PatchHandle(f"batch-invariant aten kernels ({', '.join(_OVERRIDES)}) on {' and '.join(keys)}",
                         "process")
    handle.add_callback(_release, f"torch.library aten IMPL ({', '.join(keys)})")
    return handle


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[PatchHandle | None]:
    """:func:`enable_batch_invariant` while inside (undone on exit, also on an exception); yields the handle.

    Re-entrant: nested modes share one registration, removed when the outermost one exits.
    ``enabled=False`` makes it a no-op (yields None), for code that toggles the mode with a flag.
    """
    if not isinstance(enabled, bool):
        raise InputTypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if not enabled:
        yield None
        return
    with enable_batch_invariant() as handle:
        yield handle


def kept_first(keep: torch.Tensor) -> torch.Tensor:
    """For a bool mask ``[..., L]``, the indices with the True entries first, each group in index order (a stable
    sort on the device: no host sync): how batch-invariant attention compacts a row's valid keys to the front, and
    ``kept_first(routing_map)[:, :k]`` a router's chosen experts, ascending."""
    return torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices
