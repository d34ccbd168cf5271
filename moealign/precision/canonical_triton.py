"""The canonical forward's ops as Triton kernels (CUDA; on the CPU under ``TRITON_INTERPRET=1`` for the tests).

Each kernel's bits depend on nothing but its own inputs: not on the batch (``M``), the row's position, the
sequence length or the tensor-parallel cut of ``K``. The GPU's bits need not equal the CPU definition's
(:mod:`moealign.precision.canonical`); both engines call the same kernels on a GPU, so they agree with each other.
:data:`TRITON_OPS` maps each op of :data:`~moealign.precision.canonical.SPEC` to the functions that stand for its
``c_*`` functions, with the same call signatures (a one-line dispatch on CUDA tensors).

=============  ================================================================================================
linear         a fixed-tile GEMM: ``BLOCK_M`` / ``BLOCK_N`` a function of the dtype only (:data:`LINEAR_TILES`),
               ``BLOCK_K`` = the leaf width (:data:`~moealign.precision.canonical.LEAF_WIDTH`, 32). Each K block's
               partial product is one ``tl.dot`` in fp32 (fp32 inputs: ``input_precision="ieee"``, no TF32), seeded
               with a run-time zero so the compiler cannot fold a tree add into the MMA's accumulator. The K blocks
               are combined by the CPU leaf tree's shape (:func:`~moealign.precision.tree.tree_shape`: ``nb = c *
               2**j`` blocks, the odd part ``c`` chained left to right, then the ``2**j`` group values added in
               adjacent pairs), kept as a binary counter of subtree roots in a per-program scratch stack. A TP shard
               of ``K`` holding ``nb / tp`` whole blocks (``tp`` a power of two dividing ``2**j``: what
               :func:`~moealign.precision.canonical.check_canonical_tp` asks) computes exactly a subtree
               (:func:`tree_linear_partial`), and :func:`linear_from_roots` (the same pairwise tree over the roots,
               :func:`~moealign.precision.tree.tree_reduce`) gives TP = 1's bits. Bias added to the fp32 root,
               one cast.
norm           RMSNorm: one program per row; 256 fp32 lanes (lane ``j`` sums ``x[j]**2, x[j + 256]**2, ...`` in
               order), one ``tl.sum`` over the lanes; ``div_rn`` / ``sqrt_rn`` (correctly rounded).
rope           NeoX rotation, elementwise fp32, one cast (the cos / sin table is canonical.py's).
attention      one program per (query row, head) over the row's kept keys (compacted to the front as on the CPU:
               a stable sort of the keep mask, or ``prefix=True``), in 32-key blocks from key 0: scores by lanes
               over ``head_dim`` and one ``tl.sum``, blocks combined by a fixed-order online softmax. The loop ends
               at the row's last kept key, so a decode step over ``t + 1`` cached keys runs exactly the blocks of
               row ``t`` of the full sequence (a trailing all-masked block would also leave the bits unchanged:
               its rescale factor is ``exp(0) = 1`` and it adds zeros).
router         logits: the linear kernel with an fp32 output (IEEE); top-k: ``k`` rounds of (max, lowest id among
               the maxima), returned in ascending id; gates: softmax of the chosen logits (``renormalize``) or the
               full softmax's values, as :func:`~moealign.precision.canonical.c_gates`.
experts        grouped: the (token, slot) pairs sorted by expert on the device (no host sync), tiles that never
               span two experts, each tile the linear kernel's tree over its expert's weights (rows gathered),
               SwiGLU ``(silu(g) * u).to(dtype)``, the down projection's fp32 root. Per-token invariant: a pair's
               row is one row of a fixed-shape tile whatever else its expert received.
combine        ``sum_j gate_j * y_j`` over the slots in ascending expert id, fp32, one cast.
log_softmax    one program per row: lanes + ``tl.sum`` for the sum of ``exp(x - max)``; ``x - max - log(sum)``.
=============  ================================================================================================

**exp and log** are not ``tl.exp`` / ``tl.log`` (``ex2.approx`` on NVIDIA; numpy's SIMD loops under the
interpreter): they are Cody-Waite range reduction and a fixed polynomial (Cephes' ``expf`` minimax; an atanh series
for ``log``) in fp32 IEEE basic operations and bit manipulation, so a value's bits cannot depend on where it sits.
Every kernel is launched with ``enable_fp_fusion=False`` (no multiply-add contraction): the elementwise arithmetic
is the IEEE operation sequence written here; only ``tl.dot``'s and ``tl.sum``'s internal orders are the GPU's own
(fixed for a given kernel, tile and card).

:func:`check_canonical_cuda` refuses, before any work, what the kernels do not cover: no Triton, a compute
capability below :data:`MIN_CAPABILITY`, a dtype outside :data:`KERNEL_DTYPES`, TF32 switched on in torch.

This module imports without Triton (the kernels then raise :class:`~moealign.errors.CanonicalError` when called,
and :func:`check_canonical_cuda` names the missing package).
"""

from __future__ import annotations

import math
import os

import torch

from .._optional import probe
from ..errors import CanonicalError, TreeReductionError
from .canonical import LEAF_WIDTH, kept_first
from .tree import check_tree_world_size, tree_reduce, tree_shape

# triton is optional: without it the module still imports (check_canonical_cuda names what is missing)
_TRITON = probe("triton")
triton = _TRITON.module
tl = probe("triton.language").module if triton is not None else None
_TRITON_ERROR = _TRITON.error

__all__ = [
    "KERNEL_DTYPES",
    "LINEAR_TILES",
    "MIN_CAPABILITY",
    "TRITON_OPS",
    "check_canonical_cuda",
    "linear",
    "tree_linear_partial",
    "linear_from_roots",
    "rms_norm",
    "rope",
    "attention",
    "topk",
    "gates",
    "silu_mul",
    "experts",
    "combine",
    "log_softmax",
]

#: The dtypes the kernels take (activations and weights). float64 is the CPU definition's alone.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: The compute capability the kernels need: 8.0 (Ampere), Triton 3's floor on NVIDIA and bf16 ``tl.dot``'s.
MIN_CAPABILITY = (8, 0)
#: ``(BLOCK_M, BLOCK_N, num_stages, num_warps)`` of the linear kernel per dtype (never a function of ``M``);
#: ``BLOCK_K`` is the leaf width.
LINEAR_TILES = {
    torch.float32: (32, 32, 2, 4),
    torch.float16: (64, 64, 3, 4),
    torch.bfloat16: (64, 64, 3, 4),
}
_ROW_LANES = 256          # the lanes of the row kernels (norm, log-softmax)
_KEY_BLOCK = 32           # keys per attention block
_H_BLOCK = 256            # columns per program of the elementwise kernels
_LEAF_WIDTHS = (16, 32, 64, 128)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")
_LAUNCH = {"enable_fp_fusion": False}


def _jit(**options):
    """``triton.jit`` where Triton imports; without it, a stand-in whose launch raises (never reached: the wrappers
    check first)."""
    def wrap(fn):
        if triton is not None:
            return triton.jit(fn, **options)
        return fn
    return wrap


# --------------------------------------------------------------------------------------------------------
# Refusals and input checks


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The device's compute capability, ``None`` when torch sees no CUDA device (the tests replace this)."""
    if not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tuple(torch.cuda.get_device_capability(index))


def _tf32_switches() -> list[str]:
    on = []
    if torch.backends.cuda.matmul.allow_tf32:
        on.append("torch.backends.cuda.matmul.allow_tf32 = True")
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":
        on.append(f"torch.get_float32_matmul_precision() = {precision!r} (needs 'highest')")
    return on


def check_canonical_cuda(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16) -> None:
    """Refuse, naming it, a setting the canonical Triton kernels do not cover, before any work: Triton missing, a
    device that is not a CUDA GPU of compute capability >= :data:`MIN_CAPABILITY`, a dtype outside
    :data:`KERNEL_DTYPES`, TF32 switched on for matmuls (``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.get_float32_matmul_precision() != "highest"``). ``torch.backends.cudnn.allow_tf32`` (True by torch's
    default) is not refused: it governs cuDNN's convolutions, which no op of the forward runs."""
    if triton is None:
        raise CanonicalError(f"the canonical forward on CUDA needs Triton, which does not import here "
                             f"({_TRITON_ERROR})")
    if dtype not in KERNEL_DTYPES:
        raise CanonicalError(f"the canonical Triton kernels cover {_names(KERNEL_DTYPES)}, not {dtype}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise CanonicalError(f"the canonical Triton kernels: {device!r} is not a device ({exc})") from None
    if dev.type != "cuda":
        raise CanonicalError(f"the canonical Triton kernels run on CUDA devices, not {dev}")
    capability = _cuda_capability(dev)
    if capability is None:
        raise CanonicalError(f"the canonical Triton kernels need a CUDA GPU; torch sees none "
                             f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
    if tuple(capability) < MIN_CAPABILITY:
        raise CanonicalError(f"the canonical Triton kernels need compute capability >= "
                             f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}; {dev} has {capability[0]}.{capability[1]}")
    tf32 = _tf32_switches()
    if tf32:
        raise CanonicalError("the canonical forward computes fp32 in IEEE precision; TF32 is switched on: "
                             + "; ".join(tf32))


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _tensor(t, what: str, op: str, dims: int | None = None, dtypes=KERNEL_DTYPES) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CanonicalError(f"{op}: {what} must be a tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise CanonicalError(f"{op}: {what} is {t.dtype}; the canonical Triton kernels take {_names(dtypes)}")
    if dims is not None and t.dim() != dims:
        raise CanonicalError(f"{op}: {what} must have {dims} dims, got shape {tuple(t.shape)}")
    return t


def _same_device(op: str, *tensors: torch.Tensor) -> torch.device:
    """Every tensor on one device, which the kernels can run on (CUDA; the CPU only under the interpreter)."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise CanonicalError(f"{op}: tensors on different devices {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not (_INTERPRET and device.type == "cpu"):
        raise CanonicalError(f"{op}: the canonical Triton kernels run on CUDA tensors (on the CPU only under "
                             f"TRITON_INTERPRET=1), got a tensor on {device}")
    if triton is None:
        raise CanonicalError(f"{op}: Triton does not import here ({_TRITON_ERROR})")
    return device


def _check_leaf_width(leaf_width, op: str) -> int:
    if isinstance(leaf_width, bool) or leaf_width not in _LEAF_WIDTHS:
        raise CanonicalError(f"{op}: leaf_width must be one of {_LEAF_WIDTHS} (the kernel's BLOCK_K), "
                             f"got {leaf_width!r}")
    return leaf_width


def _check_out_dtype(out_dtype, default: torch.dtype, op: str) -> torch.dtype:
    out_dtype = default if out_dtype is None else out_dtype
    if out_dtype not in KERNEL_DTYPES:
        raise CanonicalError(f"{op}: out_dtype must be one of {_names(KERNEL_DTYPES)}, got {out_dtype}")
    return out_dtype


_SM_COUNTS: dict[int, int] = {}


def _num_programs(device: torch.device) -> int:
    """The persistent grid: one program per SM (read once per device); 4 under the interpreter."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


# --------------------------------------------------------------------------------------------------------
# exp and log from IEEE basic operations (fp32)


@_jit()
def _exp_f32(x):
    """``exp(x)`` for fp32 ``x``: Cephes' ``expf`` (Cody-Waite reduction by ln 2, a degree-7 minimax polynomial),
    ``2**n`` built from bits in two halves (no overflow of the exponent field); ``exp(-inf) = 0``, NaN stays."""
    xc = tl.minimum(tl.maximum(x, -104.0), 89.0)
    n = tl.math.floor(xc * 1.44269504088896341 + 0.5)
    r = (xc - n * 0.693359375) - n * -2.12194440e-4
    p = 1.9875691500e-4
    p = p * r + 1.3981999507e-3
    p = p * r + 8.3334519073e-3
    p = p * r + 4.1665795894e-2
    p = p * r + 1.6666665459e-1
    p = p * r + 5.0000001201e-1
    p = (p * (r * r) + r) + 1.0
    ni = n.to(tl.int32)
    half = ni >> 1
    s1 = ((half + 127) << 23).to(tl.float32, bitcast=True)
    s2 = ((ni - half + 127) << 23).to(tl.float32, bitcast=True)
    out = (p * s1) * s2
    out = tl.where(x == float("-inf"), 0.0, out)
    return tl.where(x != x, x, out)


@_jit()
def _log_f32(x):
    """``log(x)`` for fp32 ``x``: the exponent and mantissa from bits (subnormals scaled by ``2**23`` first),
    the mantissa in ``[sqrt(1/2), sqrt(2))``, ``2 atanh(s)`` with ``s = (m - 1) / (m + 1)`` by a fixed series, plus
    ``e ln 2`` in Cody-Waite parts; ``log 0 = -inf``, ``log inf = inf``, negative or NaN -> NaN."""
    tiny = x < 1.1754943508222875e-38
    xs = tl.where(tiny, x * 8388608.0, x)
    bits = xs.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - tl.where(tiny, 23, 0)
    m = ((bits & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > 1.4142135623730951
    m = tl.where(big, m * 0.5, m)
    ef = tl.where(big, e + 1, e).to(tl.float32)
    s = tl.div_rn(m - 1.0, m + 1.0)
    s2 = s * s
    q = 0.09090909090909091
    q = q * s2 + 0.1111111111111111
    q = q * s2 + 0.14285714285714285
    q = q * s2 + 0.2
    q = q * s2 + 0.3333333333333333
    q = q * s2 + 1.0
    out = ef * 0.693359375 + ((2.0 * s) * q + ef * -2.12194440e-4)
    out = tl.where(x == 0.0, float("-inf"), out)
    out = tl.where(x == float("inf"), float("inf"), out)
    return tl.where((x < 0.0) | (x != x), float("nan"), out)


# --------------------------------------------------------------------------------------------------------
# linear: the fixed-tile GEMM with a tree over K blocks


@_jit()
def _leaf(a_ptrs, w_ptrs, seed, FP32_IEEE: tl.constexpr):
    a = tl.load(a_ptrs)
    w = tl.load(w_ptrs)
    if FP32_IEEE:
        out = tl.dot(a, w, seed, input_precision="ieee")
    else:
        out = tl.dot(a, w, seed)
    return out


@_jit(do_not_specialize=["M", "tiles_m"])
def _tree_linear_kernel(a_ptr, w_ptr, bias_ptr, out_ptr, stack_ptr,
                        rows_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                        M, N, chain, groups, tiles_m, zero,
                        stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_om, stride_on,
                        GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, FP32_IEEE: tl.constexpr, LEVELS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_PROGRAMS: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    tile_elems = BLOCK_M * BLOCK_N
    # this program's stack of subtree roots, one fp32 tile per tree level (a binary counter over the groups)
    stack = stack_ptr + pid.to(tl.int64) * (LEVELS * tile_elems) + rm[:, None] * BLOCK_N + rn[None, :]
    # a run-time zero: tl.dot(a, w, <constant 0>) + t would be folded into tl.dot(a, w, t) (one MMA accumulating
    # onto t), which is not the tree's IEEE add
    seed = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + zero
    for tile in range(pid, tiles_m * tiles_n, NUM_PROGRAMS):
        tile_m = tile // tiles_n
        tile_n = tile % tiles_n
        my_groups = groups
        if GATHER:    # grouped experts: a tile's rows are one expert's (token, slot) pairs, gathered
            start = tl.load(tile_start_ptr + tile_m)
            end = tl.load(tile_end_ptr + tile_m)
            pos = start + rm
            live = pos < end
            rows = tl.load(rows_ptr + pos, mask=live, other=0).to(tl.int64)
            out_rows = pos.to(tl.int64)
            w_tile = w_ptr + tl.load(tile_expert_ptr + tile_m).to(tl.int64) * stride_we
            my_groups = tl.where(start < end, groups, 0)
        else:
            offs_m = tile_m * BLOCK_M + rm
            live = offs_m < M
            rows = tl.where(live, offs_m, 0).to(tl.int64)      # rows past M read row 0, never stored
            out_rows = offs_m.to(tl.int64)
            w_tile = w_ptr
        offs_n = tile_n * BLOCK_N + rn
        cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        a_ptrs = a_ptr + rows[:, None] * stride_am + rk[None, :] * stride_ak
        w_ptrs = w_tile + rk[:, None] * stride_wk + cols[None, :] * stride_wn
        node = seed
        for g in range(0, my_groups):
            first = g * chain * BLOCK_K
            node = _leaf(a_ptrs + first * stride_ak, w_ptrs + first * stride_wk, seed, FP32_IEEE)
            for c in range(1, chain):      # the odd part: consecutive leaves, left to right
                kc = first + c * BLOCK_K
                node = node + _leaf(a_ptrs + kc * stride_ak, w_ptrs + kc * stride_wk, seed, FP32_IEEE)
            level = 0
            rest = g
            while rest % 2 == 1:          # group g closes one subtree per trailing one bit of g
                node = tl.load(stack + level * tile_elems) + node
                rest = rest // 2
                level += 1
            tl.store(stack + level * tile_elems, node)
            tl.debug_barrier()             # the stack is re-read by other threads of the program
        out = node
        if HAS_BIAS:
            out = out + tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=live[:, None] & (offs_n[None, :] < N))


def _launch_tree(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, leaf_width: int,
                 gather: tuple[torch.Tensor, ...] | None = None, tiles_m: int | None = None) -> None:
    """``out = tree(a @ w.T) (+ bias)`` for ``a [M, K]``, ``w [N, K]`` (or ``[E, N, K]`` with ``gather``:
    ``(rows, tile_expert, tile_start, tile_end)``)."""
    K = a.shape[1]
    N = w.shape[-2]
    if out.numel() == 0:
        return
    chain, groups = tree_shape(K // leaf_width)
    levels = groups.bit_length()
    block_m, block_n, stages, warps = LINEAR_TILES[a.dtype]
    if tiles_m is None:
        tiles_m = triton.cdiv(a.shape[0], block_m)
    programs = max(1, min(_num_programs(a.device), tiles_m * triton.cdiv(N, block_n)))
    stack = torch.empty((programs, levels, block_m, block_n), dtype=torch.float32, device=a.device)
    w3 = w if w.dim() == 3 else w.unsqueeze(0)
    rows, tile_expert, tile_start, tile_end = gather if gather is not None else (out, out, out, out)
    _tree_linear_kernel[(programs,)](
        a, w3, bias if bias is not None else out, out, stack, rows, tile_expert, tile_start, tile_end,
        a.shape[0], N, chain, groups, tiles_m, 0.0,
        a.stride(0), a.stride(1), w3.stride(0), w3.stride(1), w3.stride(2), out.stride(0), out.stride(1),
        GATHER=gather is not None, HAS_BIAS=bias is not None, FP32_IEEE=a.dtype == torch.float32, LEVELS=levels,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=leaf_width, NUM_PROGRAMS=programs,
        num_stages=stages, num_warps=warps, **_LAUNCH)


def _linear_inputs(x, weight, bias, leaf_width, op: str, out_dtype=torch.float32):
    _tensor(x, "x", op)
    _tensor(weight, "weight", op, dims=2)
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise CanonicalError(f"{op}: needs x [..., K] and weight [N, K] with the same K, got {tuple(x.shape)} "
                             f"and {tuple(weight.shape)}")
    if bias is not None:
        _tensor(bias, "bias", op, dims=1)
        if bias.shape[0] != weight.shape[0]:
            raise CanonicalError(f"{op}: bias has {bias.shape[0]} entries for {weight.shape[0]} outputs")
    leaf_width = _check_leaf_width(leaf_width, op)
    K = x.shape[-1]
    if K == 0 or K % leaf_width:
        raise CanonicalError(f"{op}: K = {K} is not a positive multiple of the leaf width {leaf_width} (the tree's "
                             f"leaves must tile the K axis)")
    out_dtype = _check_out_dtype(out_dtype, x.dtype, op)
    _same_device(op, x, weight, bias)
    return leaf_width, out_dtype


def tree_linear_partial(x: torch.Tensor, weight: torch.Tensor, *, leaf_width: int = LEAF_WIDTH) -> torch.Tensor:
    """The fp32 root of the K tree of ``x @ weight.T`` (``x [..., K]``, ``weight [N, K]``): on a TP rank holding a
    shard of ``K`` of whole leaves, its subtree root, for :func:`linear_from_roots`."""
    leaf_width, _ = _linear_inputs(x, weight, None, leaf_width, "tree_linear_partial")
    a = x.reshape(-1, x.shape[-1])
    out = torch.empty((a.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    _launch_tree(a, weight.to(x.dtype), out, None, leaf_width)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def linear_from_roots(roots, bias: torch.Tensor | None = None, *, out_dtype: torch.dtype) -> torch.Tensor:
    """TP ranks' fp32 subtree roots (in rank order; a power of two of them) -> the linear's output: the top of the
    same tree (adjacent pairs, :func:`~moealign.precision.tree.tree_reduce`), the bias added to the fp32 root, one
    cast. Equal, bit for bit, to :func:`linear` at TP = 1 when each shard is ``K / tp`` whole leaves."""
    roots = list(roots)
    if not roots:
        raise CanonicalError("linear_from_roots: no roots")
    for i, r in enumerate(roots):
        _tensor(r, f"root {i}", "linear_from_roots", dtypes=(torch.float32,))
        if r.shape != roots[0].shape or r.device != roots[0].device:
            raise CanonicalError(f"linear_from_roots: root {i} is {tuple(r.shape)} on {r.device}, root 0 "
                                 f"{tuple(roots[0].shape)} on {roots[0].device}")
    try:
        check_tree_world_size(len(roots))
    except TreeReductionError as exc:          # named as the canonical op's
        raise CanonicalError(f"linear_from_roots: {exc}") from None
    out_dtype = _check_out_dtype(out_dtype, torch.float32, "linear_from_roots")
    root = tree_reduce(torch.stack(roots), 0) if len(roots) > 1 else roots[0]
    if bias is not None:
        root = root + bias.to(torch.float32)
    return root.to(out_dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, leaf_width: int = LEAF_WIDTH) -> torch.Tensor:
    """``x @ weight.T + bias`` as :func:`~moealign.precision.canonical.c_linear`: the K tree's fp32 root, the bias
    added in fp32, cast once to ``out_dtype`` (default ``x.dtype``; ``torch.float32`` keeps the root: the router's
    logits)."""
    leaf_width, out_dtype = _linear_inputs(x, weight, bias, leaf_width, "linear", out_dtype)
    a = x.reshape(-1, x.shape[-1])
    out = torch.empty((a.shape[0], weight.shape[0]), dtype=out_dtype, device=x.device)
    _launch_tree(a, weight.to(x.dtype), out, bias, leaf_width)
    return out.reshape(*x.shape[:-1], weight.shape[0])


# --------------------------------------------------------------------------------------------------------
# RMSNorm, log-softmax


@_jit()
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, n_float, x_stride, out_stride, eps,
                     HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    out_row = out_ptr + row * out_stride
    lanes = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        lanes = lanes + x * x
    var = tl.div_rn(tl.sum(lanes, 0), n_float)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        y = (x * rstd).to(x_ptr.dtype.element_ty)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + offs, mask=offs < n_cols, other=0.0).to(x_ptr.dtype.element_ty)
            y = (y.to(tl.float32) * w.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(out_row + offs, y, mask=offs < n_cols)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as :func:`~moealign.precision.canonical.c_rms_norm`:
    ``(x32 * (1 / sqrt(sum(x32**2) / H + eps))).to(x.dtype) * weight`` (the product rounded once to ``x.dtype``)."""
    op = "rms_norm"
    _tensor(x, "x", op)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise CanonicalError(f"{op}: x needs a non-empty last dim, got shape {tuple(x.shape)}")
    if weight is not None:
        _tensor(weight, "weight", op, dims=1)
        if weight.shape[0] != x.shape[-1]:
            raise CanonicalError(f"{op}: weight has {weight.shape[0]} entries for a last dim of {x.shape[-1]}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise CanonicalError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    _same_device(op, x, weight)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        w = weight.contiguous() if weight is not None else rows
        _rms_norm_kernel[(rows.shape[0],)](rows, w, out, rows.shape[1], float(rows.shape[1]), rows.stride(0),
                                           out.stride(0), float(eps), HAS_WEIGHT=weight is not None,
                                           BLOCK=_ROW_LANES, **_LAUNCH)
    return out.reshape(x.shape)


@_jit()
def _row_lse(row_ptr, n_cols, BLOCK: tl.constexpr):
    """``(max, log(sum(exp(x - max))))`` of one fp32-promoted row: lanes, then one ``tl.sum``."""
    lane_max = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        lane_max = tl.maximum(lane_max, x)
    row_max = tl.max(lane_max, 0)
    lanes = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        lanes = lanes + _exp_f32(x - row_max)
    return row_max, _log_f32(tl.sum(lanes, 0))


@_jit()
def _log_softmax_kernel(x_ptr, out_ptr, n_cols, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    row_max, lse = _row_lse(x_row, n_cols, BLOCK)
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + offs, (x - row_max) - lse, mask=offs < n_cols)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log_softmax`` in fp32 as :func:`~moealign.precision.canonical.c_log_softmax`:
    ``(x - max) - log(sum(exp(x - max)))`` (``-inf`` entries stay ``-inf``); float32 out."""
    op = "log_softmax"
    _tensor(x, "x", op)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -max(1, x.dim()) <= dim < max(1, x.dim()):
        raise CanonicalError(f"{op}: dim {dim!r} is out of range for shape {tuple(x.shape)}")
    if x.dim() == 0 or x.shape[dim] == 0:
        raise CanonicalError(f"{op}: x needs a non-empty dim {dim}, got shape {tuple(x.shape)}")
    _same_device(op, x)
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _log_softmax_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), out.stride(0),
                                              BLOCK=_ROW_LANES, **_LAUNCH)
    return out.reshape(moved.shape).movedim(-1, dim)


# --------------------------------------------------------------------------------------------------------
# RoPE


@_jit()
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, head_dim, half, x_stride_r, x_stride_h,
                 cs_stride, out_stride_r, out_stride_h, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    rot = offs < half
    c = tl.load(cos_ptr + r * cs_stride + offs, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + r * cs_stride + offs, mask=rot, other=0.0).to(tl.float32)
    x_row = x_ptr + r * x_stride_r + h * x_stride_h
    o_row = out_ptr + r * out_stride_r + h * out_stride_h
    x1 = tl.load(x_row + offs, mask=rot, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + offs, mask=rot, other=0.0).to(tl.float32)
    tl.store(o_row + offs, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=rot)
    tl.store(o_row + half + offs, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=rot)
    for c0 in range(2 * half, head_dim, BLOCK):      # the rest of the head passes unchanged
        rest = c0 + offs
        keep = tl.load(x_row + rest, mask=rest < head_dim, other=0.0)
        tl.store(o_row + rest, keep, mask=rest < head_dim)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation as :func:`~moealign.precision.canonical.c_rope`: ``x [..., heads, head_dim]``, ``cos`` /
    ``sin`` ``[..., rot / 2]`` (fp32, from the canonical table) broadcast over heads; fp32 arithmetic, one cast."""
    op = "rope"
    _tensor(x, "x", op)
    _tensor(cos, "cos", op, dtypes=(torch.float32,))
    _tensor(sin, "sin", op, dtypes=(torch.float32,))
    if x.dim() < 2 or cos.shape != sin.shape or cos.dim() != x.dim() - 1:
        raise CanonicalError(f"{op}: needs x [..., heads, head_dim] and cos, sin [..., rot / 2] of one shape, got "
                             f"{tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    half = cos.shape[-1]
    lead = x.shape[:-2]
    if half == 0 or 2 * half > x.shape[-1] or any(c not in (1, n) for c, n in zip(cos.shape[:-1], lead)):
        raise CanonicalError(f"{op}: cos / sin {tuple(cos.shape)} do not fit x {tuple(x.shape)} (rot / 2 in "
                             f"[1, head_dim / 2], leading dims broadcastable)")
    _same_device(op, x, cos, sin)
    heads, head_dim = x.shape[-2:]
    rows = x.reshape(-1, heads, head_dim).contiguous()
    cs = [t.expand(*lead, half).reshape(-1, half).contiguous() for t in (cos, sin)]
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        _rope_kernel[(rows.shape[0], heads)](rows, cs[0], cs[1], out, heads, head_dim, half, rows.stride(0),
                                             rows.stride(1), cs[0].stride(0), out.stride(0), out.stride(1),
                                             BLOCK=triton.next_power_of_2(half), **_LAUNCH)
    return out.reshape(x.shape)


# --------------------------------------------------------------------------------------------------------
# attention


@_jit()
def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, order_ptr, valid_ptr, scale, head_dim,
                      sq_q, sq_h, sq_d, sk_q, sk_l, sk_h, sk_d, sv_q, sv_l, sv_h, sv_d, so_q, so_h, so_d, s_order,
                      PREFIX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    qi = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rd = tl.arange(0, BLOCK_D)
    dmask = rd < head_dim
    qv = tl.load(q_ptr + qi * sq_q + h * sq_h + rd * sq_d, mask=dmask, other=0.0).to(tl.float32)
    n_valid = tl.load(valid_ptr + qi)
    k_row = k_ptr + qi * sk_q + h * sk_h
    v_row = v_ptr + qi * sv_q + h * sv_h
    m_i = tl.max(tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32), 0)
    l_i = tl.sum(tl.zeros((BLOCK_N,), dtype=tl.float32), 0)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j0 in range(0, n_valid, BLOCK_N):     # blocks from key 0 up to the row's last kept key, in order
        offs = j0 + tl.arange(0, BLOCK_N)
        valid = offs < n_valid
        if PREFIX:
            kidx = tl.where(valid, offs, 0).to(tl.int64)
        else:
            kidx = tl.load(order_ptr + qi * s_order + offs, mask=valid, other=0).to(tl.int64)
        mask2 = valid[:, None] & dmask[None, :]
        kt = tl.load(k_row + kidx[:, None] * sk_l + rd[None, :] * sk_d, mask=mask2, other=0.0).to(tl.float32)
        s = tl.sum(qv[None, :] * kt, 1) * scale
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = _exp_f32(m_i - m_new)
        p = _exp_f32(s - m_new)
        vt = tl.load(v_row + kidx[:, None] * sv_l + rd[None, :] * sv_d, mask=mask2, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * vt, 0)
        m_i = m_new
    out = tl.div_rn(acc, l_i)
    tl.store(out_ptr + qi * so_q + h * so_h + rd * so_d, out.to(out_ptr.dtype.element_ty), mask=dmask)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
              max_elements: int = 1 << 24, prefix: bool = False) -> torch.Tensor:
    """Attention of each query row over its own kept keys, as :func:`~moealign.precision.canonical.c_attention`:
    ``q [Q, H, d]``, ``k, v [Q, L, H, d]`` or ``[1, L, H, d]`` (heads expanded for GQA), ``keep [Q, L]`` bool;
    scale ``1 / sqrt(d)``; ``[Q, H, d]`` in ``q.dtype``. Kept keys are taken in index order (a stable device sort
    of the mask; ``prefix=True``: they lead already). ``max_elements`` is accepted for the signature (no
    chunking here). A row with no kept key gives NaN, as on the CPU."""
    op = "attention"
    _tensor(q, "q", op, dims=3)
    _tensor(k, "k", op, dims=4)
    _tensor(v, "v", op, dims=4)
    _tensor(keep, "keep", op, dims=2, dtypes=(torch.bool,))
    Q, H, d = q.shape
    if k.shape != v.shape or k.shape[0] not in (1, Q) or k.shape[2:] != (H, d) or keep.shape != (Q, k.shape[1]):
        raise CanonicalError(f"{op}: needs q [Q, H, d], k = v [Q or 1, L, H, d], keep [Q, L]; got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, keep {tuple(keep.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise CanonicalError(f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 1:
        raise CanonicalError(f"{op}: max_elements must be a positive integer, got {max_elements!r}")
    _same_device(op, q, k, v, keep)
    out = torch.empty((Q, H, d), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    n_valid = keep.sum(-1, dtype=torch.int32)
    order = keep if prefix else kept_first(keep)
    _attention_kernel[(Q, H)](
        q, k, v, out, order, n_valid, 1.0 / math.sqrt(d), d,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0) if k.shape[0] > 1 else 0, k.stride(1), k.stride(2),
        k.stride(3), v.stride(0) if v.shape[0] > 1 else 0, v.stride(1), v.stride(2), v.stride(3),
        out.stride(0), out.stride(1), out.stride(2), order.stride(0),
        PREFIX=bool(prefix), BLOCK_N=_KEY_BLOCK, BLOCK_D=triton.next_power_of_2(d), **_LAUNCH)
    return out


# --------------------------------------------------------------------------------------------------------
# router: top-k and gates


@_jit()
def _topk_kernel(logits_ptr, out_ptr, n_experts, stride_l, stride_o, K_SEL: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    vals = tl.load(logits_ptr + row * stride_l + lanes, mask=lanes < n_experts, other=float("-inf"))
    vals = tl.where(vals != vals, float("-inf"), vals)          # NaN: chosen last
    taken = lanes >= n_experts
    for _ in tl.static_range(K_SEL):
        best = tl.max(tl.where(taken, float("-inf"), vals), 0)
        pick = tl.min(tl.where((~taken) & (vals == best), lanes, BLOCK_E), 0)   # ties: the lower id
        taken = taken | (lanes == pick)
    chosen = taken & (lanes < n_experts)
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1                 # ascending expert id
    tl.store(out_ptr + row * stride_o + slot, lanes.to(tl.int64), mask=chosen)


def topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` experts of each row ``[T, E]`` with the largest logits (ties: the lower id), ascending ``[T, k]``
    int64, as :func:`~moealign.precision.canonical.c_topk` (NaN logits are chosen last)."""
    op = "topk"
    _tensor(logits, "logits", op, dims=2)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= logits.shape[1]:
        raise CanonicalError(f"{op}: k must be an integer in [1, {logits.shape[1]}], got {k!r}")
    _same_device(op, logits)
    out = torch.empty((logits.shape[0], k), dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        _topk_kernel[(logits.shape[0],)](logits, out, logits.shape[1], logits.stride(0), out.stride(0), K_SEL=k,
                                         BLOCK_E=triton.next_power_of_2(logits.shape[1]), **_LAUNCH)
    return out


@_jit()
def _gates_kernel(logits_ptr, ids_ptr, out_ptr, n_experts, stride_l, stride_i, stride_o,
                  K_SEL: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK_K)
    live = slots < K_SEL
    ids = tl.load(ids_ptr + row * stride_i + slots, mask=live, other=0)
    chosen = tl.load(logits_ptr + row * stride_l + ids, mask=live, other=float("-inf")).to(tl.float32)
    if RENORMALIZE:
        e = _exp_f32(chosen - tl.max(chosen, 0))
        out = tl.div_rn(e, tl.sum(e, 0))
    else:
        row_max, lse = _row_lse(logits_ptr + row * stride_l, n_experts, BLOCK_E)
        out = _exp_f32((chosen - row_max) - lse)
    tl.store(out_ptr + row * stride_o + slots, out, mask=live)


def gates(logits: torch.Tensor, ids: torch.Tensor, *, renormalize: bool) -> torch.Tensor:
    """The gate of each chosen expert ``[T, k]`` fp32, as :func:`~moealign.precision.canonical.c_gates`: ``softmax``
    over the chosen logits (``renormalize``) or the full softmax's value at each chosen expert."""
    op = "gates"
    _tensor(logits, "logits", op, dims=2, dtypes=(torch.float32,))
    _tensor(ids, "ids", op, dims=2, dtypes=(torch.int64, torch.int32))
    if ids.shape[0] != logits.shape[0] or not 1 <= ids.shape[1] <= logits.shape[1]:
        raise CanonicalError(f"{op}: ids {tuple(ids.shape)} do not fit logits {tuple(logits.shape)}")
    _same_device(op, logits, ids)
    out = torch.empty(ids.shape, dtype=torch.float32, device=logits.device)
    if ids.shape[0]:
        _gates_kernel[(ids.shape[0],)](logits, ids, out, logits.shape[1], logits.stride(0), ids.stride(0),
                                       out.stride(0), K_SEL=ids.shape[1],
                                       BLOCK_K=triton.next_power_of_2(ids.shape[1]), RENORMALIZE=bool(renormalize),
                                       BLOCK_E=_ROW_LANES, **_LAUNCH)
    return out


# --------------------------------------------------------------------------------------------------------
# experts (grouped) and the combine


@_jit()
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < inter
    g = tl.load(gu_ptr + row * stride_g + offs, mask=live, other=0.0)
    u = tl.load(gu_ptr + row * stride_g + inter + offs, mask=live, other=0.0)
    act = tl.div_rn(g, 1.0 + _exp_f32(-g)) * u
    tl.store(out_ptr + row * stride_o + offs, act.to(out_ptr.dtype.element_ty), mask=live)


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SwiGLU of fp32 gate / up roots ``[P, 2I]`` (gate first): ``(g / (1 + exp(-g)) * u).to(dtype)`` ``[P, I]``."""
    op = "silu_mul"
    _tensor(gate_up, "gate_up", op, dims=2, dtypes=(torch.float32,))
    if gate_up.shape[1] % 2:
        raise CanonicalError(f"{op}: gate_up needs an even last dim (gate then up), got {tuple(gate_up.shape)}")
    dtype = _check_out_dtype(dtype, dtype, op)
    _same_device(op, gate_up)
    inter = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inter), dtype=dtype, device=gate_up.device)
    if out.numel():
        _silu_mul_kernel[(out.shape[0], triton.cdiv(inter, _H_BLOCK))](gate_up, out, inter, gate_up.stride(0),
                                                                       out.stride(0), BLOCK=_H_BLOCK, **_LAUNCH)
    return out


def _expert_tiles(flat: torch.Tensor, n_experts: int, block_m: int):
    """The grouped schedule on the device (no host sync): the pairs sorted by expert (stable), and for each of a
    fixed upper bound of tiles ``cdiv(P, BLOCK_M) + E`` its expert and its ``[start, end)`` in the sorted pairs
    (tiles past the last one are empty)."""
    P = flat.numel()
    perm = torch.sort(flat, stable=True).indices
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    group_start = torch.cumsum(counts, 0) - counts
    tiles = (counts + block_m - 1) // block_m
    tiles_end = torch.cumsum(tiles, 0)
    n_tiles = triton.cdiv(P, block_m) + n_experts
    t = torch.arange(n_tiles, device=flat.device)
    expert = torch.searchsorted(tiles_end, t, right=True)
    real = expert < n_experts
    e = expert.clamp(max=n_experts - 1)
    local = t - (tiles_end[e] - tiles[e])
    start = group_start[e] + local * block_m
    end = torch.minimum(start + block_m, group_start[e] + counts[e])
    start = torch.where(real, start, 0).to(torch.int32)
    end = torch.where(real, end, 0).to(torch.int32)
    return perm, e.to(torch.int32), start, end, n_tiles


def experts(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
            leaf_width: int = LEAF_WIDTH) -> torch.Tensor:
    """Each (token, slot)'s expert output ``[T, k, H]`` fp32 (the down projection's root), as
    :func:`~moealign.precision.canonical.c_experts`: ``w13 [E, 2I, H]`` (gate rows first), ``w2 [E, H, I]``, in
    ``x``'s dtype. Grouped by expert on the device; a pair's bits are those of :func:`tree_linear_partial` of its
    token with its expert's weights, then :func:`silu_mul`, then :func:`tree_linear_partial` of ``w2``."""
    op = "experts"
    _tensor(x, "x", op, dims=2)
    _tensor(ids, "ids", op, dims=2, dtypes=(torch.int64, torch.int32))
    _tensor(w13, "w13", op, dims=3)
    _tensor(w2, "w2", op, dims=3)
    T, H = x.shape
    E, two_i = w13.shape[:2]
    if (ids.shape[0] != T or ids.shape[1] < 1 or two_i % 2 or w13.shape[2] != H
            or w2.shape != (E, H, two_i // 2)):
        raise CanonicalError(f"{op}: needs x [T, H], ids [T, k], w13 [E, 2I, H], w2 [E, H, I]; got x "
                             f"{tuple(x.shape)}, ids {tuple(ids.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    leaf_width = _check_leaf_width(leaf_width, op)
    for what, size in (("hidden size", H), ("intermediate size", two_i // 2)):
        if size == 0 or size % leaf_width:
            raise CanonicalError(f"{op}: the {what} {size} is not a positive multiple of the leaf width {leaf_width}")
    _same_device(op, x, ids, w13, w2)
    k = ids.shape[1]
    out = torch.empty((T, k, H), dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    w13, w2 = w13.to(x.dtype), w2.to(x.dtype)
    flat = ids.reshape(-1).to(torch.int64)
    block_m = LINEAR_TILES[x.dtype][0]
    perm, tile_expert, start, end, n_tiles = _expert_tiles(flat, E, block_m)
    tokens = (perm // k).to(torch.int32)
    gate_up = torch.empty((flat.numel(), two_i), dtype=torch.float32, device=x.device)
    _launch_tree(x, w13, gate_up, None, leaf_width, (tokens, tile_expert, start, end), n_tiles)
    act = silu_mul(gate_up, x.dtype)
    pairs = torch.arange(flat.numel(), dtype=torch.int32, device=x.device)
    y = torch.empty((flat.numel(), H), dtype=torch.float32, device=x.device)
    _launch_tree(act, w2, y, None, leaf_width, (pairs, tile_expert, start, end), n_tiles)
    out.view(-1, H).index_copy_(0, perm, y)
    return out


@_jit()
def _combine_kernel(p_ptr, g_ptr, out_ptr, hidden, stride_pt, stride_pk, stride_gt, stride_ot,
                    K_SEL: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < hidden
    acc = tl.load(p_ptr + t * stride_pt + offs, mask=live, other=0.0) * tl.load(g_ptr + t * stride_gt)
    for j in tl.static_range(1, K_SEL):        # slots in ascending expert id, left to right
        acc = acc + tl.load(p_ptr + t * stride_pt + j * stride_pk + offs, mask=live, other=0.0) * tl.load(
            g_ptr + t * stride_gt + j)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=live)


def combine(partials: torch.Tensor, gates: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_j gates[:, j] * partials[:, j]`` left to right over the (ascending-id) slots, fp32, cast once, as
    :func:`~moealign.precision.canonical.c_combine` (``partials [T, k, H]`` fp32, ``gates [T, k]`` fp32)."""
    op = "combine"
    _tensor(partials, "partials", op, dims=3, dtypes=(torch.float32,))
    _tensor(gates, "gates", op, dims=2, dtypes=(torch.float32,))
    if gates.shape != partials.shape[:2] or partials.shape[1] < 1:
        raise CanonicalError(f"{op}: gates {tuple(gates.shape)} do not fit partials {tuple(partials.shape)}")
    dtype = _check_out_dtype(dtype, dtype, op)
    _same_device(op, partials, gates)
    T, k, H = partials.shape
    p = partials.contiguous()
    g = gates.contiguous()
    out = torch.empty((T, H), dtype=dtype, device=p.device)
    if out.numel():
        _combine_kernel[(T, triton.cdiv(H, _H_BLOCK))](p, g, out, H, p.stride(0), p.stride(1), g.stride(0),
                                                       out.stride(0), K_SEL=k, BLOCK=_H_BLOCK, **_LAUNCH)
    return out


#: Each op of :data:`~moealign.precision.canonical.SPEC` -> the ``c_*`` functions it covers -> the Triton function
#: that stands for it on CUDA, with the same call signature.
TRITON_OPS = {
    "linear": {"c_linear": linear},
    "norm": {"c_rms_norm": rms_norm},
    "rope": {"c_rope": rope},
    "attention": {"c_attention": attention},
    "router": {"c_linear": linear, "c_topk": topk, "c_gates": gates},
    "experts": {"c_experts": experts, "c_combine": combine},
    "lm_head": {"c_linear": linear},
    "log_softmax": {"c_log_softmax": log_softmax},
}
