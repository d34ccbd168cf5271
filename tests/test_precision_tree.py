"""TP-invariant tree reductions: the canonical tree, simulated TP in one process, and real gloo processes.

Negative controls differ by construction, never by hoping that the machine's BLAS or thread split orders a
stock sum differently: the naive TP path rounds each rank's partial to the output dtype before the ranks'
partials are added (what an all-reduce of per-rank outputs does), and every partial is the exact sum of its
share (``math.fsum`` of exact fp64 products), rounded once. Its bits are therefore the same on every
machine, and the seeded data below show the split in them.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moealign.precision import tree as T
from moealign.tp_check import run_gloo

LEAF = 64


def _rand(*shape, seed=0, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _shards(t, world):
    return list(t.chunk(world, dim=-1))


def _exact_sum(t, dtype):
    """Sum over the last dim exactly (``math.fsum`` of the fp64 values), rounded to ``dtype``: no dependence on
    any library's summation order, so the same bits on every machine."""
    rows = t.double().reshape(-1, t.shape[-1]).tolist()
    return torch.tensor([math.fsum(r) for r in rows], dtype=torch.float64).reshape(t.shape[:-1]).to(dtype)


def _exact_linear(x, w):
    """``F.linear(x, w)`` from exact products (fp32 / bf16 products are exact in fp64) and an exact sum,
    rounded once to the input dtype: one rank's partial of the naive TP path, or the naive TP = 1 result."""
    return _exact_sum(x.double().unsqueeze(-2) * w.double(), x.dtype)


def _naive_tp(partials):
    """The ranks' partials (each already rounded to the output dtype) added in rank order, in that dtype."""
    total = partials[0]
    for p in partials[1:]:
        total = total + p
    return total


# --------------------------------------------------------------------------------------------------
# The canonical tree
# --------------------------------------------------------------------------------------------------


def test_tree_reduce_is_chain_over_odd_part_then_adjacent_pairs():
    # values spanning many magnitudes, so that the association order shows in the bits
    x = _rand(12, 5, scale=1.0) * torch.logspace(-6, 6, 12).unsqueeze(1)
    g = [x[3 * i] + x[3 * i + 1] + x[3 * i + 2] for i in range(4)]  # chains of 3 (12 = 3 * 4)
    expected = (g[0] + g[1]) + (g[2] + g[3])
    assert torch.equal(T.tree_reduce(x, 0), expected)
    sequential = x[0]
    for row in x[1:]:
        sequential = sequential + row
    assert not torch.equal(T.tree_reduce(x, 0), sequential)  # the order is really different from a loop
    assert T.tree_shape(12) == (3, 4) and T.tree_shape(16) == (1, 16) and T.tree_shape(7) == (7, 1)


def test_tree_reduce_any_dim_matches_dim0():
    x = _rand(3, 8, 4, seed=1)
    assert torch.equal(T.tree_reduce(x, 1), T.tree_reduce(x.movedim(1, 0), 0))
    assert torch.equal(T.tree_reduce(x, -1), T.tree_reduce(x.movedim(-1, 0), 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_simulated_tp_matmul_is_invariant_and_naive_split_is_not(dtype):
    x, w = _rand(8, 1024, seed=2, dtype=dtype), _rand(48, 1024, seed=3, dtype=dtype, scale=0.05)
    full = T.tree_matmul(x, w, leaf_width=LEAF)
    assert full.dtype == torch.float32  # fp32 nodes for both fp32 and bf16 inputs
    naive_full = _exact_linear(x, w)
    for tp in (2, 4, 8, 16):
        roots = [T.tree_matmul(xs, ws, leaf_width=LEAF) for xs, ws in zip(_shards(x, tp), _shards(w, tp))]
        assert torch.equal(T.tree_reduce(torch.stack(roots), 0), full), tp
        # negative control, by construction: rank partials rounded to the dtype, then added, differ from TP = 1
        naive = _naive_tp([_exact_linear(xs, ws) for xs, ws in zip(_shards(x, tp), _shards(w, tp))])
        assert not torch.equal(naive, naive_full), tp


def test_simulated_tp_tree_sum_with_odd_leaf_count():
    x = _rand(5, 3 * 8 * LEAF, seed=4, scale=10.0)  # 24 leaves = chains of 3 under a binary tree of 8
    full = T.tree_sum(x, -1, leaf_width=LEAF)
    for tp in (2, 4, 8):
        roots = [T.tree_sum(s, -1, leaf_width=LEAF) for s in _shards(x, tp)]
        assert torch.equal(T.tree_reduce(torch.stack(roots), 0), full), tp
    for tp in (2, 4, 8):   # negative control, by construction (exact partials rounded to fp32, then added)
        assert not torch.equal(_naive_tp([_exact_sum(s, x.dtype) for s in _shards(x, tp)]), _exact_sum(x, x.dtype))
    with pytest.raises(T.TreeReductionError, match="whole subtrees"):
        T.check_tree_world_size(16, num_leaves=24)


def test_bf16_nodes_vs_fp32_nodes_accuracy():
    x, w = _rand(16, 2048, seed=5, dtype=torch.bfloat16), _rand(64, 2048, seed=6, dtype=torch.bfloat16)
    exact = x.double() @ w.double().T
    tree_err = (T.tree_matmul(x, w, leaf_width=LEAF).to(torch.bfloat16).double() - exact).abs().max()
    stock_err = (F.linear(x, w).double() - exact).abs().max()
    bf16_nodes_err = (T.tree_matmul(x, w, leaf_width=LEAF, node_dtype=torch.bfloat16).double() - exact).abs().max()
    assert tree_err <= 1.5 * stock_err
    assert bf16_nodes_err > tree_err  # why the default is fp32 nodes


def test_vocab_logprob_single_process_matches_log_softmax():
    logits, target = _rand(32, 4096, seed=7, scale=4.0), torch.randint(0, 4096, (32,))
    got = T.vocab_parallel_logprob_tree(logits, target, leaf_width=LEAF)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-5)


def test_autograd_through_tree_ops():
    x = _rand(4, 256, seed=8).requires_grad_()
    w = _rand(16, 256, seed=9).requires_grad_()
    T.row_parallel_linear_tree(x, w, leaf_width=LEAF).square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    F.linear(x, w).square().sum().backward()
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-4)

    logits = _rand(6, 512, seed=10, scale=3.0).requires_grad_()
    target = torch.randint(0, 512, (6,))
    T.vocab_parallel_logprob_tree(logits, target, leaf_width=LEAF).sum().backward()
    g = logits.grad.clone()
    logits.grad = None
    torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(g, logits.grad, rtol=1e-5, atol=1e-6)


def test_errors_name_the_problem():
    x, w = _rand(2, 100), _rand(3, 100)
    with pytest.raises(T.TreeReductionError, match="not a positive multiple of leaf_width=64"):
        T.tree_matmul(x, w, leaf_width=LEAF)
    with pytest.raises(T.TreeReductionError, match="K=100 but weight has K=128"):
        T.tree_matmul(x, _rand(3, 128), leaf_width=LEAF)
    with pytest.raises(TypeError, match="weight is torch.bfloat16"):
        T.tree_matmul(_rand(2, 128), _rand(3, 128, dtype=torch.bfloat16), leaf_width=LEAF)
    with pytest.raises(T.TreeReductionError, match="positive integer"):
        T.tree_sum(x, leaf_width=0)
    with pytest.raises(TypeError, match="floating-point"):
        T.tree_sum(torch.ones(4, 64, dtype=torch.int32), leaf_width=LEAF)
    with pytest.raises(T.TreeReductionError, match="power-of-two"):
        T.check_tree_world_size(3)
    with pytest.raises(ValueError, match="unknown tree all-reduce algorithm"):
        T.tree_all_reduce(torch.ones(3), algorithm="ring")
    assert "pair" in T.ALGORITHMS
    logits = _rand(4, 128)
    with pytest.raises(T.TreeReductionError, match=r"target ids must lie in \[0, 128\)"):
        T.vocab_parallel_logprob_tree(logits, torch.tensor([0, 1, 2, 128]), leaf_width=LEAF)
    with pytest.raises(T.TreeReductionError, match="target shape"):
        T.vocab_parallel_logprob_tree(logits, torch.zeros(5, dtype=torch.long), leaf_width=LEAF)
    with pytest.raises(TypeError, match="integer token ids"):
        T.vocab_parallel_logprob_tree(logits, torch.zeros(4), leaf_width=LEAF)


# --------------------------------------------------------------------------------------------------
# Real gloo processes
# --------------------------------------------------------------------------------------------------

M, K, N, V = 8, 2048, 32, 4096


def _inputs():
    return (_rand(M, K, seed=11), _rand(N, K, seed=12, scale=0.05), _rand(M, K, seed=13, dtype=torch.bfloat16),
            _rand(M, V, seed=14, scale=4.0), torch.randint(0, V, (M,), generator=torch.Generator().manual_seed(15)))


def _gloo_worker(rank, world):
    x, w, xb, logits, target = _inputs()
    xs, ws, xbs, ls = (t.chunk(world, -1)[rank].contiguous() for t in (x, w, xb, logits))
    out = {
        "linear": T.row_parallel_linear_tree(xs, ws, leaf_width=LEAF),
        "linear_rs": T.row_parallel_linear_tree(xs, ws, leaf_width=LEAF, algorithm="reduce_scatter"),
        "linear_ag": T.row_parallel_linear_tree(xs, ws, leaf_width=LEAF, algorithm="all_gather"),
        "linear_bf16": T.row_parallel_linear_tree(xbs, ws.to(torch.bfloat16), leaf_width=LEAF),
        "logprob": T.vocab_parallel_logprob_tree(ls, target, leaf_width=LEAF),
        "naive_linear": _exact_linear(xs, ws),   # this rank's partial, rounded to fp32 (negative control)
    }
    dist.all_reduce(out["naive_linear"])        # the stock all-reduce adds the rounded partials
    # tree reduce-scatter of the per-rank partials: this rank's rows of the tree sum
    out["rs"] = T.tree_reduce_scatter(T.tree_matmul(xs, ws, leaf_width=LEAF), dim=0)
    # backward through the tree all-reduce (identity) gives this rank's slice of the input gradient
    xg = xs.clone().requires_grad_()
    T.row_parallel_linear_tree(xg, ws, leaf_width=LEAF).square().sum().backward()
    out["grad_x"] = xg.grad
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_tree_ops_equal_tp1_on_every_rank(world):
    x, w, xb, logits, target = _inputs()
    ref_linear = T.row_parallel_linear_tree(x, w, leaf_width=LEAF)
    ref_bf16 = T.row_parallel_linear_tree(xb, w.to(torch.bfloat16), leaf_width=LEAF)
    ref_logprob = T.vocab_parallel_logprob_tree(logits, target, leaf_width=LEAF)
    results = run_gloo(world, _gloo_worker, timeout=120)
    rows = M // world
    for rank, out in enumerate(results):
        assert torch.equal(out["linear"], ref_linear), rank
        assert torch.equal(out["linear_rs"], ref_linear), rank
        assert torch.equal(out["linear_ag"], ref_linear), rank      # "linear" used "auto": "pair" at 2 ranks
        assert torch.equal(out["linear_bf16"], ref_bf16) and out["linear_bf16"].dtype == torch.bfloat16, rank
        assert torch.equal(out["logprob"], ref_logprob), rank
        assert torch.equal(out["rs"], ref_linear[rank * rows:(rank + 1) * rows]), rank
        xg = x.clone().requires_grad_()
        F.linear(xg, w).square().sum().backward()
        torch.testing.assert_close(out["grad_x"], xg.grad.chunk(world, -1)[rank], rtol=1e-4, atol=1e-5)
    # negative control, by construction: per-rank partials rounded to fp32 and summed by all_reduce differ
    # from TP = 1 (the rank partials are exact sums rounded once, so this does not depend on the BLAS)
    naive_tp1 = _exact_linear(x, w)
    for rank, out in enumerate(results):
        assert not torch.equal(out["naive_linear"], naive_tp1), rank


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_linear_is_invariant_to_k_cut_n_cut_rows_and_threads(dtype):
    x, w = _rand(6, 512, seed=11, dtype=dtype), _rand(40, 512, seed=12, dtype=dtype, scale=0.05)
    full = T.tree_linear(x, w, leaf_width=32)
    assert full.dtype == torch.float32 and full.shape == (6, 40)
    # each element is tree_sum of its own products: the definition, element by element
    assert torch.equal(full, T.tree_sum(x.float()[:, None, :] * w.float()[None], -1, leaf_width=32))
    for tp in (2, 4, 8):   # a K shard gives its subtree root
        roots = [T.tree_linear(xs, ws, leaf_width=32) for xs, ws in zip(_shards(x, tp), _shards(w, tp))]
        assert torch.equal(T.tree_reduce(torch.stack(roots), 0), full), tp
    assert torch.equal(T.tree_linear(x, w[8:24], leaf_width=32), full[:, 8:24])    # an N shard: same columns
    assert torch.equal(T.tree_linear(x[2:3], w, leaf_width=32), full[2:3])        # one row alone
    assert torch.equal(T.tree_linear(x, w, leaf_width=32, max_elements=1000), full)   # chunked columns
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = T.tree_linear(x, w, leaf_width=32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, full)
    # negative control, by construction: the same products summed left to right (no tree) differ
    prods = x.float()[:, None, :] * w.float()[None]
    chain = prods[..., 0]
    for i in range(1, prods.shape[-1]):
        chain = chain + prods[..., i]
    assert not torch.equal(chain, full)


def test_tree_linear_refuses_bad_shapes():
    with pytest.raises(T.TreeReductionError, match="same K"):
        T.tree_linear(torch.zeros(2, 64), torch.zeros(3, 32))
    with pytest.raises(T.TreeReductionError, match="leaf_width"):
        T.tree_linear(torch.zeros(2, 48), torch.zeros(3, 48), leaf_width=32)
    with pytest.raises(T.InputTypeError, match="bfloat16"):
        T.tree_linear(torch.zeros(2, 64), torch.zeros(3, 64, dtype=torch.bfloat16))
