"""The canonical ops (moealign.precision.canonical): accuracy against torch's ops, bits that depend on nothing but
the op's own inputs (position in the tensor, batch mates, key-axis length, TP cut), gradients, refusals."""

from __future__ import annotations

import math

import pytest
import torch

from moealign.errors import CanonicalError, MoealignError
from moealign.precision import canonical as C
from moealign.precision.batch_invariant import fixed_tree_sum
from moealign.precision.tree import tree_linear


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_exp_log_accuracy_and_special_values():
    x = torch.randn(20000, generator=_gen(), dtype=torch.float32) * 30
    ref = torch.exp(x.double())
    got = C.c_exp(x).double()
    ok = (ref > 1e-37) & (ref < 3e38)          # float32 range (beyond it: 0 / inf, as torch.exp)
    assert ((got - ref).abs() / ref)[ok].max() < 7e-8          # float32's half ulp is 5.96e-8
    y = torch.rand(20000, generator=_gen(1), dtype=torch.float32) * 1e4 + 1e-30
    assert (C.c_log(y).double() - torch.log(y.double())).abs().max() < 1.1e-6     # |log y| < 10: half ulp 4.8e-7
    assert C.c_exp(torch.tensor([float("-inf"), 0.0, 100.0, -200.0])).tolist() == [0.0, 1.0, math.inf, 0.0]
    out = C.c_log(torch.tensor([0.0, 1.0, math.inf, -1.0]))
    assert out[:3].tolist() == [-math.inf, 0.0, math.inf] and math.isnan(out[3])
    assert C.c_exp(torch.tensor([1.0], dtype=torch.float64)).dtype == torch.float64
    assert C.c_exp(torch.tensor([1.0], dtype=torch.bfloat16)).dtype == torch.float32


def test_elementwise_bits_do_not_depend_on_position():
    """The same value at different positions of tensors of different lengths (vector tails, thread chunks) gets the
    same bits from c_exp / c_log / c_silu."""
    a = torch.randn(37, generator=_gen(2))
    for fn in (C.c_exp, C.c_silu, lambda t: C.c_log(t.abs() + 0.1)):
        ref = fn(a)
        for pad, tail in ((0, 0), (5, 100), (1, 100_003), (31, 7)):
            big = torch.cat([torch.randn(pad, generator=_gen(3)), a, torch.randn(tail, generator=_gen(4))])
            assert torch.equal(fn(big)[pad:pad + 37], ref)


def test_log_softmax_matches_torch_and_keeps_minus_inf():
    z = torch.randn(6, 300, generator=_gen(5)) * 5
    z[0, 3] = -math.inf
    z[2, :250] = -math.inf
    got = C.c_log_softmax(z)
    finite = torch.isfinite(z)
    assert (got - torch.log_softmax(z, -1))[finite].abs().max() < 2e-6
    assert torch.equal(torch.isinf(got), ~finite)
    # a row's value does not depend on its batch mates
    assert torch.equal(C.c_log_softmax(z[2:3]), got[2:3])


def test_log_softmax_mode_swaps_and_restores_torch():
    z = torch.randn(4, 64, generator=_gen(6))
    stock = torch.log_softmax(z, -1)
    with C.log_softmax_mode():
        with C.log_softmax_mode():                       # nested modes share one override
            assert torch.equal(torch.log_softmax(z, -1), C.c_log_softmax(z))
        assert torch.equal(torch.log_softmax(z, -1), C.c_log_softmax(z))
    assert torch.equal(torch.log_softmax(z, -1), stock)


def test_linear_is_tp_cut_and_batch_invariant():
    x = torch.randn(9, 128, generator=_gen(7))
    w = torch.randn(48, 128, generator=_gen(8))
    full = C.c_linear(x, w, out_dtype=torch.float32)
    assert (full - x @ w.T).abs().max() < 1e-4
    # two K shards: subtree roots, added as the tree's top level = TP 1's bits
    halves = [tree_linear(x[:, i * 64:(i + 1) * 64], w[:, i * 64:(i + 1) * 64], leaf_width=C.LEAF_WIDTH)
              for i in range(2)]
    assert torch.equal(halves[0] + halves[1], full)
    assert torch.equal(C.c_linear(x[4:5], w, out_dtype=torch.float32), full[4:5])          # batch of one
    # negative control by construction: per-shard sums added in the other order of K leaves
    xs = torch.tensor([[1e8, 1.0, -1e8, 1.0] * 32])
    ws = torch.ones(1, 128)
    flipped = tree_linear(xs[:, 64:], ws[:, 64:], leaf_width=C.LEAF_WIDTH) + \
        tree_linear(xs[:, :64], ws[:, :64], leaf_width=C.LEAF_WIDTH)
    assert torch.equal(flipped, C.c_linear(xs, ws, out_dtype=torch.float32))   # fp32 add is commutative
    chained = torch.zeros(1)
    for value in (xs[0] * ws[0]).tolist():
        chained = chained + value                      # a left-to-right chain: another tree, other bits here
    assert not torch.equal(chained, C.c_linear(xs, ws, out_dtype=torch.float32))


def test_rms_norm_matches_torch():
    x = torch.randn(7, 128, generator=_gen(9)).to(torch.bfloat16)
    w = torch.rand(128, generator=_gen(10)).to(torch.bfloat16) + 0.5
    got = C.c_rms_norm(x, w, 1e-6)
    ref = torch.nn.functional.rms_norm(x.float(), (128,), eps=1e-6).to(torch.bfloat16) * w
    assert got.dtype == torch.bfloat16 and (got.float() - ref.float()).abs().max() <= 0.02


def test_rope_table_and_rotation():
    C.rope_reserve(300, 32, 10000.0)
    cos, sin = C.rope_cos_sin(torch.tensor([0, 5, 299]), 32, 10000.0)
    inv = torch.tensor([1.0 / 10000.0 ** (2 * i / 32) for i in range(16)], dtype=torch.float64)
    assert (cos.double() - torch.cos(torch.tensor([0.0, 5.0, 299.0], dtype=torch.float64)[:, None] * inv)).abs().max() < 1e-7
    # the table's entries do not change when it grows
    before = C.rope_cos_sin(torch.arange(300), 32, 10000.0)[0].clone()
    C.rope_reserve(2000, 32, 10000.0)
    assert torch.equal(C.rope_cos_sin(torch.arange(300), 32, 10000.0)[0], before)
    with pytest.raises(CanonicalError, match="not reserved"):
        C.rope_cos_sin(torch.tensor([1]), 48, 10000.0)
    x = torch.randn(3, 2, 32, generator=_gen(11))
    y = C.c_rope(x, cos, sin)
    x1, x2 = x[..., :16], x[..., 16:]
    ref = torch.cat([x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]], -1)
    assert (y - ref).abs().max() < 1e-6
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)          # a rotation


def _qkv(Q=11, H=4, KV=2, d=32, seed=12):
    g = _gen(seed)
    return torch.randn(Q, H, d, generator=g), torch.randn(Q, KV, d, generator=g), torch.randn(Q, KV, d, generator=g)


def test_attention_matches_sdpa_and_decode_row_equals_full_row():
    q, k, v = _qkv()
    Q, H = q.shape[:2]
    hk = torch.arange(H) // (H // k.shape[1])
    keep = torch.ones(Q, Q, dtype=torch.bool).tril()
    full = C.c_attention(q, k[None, :, hk], v[None, :, hk], keep)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k[:, hk].transpose(0, 1),
                                                           v[:, hk].transpose(0, 1), is_causal=True).transpose(0, 1)
    assert (full - ref).abs().max() < 2e-6
    for t in (0, 4, Q - 1):
        # a decode step over the t + 1 cached keys (and a cache longer than that, masked) gives row t's bits
        row = C.c_attention(q[t:t + 1], k[None, :t + 1, hk], v[None, :t + 1, hk], torch.ones(1, t + 1, dtype=torch.bool))
        assert torch.equal(row, full[t:t + 1])
        padded = C.c_attention(q[t:t + 1], k[None, :, hk], v[None, :, hk], keep[t:t + 1])
        assert torch.equal(padded, full[t:t + 1])
    # left padding: the kept keys sit behind masked ones; compaction gives the same bits
    shifted_k = torch.cat([torch.randn(3, H, 32, generator=_gen(13)), k[:, hk]])[None]
    shifted_v = torch.cat([torch.randn(3, H, 32, generator=_gen(14)), v[:, hk]])[None]
    keep_left = torch.zeros(1, Q + 3, dtype=torch.bool)
    keep_left[0, 3:3 + 6] = True
    assert torch.equal(C.c_attention(q[5:6], shifted_k, shifted_v, keep_left), full[5:6])


def test_attention_negative_control_another_key_order():
    """By construction: probabilities [1, e, e, e] (e = 2**-24) summed left to right, as an online-softmax kernel
    does, stay 1 (each 1 + e rounds back), while the fixed tree adds e + e first: other bits. The canonical
    attention's decode-equals-full property rests on every engine using the tree."""
    p = torch.tensor([[1.0, 2.0 ** -24, 2.0 ** -24, 2.0 ** -24]])
    chained = ((p[:, 0] + p[:, 1]) + p[:, 2]) + p[:, 3]
    assert chained.item() == 1.0
    assert fixed_tree_sum(p, -1).item() == 1.0 + 2.0 ** -23
    assert not torch.equal(fixed_tree_sum(p, -1), chained)


def test_router_topk_gates_and_experts():
    logits = torch.randn(6, 16, generator=_gen(15))
    logits[0, 3] = logits[0, 9] = 10.0                   # a tie: the lower id first
    ids = C.c_topk(logits, 4)
    assert ids[0, :2].tolist() == [3, 9] and bool((ids[:, 1:] > ids[:, :-1]).all())
    probs = torch.softmax(logits, -1)
    assert torch.equal(ids[1:], probs[1:].topk(4).indices.sort().values)
    gates = C.c_gates(logits, ids, renormalize=True)
    chosen = torch.gather(probs, 1, ids)
    assert (gates - chosen / chosen.sum(-1, keepdim=True)).abs().max() < 1e-6
    assert (C.c_gates(logits, ids, renormalize=False) - chosen).abs().max() < 1e-6
    x = torch.randn(6, 64, generator=_gen(16))
    w13 = torch.randn(16, 64, 64, generator=_gen(17)) * 0.1
    w2 = torch.randn(16, 64, 32, generator=_gen(18)) * 0.1
    out = C.c_combine(C.c_experts(x, ids, w13, w2), gates, x.dtype)
    ref = torch.zeros(6, 64)
    for t in range(6):
        for j, e in enumerate(ids[t].tolist()):
            g, u = (x[t] @ w13[e].T).chunk(2)
            ref[t] += gates[t, j] * ((torch.nn.functional.silu(g) * u) @ w2[e].T)
    assert (out - ref).abs().max() < 1e-5
    # a token's output does not depend on its batch mates
    one = C.c_combine(C.c_experts(x[2:3], ids[2:3], w13, w2), gates[2:3], x.dtype)
    assert torch.equal(one, out[2:3])
    # each (token, expert) pair has c_linear's bits
    g_u = C.c_linear(x[2:3], w13[ids[2, 1]], out_dtype=torch.float32)
    act = (C.c_silu(g_u[:, :32]) * g_u[:, 32:]).to(x.dtype)
    pair = C.c_experts(x[2:3], ids[2:3], w13, w2)[0, 1]
    assert torch.equal(pair, C.c_linear(act, w2[ids[2, 1]], out_dtype=torch.float32)[0])
    # gradients through the gathered trees: the stock ones
    xg, w13g, w2g = (t.double().requires_grad_() for t in (x, w13, w2))
    C.c_experts(xg, ids, w13g, w2g).pow(2).sum().backward()
    xr, w13r, w2r = (t.double().requires_grad_() for t in (x, w13, w2))
    ref = torch.zeros(6, 4, 64, dtype=torch.float64)
    for t in range(6):
        for j, e in enumerate(ids[t].tolist()):
            g, u = (xr[t] @ w13r[e].T).chunk(2)
            ref[t, j] = (torch.nn.functional.silu(g) * u) @ w2r[e].T
    ref.pow(2).sum().backward()
    for a, b in ((xg, xr), (w13g, w13r), (w2g, w2r)):
        assert torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12)


def test_gradients_match_the_stock_ops():
    x = torch.randn(5, 64, generator=_gen(19), dtype=torch.float64, requires_grad=True)
    w = torch.randn(32, 64, generator=_gen(20), dtype=torch.float64, requires_grad=True)
    for canon, stock in ((lambda a, b: C.c_silu(C.c_linear(a, b)).sum(),
                          lambda a, b: torch.nn.functional.silu(a @ b.T).sum()),
                         (lambda a, b: C.c_log_softmax(C.c_linear(a, b)).exp().pow(2).sum(),
                          lambda a, b: torch.log_softmax(a @ b.T, -1).exp().pow(2).sum()),
                         (lambda a, b: C.c_rms_norm(a, None, 1e-6).pow(3).sum(),
                          lambda a, b: torch.nn.functional.rms_norm(a, (64,), eps=1e-6).pow(3).sum())):
        ga = torch.autograd.grad(canon(x, w), (x, w), allow_unused=True)
        gb = torch.autograd.grad(stock(x, w), (x, w), allow_unused=True)
        for a, b in zip(ga, gb):
            if b is not None:
                assert torch.allclose(a, b, rtol=1e-9, atol=1e-10)
    q, k, v = (t.double().requires_grad_() for t in _qkv(Q=5))
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    hk = torch.arange(4) // 2
    out = C.c_attention(q, k[None, :, hk], v[None, :, hk], keep).pow(2).sum()
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k[:, hk].transpose(0, 1),
                                                           v[:, hk].transpose(0, 1), is_causal=True).pow(2).sum()
    for a, b in zip(torch.autograd.grad(out, (q, k, v)), torch.autograd.grad(ref, (q, k, v))):
        assert torch.allclose(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("change, match", [
    ({"model_type": "mixtral"}, "model_type 'mixtral' is not covered"),
    ({"use_sliding_window": True, "sliding_window": 64}, "sliding-window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "scaled RoPE \\(type 'yarn'\\)"),
    ({"partial_rotary_factor": 0.5}, "partial RoPE"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_only_layers": [0]}, "dense MLP layers"),
    ({"kv_lora_rank": 512}, "MLA"),
])
def test_check_canonical_model_refuses_what_it_does_not_cover(change, match):
    from moealign.embedded import embedded_model_path
    from moealign.model_config import read_model_config

    config = dict(read_model_config(embedded_model_path()))
    C.check_canonical_model(config)                      # the embedded model is covered
    config.update(change)
    with pytest.raises(CanonicalError, match=match) as info:
        C.check_canonical_model(config)
    assert isinstance(info.value, MoealignError)


def test_rope_is_refused_in_one_wording_wherever_it_is_looked_at():
    # issue 36: a checkpoint's config, Megatron's config and runtime scale, vLLM's live modules: one function
    assert C.rope_problems() == []
    assert C.rope_problems(rope_type="yarn") == ["scaled RoPE (type 'yarn')"]
    assert C.rope_problems(mscale=1.2) == ["scaled RoPE (mscale=1.2)"]
    assert C.rope_problems(interleaved=True) == ["interleaved (GPT-J style) RoPE"]
    assert "scaled or interpolated" in C.rope_problems(frequencies_match=False)[0]


@pytest.mark.parametrize("shape", [(37, 50, 128, 32), (5, 7, 96, 32), (3, 33, 64, 16), (2, 300, 1024, 64)])
def test_fused_tree_kernel_has_the_torch_trees_bits(shape, monkeypatch):
    """The fused CPU kernel (built on first use) against the torch tree it replaces, bit for bit; a tree of another
    shape (negative control) gives other bits."""
    from moealign.precision import _tree_kernel
    from moealign.precision.tree import tree_sum

    if _tree_kernel.tree_kernel() is None:
        pytest.skip("the fused tree kernel cannot be built here (the torch path runs)")
    M, N, K, leaf = shape
    g = _gen(21)
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
        ref = tree_sum(x.float()[:, None, :] * w.float()[None], dim=-1, leaf_width=leaf)
        assert torch.equal(_tree_kernel.leaf_tree_linear(x.float(), w.float(), leaf), ref)
        monkeypatch.setenv("MOEALIGN_TREE_KERNEL", "0")               # the torch path through tree_linear
        torch_path = tree_linear(x, w, leaf_width=leaf)
        monkeypatch.setenv("MOEALIGN_TREE_KERNEL", "1")
        assert torch.equal(tree_linear(x, w, leaf_width=leaf), torch_path)
    # negative control by construction: [1, e, e, e, 0, ...] (e = 2**-24) is 1 + 2**-23 in the tree, 1 in a chain
    crafted = torch.zeros(1, K)
    crafted[0, :4] = torch.tensor([1.0, 2.0 ** -24, 2.0 ** -24, 2.0 ** -24])
    fused = _tree_kernel.leaf_tree_linear(crafted, torch.ones(1, K), leaf)
    assert fused.item() == 1.0 + 2.0 ** -23 and fused.item() != sum(crafted[0].tolist())
    W = torch.randn(8, N, K, generator=g)
    idx = torch.randint(0, 8, (M,), generator=g)
    xs = torch.randn(M, K, generator=g)
    assert torch.equal(_tree_kernel.leaf_tree_linear(xs, W, leaf, idx),
                       tree_sum(xs[:, None, :] * W[idx], dim=-1, leaf_width=leaf))
