"""TP-invariant tree reductions (after TBIK, Zhang et al. arXiv:2511.17826), in plain torch + torch.distributed.

Why: a tensor-parallel (TP) reduction over an axis split across ranks (row-parallel linear: the K axis;
Megatron's vocab-parallel cross-entropy: the vocab axis) sums in an order that depends on the TP size,
so TP = 1 and TP = 4 give different bits. Here every reduction follows one canonical tree fixed on the
GLOBAL axis, and TP only decides where the tree is cut between ranks:

* **Leaves** have a fixed width ``leaf_width`` on the global reduction axis. A leaf's value is computed
  the same way on every TP size (a fixed-shape matmul for :func:`tree_matmul`, the canonical tree over
  its ``leaf_width`` elements for :func:`tree_sum`).
* **Canonical tree over T leaves** (:func:`tree_reduce`): write ``T = c * 2**j`` with ``c`` odd. The first
  level sums ``c`` consecutive leaves left to right (a chain); the ``2**j`` group values are then added
  in adjacent pairs, level by level: ``((g0 + g1) + (g2 + g3)) + ...``.
* **Cutting the tree:** for a TP size ``tp = 2**t <= 2**j``, rank ``r`` holds leaves
  ``[r*T/tp, (r+1)*T/tp)``. Its ``T/tp`` leaves have the same odd part ``c``, so the same rule applied to
  them computes exactly the subtree rooted at level ``j - t``. The cross-rank part
  (:func:`tree_all_reduce`) all-gathers the ``tp`` subtree roots and builds the top ``t`` levels of the
  same tree, in rank order, on every rank: every rank gets the same bits, and they equal TP = 1.
  TP must be a power of two and must divide the number of leaves; anything else raises.

**Node dtype (decided here):** every tree node, including the partials that cross the rank boundary,
has one dtype, :func:`node_dtype_for` the input dtype: float32 for bfloat16 / float16 / float32 inputs,
float64 for float64. The result is cast back to the input dtype once, after the root. Reasons: (1) the
root must be computed in a dtype that does not depend on where the tree is cut - a rank that reduces its
subtree in fp32 and casts to bf16 before the collective breaks invariance (reference experiment (c));
(2) fp32 nodes are about 1.6x more accurate than bf16 nodes (TBIK's released kernel) and match a stock
bf16 matmul's error (reference experiment (b)); (3) the price is 2x the collective bytes for 16-bit
inputs, paid only on the (small) partials. Products of bf16/fp16 values are exact in fp32, so a leaf is
a plain fp32 dot product.

Scope: these ops make results invariant to the TP size. They do not make a leaf kernel invariant to
the batch size M (a stock matmul of shape [M, leaf] x [leaf, N] may depend on M); that is a separate
requirement (batch-invariant kernels).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._tree_kernel import leaf_tree_linear

from .._validate import check_positive_int
from ..errors import EngineError, InputError, InputTypeError, TreeReductionError
from ..handle import PatchHandle

__all__ = [
    "DEFAULT_LEAF_WIDTH",
    "CANONICAL_LEAF_WIDTH",
    "ALGORITHMS",
    "AUTO_REDUCE_SCATTER_NUMEL",
    "TreeReductionError",
    "node_dtype_for",
    "tree_shape",
    "tree_reduce",
    "tree_sum",
    "tree_matmul",
    "tree_linear",
    "check_tree_world_size",
    "tree_all_reduce",
    "tree_reduce_scatter",
    "row_parallel_linear_tree",
    "vocab_parallel_logprob_tree",
]

DEFAULT_LEAF_WIDTH = 64
#: The leaf width of every canonical linear layer (:data:`moealign.precision.canonical.LEAF_WIDTH`, the Triton
#: kernels' ``BLOCK_K``): one value for every engine, it fixes the tree.
CANONICAL_LEAF_WIDTH = 32
ALGORITHMS = ("auto", "all_gather", "reduce_scatter", "pair")
AUTO_REDUCE_SCATTER_NUMEL = 1 << 16  # "auto": below this, one all-gather (latency); above, RS + AG (bandwidth)



class TreeReducePatch(PatchHandle):
    """Undo handle of the patches that swap these tree reductions into an engine (Megatron-core's
    ``moealign.patches.megatron.tree_reduce``, vLLM's ``moealign.patches.vllm.tree_reduce``)."""


# --------------------------------------------------------------------------------------------------
# The canonical tree (local)
# --------------------------------------------------------------------------------------------------


def node_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype of every tree node for inputs of ``dtype`` (see the module docstring for why)."""
    if dtype in (torch.bfloat16, torch.float16, torch.float32):
        return torch.float32
    if dtype == torch.float64:
        return torch.float64
    raise InputTypeError(f"tree reductions need a floating-point input (bf16, fp16, fp32, fp64), got {dtype}")


def _resolve_node_dtype(dtype: torch.dtype, node_dtype: torch.dtype | None) -> torch.dtype:
    default = node_dtype_for(dtype)
    if node_dtype is None:
        return default
    if not node_dtype.is_floating_point:
        raise InputTypeError(f"node_dtype must be a floating-point dtype, got {node_dtype}")
    return node_dtype


def tree_shape(num_leaves: int) -> tuple[int, int]:
    """``(chain, groups)`` of the canonical tree over ``num_leaves``: ``chain`` is the odd part of
    ``num_leaves`` (consecutive leaves summed left to right), ``groups`` the power of two above it."""
    if not isinstance(num_leaves, int) or num_leaves < 1:
        raise TreeReductionError(f"a tree needs at least one leaf, got {num_leaves!r}")
    chain = num_leaves
    while chain % 2 == 0:
        chain //= 2
    return chain, num_leaves // chain


def tree_reduce(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over ``dim`` (removed) in the canonical tree order, adding in ``x``'s dtype.

    Only elementwise additions are used (a chain over the odd part, then adjacent pairs level by level),
    so each output element's bits depend only on the values along ``dim``, never on threads or vector width.
    """
    n = x.shape[dim]
    chain, groups = tree_shape(n)
    x = x.movedim(dim, 0)
    x = x.reshape(groups, chain, *x.shape[1:])
    acc = x[:, 0]
    for i in range(1, chain):
        acc = acc + x[:, i]
    while acc.shape[0] > 1:
        acc = acc[0::2] + acc[1::2]
    return acc[0]


def _check_leaf_width(leaf_width: int) -> None:
    check_positive_int(leaf_width, "leaf_width", TreeReductionError, noun="integer")


def _num_leaves(size: int, leaf_width: int, what: str) -> int:
    _check_leaf_width(leaf_width)
    if size == 0 or size % leaf_width:
        raise TreeReductionError(
            f"{what} has size {size}, which is not a positive multiple of leaf_width={leaf_width}; "
            f"the tree's leaves must tile the reduction axis exactly")
    return size // leaf_width


def tree_sum(x: torch.Tensor, dim: int = -1, *, leaf_width: int = DEFAULT_LEAF_WIDTH,
             node_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum ``x`` over ``dim`` in the canonical leaf tree; the result is in the node dtype.

    Leaves are ``leaf_width`` consecutive elements; a leaf's value is the canonical tree over its elements,
    and the root is the canonical tree over the leaves. On a rank holding a contiguous, whole-leaf slice
    of the global axis this returns that slice's subtree root (combine with :func:`tree_all_reduce`).
    """
    nd = _resolve_node_dtype(x.dtype, node_dtype)
    size = x.shape[dim]
    leaves = _num_leaves(size, leaf_width, f"reduction axis {dim}")
    x = x.to(nd).movedim(dim, -1)
    x = x.reshape(*x.shape[:-1], leaves, leaf_width)
    return tree_reduce(tree_reduce(x, dim=x.dim() - 1), dim=x.dim() - 2)


class _StreamingTree:
    """The canonical tree fed one leaf at a time, holding O(log T) partial nodes (a binary counter)."""

    def __init__(self, num_leaves: int):
        self.chain, self.groups = tree_shape(num_leaves)
        self._pending: torch.Tensor | None = None
        self._count = 0
        self._stack: list[tuple[int, torch.Tensor]] = []

    def push(self, leaf: torch.Tensor) -> None:
        self._pending = leaf if self._pending is None else self._pending + leaf
        self._count += 1
        if self._count < self.chain:
            return
        node, level = self._pending, 0
        self._pending, self._count = None, 0
        while self._stack and self._stack[-1][0] == level:
            node = self._stack.pop()[1] + node
            level += 1
        self._stack.append((level, node))

    def root(self) -> torch.Tensor:
        if self._pending is not None or len(self._stack) != 1:
            raise EngineError("tree fed an incomplete set of leaves")
        return self._stack[0][1]


def tree_matmul(x: torch.Tensor, weight: torch.Tensor, *, leaf_width: int = DEFAULT_LEAF_WIDTH,
                node_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T`` (``F.linear`` layout: x ``[..., K]``, weight ``[N, K]``) with K reduced in the
    canonical leaf tree; the result is in the node dtype (a subtree root when K is a rank's shard).

    Leaf ``l`` is one stock matmul of the contiguous, node-dtype tiles ``x[..., lL:(l+1)L]`` and
    ``weight[:, lL:(l+1)L]``: the same call shape whatever the TP size. Differentiable.
    """
    if x.dim() < 1 or weight.dim() != 2:
        raise TreeReductionError(f"tree_matmul needs x [..., K] and weight [N, K], got {tuple(x.shape)} "
                                 f"and {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise TreeReductionError(f"tree_matmul: x has K={x.shape[-1]} but weight has K={weight.shape[1]}")
    nd = _resolve_node_dtype(x.dtype, node_dtype)
    if weight.dtype != x.dtype:
        raise InputTypeError(f"tree_matmul: x is {x.dtype} but weight is {weight.dtype}")
    leaves = _num_leaves(x.shape[-1], leaf_width, "the K axis")
    xn, wn = x.to(nd), weight.to(nd)
    tree = _StreamingTree(leaves)
    for leaf in range(leaves):
        cols = slice(leaf * leaf_width, (leaf + 1) * leaf_width)
        tree.push(torch.matmul(xn[..., cols].contiguous(), wn[:, cols].contiguous().t()))
    return tree.root()


def _tree_linear_forward(x: torch.Tensor, weight: torch.Tensor, leaf_width: int, nd: torch.dtype,
                         max_elements: int) -> torch.Tensor:
    lead = x.shape[:-1]
    xn = x.reshape(-1, x.shape[-1]).to(nd)
    wn = weight.to(nd)
    fused = leaf_tree_linear(xn, wn, leaf_width)          # the same bits (a fused CPU kernel), or None
    if fused is not None:
        return fused.reshape(*lead, weight.shape[0])
    rows, k = xn.shape
    step = max(1, max_elements // max(1, rows * k))
    cols = [tree_sum(xn[:, None, :] * wn[None, start:start + step, :], dim=-1, leaf_width=leaf_width)
            for start in range(0, weight.shape[0], step)]
    out = cols[0] if len(cols) == 1 else torch.cat(cols, dim=-1)
    return out.reshape(*lead, weight.shape[0])


class _TreeLinear(torch.autograd.Function):
    """The tree's forward; the backward is the stock one (two matmuls in the node dtype): a gradient need not have
    the forward's bits, and the elementwise-product graph would cost ``rows x N x K`` memory per layer."""

    @staticmethod
    def forward(ctx, x, weight, leaf_width, nd, max_elements):
        ctx.save_for_backward(x, weight)
        return _tree_linear_forward(x, weight, leaf_width, nd, max_elements)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.to(g.dtype)).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ x.reshape(-1, x.shape[-1]).to(g.dtype)).to(weight.dtype)
        return grad_x, grad_w, None, None, None


def tree_linear(x: torch.Tensor, weight: torch.Tensor, *, leaf_width: int = DEFAULT_LEAF_WIDTH,
                node_dtype: torch.dtype | None = None, max_elements: int = 1 << 22) -> torch.Tensor:
    """``x @ weight.T`` (``F.linear`` layout) from element-wise products and element-wise adds only: each
    output element is :func:`tree_sum` of its K products (node dtype), so its bits depend on nothing but its
    own row of ``x`` and row of ``weight``: not on the TP size (a K shard gives its subtree root, an N shard
    the same columns), nor on the batch size, the thread count or the BLAS library, by construction.

    :func:`tree_matmul` leaves use a stock matmul per leaf, which is fast but whose bits may change with the
    thread count (measured here: MKL, 1 vs 2 threads); this op is the slower one without that caveat. Output
    columns are computed in chunks of at most ``max_elements`` products (chunking changes no bits). Differentiable;
    the backward is the stock one (two matmuls), not the tree.
    """
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise TreeReductionError(f"tree_linear needs x [..., K] and weight [N, K] with the same K, got "
                                 f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise InputTypeError(f"tree_linear: x is {x.dtype} but weight is {weight.dtype}")
    check_positive_int(max_elements, "max_elements", TreeReductionError, noun="integer")
    _num_leaves(x.shape[-1], leaf_width, "the K axis")
    nd = _resolve_node_dtype(x.dtype, node_dtype)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _TreeLinear.apply(x, weight, leaf_width, nd, max_elements)
    return _tree_linear_forward(x, weight, leaf_width, nd, max_elements)


# --------------------------------------------------------------------------------------------------
# Across ranks
# --------------------------------------------------------------------------------------------------


def _group_size_rank(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise EngineError("a process group was given but torch.distributed is not initialized")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_tree_world_size(world_size: int, num_leaves: int | None = None) -> None:
    """Raise :class:`TreeReductionError` unless the tree can be cut into ``world_size`` whole subtrees."""
    if world_size < 1 or world_size & (world_size - 1):
        raise TreeReductionError(f"TP-invariant tree reductions need a power-of-two group size, got {world_size}")
    if num_leaves is not None:
        _, groups = tree_shape(num_leaves)
        if groups % world_size:
            raise TreeReductionError(
                f"{num_leaves} leaves cannot be cut into {world_size} whole subtrees (the tree's binary part "
                f"has {groups} groups)")


def _all_gather_tree(xn: torch.Tensor, world: int, group) -> torch.Tensor:
    parts = [torch.empty_like(xn) for _ in range(world)]
    dist.all_gather(parts, xn, group=group)
    return tree_reduce(torch.stack(parts), 0)


def _all_gather_flat(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    """All-gather equal 1-D pieces straight into ``out`` (torch >= 2.13 names it ``all_gather_single``)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)


def _reduce_scatter_chunks(xn: torch.Tensor, world: int, group) -> torch.Tensor:
    """``xn`` is ``[world, chunk...]``; returns the tree sum over ranks of this rank's chunk."""
    recv = torch.empty_like(xn)
    dist.all_to_all_single(recv, xn, group=group)
    return tree_reduce(recv, 0)


def _tree_all_reduce_impl(x: torch.Tensor, group, node_dtype, algorithm: str) -> torch.Tensor:
    if algorithm not in ALGORITHMS:
        raise InputError(f"unknown tree all-reduce algorithm {algorithm!r}; expected one of {ALGORITHMS}")
    nd = _resolve_node_dtype(x.dtype, node_dtype)
    world, _ = _group_size_rank(group)
    check_tree_world_size(world)
    xn = x.detach().to(nd).contiguous()
    if world == 1:
        return xn.to(x.dtype)
    if algorithm == "auto":
        if world == 2:
            algorithm = "pair"
        else:
            algorithm = "reduce_scatter" if xn.numel() >= AUTO_REDUCE_SCATTER_NUMEL else "all_gather"
    if algorithm == "pair":
        # two ranks: the top of the tree is one addition r0 + r1, and IEEE addition is commutative, so the
        # stock all-reduce (which adds the two partials once, in either order) computes it exactly
        if world != 2:
            raise TreeReductionError(f"the 'pair' tree all-reduce is for a group of 2 ranks, got {world}")
        out = xn.clone()
        dist.all_reduce(out, group=group)
    elif algorithm == "all_gather":
        out = _all_gather_tree(xn, world, group)
    else:
        flat = xn.reshape(-1)
        n = flat.numel()
        chunk = -(-n // world)
        if chunk * world != n:
            flat = torch.cat([flat, flat.new_zeros(chunk * world - n)])
        mine = _reduce_scatter_chunks(flat.view(world, chunk), world, group)
        gathered = mine.new_empty(world * chunk)
        _all_gather_flat(gathered, mine, group)
        out = gathered[:n].view(x.shape)
    return out.to(x.dtype)


class _TreeAllReduce(torch.autograd.Function):
    """Forward: tree all-reduce. Backward: identity (the output is replicated, as in Megatron's reduce)."""

    @staticmethod
    def forward(ctx, x, group, node_dtype, algorithm):
        return _tree_all_reduce_impl(x, group, node_dtype, algorithm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def tree_all_reduce(x: torch.Tensor, group=None, *, node_dtype: torch.dtype | None = None,
                    algorithm: str = "auto") -> torch.Tensor:
    """Sum every rank's ``x`` (its subtree root) in the canonical tree over ranks, returning the same bits
    on every rank, in ``x``'s dtype (nodes in the node dtype, so pass fp32 roots to avoid a round trip).

    ``algorithm="all_gather"``: every rank gathers all partials and builds the top of the tree (simple,
    receives (tp-1)|x|). ``"reduce_scatter"``: rank i tree-reduces the i-th slice of all partials
    (all-to-all), then the slices are all-gathered (ring-like bandwidth). ``"pair"`` (two ranks only): the
    top of the tree is the single addition ``r0 + r1``, which is commutative, so the stock SUM all-reduce
    of the node-dtype partials computes it exactly. ``"auto"`` (default) picks ``"pair"`` for two ranks,
    otherwise all-gather below :data:`AUTO_REDUCE_SCATTER_NUMEL` elements, else reduce-scatter. All give
    identical bits.
    Without an initialized process group (and ``group=None``) this is the identity. The group size must be
    a power of two. Differentiable (identity backward).
    """
    return _TreeAllReduce.apply(x, group, node_dtype, algorithm)


class _TreeReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, node_dtype, dim):
        ctx.group, ctx.dim = group, dim
        nd = _resolve_node_dtype(x.dtype, node_dtype)
        world, _ = _group_size_rank(group)
        check_tree_world_size(world)
        if x.shape[dim] % world:
            raise TreeReductionError(f"tree_reduce_scatter: dim {dim} has size {x.shape[dim]}, not divisible "
                                     f"by the group size {world}")
        ctx.world = world
        if world == 1:
            return x.detach().to(nd).to(x.dtype)
        xn = x.detach().to(nd).movedim(dim, 0)
        xn = xn.reshape(world, xn.shape[0] // world, *xn.shape[1:]).contiguous()
        mine = _reduce_scatter_chunks(xn, world, group)
        return mine.movedim(0, dim).to(x.dtype).contiguous()

    @staticmethod
    def backward(ctx, grad):
        if ctx.world == 1:
            return grad, None, None, None
        g = grad.contiguous()
        parts = [torch.empty_like(g) for _ in range(ctx.world)]
        dist.all_gather(parts, g, group=ctx.group)
        return torch.cat(parts, dim=ctx.dim), None, None, None


def tree_reduce_scatter(x: torch.Tensor, group=None, *, dim: int = 0,
                        node_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reduce-scatter along ``dim`` in tree order: rank i gets the canonical-tree sum over ranks of the
    i-th of ``world`` equal slices of ``dim`` (Megatron's sequence-parallel reduce-scatter, made invariant).
    Differentiable (backward: all-gather along ``dim``)."""
    return _TreeReduceScatter.apply(x, group, node_dtype, dim)


# --------------------------------------------------------------------------------------------------
# The two TP ops
# --------------------------------------------------------------------------------------------------


def row_parallel_linear_tree(x_shard: torch.Tensor, weight_shard: torch.Tensor, group=None, *,
                             leaf_width: int = DEFAULT_LEAF_WIDTH, node_dtype: torch.dtype | None = None,
                             algorithm: str = "auto") -> torch.Tensor:
    """Row-parallel ``y = x @ W.T`` whose bits do not depend on the TP size.

    ``x_shard [..., K/tp]`` and ``weight_shard [N, K/tp]`` are this rank's contiguous slice of the global K
    axis (rank r holds ``[r*K/tp, (r+1)*K/tp)``); ``K/tp`` must be a multiple of ``leaf_width`` and tp a
    power of two. The rank's subtree (:func:`tree_matmul`) stays in the node dtype through the collective;
    the output is cast once to ``x_shard``'s dtype. Every rank returns the full, identical ``[..., N]``.
    """
    world, _ = _group_size_rank(group)
    check_tree_world_size(world)
    local = tree_matmul(x_shard, weight_shard, leaf_width=leaf_width, node_dtype=node_dtype)
    return tree_all_reduce(local, group, node_dtype=local.dtype, algorithm=algorithm).to(x_shard.dtype)


class _OwnerMax(torch.autograd.Function):
    """Combine a value that exactly one rank owns (the others hold -inf) with an exact MAX all-reduce;
    the gradient flows to the owner only."""

    @staticmethod
    def forward(ctx, value, owned, group, world):
        ctx.save_for_backward(owned)
        out = value.detach().clone()
        if world > 1:
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        (owned,) = ctx.saved_tensors
        return grad * owned.to(grad.dtype), None, None, None


def vocab_parallel_logprob_tree(logits_shard: torch.Tensor, target: torch.Tensor, group=None, *,
                                leaf_width: int = DEFAULT_LEAF_WIDTH, vocab_start: int | None = None,
                                node_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Selected-token log-prob ``logit[t] - max - log(sum exp(logit - max))`` over a vocab split across
    ranks, bitwise the same for every TP size. Returned in the node dtype (fp32 for 16-bit logits).

    ``logits_shard [..., V/tp]`` is this rank's contiguous vocab slice starting at ``vocab_start``
    (default ``rank * V/tp``, Megatron's layout); ``target [...]`` holds global token ids. The max is an
    exact MAX all-reduce; sum-exp is :func:`tree_sum` over vocab leaves plus :func:`tree_all_reduce`; the
    selected logit comes from its one owner rank through an exact MAX (others contribute -inf).
    """
    if logits_shard.dim() < 1 or tuple(target.shape) != tuple(logits_shard.shape[:-1]):
        raise TreeReductionError(f"target shape {tuple(target.shape)} must equal the logits' leading shape "
                                 f"{tuple(logits_shard.shape[:-1])}")
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise InputTypeError(f"target must hold integer token ids, got {target.dtype}")
    nd = _resolve_node_dtype(logits_shard.dtype, node_dtype)
    world, rank = _group_size_rank(group)
    v_local = logits_shard.shape[-1]
    check_tree_world_size(world, _num_leaves(v_local, leaf_width, "the local vocab axis") * world)
    start = rank * v_local if vocab_start is None else int(vocab_start)
    vocab = v_local * world
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocab):
        raise TreeReductionError(f"target ids must lie in [0, {vocab}), got range "
                                 f"[{int(target.min())}, {int(target.max())}]")

    logits = logits_shard.to(nd)
    m = logits.detach().amax(dim=-1)
    if world > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sum_exp = tree_sum(torch.exp(logits - m.unsqueeze(-1)), -1, leaf_width=leaf_width, node_dtype=nd)
    sum_exp = tree_all_reduce(sum_exp, group, node_dtype=nd)

    local_ids = target.long() - start
    owned = (local_ids >= 0) & (local_ids < v_local)
    picked = torch.gather(logits, -1, local_ids.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(owned, picked, torch.full_like(picked, float("-inf")))
    selected = _OwnerMax.apply(picked, owned, group, world)
    return (selected - m) - torch.log(sum_exp)
