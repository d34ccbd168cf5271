"""The canonical forward: one implementation of every op of an MoE decoder, whose bits depend on nothing but
the op's own inputs, so two engines that both run it agree bit for bit.

Why the stock ops cannot: each engine has its own kernels (oneDNN / MKL GEMMs, fused RMSNorm, paged attention,
fused MoE), and even one kernel's result depends on the batch size (GEMV vs GEMM), the thread count (a
reduction split across threads), the vector width (an element in a vector's tail takes the scalar path: a
``torch.exp`` of one value differs between SLEEF and libm) and the tensor-parallel cut. The canonical ops
remove every such dependency *by construction*, using only operations whose IEEE result is fixed:

* **Elementwise add, subtract, multiply, divide, sqrt, comparisons, max, rounding, frexp and dtype casts**:
  correctly rounded (or exact) in every code path, scalar or vector, on any thread.
* **Sums** (:func:`~moealign.precision.batch_invariant.fixed_tree_sum` and the leaf tree of
  :mod:`moealign.precision.tree`): fixed trees of elementwise adds. The tree over a key axis pads to a power of
  two, so a row with trailing zeros (masked keys) sums the same whatever the axis length: a decode step over
  ``t + 1`` cached keys equals row ``t`` of a full-sequence forward.
* **exp and log** (:func:`c_exp`, :func:`c_log`): range reduction and a fixed polynomial evaluated in float64
  with elementwise ops only (error far below float32's rounding), then one rounding to the input dtype. No
  libm, no SLEEF: the same bits in every position, process and engine.
* **Linear layers** (:func:`c_linear`): :func:`~moealign.precision.tree.tree_linear` (each output element is
  the leaf tree of its ``K`` products in fp32, leaf width :data:`LEAF_WIDTH`), so TP shards of ``K`` give
  subtree roots that :func:`~moealign.precision.tree.tree_all_reduce` turns into the same bits as TP = 1.
* **RoPE** (:func:`rope_cos_sin`): the cos / sin table is built in fixed 256-position chunks of float64
  (under torch's parallel grain, so one thread; the same shape every time), rounded to float32 once.

The formulas (one per op; both engines are patched to call exactly these):

=================  ==========================================================================================
RMSNorm            ``y = (x32 * (1 / sqrt(tree_sum(x32 * x32) / H + eps))).to(dtype) * w`` (residual add in
                   the activation dtype before it, as both engines do)
linear             ``tree_linear(x, W)`` (fp32 nodes) ``+ b``, cast to the activation dtype once
RoPE (NeoX)        ``[x1 * cos - x2 * sin, x2 * cos + x1 * sin]`` in fp32, cast once; cos / sin from the table
attention          per query row over its own valid keys (compacted to the front): ``s = tree_sum(q * k) *
                   (1 / sqrt(d))``, ``p = c_exp(s - max s)``, ``o = tree_sum(p * v) / tree_sum(p)``; fp32, cast once
router             logits = ``tree_linear(x, W_router)`` kept in fp32; top-k by a stable descending sort
                   (ties: the lower expert id); gates over the chosen experts taken in ascending expert id:
                   ``softmax`` of their logits (``renormalize``) or the full softmax's values
experts            per (token, expert): ``act = (silu(g) * u).to(dtype)`` from the fp32 gate / up roots,
                   ``y = tree_linear(act, W_down)`` (fp32; the TP partials tree-reduced)
combine            ``sum_j gate_j * y_j`` over the chosen experts in ascending expert id, fp32, cast once
log-softmax        ``x - max - c_log(fixed_tree_sum(c_exp(x - max)))`` in fp32 (``-inf`` entries stay ``-inf``)
DeepSeek-V3        rope: de-interleave, then NeoX (:func:`c_rope_deinterleaved`); MLA attention: ``c_attention``
                   over ``[k_nope; k_pe]`` with ``v`` of its own head dim (``kv = c_linear(kv_c_normed, W_kv_b)``);
                   router: :func:`c_grouped_topk` on ``c_sigmoid(logits) + bias``, :func:`c_sigmoid_gates`
                   (unbiased, ``/ (tree_sum + 1e-20)``); routed output ``c_combine(...) * routed_scaling_factor``
                   then ``+ shared`` (activation dtype); shared expert / dense layers: ``c_linear``,
                   :func:`c_silu_and_mul`, ``c_linear``
=================  ==========================================================================================

Everything is differentiable (autograd through the elementwise ops; :func:`c_exp` / :func:`c_log` carry their
own exact derivatives), so a trainer runs its backward through the same forward. The price is speed: these
are elementwise-product kernels, not GEMMs (see ``tools/bench_aligned.py``).

**On CUDA** each ``c_*`` op whose input is a CUDA tensor runs its Triton kernel instead
(:data:`moealign.precision.canonical_triton.TRITON_OPS`, imported on first use; the choice is a device attribute
check, no host sync): the same formula, its bits fixed on a given card (not equal to this CPU definition's). The ops
with no Triton kernel (DeepSeek-V3's :func:`c_sigmoid`, :func:`c_grouped_topk`, :func:`c_sigmoid_gates`,
:func:`c_rope_deinterleaved`) refuse CUDA by name; :func:`c_silu_and_mul` runs the kernels' SwiGLU. The backend is
:data:`BACKENDS`: ``MOEALIGN_CANONICAL_BACKEND`` (read once, at import) or :func:`canonical_backend` (a scoped switch,
per function: the tests' way to run the Triton path on CPU tensors under ``TRITON_INTERPRET=1``, and a negative
control that leaves one op on this definition).
"""

from __future__ import annotations

import math
import os

import torch

from ..errors import CanonicalError
from .batch_invariant import fixed_tree_sum, kept_first
from ._tree_kernel import leaf_tree_linear
from .tree import CANONICAL_LEAF_WIDTH, node_dtype_for, tree_linear, tree_sum

__all__ = [
    "LEAF_WIDTH",
    "OPS",
    "SPEC",
    "BACKENDS",
    "BACKEND_ENV",
    "TRITON_FAMILIES",
    "engine_ops",
    "canonical_backend",
    "parse_backend",
    "default_backend",
    "on_triton",
    "check_device_backend",
    "route_ids",
    "CanonicalError",
    "c_exp",
    "c_log",
    "c_silu",
    "c_silu_and_mul",
    "c_sigmoid",
    "c_log_softmax",
    "c_linear",
    "c_rms_norm",
    "rope_cos_sin",
    "c_rope",
    "c_rope_deinterleaved",
    "c_attention",
    "kept_first",
    "c_topk",
    "c_gates",
    "c_grouped_topk",
    "c_sigmoid_gates",
    "c_experts",
    "c_combine",
    "log_softmax_mode",
    "covered_families",
    "rope_problems",
    "check_canonical_model",
    "check_canonical_tp",
]

#: The leaf width of every canonical linear layer (both engines must use one value: it fixes the tree; defined
#: in :mod:`.tree` beside the trees, so that the Triton kernels read it without importing this module).
LEAF_WIDTH = CANONICAL_LEAF_WIDTH

#: The canonical forward's spec: each op, what it covers, and where each engine binding installs it (None: that
#: engine has no such op to patch; the scorer runs it under :func:`log_softmax_mode`). The one list both bindings
#: (:mod:`moealign.patches.vllm.canonical`, :mod:`moealign.patches.megatron.canonical`), the audit and the diagnosis
#: read.
SPEC = {
    "linear": ("every linear layer but the router and the LM head: c_linear (the leaf tree, TP-invariant); MLA's "
               "q / kv down and up projections included (vLLM's fused q_a + kv_a projection: the same per-column trees)",
               {"vllm": "UnquantizedLinearMethod.apply, RowParallelLinear.forward (the tree forward)",
                "megatron": "ColumnParallelLinear / RowParallelLinear.forward",
                "hf": "the attention's nn.Linear.forward (q / k / v / o_proj)"}),
    "norm": ("RMSNorm (with vLLM's fused residual add; MLA's q / kv layernorms): c_rms_norm",
             {"vllm": "RMSNorm.forward_native / forward_cpu", "megatron": "torch.nn.RMSNorm.forward",
              "hf": "Qwen3MoeRMSNorm.forward"}),
    "rope": ("rotary embedding from the canonical table: c_rope (NeoX style); an interleaved rope (DeepSeek's MLA) "
             "de-interleaved first, c_rope_deinterleaved (its output in the NeoX layout on both engines)",
             {"vllm": "RotaryEmbedding.forward", "megatron": "apply_rotary_pos_emb (as the attention / MLA reads it)",
              "hf": "Qwen3MoeAttention.forward (position_ids)"}),
    "attention": ("each query row over its own valid keys: c_attention; MLA non-absorbed: k = [c_linear(kv_c_normed, "
                  "W_kv_b)'s nope part; k_pe], v its v part, scale 1 / sqrt(qk head dim)",
                  {"vllm": "CPUAttentionBackendImpl.forward (+ a shadow KV cache); MLAAttention.forward_impl "
                           "(+ a shadow cache of the expanded keys / values, written in CPUMLAImpl.do_kv_cache_update)",
                   "megatron": "DotProductAttention.forward (LocalMLACoreAttention for MLA)",
                   "hf": "attn_implementation 'moealign_canonical' (its boolean mask, the KV cache as is)"}),
    "router": ("fp32 router logits; softmax routers: top-k (ties: the lower id) in ascending ids, c_gates; sigmoid "
               "routers (DeepSeek-V3): c_grouped_topk (bias for selection only, groups by their top-2 sum) and "
               "c_sigmoid_gates (unbiased, normalised)",
               {"vllm": "GateLinear, FusedTopKRouter / CPURouter._compute_routing",
                "megatron": "TopKRouter.gating / routing",
                "hf": "a forward hook on Qwen3MoeTopKRouter (replay's forced ids kept)"}),
    "experts": ("per (token, expert) c_experts, combined in ascending expert id: c_combine; then * "
                "routed_scaling_factor (activation dtype) and + the shared expert's output (activation dtype); the "
                "shared expert and dense MLP layers: c_linear, c_silu_and_mul, c_linear",
                {"vllm": "RoutedExperts.forward_modular (the tree forward's experts), SiluAndMul.forward",
                 "megatron": "MoELayer.forward, MLP.forward (dense and shared)",
                 "hf": "Qwen3MoeExperts.forward"}),
    "lm_head": ("the output layer: c_linear", {"vllm": "UnquantizedEmbeddingMethod.apply",
                                               "megatron": "the output ColumnParallelLinear",
                                               "hf": "get_output_embeddings().forward"}),
    "log_softmax": ("the processed log-probs: c_log_softmax",
                    {"vllm": "TopKTopPSampler.forward_cpu / forward_native", "megatron": None,
                     "hf": "generate_with_record under log_softmax_mode (the rollout engine)"}),
}

#: The canonical ops, as the engines' patches, the audit and the diagnosis name them.
OPS = tuple(SPEC)


def engine_ops(engine: str) -> tuple[str, ...]:
    """The ops of :data:`SPEC` an engine binding installs (``"vllm"``, ``"megatron"`` or ``"hf"``)."""
    return tuple(op for op, (_, where) in SPEC.items() if where.get(engine) is not None)

# --------------------------------------------------------------------------------------------------------
# The backend: the CPU definition below, or the Triton kernels (canonical_triton) for CUDA tensors

#: ``"auto"``: a ``c_*`` op on a CUDA tensor runs its Triton kernel, on any other tensor the definition in this module;
#: ``"triton"``: every call runs the Triton kernels (CPU tensors only under ``TRITON_INTERPRET=1``: the tests run the
#: dispatch and the bindings end to end without a GPU); ``"cpu"``: this module's definition everywhere (CUDA tensors
#: too: slow, a negative control).
BACKENDS = ("auto", "triton", "cpu")
#: The environment variable naming the process's default backend (read once, when this module is imported).
BACKEND_ENV = "MOEALIGN_CANONICAL_BACKEND"
#: The families whose every op has a Triton kernel: those ``--aligned`` covers on CUDA (DeepSeek-V3's sigmoid grouped
#: router, MLA's rope and value head dim and its dense SwiGLU layers have none).
TRITON_FAMILIES = ("qwen3_moe",)
#: The ``c_*`` functions that run their Triton kernel on the Triton backend, and those with none (refused there).
_DISPATCHED = ("c_linear", "c_rms_norm", "c_rope", "c_attention", "c_topk", "c_gates", "c_experts", "c_combine",
               "c_log_softmax", "c_silu_and_mul")
_NO_TRITON = ("c_sigmoid", "c_grouped_topk", "c_sigmoid_gates", "c_rope_deinterleaved")


def parse_backend(value: str | None, what: str = BACKEND_ENV) -> str:
    """A backend name of :data:`BACKENDS` (``None`` or empty: ``"auto"``), else a :class:`CanonicalError` naming it."""
    value = "auto" if value is None or not str(value).strip() else str(value).strip().lower()
    if value not in BACKENDS:
        raise CanonicalError(f"{what}={value!r}: the canonical ops' backend is one of {', '.join(BACKENDS)}")
    return value


try:                                  # read once; a bad value is named by default_backend(), never ignored
    _BACKEND, _BACKEND_ERROR = parse_backend(os.environ.get(BACKEND_ENV)), None
except CanonicalError as exc:
    _BACKEND, _BACKEND_ERROR = "auto", str(exc)
_ROUTES: dict[str, str] = {}          # c_* name -> backend, set by canonical_backend (scoped)
_TRITON_FUNCTIONS: dict = {}          # c_* name -> its Triton function (filled on first use)


def default_backend() -> str:
    """The process's backend, :data:`BACKEND_ENV` as read when this module was imported (``"auto"`` when unset); a
    value outside :data:`BACKENDS` raises a :class:`CanonicalError` naming it (here, and from every op and check that
    reads the backend: the commands' option checks call this first, before any work)."""
    if _BACKEND_ERROR is not None:
        raise CanonicalError(_BACKEND_ERROR)
    return _BACKEND


def on_triton(x: torch.Tensor | torch.device | str, name: str = "c_linear") -> bool:
    """Whether the ``c_*`` function ``name`` runs its Triton kernel for ``x`` (a tensor, or the device its inputs are
    on) under the current backend. A device attribute read: no host sync."""
    backend = _ROUTES.get(name) or default_backend()
    if backend == "auto":
        return (x.is_cuda if isinstance(x, torch.Tensor) else torch.device(x).type == "cuda")
    return backend == "triton"


def _kernel(name: str):
    """The Triton function standing for ``name`` (:data:`~moealign.precision.canonical_triton.TRITON_OPS`)."""
    fn = _TRITON_FUNCTIONS.get(name)
    if fn is None:
        from . import canonical_triton

        for functions in canonical_triton.TRITON_OPS.values():
            _TRITON_FUNCTIONS.update(functions)
        _TRITON_FUNCTIONS.setdefault("c_silu_and_mul", _triton_silu_and_mul)
        fn = _TRITON_FUNCTIONS[name]
    return fn


def _triton_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """:func:`c_silu_and_mul` on the kernels' SwiGLU (``silu_mul`` of the fp32 halves, one cast; exact upcast)."""
    from .canonical_triton import silu_mul

    half = x.shape[-1] // 2
    out = silu_mul(x.reshape(-1, x.shape[-1]).to(torch.float32), x.dtype)
    return out.reshape(*x.shape[:-1], half)


def _refuse_triton(name: str, x: torch.Tensor) -> None:
    if on_triton(x, name):
        raise CanonicalError(f"{name}: the canonical forward has no Triton kernel for it (DeepSeek-V3's sigmoid "
                             f"grouped router and MLA's rope), so it does not run on CUDA; on CUDA --aligned covers "
                             f"{list(TRITON_FAMILIES)}")


def canonical_backend(backend: str, functions=None):
    """Run the ``c_*`` ``functions`` (default: every one) on ``backend`` (:data:`BACKENDS`) until the returned
    :class:`~moealign.handle.PatchHandle` is undone (a context manager; process-wide, nested uses restore what they
    found). ``canonical_backend("triton")`` under ``TRITON_INTERPRET=1`` runs the Triton kernels on CPU tensors;
    ``canonical_backend("cpu", ["c_rms_norm"])`` leaves one op on the CPU definition (a negative control)."""
    from ..handle import PatchHandle

    backend = parse_backend(backend, "backend")
    known = list(_DISPATCHED + _NO_TRITON)
    names = known if functions is None else list(functions)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise CanonicalError(f"canonical_backend: unknown functions {unknown}; the canonical functions are {known}")
    saved = {n: _ROUTES.get(n) for n in names}
    handle = PatchHandle(f"canonical backend {backend} for {', '.join(names) if functions is not None else 'every op'}",
                         "process")
    _ROUTES.update(dict.fromkeys(names, backend))

    def restore() -> None:
        for n, value in saved.items():
            if value is None:
                _ROUTES.pop(n, None)
            else:
                _ROUTES[n] = value

    handle.add_callback(restore, "the canonical ops' backend")
    return handle


def check_device_backend(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Where a binding installs the canonical forward (once, before any work): ``True`` when its ops will run the
    Triton kernels on ``device`` (``check_canonical_cuda(device, dtype)`` then refuses, by name, what the kernels do not
    cover: no Triton, an older GPU, the dtype, TF32 switched on; a CPU device is left to the interpreter's tests)."""
    if not on_triton(device):
        return False
    if torch.device(device).type == "cuda":
        from .canonical_triton import check_canonical_cuda

        check_canonical_cuda(device, dtype)
    return True


_LN2_HI = 6.93147180369123816490e-01      # fdlibm's split of ln 2: n * _LN2_HI is exact for |n| < 2**11
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00
_LN2 = math.log(2.0)
_EXP_COEFFS = [1.0 / math.factorial(k) for k in range(14)]        # Taylor on |r| <= ln2 / 2: error < 1e-17
_SQRT_HALF = math.sqrt(0.5)


def _float_out(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32


def _exp64(x: torch.Tensor) -> torch.Tensor:
    """exp of a float64 tensor from elementwise ops only (range reduction, Horner, 2**n built from bits)."""
    neg_inf = x == float("-inf")
    x = x.clamp(-746.0, 710.0)
    n = torch.floor(x * _INV_LN2 + 0.5)       # any integer near x / ln 2 serves (|r| <= 0.35); floor is cheap
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[-1])
    for c in reversed(_EXP_COEFFS[:-1]):
        p = p * r + c
    ni = n.to(torch.int64)
    half = torch.div(ni, 2, rounding_mode="floor")                 # 2**n as 2**half * 2**(n - half): no overflow
    two = lambda e: ((e + 1023) << 52).view(torch.float64)         # noqa: E731  (e in [-1022, 1023])
    out = p * two(half) * two(ni - half)
    return out.masked_fill(neg_inf, 0.0)


def _log64(x: torch.Tensor) -> torch.Tensor:
    """log of a float64 tensor from elementwise ops only (frexp, an atanh series, e * ln 2)."""
    m, e = torch.frexp(x)                     # x = m * 2**e, m in [0.5, 1)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    e = (e - small.to(e.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)                  # |s| <= 0.1716
    s2 = s * s
    acc = torch.full_like(s, 1.0 / 21.0)
    for k in range(19, 0, -2):
        acc = acc * s2 + 1.0 / k
    out = (2.0 * s * acc + e * _LN2_LO) + e * _LN2_HI
    out = torch.where(x == 0, float("-inf"), out)
    out = torch.where(x == float("inf"), float("inf"), out)
    return torch.where((x < 0) | torch.isnan(x), float("nan"), out)


class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = _exp64(x.to(torch.float64)).to(_float_out(x))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out


class _Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _log64(x.to(torch.float64)).to(_float_out(x))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / x


def c_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` with the same bits wherever the element sits (float32 out for half inputs; ``exp(-inf) = 0``)."""
    return _Exp.apply(x)


def c_log(x: torch.Tensor) -> torch.Tensor:
    """``log(x)`` with the same bits wherever the element sits (``log 0 = -inf``, negative -> NaN)."""
    return _Log.apply(x)


def c_silu(x: torch.Tensor) -> torch.Tensor:
    """``x / (1 + exp(-x))`` in fp32 (fp64 for fp64) with :func:`c_exp`."""
    xf = x.to(_float_out(x))
    return xf / (1.0 + c_exp(-xf))


def c_log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log_softmax`` in fp32 (fp64 for fp64): ``x - max - log(tree_sum(exp(x - max)))``; ``-inf`` stays ``-inf``."""
    if on_triton(x, "c_log_softmax"):
        return _kernel("c_log_softmax")(x, dim)
    xf = x.to(_float_out(x))
    shifted = xf - xf.amax(dim=dim, keepdim=True)
    return shifted - c_log(fixed_tree_sum(c_exp(shifted), dim)).unsqueeze(dim)


def c_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             out_dtype: torch.dtype | None = None, leaf_width: int = LEAF_WIDTH) -> torch.Tensor:
    """``x @ weight.T + bias``: the leaf tree of each output's products (fp32 nodes), cast once to ``out_dtype``
    (default ``x.dtype``; ``torch.float32`` keeps the root, e.g. the router's logits)."""
    if on_triton(x, "c_linear"):
        return _kernel("c_linear")(x, weight, bias, out_dtype=out_dtype, leaf_width=leaf_width)
    out = tree_linear(x, weight.to(x.dtype), leaf_width=leaf_width)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype or x.dtype)


def c_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``(x32 * (1 / sqrt(tree_sum(x32 * x32) / H + eps))).to(x.dtype) * weight``."""
    if on_triton(x, "c_rms_norm"):
        return _kernel("c_rms_norm")(x, weight, eps)
    xf = x.to(_float_out(x))
    var = fixed_tree_sum(xf * xf, -1).unsqueeze(-1) / x.shape[-1]
    y = (xf * (1.0 / torch.sqrt(var + eps))).to(x.dtype)
    return y if weight is None else y * weight.to(x.dtype)


_ROPE_CHUNK = 256
_ROPE_TABLES: dict[tuple[int, float, str], torch.Tensor] = {}


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[*positions.shape, rotary_dim // 2]`` float32 from the process's canonical table.

    ``inv_freq[i] = 1 / base ** (2i / rotary_dim)`` (Python floats); the table grows in fixed chunks of 256
    positions, each ``cos`` / ``sin`` of a ``[256, rotary_dim // 2]`` float64 tensor, so an entry's bits do not
    depend on how far the table reaches or who built it. Reading it syncs nothing (the table is sized from the
    engine's max position at setup: :func:`rope_reserve`).
    """
    key = (int(rotary_dim), float(base), str(positions.device))
    table = _ROPE_TABLES.get(key)
    if table is None:
        raise CanonicalError(f"the canonical RoPE table for rotary_dim={rotary_dim}, base={base} on "
                             f"{positions.device} was not reserved (rope_reserve at setup)")
    cs = table[positions.long()]
    return cs[..., 0, :], cs[..., 1, :]


def rope_reserve(max_positions: int, rotary_dim: int, base: float, device: torch.device | str = "cpu") -> None:
    """Build (or extend) the canonical cos / sin table to ``max_positions`` positions (setup time)."""
    if rotary_dim % 2 or rotary_dim <= 0:
        raise CanonicalError(f"the canonical RoPE needs an even rotary dim, got {rotary_dim}")
    key = (int(rotary_dim), float(base), str(torch.device(device)))
    have = _ROPE_TABLES.get(key)
    have_n = 0 if have is None else have.shape[0]
    want = -(-int(max_positions) // _ROPE_CHUNK) * _ROPE_CHUNK
    if want <= have_n:
        return
    half = rotary_dim // 2
    inv_freq = torch.tensor([1.0 / (float(base) ** (2 * i / rotary_dim)) for i in range(half)], dtype=torch.float64)
    chunks = [] if have is None else [have.cpu()]
    for start in range(have_n, want, _ROPE_CHUNK):
        pos = torch.arange(start, start + _ROPE_CHUNK, dtype=torch.float64)[:, None]
        freqs = pos * inv_freq[None]
        chunks.append(torch.stack([torch.cos(freqs), torch.sin(freqs)], dim=1).to(torch.float32))
    _ROPE_TABLES[key] = torch.cat(chunks).to(device)


def c_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation of the first ``2 * cos.shape[-1]`` dims of ``x [..., heads, head_dim]``; ``cos`` /
    ``sin`` ``[..., rot / 2]`` broadcast over heads. fp32 arithmetic, cast once; the rest of each head passes."""
    if on_triton(x, "c_rope"):
        return _kernel("c_rope")(x, cos, sin)
    half = cos.shape[-1]
    xf = x.to(_float_out(x))
    x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
    return out.to(x.dtype)


def c_rope_deinterleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """An interleaved (GPT-J style) rotary embedding of the first ``2 * cos.shape[-1]`` dims, as DeepSeek's MLA
    defines it: those dims de-interleaved (``[x0, x2, ..., x1, x3, ...]``, an exact permutation, what transformers'
    ``rope_interleave`` and Megatron's MLA do) and rotated by :func:`c_rope`. The output stays in the de-interleaved
    (NeoX) layout on both engines: query and key rows are permuted alike, and the attention's trees read them in that
    one order."""
    _refuse_triton("c_rope_deinterleaved", x)
    rot = 2 * cos.shape[-1]
    head = x[..., :rot]
    return c_rope(torch.cat([head[..., 0::2], head[..., 1::2], x[..., rot:]], dim=-1), cos, sin)


def route_ids(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """The routing step's one form: a ``[T, E]`` bool routing map (an engine's own selection, or replayed routes) ->
    the ``k`` chosen experts of each token in ascending expert id ``[T, k]`` (no host sync)."""
    return kept_first(routing_map.reshape(routing_map.shape[0], -1))[:, :k]


def _attention_rows(q, k, v, keep, max_elements, prefix):
    Q, H, d = q.shape
    L = k.shape[1]
    k, v = k.expand(Q, -1, -1, -1), v.expand(Q, -1, -1, -1)          # views: a shared key set costs nothing
    acc = _float_out(q)
    scale = 1.0 / math.sqrt(d)
    out = []
    step = max(1, max_elements // max(1, L * H * d))
    for start in range(0, Q, step):
        sl = slice(start, min(Q, start + step))
        if prefix:
            kept, ks, vs = keep[sl], k[sl].to(acc), v[sl].to(acc)
        else:
            order = kept_first(keep[sl])
            kept = torch.gather(keep[sl], 1, order)
            idx = order[:, :, None, None]                 # v's head dim may differ from q / k's (MLA)
            ks = torch.gather(k[sl], 1, idx.expand(-1, -1, H, d)).to(acc)
            vs = torch.gather(v[sl], 1, idx.expand(-1, -1, H, v.shape[-1])).to(acc)
        scores = fixed_tree_sum(q[sl].to(acc)[:, None] * ks, -1) * scale           # [q, L, H]
        scores = scores.masked_fill(~kept[:, :, None], float("-inf"))
        p = c_exp(scores - scores.amax(dim=1, keepdim=True))
        denom = fixed_tree_sum(p, 1)                                                # [q, H]
        o = fixed_tree_sum(p[..., None] * vs, 1)                                    # [q, H, d]
        out.append((o / denom[..., None]).to(q.dtype))
    return torch.cat(out) if len(out) > 1 else out[0]


class _Attention(torch.autograd.Function):
    """The canonical forward; the backward is the stock softmax-attention gradient (einsums in the compute dtype):
    a gradient need not have the forward's bits, and the elementwise graph would hold ``Q x L x H x d`` products."""

    @staticmethod
    def forward(ctx, q, k, v, keep, max_elements, prefix):
        ctx.save_for_backward(q, k, v, keep)
        return _attention_rows(q, k, v, keep, max_elements, prefix)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, keep = ctx.saved_tensors
        acc = _float_out(q)
        scale = 1.0 / math.sqrt(q.shape[-1])
        shared = k.shape[0] == 1
        kk, vv = (k[0].to(acc), v[0].to(acc)) if shared else (k.to(acc), v.to(acc))
        qf, g = q.to(acc), grad.to(acc)
        kpat, dpat = ("lhd", "lhd") if shared else ("qlhd", "qlhd")
        s = torch.einsum(f"qhd,{kpat}->qlh", qf, kk) * scale
        p = torch.softmax(s.masked_fill(~keep[:, :, None], float("-inf")), dim=1)
        o = torch.einsum(f"qlh,{kpat}->qhd", p, vv)
        dp = torch.einsum(f"qhd,{kpat}->qlh", g, vv)
        ds = p * (dp - (g * o).sum(-1)[:, None, :])
        dq = torch.einsum(f"qlh,{kpat}->qhd", ds, kk) * scale
        dk = torch.einsum(f"qlh,qhd->{dpat}", ds, qf) * scale
        dv = torch.einsum(f"qlh,qhd->{dpat}", p, g)
        if shared:
            dk, dv = dk[None], dv[None]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def c_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *,
                max_elements: int = 1 << 24, prefix: bool = False) -> torch.Tensor:
    """Attention of each query row over its own kept keys.

    ``q [Q, H, d]``; ``k, v [Q, L, H, d]`` or ``[1, L, H, d]`` (one key set shared by every query; heads already
    expanded for GQA; ``v``'s head dim may differ from ``d``: MLA); ``keep [Q, L]`` bool. Kept keys are compacted to the front (a stable device sort, no host
    sync; ``prefix=True``: the caller's keys already lead by construction, and the compaction, an identity then,
    is skipped), so the trees see the same leading values whatever the padding or the key axis length. Scale ``1 / sqrt(d)``. Returns ``[Q, H, v's head dim]`` in ``q.dtype``. Queries are
    processed in chunks bounded by ``max_elements`` products (no effect on the bits). Differentiable (the
    backward is the stock attention gradient).
    """
    if on_triton(q, "c_attention"):
        return _kernel("c_attention")(q, k, v, keep, max_elements=max_elements, prefix=prefix)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _Attention.apply(q, k, v, keep, max_elements, prefix)
    return _attention_rows(q, k, v, keep, max_elements, prefix)


def c_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` experts of each row ``[T, E]`` with the largest logits (stable: ties go to the lower id),
    returned in ascending expert id ``[T, k]`` int64."""
    if on_triton(logits, "c_topk"):
        return _kernel("c_topk")(logits, k)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.sort(order, dim=-1).values


def c_gates(logits: torch.Tensor, ids: torch.Tensor, *, renormalize: bool) -> torch.Tensor:
    """The gate of each chosen expert ``[T, k]`` fp32 from fp32 router logits ``[T, E]`` and ids ``[T, k]`` in
    ascending order: ``softmax`` over the chosen logits (``renormalize``: equal to the full softmax renormalised,
    in exact arithmetic) or the full softmax's value at each chosen expert."""
    if on_triton(logits, "c_gates"):
        return _kernel("c_gates")(logits, ids, renormalize=renormalize)
    lf = logits.to(torch.float32)
    if renormalize:
        chosen = torch.gather(lf, 1, ids)
        e = c_exp(chosen - chosen.amax(dim=-1, keepdim=True))
        return e / fixed_tree_sum(e, -1).unsqueeze(-1)
    full = c_exp(c_log_softmax(lf, -1))
    return torch.gather(full, 1, ids)


def _gathered_tree_forward(rows: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, leaf_width: int,
                           max_elements: int) -> torch.Tensor:
    """``out[r] = tree_linear(rows[r], weights[idx[r]])`` for every row at once (chunks of rows bounded by
    ``max_elements`` products): the same products and the same trees as :func:`c_linear`, so the same bits."""
    n, k = weights.shape[1:]
    nd = node_dtype_for(rows.dtype)
    fused = leaf_tree_linear(rows.to(nd), weights.to(nd), leaf_width, idx)    # the same bits, or None
    if fused is not None:
        return fused
    out = []
    step = max(1, max_elements // max(1, n * k))
    for start in range(0, rows.shape[0], step):
        sl = slice(start, start + step)
        prods = rows[sl].to(nd)[:, None, :] * weights[idx[sl]].to(nd)
        out.append(tree_sum(prods, dim=-1, leaf_width=leaf_width))
    return torch.cat(out) if len(out) > 1 else out[0]


class _GatheredTree(torch.autograd.Function):
    """The gathered tree's forward; the stock backward (einsums per chunk, the weight gradient index-added)."""

    @staticmethod
    def forward(ctx, rows, weights, idx, leaf_width, max_elements):
        ctx.save_for_backward(rows, weights, idx)
        ctx.max_elements = max_elements
        return _gathered_tree_forward(rows, weights, idx, leaf_width, max_elements)

    @staticmethod
    def backward(ctx, grad):
        rows, weights, idx = ctx.saved_tensors
        n, k = weights.shape[1:]
        step = max(1, ctx.max_elements // max(1, n * k))
        grad_rows = torch.empty(rows.shape, dtype=grad.dtype, device=grad.device)
        grad_w = torch.zeros(weights.shape, dtype=grad.dtype, device=grad.device)
        for start in range(0, rows.shape[0], step):
            sl = slice(start, start + step)
            w = weights[idx[sl]].to(grad.dtype)
            grad_rows[sl] = torch.einsum("cn,cnk->ck", grad[sl], w)
            grad_w.index_add_(0, idx[sl], torch.einsum("cn,ck->cnk", grad[sl], rows[sl].to(grad.dtype)))
        return grad_rows.to(rows.dtype), grad_w.to(weights.dtype), None, None, None


def _gathered_tree(rows, weights, idx, leaf_width: int, max_elements: int = 1 << 22) -> torch.Tensor:
    if torch.is_grad_enabled() and (rows.requires_grad or weights.requires_grad):
        return _GatheredTree.apply(rows, weights, idx, leaf_width, max_elements)
    return _gathered_tree_forward(rows, weights, idx, leaf_width, max_elements)


def c_experts(x: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
              leaf_width: int = LEAF_WIDTH) -> torch.Tensor:
    """Each (token, slot)'s expert output ``[T, k, H]`` fp32 (the down projection's root: on a TP shard of the
    expert's intermediate axis, that shard's subtree root, to be tree-all-reduced).

    ``w13 [E, 2I, H]`` (gate rows first) and ``w2 [E, H, I]``: every expert's weights, stacked, in ``x``'s dtype.
    All (token, slot) pairs are computed at once (each gathers its expert's weights), so the bits are those of
    :func:`c_linear` per pair, without a Python loop over experts or a host sync.
    """
    if on_triton(x, "c_experts"):
        return _kernel("c_experts")(x, ids, w13, w2, leaf_width=leaf_width)
    T, k = ids.shape
    flat = ids.reshape(-1)
    inter = w13.shape[1] // 2
    xe = x.repeat_interleave(k, dim=0)
    gate_up = _gathered_tree(xe, w13, flat, leaf_width)
    act = (c_silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype)
    return _gathered_tree(act, w2, flat, leaf_width).view(T, k, -1)


def c_combine(partials: torch.Tensor, gates: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``sum_j gates[:, j] * partials[:, j]`` left to right over the (ascending-id) slots, fp32, cast once."""
    if on_triton(partials, "c_combine"):
        return _kernel("c_combine")(partials, gates, dtype)
    g = gates.to(torch.float32)
    out = partials[:, 0] * g[:, :1]
    for j in range(1, partials.shape[1]):
        out = out + partials[:, j] * g[:, j:j + 1]
    return out.to(dtype)


def c_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU's activation: ``x = [g, u]`` (gate half first, the activation dtype, as a linear layer's output)
    -> ``(c_silu(g) * u).to(x.dtype)`` (fp32 arithmetic, cast once). The shared expert and the dense MLP layers."""
    if on_triton(x, "c_silu_and_mul"):
        return _kernel("c_silu_and_mul")(x)
    half = x.shape[-1] // 2
    return (c_silu(x[..., :half]) * x[..., half:].to(_float_out(x))).to(x.dtype)


def c_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + c_exp(-x))`` in fp32 (fp64 for fp64): the sigmoid router's scores."""
    _refuse_triton("c_sigmoid", x)
    xf = x.to(_float_out(x))
    return 1.0 / (1.0 + c_exp(-xf))


def c_grouped_topk(logits: torch.Tensor, k: int, *, bias: torch.Tensor | None = None, n_group: int = 1,
                   topk_group: int = 1) -> torch.Tensor:
    """DeepSeek-V3's selection from fp32 router logits ``[T, E]``: ``scores = c_sigmoid(logits)``, ``+ bias`` (the
    ``e_score_correction_bias``; selection only), a group's score the sum of its two best biased scores (its best one
    when a group holds one expert), the ``topk_group`` best groups kept (stable: ties to the lower group id), the
    other groups' experts masked to ``-inf``, then :func:`c_topk` (ties to the lower expert id). Returns the ``k``
    chosen ids ascending ``[T, k]`` int64."""
    _refuse_triton("c_grouped_topk", logits)
    scores = c_sigmoid(logits.to(torch.float32))
    if bias is not None:
        scores = scores + bias.to(torch.float32)
    T, E = scores.shape
    if n_group > 1 and topk_group < n_group:
        grouped = scores.view(T, n_group, E // n_group)
        best = torch.sort(grouped, dim=-1, descending=True, stable=True).values
        group_scores = best[..., 0] + best[..., 1] if best.shape[-1] > 1 else best[..., 0]
        keep = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        mask = torch.zeros(T, n_group, dtype=torch.bool, device=scores.device).scatter(1, keep, True)
        scores = scores.masked_fill(~mask.repeat_interleave(E // n_group, dim=1), float("-inf"))
    return c_topk(scores, k)


def c_sigmoid_gates(logits: torch.Tensor, ids: torch.Tensor, *, renormalize: bool) -> torch.Tensor:
    """The sigmoid router's gate of each chosen expert ``[T, k]`` fp32 (ids ascending): its *unbiased* score
    ``c_sigmoid(logit)``, divided by ``fixed_tree_sum`` of the chosen scores ``+ 1e-20`` when ``renormalize``
    (``norm_topk_prob``). The ``routed_scaling_factor`` is applied to the combined output (:data:`SPEC` experts)."""
    _refuse_triton("c_sigmoid_gates", logits)
    gates = c_sigmoid(torch.gather(logits.to(torch.float32), 1, ids))
    if renormalize:
        gates = gates / (fixed_tree_sum(gates, -1).unsqueeze(-1) + 1e-20)
    return gates


def rope_problems(*, rope_type: str = "default", partial_factor: float = 1.0, interleaved: bool = False,
                  mscale: float = 1.0, frequencies_match: bool = True) -> list[str]:
    """What of a rotary embedding the canonical RoPE does not cover, in one wording for every place that looks (a
    checkpoint's config, Megatron's config and its runtime scale, vLLM's live modules): empty when covered (plain
    NeoX-style RoPE over the whole head at theta's frequencies)."""
    problems = []
    if (rope_type or "default") != "default":
        problems.append(f"scaled RoPE (type {rope_type!r})")
    if partial_factor != 1.0:
        problems.append(f"partial RoPE (partial_rotary_factor={partial_factor})")
    if interleaved:
        problems.append("interleaved (GPT-J style) RoPE")
    if mscale != 1.0:
        problems.append(f"scaled RoPE (mscale={mscale})")
    if not frequencies_match:
        problems.append("scaled or interpolated RoPE (frequencies other than theta's)")
    return problems


def covered_families() -> tuple[str, ...]:
    """The model families whose every op the canonical forward covers in both engines (verified bitwise): those whose
    family file says so (``MoEFamily.verified`` holds ``"aligned"``, :mod:`moealign.families`)."""
    from ..families import verified_families

    return verified_families("aligned")


def _mla_problems(config: dict) -> list[str]:
    """What of a DeepSeek-V3 (MLA, sigmoid grouped router, shared experts) checkpoint the canonical forward does not
    cover: the family's own refusals (:mod:`moealign.families.deepseek_v3`: multi-token prediction, DeepSeek-V3.2's
    indexer, another router, and what the Megatron conversion does not express: no q LoRA, attention biases,
    ``rope_interleave=False``, ...), and a softmax scale other than ``1 / sqrt(qk head dim)`` (mscale / YaRN)."""
    from types import SimpleNamespace

    from ..families import deepseek_v3

    view = SimpleNamespace(**config)
    problems = [reason for reason in (deepseek_v3.megatron_unsupported(view),) if reason]
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    for key in ("mscale", "mscale_all_dim", "factor"):
        if rope.get(key) not in (None, 0, 1, 0.0, 1.0):
            problems.append(f"rope {key}={rope[key]!r} (the softmax scale is 1 / sqrt(qk head dim))")
    return problems


def check_canonical_model(config: dict) -> None:
    """Refuse (naming it) a checkpoint ``config.json`` the canonical forward does not cover: another family, sliding
    window attention, attention sinks, MLA outside DeepSeek-V3, scaled RoPE (YaRN, mscale), dense MLP layers outside
    DeepSeek-V3's first layers, a non-SiLU activation; on DeepSeek-V3 also what its family refuses (multi-token
    prediction, DeepSeek-V3.2's indexer, another router, no q LoRA, attention biases, a non-interleaved rope)."""
    family = config.get("model_type")
    covered = covered_families()
    if family not in covered:
        raise CanonicalError(f"--aligned covers {list(covered)} checkpoints; model_type {family!r} is not "
                             "covered (its ops have not been verified in both engines)")
    problems = []
    mla = family == "deepseek_v3"
    if mla:
        problems += _mla_problems(config)
    if config.get("use_sliding_window"):
        problems.append("sliding-window attention")
    if config.get("layer_types") and any(t != "full_attention" for t in config["layer_types"]):
        problems.append(f"layer types {sorted(set(config['layer_types']))}")
    if not mla and any(key in config for key in ("kv_lora_rank", "q_lora_rank")):
        problems.append("MLA attention")
    if config.get("sinks") or config.get("attention_sinks"):
        problems.append("attention sinks")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    problems += rope_problems(rope_type=rope.get("rope_type") or rope.get("type") or "default",
                              partial_factor=config.get("partial_rotary_factor", 1.0))
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r}")
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        problems.append("dense MLP layers (mlp_only_layers / decoder_sparse_step)")
    if config.get("shared_expert_intermediate_size"):
        problems.append("shared experts")
    if problems:
        raise CanonicalError(f"--aligned does not cover this {family} checkpoint: " + ", ".join(dict.fromkeys(problems)))


def check_canonical_tp(config: dict, tp: int, flag: str = "tp", *, rollout: bool = False) -> None:
    """Refuse a tensor-parallel size the canonical trees cannot cut: a power of two whose shards of every reduced
    axis (hidden size, attention output, expert / shared-expert / dense intermediate size) are whole multiples of
    :data:`LEAF_WIDTH`. ``rollout`` (vLLM's ``--rollout-tp``): MLA (DeepSeek-V3) is covered, its heads split over the
    ranks, and its shards may also be power-of-two parts of one leaf (a leaf's value is the perfect binary tree over
    its products, so such a shard's sum is a subtree of it; measured bitwise at TP 2 and 4); the trainer's TP with
    MLA stays refused."""
    if tp < 1 or tp & (tp - 1):
        raise CanonicalError(f"{flag} {tp}: the canonical forward cuts its trees at power-of-two TP sizes")
    mla = "kv_lora_rank" in config
    if tp > 1 and mla and not rollout:
        raise CanonicalError(f"{flag} {tp}: the canonical forward covers MLA (DeepSeek-V3) at trainer TP 1 (vLLM "
                             "rollout TP is covered)")
    heads = config.get("num_attention_heads", 1)
    if mla:
        head_dim = config.get("v_head_dim", 0)
        if heads % tp:
            raise CanonicalError(f"{flag} {tp}: {heads} MLA heads do not split over {tp} ranks")
    else:
        head_dim = config.get("head_dim") or config.get("hidden_size", 0) // max(1, heads)
    axes = [("hidden_size", config.get("hidden_size", 0)), ("attention output", heads * head_dim),
            ("moe_intermediate_size", config.get("moe_intermediate_size", 0))]
    if config.get("n_shared_experts"):
        axes.append(("shared expert intermediate size",
                     config.get("moe_intermediate_size", 0) * config["n_shared_experts"]))
    if mla and config.get("first_k_dense_replace"):
        axes.append(("intermediate_size (dense layers)", config.get("intermediate_size", 0)))
    hidden = config.get("hidden_size", 0)
    for what, size in axes:
        if not size % (tp * LEAF_WIDTH):
            continue
        shard = size // tp if size % tp == 0 else 0
        sub_leaf = (rollout and mla and tp > 1 and shard and LEAF_WIDTH % shard == 0 and what != "hidden_size"
                    and hidden % LEAF_WIDTH == 0 and (hidden // LEAF_WIDTH) & (hidden // LEAF_WIDTH - 1) == 0)
        if not sub_leaf:
            raise CanonicalError(f"{flag} {tp}: the {what} {size} does not split into whole {LEAF_WIDTH}-wide tree "
                                 f"leaves per rank" + (" (nor into power-of-two parts of one leaf, with a "
                                                       "power-of-two number of hidden-size leaves)" if rollout and mla
                                                      else ""))
    if not mla and config.get("num_key_value_heads", heads) % tp and tp % config.get("num_key_value_heads", heads):
        raise CanonicalError(f"{flag} {tp}: {config.get('num_key_value_heads')} KV heads do not split over {tp} ranks")


# --------------------------------------------------------------------------------------------------------
# log_softmax as an aten override (the trainer's scoring calls torch.log_softmax)


def _aten_log_softmax(x, dim, half_to_float):
    out = c_log_softmax(x, dim)
    return out if (half_to_float or x.dtype in (torch.float32, torch.float64)) else out.to(x.dtype)


class _LogSoftmaxMode:
    lib: torch.library.Library | None = None
    depth = 0


def log_softmax_mode():
    """A context manager under which ``torch.log_softmax`` (``aten::_log_softmax``, CPU and CUDA) is
    :func:`c_log_softmax`, so scoring code written with ``torch.log_softmax`` runs the canonical op (a
    :class:`~moealign.handle.PatchHandle`, scope ``"process"``; nested uses share one override)."""
    from ..handle import PatchHandle

    handle = PatchHandle("aten::_log_softmax -> the canonical log-softmax", "process")
    if _LogSoftmaxMode.depth == 0:
        import warnings

        lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")     # overriding the kernel is the point
            for key in ["CPU"] + (["CUDA"] if torch.cuda.is_available() else []):
                lib.impl("_log_softmax", _aten_log_softmax, key)
        _LogSoftmaxMode.lib = lib
    _LogSoftmaxMode.depth += 1

    def release() -> None:
        _LogSoftmaxMode.depth -= 1
        if _LogSoftmaxMode.depth == 0 and _LogSoftmaxMode.lib is not None:
            _LogSoftmaxMode.lib._destroy()
            _LogSoftmaxMode.lib = None

    handle.add_callback(release, "aten::_log_softmax override")
    return handle
