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

**Autograd.** The public names (``linear``, ``tree_linear_partial``, ``rms_norm``, ``rope``, ``attention``,
``gates``, ``silu_mul``, ``experts``, ``combine``, ``log_softmax``: :data:`TRITON_OPS`' entries) are differentiable,
as the ``c_*`` functions are; each is a ``torch.autograd.Function`` whose forward is the kernel, kept under the name
``<name>_forward`` (forward only: the same bits, no graph; the public name calls it directly when no input needs a
gradient). ``topk`` has no gradient; ``linear_from_roots`` is torch adds and differentiable as it stands. The backward
need not be canonical (only the forward's log-probs are compared) and is standard math, without host syncs: the
linear's two matmuls (in the wider of the gradient's and the input's dtypes) and the bias' column sum; RMSNorm's
``rstd (g w - xhat mean(g w xhat))`` with ``rstd`` recomputed; RoPE's transposed rotation; the softmax-attention
gradient in fp32 from recomputed probabilities and the saved output, query rows in chunks bounded by
``max_elements`` (a row with no kept key gives no gradient); the gates' softmax gradient; the SwiGLU's derivative;
the combine's products; log-softmax's ``g - exp(out) sum(g)``. The grouped experts' backward reuses the forward's
schedule and saved fp32 gate / up roots: ``dA = dY W2[e]`` and ``dx = sum d[g, u] W13[e]`` by the linear kernel
(weights read transposed), ``dW2``, ``dW13`` by a grouped weight-gradient kernel (one program per expert and output
tile, a loop over the expert's sorted pairs, ``tl.dot`` accumulating in fp32, :data:`WGRAD_TILES`), 16-bit
gradients cast to the activation dtype as a stock mixed-precision backward does. No double backward.

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
from .batch_invariant import kept_first
from .tree import CANONICAL_LEAF_WIDTH as LEAF_WIDTH
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
    "WGRAD_TILES",
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
    "linear_forward",
    "tree_linear_partial_forward",
    "rms_norm_forward",
    "rope_forward",
    "attention_forward",
    "gates_forward",
    "silu_mul_forward",
    "experts_forward",
    "combine_forward",
    "log_softmax_forward",
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


def tree_linear_partial_forward(x: torch.Tensor, weight: torch.Tensor, *,
                                leaf_width: int = LEAF_WIDTH) -> torch.Tensor:
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


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
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


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
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


def log_softmax_forward(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
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


def rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
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


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
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


def gates_forward(logits: torch.Tensor, ids: torch.Tensor, *, renormalize: bool) -> torch.Tensor:
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


def silu_mul_forward(gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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
    groups = torch.stack([group_start, group_start + counts]).to(torch.int32)    # each expert's [start, end)
    return perm, e.to(torch.int32), start, end, n_tiles, groups


def experts_forward(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                    leaf_width: int = LEAF_WIDTH) -> torch.Tensor:
    """Each (token, slot)'s expert output ``[T, k, H]`` fp32 (the down projection's root), as
    :func:`~moealign.precision.canonical.c_experts`: ``w13 [E, 2I, H]`` (gate rows first), ``w2 [E, H, I]``, in
    ``x``'s dtype. Grouped by expert on the device; a pair's bits are those of :func:`tree_linear_partial` of its
    token with its expert's weights, then :func:`silu_mul`, then :func:`tree_linear_partial` of ``w2``."""
    return _experts_run(x, ids, w13, w2, _experts_inputs(x, ids, w13, w2, leaf_width))[0]


def _experts_inputs(x, ids, w13, w2, leaf_width) -> int:
    """The experts' input checks (before any work); returns the leaf width."""
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
    return leaf_width


def _experts_run(x, ids, w13, w2, leaf_width):
    """The grouped experts on checked inputs: ``(out, schedule)``, ``schedule`` what the backward reuses (``None``
    for no tokens): the fp32 gate / up roots in expert-sorted pair order, the sort, the pairs' tokens, the tiles."""
    T, H = x.shape
    k = ids.shape[1]
    out = torch.empty((T, k, H), dtype=torch.float32, device=x.device)
    if T == 0:
        return out, None
    w13, w2 = w13.to(x.dtype), w2.to(x.dtype)
    flat = ids.reshape(-1).to(torch.int64)
    block_m = LINEAR_TILES[x.dtype][0]
    perm, tile_expert, start, end, n_tiles, groups = _expert_tiles(flat, w13.shape[0], block_m)
    tokens = (perm // k).to(torch.int32)
    tiles = (tile_expert, start, end)
    gate_up = torch.empty((flat.numel(), w13.shape[1]), dtype=torch.float32, device=x.device)
    _launch_tree(x, w13, gate_up, None, leaf_width, (tokens, *tiles), n_tiles)
    act = silu_mul_forward(gate_up, x.dtype)
    pairs = torch.arange(flat.numel(), dtype=torch.int32, device=x.device)
    y = torch.empty((flat.numel(), H), dtype=torch.float32, device=x.device)
    _launch_tree(act, w2, y, None, leaf_width, (pairs, *tiles), n_tiles)
    out.view(-1, H).index_copy_(0, perm, y)
    return out, (gate_up, perm, tokens, pairs, tiles, n_tiles, groups)


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


def combine_forward(partials: torch.Tensor, gates: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
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


# --------------------------------------------------------------------------------------------------------
# Autograd: the public names are differentiable; the forward is the kernel above (``<name>_forward``), the backward
# standard torch math (and, for the grouped experts, Triton GEMMs on the forward's expert schedule). A gradient need
# not have canonical bits: only the forward's log-probs are compared.


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _Linear(torch.autograd.Function):
    """:func:`linear` / :func:`tree_linear_partial`: ``dx = g @ W``, ``dW = g.T @ x``, ``db = sum g`` (matmuls in
    the wider of the gradient's and ``x``'s dtypes)."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, leaf_width, partial):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        if partial:
            return tree_linear_partial_forward(x, weight, leaf_width=leaf_width)
        return linear_forward(x, weight, bias, out_dtype=out_dtype, leaf_width=leaf_width)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        cd = torch.promote_types(grad.dtype, ctx.x_dtype)
        g = _flat(grad).to(cd)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = (g @ weight.to(cd)).to(ctx.x_dtype).reshape(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            dw = (g.t() @ _flat(x).to(cd)).to(ctx.w_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = g.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, leaf_width: int = LEAF_WIDTH) -> torch.Tensor:
    """:func:`linear_forward`, differentiable in ``x``, ``weight`` and ``bias``."""
    if _needs_grad(x, weight, bias):
        return _Linear.apply(x, weight, bias, out_dtype, leaf_width, False)
    return linear_forward(x, weight, bias, out_dtype=out_dtype, leaf_width=leaf_width)


def tree_linear_partial(x: torch.Tensor, weight: torch.Tensor, *, leaf_width: int = LEAF_WIDTH) -> torch.Tensor:
    """:func:`tree_linear_partial_forward`, differentiable in ``x`` and ``weight`` (a TP rank's share of the
    gradient; :func:`linear_from_roots` is torch adds, differentiable as it stands)."""
    if _needs_grad(x, weight):
        return _Linear.apply(x, weight, None, None, leaf_width, True)
    return tree_linear_partial_forward(x, weight, leaf_width=leaf_width)


class _RMSNorm(torch.autograd.Function):
    """``dx = rstd * (gw - xhat * mean(gw * xhat))`` with ``gw = g * w``, ``dw = sum(g * y)`` (``y`` the rounded
    normalised row); fp32, ``rstd`` recomputed from ``x`` (one row reduction)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm_forward(x, weight, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        xf = x.float()
        rstd = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + ctx.eps)
        xhat = xf * rstd
        g = grad.float()
        gw = g if weight is None else g * weight.to(x.dtype).float()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            dw = _flat(g * xhat.to(x.dtype).float()).sum(0).to(weight.dtype)
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """:func:`rms_norm_forward`, differentiable in ``x`` and ``weight``."""
    if _needs_grad(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_forward(x, weight, eps)


class _Rope(torch.autograd.Function):
    """The rotation's transpose: ``dx1 = g1 cos + g2 sin``, ``dx2 = g2 cos - g1 sin``, the rest passed; ``cos`` /
    ``sin`` (a table, normally constant) get ``sum(g1 x1 + g2 x2)`` / ``sum(g2 x1 - g1 x2)`` when they ask."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else None, cos, sin)
        ctx.x_dtype = x.dtype
        return rope_forward(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, cos, sin = ctx.saved_tensors
        half = cos.shape[-1]
        g = grad.float()
        g1, g2 = g[..., :half], g[..., half:2 * half]
        c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
        dx = dcos = dsin = None
        if ctx.needs_input_grad[0]:
            dx = torch.cat([g1 * c + g2 * s, g2 * c - g1 * s, g[..., 2 * half:]], -1).to(ctx.x_dtype)
        if x is not None:
            xf = x.float()
            x1, x2 = xf[..., :half], xf[..., half:2 * half]
            if ctx.needs_input_grad[1]:
                dcos = (g1 * x1 + g2 * x2).sum(-2).sum_to_size(cos.shape)
            if ctx.needs_input_grad[2]:
                dsin = (g2 * x1 - g1 * x2).sum(-2).sum_to_size(sin.shape)
        return dx, dcos, dsin


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`rope_forward`, differentiable in ``x`` (and in ``cos`` / ``sin`` if they require it)."""
    if _needs_grad(x, cos, sin):
        return _Rope.apply(x, cos, sin)
    return rope_forward(x, cos, sin)


def _attention_backward(q, k, v, keep, out, grad, max_elements):
    """The softmax-attention gradient in fp32, query rows in chunks (``max_elements`` bounds a chunk's ``[rows, L,
    H]`` scores, or its ``[rows, L, H, d]`` keys for per-row key sets): ``p`` recomputed from ``q``, ``k`` and the
    mask (torch's softmax), ``D = rowsum(dO * O)`` from the saved output. A row with no kept key (NaN forward)
    contributes no gradient."""
    Q, H, d = q.shape
    L = k.shape[1]
    shared = k.shape[0] == 1
    scale = 1.0 / math.sqrt(d)
    f32 = torch.float32
    dq = torch.empty(q.shape, dtype=f32, device=q.device)
    dk = torch.zeros(k.shape, dtype=f32, device=q.device)
    dv = torch.zeros(v.shape, dtype=f32, device=q.device)
    if shared:
        ks_all, vs_all = k[0].to(f32), v[0].to(f32)
    pat = "lhd" if shared else "qlhd"
    step = max(1, max_elements // max(1, L * H * (1 if shared else d)))
    live = keep.any(-1)
    for start in range(0, Q, step):
        sl = slice(start, min(Q, start + step))
        qf, g, o = q[sl].to(f32), grad[sl].to(f32), out[sl].to(f32)
        ks, vs = (ks_all, vs_all) if shared else (k[sl].to(f32), v[sl].to(f32))
        s = torch.einsum(f"qhd,{pat}->qlh", qf, ks) * scale
        p = torch.softmax(s.masked_fill(~keep[sl, :, None], float("-inf")), dim=1)
        p = p.masked_fill(~live[sl, None, None], 0.0)
        o = o.masked_fill(~live[sl, None, None], 0.0)
        dp = torch.einsum(f"qhd,{pat}->qlh", g, vs)
        ds = p * (dp - (g * o).sum(-1)[:, None, :])
        dq[sl] = torch.einsum(f"qlh,{pat}->qhd", ds, ks) * scale
        if shared:
            dk[0] += torch.einsum("qlh,qhd->lhd", ds, qf) * scale
            dv[0] += torch.einsum("qlh,qhd->lhd", p, g)
        else:
            dk[sl] = torch.einsum("qlh,qhd->qlhd", ds, qf) * scale
            dv[sl] = torch.einsum("qlh,qhd->qlhd", p, g)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _Attention(torch.autograd.Function):
    """:func:`attention`'s backward: :func:`_attention_backward` (saves ``q``, ``k``, ``v``, ``keep`` and the
    output)."""

    @staticmethod
    def forward(ctx, q, k, v, keep, max_elements, prefix):
        out = attention_forward(q, k, v, keep, max_elements=max_elements, prefix=prefix)
        ctx.save_for_backward(q, k, v, keep, out)
        ctx.max_elements = max_elements
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, keep, out = ctx.saved_tensors
        return (*_attention_backward(q, k, v, keep, out, grad, ctx.max_elements), None, None, None)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
              max_elements: int = 1 << 24, prefix: bool = False) -> torch.Tensor:
    """:func:`attention_forward`, differentiable in ``q``, ``k`` and ``v`` (``max_elements`` bounds the backward's
    chunks of query rows)."""
    if _needs_grad(q, k, v):
        return _Attention.apply(q, k, v, keep, max_elements, prefix)
    return attention_forward(q, k, v, keep, max_elements=max_elements, prefix=prefix)


class _Gates(torch.autograd.Function):
    """Softmax gradients onto the chosen logits (``renormalize``: the softmax over the chosen ones,
    ``dz = G (g - sum(g G))``) or onto every logit (the full softmax: ``dz = scatter(g G) - P sum(g G)``, ``P``
    recomputed)."""

    @staticmethod
    def forward(ctx, logits, ids, renormalize):
        out = gates_forward(logits, ids, renormalize=renormalize)
        ctx.save_for_backward(None if renormalize else logits, ids, out)
        ctx.shape = logits.shape
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        logits, ids, out = ctx.saved_tensors
        gg = grad.float() * out
        total = gg.sum(-1, keepdim=True)
        dz = torch.zeros(ctx.shape, dtype=torch.float32, device=out.device)
        if logits is None:
            dz.scatter_(1, ids.long(), gg - out * total)
        else:
            dz.scatter_(1, ids.long(), gg)
            dz -= torch.softmax(logits, -1) * total
        return dz, None, None


def gates(logits: torch.Tensor, ids: torch.Tensor, *, renormalize: bool) -> torch.Tensor:
    """:func:`gates_forward`, differentiable in ``logits``."""
    if _needs_grad(logits):
        return _Gates.apply(logits, ids, renormalize)
    return gates_forward(logits, ids, renormalize=renormalize)


def _silu_mul_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``d [g, u]`` of ``silu(g) * u`` (fp32): ``dg = dA u s (1 + g (1 - s))``, ``du = dA g s``, ``s = sigmoid(g)``."""
    inter = gate_up.shape[1] // 2
    g, u = gate_up[:, :inter], gate_up[:, inter:]
    s = torch.sigmoid(g)
    da = grad.float()
    return torch.cat([da * u * (s * (1.0 + g * (1.0 - s))), da * (g * s)], 1)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, dtype):
        ctx.save_for_backward(gate_up)
        return silu_mul_forward(gate_up, dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        return _silu_mul_backward(gate_up, grad), None


def silu_mul(gate_up: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`silu_mul_forward`, differentiable in ``gate_up``."""
    if _needs_grad(gate_up):
        return _SiluMul.apply(gate_up, dtype)
    return silu_mul_forward(gate_up, dtype)


#: ``(BLOCK_P, BLOCK_N, BLOCK_K)`` of the experts' weight-gradient kernel per dtype (``P`` the pairs reduced over).
WGRAD_TILES = {
    torch.float32: (32, 32, 32),
    torch.float16: (32, 64, 64),
    torch.bfloat16: (32, 64, 64),
}


@_jit()
def _wgrad_kernel(a_ptr, b_ptr, brows_ptr, groups_ptr, out_ptr, N, K, n_experts,
                  stride_ap, stride_an, stride_bm, stride_bk, stride_oe, stride_on, stride_ok,
                  GATHER_B: tl.constexpr, FP32_IEEE: tl.constexpr,
                  BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[e] = sum over e's pairs p of a[p]^T b[rows[p]]`` (``[N, K]`` per expert): one program per (expert,
    output tile), a loop over the expert's ``[start, end)`` of the sorted pairs, fp32 accumulation in ``tl.dot``."""
    e = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    rn = (tile // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    rp = tl.arange(0, BLOCK_P)
    start = tl.load(groups_ptr + e)
    end = tl.load(groups_ptr + n_experts + e)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for p0 in range(start, end, BLOCK_P):
        pos = p0 + rp
        live = pos < end
        a = tl.load(a_ptr + pos[None, :].to(tl.int64) * stride_ap + rn[:, None] * stride_an,
                    mask=live[None, :] & (rn[:, None] < N), other=0.0)
        if GATHER_B:
            brow = tl.load(brows_ptr + pos, mask=live, other=0).to(tl.int64)
        else:
            brow = pos.to(tl.int64)
        b = tl.load(b_ptr + brow[:, None] * stride_bm + rk[None, :] * stride_bk,
                    mask=live[:, None] & (rk[None, :] < K), other=0.0)
        if FP32_IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(out_ptr + e * stride_oe + rn[:, None] * stride_on + rk[None, :] * stride_ok, acc,
             mask=(rn[:, None] < N) & (rk[None, :] < K))


def _grouped_wgrad(a: torch.Tensor, b: torch.Tensor, b_rows: torch.Tensor | None, groups: torch.Tensor,
                   n_experts: int) -> torch.Tensor:
    """Per expert ``sum_p a[p] (outer) b[b_rows[p]]`` over its sorted pairs (``groups [2, E]``: each expert's
    ``[start, end)``) -> ``[E, N, K]`` fp32; ``a [P, N]`` and ``b`` in one dtype."""
    N, K = a.shape[1], b.shape[1]
    out = torch.empty((n_experts, N, K), dtype=torch.float32, device=a.device)
    block_p, block_n, block_k = WGRAD_TILES[a.dtype]
    grid = (n_experts, triton.cdiv(N, block_n) * triton.cdiv(K, block_k))
    _wgrad_kernel[grid](a, b, b_rows if b_rows is not None else groups, groups, out, N, K, n_experts,
                        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                        out.stride(2), GATHER_B=b_rows is not None, FP32_IEEE=a.dtype == torch.float32,
                        BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **_LAUNCH)
    return out


class _Experts(torch.autograd.Function):
    """The grouped experts' backward on the forward's schedule (pairs sorted by expert, the same tiles), in the
    activation dtype with fp32 accumulation (the upstream gradient is cast to it, as a stock bf16 backward does):
    ``dA = dY @ W2[e]`` (the linear kernel, ``W2`` read transposed), the SwiGLU's derivative on the saved fp32
    gate / up roots, ``dx = sum over slots of d[g, u] @ W13[e]``; ``dW2[e] = sum dY^T A``, ``dW13[e] = sum d[g, u]^T
    x`` (:func:`_grouped_wgrad`, ``A`` recomputed by the SwiGLU kernel). Saves ``x``, the weights, the gate / up
    roots ``[T k, 2I]`` fp32 and the schedule."""

    @staticmethod
    def forward(ctx, x, ids, w13, w2, leaf_width):
        out, schedule = _experts_run(x, ids, w13, w2, _experts_inputs(x, ids, w13, w2, leaf_width))
        ctx.schedule = schedule is not None
        ctx.leaf_width = leaf_width
        ctx.k = ids.shape[1]
        if schedule is None:
            ctx.save_for_backward(x, w13, w2)
            return out
        gate_up, perm, tokens, pairs, tiles, n_tiles, groups = schedule
        ctx.n_tiles = n_tiles
        ctx.save_for_backward(x, w13, w2, gate_up, perm, tokens, pairs, *tiles, groups)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, w13, w2, *rest = ctx.saved_tensors
        if not ctx.schedule:
            return torch.zeros_like(x), None, torch.zeros_like(w13), torch.zeros_like(w2), None
        gate_up, perm, tokens, pairs, tile_expert, start, end, groups = rest
        dt, lw = x.dtype, ctx.leaf_width
        T, H = x.shape
        E, I = w2.shape[0], w2.shape[2]
        tiles = (tile_expert, start, end)
        dy = grad.reshape(-1, H)[perm].to(dt)                               # expert-sorted pairs
        dx = dw13 = dw2 = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            dact = torch.empty((perm.numel(), I), dtype=torch.float32, device=x.device)
            _launch_tree(dy, w2.to(dt).transpose(1, 2), dact, None, lw, (pairs, *tiles), ctx.n_tiles)
            dgu = _silu_mul_backward(gate_up, dact).to(dt)
        if ctx.needs_input_grad[0]:
            dxe = torch.empty((perm.numel(), H), dtype=torch.float32, device=x.device)
            _launch_tree(dgu, w13.to(dt).transpose(1, 2), dxe, None, lw, (pairs, *tiles), ctx.n_tiles)
            dx = torch.empty_like(dxe).index_copy_(0, perm, dxe).view(T, ctx.k, H).sum(1).to(dt)
        if ctx.needs_input_grad[2]:
            dw13 = _grouped_wgrad(dgu, x, tokens, groups, E).to(w13.dtype)
        if ctx.needs_input_grad[3]:
            dw2 = _grouped_wgrad(dy, silu_mul_forward(gate_up, dt), None, groups, E).to(w2.dtype)
        return dx, None, dw13, dw2, None


def experts(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
            leaf_width: int = LEAF_WIDTH) -> torch.Tensor:
    """:func:`experts_forward`, differentiable in ``x``, ``w13`` and ``w2`` (not in ``ids``: routing is a
    choice)."""
    if _needs_grad(x, w13, w2):
        return _Experts.apply(x, ids, w13, w2, leaf_width)
    return experts_forward(x, ids, w13, w2, leaf_width=leaf_width)


class _Combine(torch.autograd.Function):
    """``d partials[:, j] = g * gates[:, j]``, ``d gates[:, j] = sum(g * partials[:, j])`` (fp32)."""

    @staticmethod
    def forward(ctx, partials, gates, dtype):
        ctx.save_for_backward(partials if ctx.needs_input_grad[1] else None, gates if ctx.needs_input_grad[0] else None)
        return combine_forward(partials, gates, dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        partials, gates = ctx.saved_tensors
        g = grad.float()
        dp = g[:, None, :] * gates[:, :, None] if ctx.needs_input_grad[0] else None
        dg = torch.einsum("th,tkh->tk", g, partials) if ctx.needs_input_grad[1] else None
        return dp, dg, None


def combine(partials: torch.Tensor, gates: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`combine_forward`, differentiable in ``partials`` and ``gates``."""
    if _needs_grad(partials, gates):
        return _Combine.apply(partials, gates, dtype)
    return combine_forward(partials, gates, dtype)


class _LogSoftmax(torch.autograd.Function):
    """``dx = g - exp(out) * sum(g)`` from the saved fp32 output."""

    @staticmethod
    def forward(ctx, x, dim):
        out = log_softmax_forward(x, dim)
        ctx.save_for_backward(out)
        ctx.dim, ctx.x_dtype = dim, x.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        g = grad.float()
        return (g - torch.exp(out) * g.sum(ctx.dim, keepdim=True)).to(ctx.x_dtype), None


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """:func:`log_softmax_forward`, differentiable in ``x``."""
    if _needs_grad(x):
        return _LogSoftmax.apply(x, dim)
    return log_softmax_forward(x, dim)


#: Each op of :data:`~moealign.precision.canonical.SPEC` -> the ``c_*`` functions it covers -> the Triton function
#: that stands for it on CUDA, with the same call signature, differentiable as the ``c_*`` function is (``topk``: no
#: gradient).
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
