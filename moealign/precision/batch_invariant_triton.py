"""Triton GPU kernels for the batch-invariant ops (imported lazily, only when CUDA and triton exist).

Every kernel fixes the reduction order of an output element independently of the batch size:

* :func:`matmul` - a persistent kernel (grid = number of SMs, output tiles strided over the programs, grouped
  for L2 reuse). The tile configuration (:func:`matmul_config`) is a function of ``(N, K, dtype)`` and the
  device only, never of ``M``: one compiled kernel serves every batch size (``M`` is not even specialised on),
  so every row runs the same instructions in the same order (int64 addressing past 2**31 elements per operand
  is another compilation of the same arithmetic). Each output tile loops over all of ``K`` in one
  program, ``BLOCK_K`` at a time, into an fp32 accumulator (no split-K, no stream-K): a row's K order is fixed
  by ``BLOCK_K`` alone. A bias is added to the fp32 accumulator before the single cast. For speed (issue 24,
  item 3): rows / columns past the edge are clamped instead of masked (the loads stay unmasked and
  vectorised, the store is masked), the K mask is compiled out when ``BLOCK_K`` divides ``K``, offsets are
  int32 unless the operands need int64, and ``BLOCK_N`` is chosen from ``N`` so that a small batch still
  spreads over enough SMs (``M`` small is memory-bound: the whole of ``b`` is streamed once). The persistent
  loop is *not* flattened (``tl.range(..., flatten=True)``): on an H200 (Triton 3.6, bf16, K = N = 4096 and
  N = 12288) the flattened loop cost 1.5x to 5x in every configuration tried (``tools/sweep_bi_matmul.py``).
  On Hopper (compute capability 9.x) the 16-bit dtypes use one measured configuration for every ``N``
  (:data:`HOPPER_CONFIGS`).
* :func:`log_softmax`, :func:`mean`, :func:`rms_norm` - one program per row; the row is read in
  ``BLOCK``-wide chunks into a ``BLOCK``-lane fp32 accumulator (lane ``j`` sums elements ``j, j + BLOCK,
  ...`` in order), and the lanes are combined by one ``tl.sum`` whose tree depends only on ``BLOCK``.

These kernels are batch-invariant among themselves; they do not reproduce the torch path's bits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..errors import InputError

__all__ = ["matmul", "matmul_config", "log_softmax", "mean", "rms_norm", "MATMUL_CONFIGS", "HOPPER_CONFIGS"]

#: (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) per dtype for wide outputs (``N`` of at least
#: ``64 * 128`` columns: enough tiles across ``N`` alone to fill an H100 / H200 at any ``M``).
MATMUL_CONFIGS = {
    torch.bfloat16: (128, 128, 64, 4, 8),
    torch.float16: (128, 128, 64, 4, 8),
    torch.float32: (128, 128, 32, 3, 8),
}
#: narrower outputs (e.g. K = N = 4096): 64-column tiles, twice the tiles across ``N`` for a small batch
#: (64 of them at N = 4096), more stages in flight; the same for every ``M``.
_NARROW_CONFIGS = {
    torch.bfloat16: (128, 64, 64, 5, 4),
    torch.float16: (128, 64, 64, 5, 4),
    torch.float32: (128, 64, 32, 4, 4),
}
#: compute capability 9.x (H100 / H200), 16-bit dtypes, every ``N``: the best of the sweep at m >= 1024 among the
#: configurations that stay within ~2.9x at m = 1 (H200, bf16, ``tools/sweep_bi_matmul.py``: K = N = 4096 2.86x,
#: 2.46x, 1.25x, 1.27x at m = 1, 64, 1024, 4096; N = 12288 2.54x, 1.87x, 1.25x, 1.28x; 192 KiB of shared memory
#: for the 3 stages, which Hopper has). fp32 keeps the portable configurations above.
HOPPER_CONFIGS = {
    torch.bfloat16: (128, 128, 128, 3, 8),
    torch.float16: (128, 128, 128, 3, 8),
}
_WIDE_TILES_N = 64
_GROUP_M = 8
_ROW_BLOCK = 1024
_INT32_MAX = 2 ** 31 - 1

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def matmul_config(n: int, k: int, dtype: torch.dtype,
                  device: torch.device | None = None) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)`` for an ``[M, k] @ [k, n]`` product: a function of
    ``(n, k, dtype)`` and the device's generation only (never of ``M``: a row's result cannot depend on the batch
    it is in)."""
    if dtype not in MATMUL_CONFIGS:
        raise InputError(f"matmul supports {list(MATMUL_CONFIGS)}, got {dtype}")
    if dtype in HOPPER_CONFIGS and _capability_major(device) == 9:
        return HOPPER_CONFIGS[dtype]
    wide = MATMUL_CONFIGS[dtype]
    if triton.cdiv(int(n), wide[1]) >= _WIDE_TILES_N:
        return wide
    return _NARROW_CONFIGS[dtype]


def _capability_major(device: torch.device | None) -> int | None:
    if device is None or torch.device(device).type != "cuda":
        return None
    return _cuda_facts(_cuda_index(torch.device(device)))[0]


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _cuda_facts(index: int) -> tuple[int, int]:
    """``(compute capability major, SM count)`` of a CUDA device, read once (not on every matmul call)."""
    props = torch.cuda.get_device_properties(index)
    return props.major, props.multi_processor_count


@triton.jit(do_not_specialize=["M"])
def _persistent_matmul_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                              stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                              HAS_BIAS: tl.constexpr, FP32_IEEE: tl.constexpr, EVEN_K: tl.constexpr,
                              EVEN_N: tl.constexpr, USE_INT64: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    tiles_per_group = GROUP_M * tiles_n
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(pid, num_tiles, NUM_PROGRAMS):
        # Grouped tile order (for L2 reuse): a schedule only, it does not change any element's K order.
        group = tile // tiles_per_group
        first_m = group * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (tile % tiles_per_group) % group_rows
        tile_n = (tile % tiles_per_group) // group_rows
        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # rows / columns past the edge read row / column 0 (their results are never stored): unmasked loads
        rows = tl.where(offs_m < M, offs_m, 0)
        cols = tl.where(offs_n < N, offs_n, 0)
        if EVEN_N:    # (a function of N only) every column tile is whole: contiguous, aligned column offsets
            cols = tl.max_contiguous(tl.multiple_of(cols, BLOCK_N), BLOCK_N)
        if USE_INT64:
            rows = rows.to(tl.int64)
            cols = cols.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            offs_k = ks * BLOCK_K + tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
            b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < K, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < K, other=0.0)
            if FP32_IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols).to(tl.float32)
            acc = acc + bias[None, :]
        out_m = offs_m
        out_n = offs_n
        if USE_INT64:
            out_m = out_m.to(tl.int64)
            out_n = out_n.to(tl.int64)
        tl.store(c_ptr + out_m[:, None] * stride_cm + out_n[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_facts(_cuda_index(device))[1]
    return 4  # Triton's CPU interpreter (TRITON_INTERPRET=1): any fixed number works


def _needs_int64(*tensors: torch.Tensor) -> bool:
    """True when an element offset of any operand may pass int32 (addressing only: the arithmetic is the same)."""
    return any(sum((d - 1) * abs(st) for d, st in zip(t.shape, t.stride())) > _INT32_MAX for t in tensors)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
           config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``a [M, K] @ b [K, N] (+ bias [N])`` with the persistent kernel; ``config`` (tests): override
    :func:`matmul_config` (it must then be the same for every ``M`` too)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise InputError(f"matmul needs a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in MATMUL_CONFIGS or b.dtype != a.dtype:
        raise InputError(f"matmul supports {list(MATMUL_CONFIGS)} (same dtype), got {a.dtype} and {b.dtype}")
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_() if bias is None else c.copy_(bias.to(c.dtype).expand(m, n))
    block_m, block_n, block_k, stages, warps = config or matmul_config(n, k, a.dtype, a.device)
    # the grid depends on M (a schedule: which program runs which tile), never a tile's arithmetic
    programs = min(_num_programs(a.device), triton.cdiv(m, block_m) * triton.cdiv(n, block_n))
    _persistent_matmul_kernel[(programs,)](
        a, b, c, bias if bias is not None else c, m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, FP32_IEEE=a.dtype == torch.float32, EVEN_K=k % block_k == 0,
        EVEN_N=n % block_n == 0, USE_INT64=_needs_int64(a, b, c),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=_GROUP_M, NUM_PROGRAMS=programs,
        num_stages=stages, num_warps=warps)
    return c


@triton.jit
def _row_log_softmax_kernel(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    lane_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        lane_max = tl.maximum(lane_max, x)
    row_max = tl.max(lane_max, 0)
    lane_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        lane_sum += tl.exp(x - row_max)
    log_norm = tl.log(tl.sum(lane_sum, 0))
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        y = (x - row_max) - log_norm
        tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=offs < n_cols)


def _rows_last(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with ``dim`` moved last, as a contiguous ``[rows, n]`` matrix."""
    return x.movedim(dim, -1).contiguous().reshape(-1, x.shape[dim])


def log_softmax(x: torch.Tensor, dim: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Row-wise log_softmax over ``dim`` (three passes per row: max, sum of exp, write)."""
    rows = _rows_last(x, dim)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.numel():
        _row_log_softmax_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), out.stride(0),
                                                  BLOCK=_ROW_BLOCK)
    moved = x.movedim(dim, -1).shape
    return out.reshape(moved).movedim(-1, dim)


@triton.jit
def _row_mean_kernel(x_ptr, out_ptr, n_cols, row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lane_sum = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        lane_sum += tl.load(x_ptr + row * row_stride + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
    total = tl.sum(lane_sum, 0)
    tl.store(out_ptr + row, (total / n_cols).to(out_ptr.dtype.element_ty))


def mean(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    """Mean over ``dims`` (sorted, distinct): the reduced dims are moved last and flattened per output."""
    kept = [d for d in range(x.dim()) if d not in dims]
    count = 1
    for d in dims:
        count *= x.shape[d]
    rows = x.permute(*kept, *dims).contiguous().reshape(-1, count)
    out = torch.empty((rows.shape[0],), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        if count == 0:
            out.fill_(float("nan"))
        else:
            _row_mean_kernel[(rows.shape[0],)](rows, out, count, rows.stride(0), BLOCK=_ROW_BLOCK)
    if keepdim:
        return out.reshape([1 if d in dims else x.shape[d] for d in range(x.dim())])
    return out.reshape([x.shape[d] for d in kept])


@triton.jit
def _row_rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, eps,
                         HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    lane_sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        lane_sq += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(lane_sq, 0) / n_cols + eps)
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        # transformers' convention: normalise in fp32, cast to the input dtype, then scale by the weight.
        y = (x * rstd).to(x_ptr.dtype.element_ty)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + offs, mask=offs < n_cols, other=0.0)
            y = (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_row + offs, y, mask=offs < n_cols)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, one program per row."""
    rows = x.contiguous().reshape(-1, x.shape[-1])
    out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.numel():
        w = weight.contiguous() if weight is not None else rows
        _row_rms_norm_kernel[(rows.shape[0],)](rows, w, out, rows.shape[1], rows.stride(0), out.stride(0),
                                               float(eps), HAS_WEIGHT=weight is not None, BLOCK=_ROW_BLOCK)
    return out.reshape(x.shape)
