"""The canonical Triton kernels' checks (moealign/precision/canonical_triton.py), one process, one device:

    TRITON_INTERPRET=1 python tests/canonical_triton_child.py --device cpu     # tests/test_canonical_triton_interp.py
    python tests/canonical_triton_child.py --device cuda                         # tools/gpu_check.py's canonical-triton

Accuracy against float64; bitwise invariances (the batch / M, the row's position, decode vs the full sequence, TP
cuts of K combined by the same tree, a token's expert output whatever else its expert received), each next to a
negative control built to differ. On CUDA bf16 runs too (the interpreter misreads bf16) and the CPU-formula
cross-checks (RoPE, combine: equal under the interpreter, where every op is one IEEE numpy op) become closeness
checks. Prints ``RESULT ok ...`` on success.
"""

import argparse
import math
import sys

import numpy as np
import torch

from moealign.precision import canonical as C
from moealign.precision import canonical_triton as T

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cpu")
dev = torch.device(ap.parse_args().device)
on_cpu = dev.type == "cpu"
if on_cpu and not T._INTERPRET:
    sys.exit("the CPU run needs TRITON_INTERPRET=1")
stock_moves = None
if on_cpu:
    from triton.runtime import interpreter

    # The interpreter's tl.dot is numpy's BLAS, whose bits for a row depend on the row's place in the tile (OpenBLAS
    # sgemm; a GPU's MMA gives every row of a tile the same instruction sequence). Stand in for the MMA: each
    # element the fp32 products of its row and column summed in K order, nothing else.
    a0 = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)
    a1 = np.roll(a0, 7, axis=0)
    stock_moves = not np.array_equal(np.matmul(a1, a0, dtype=np.float32)[7:],
                                     np.matmul(a0, a0, dtype=np.float32)[:-7])

    def _mma_like_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        x, y = a.data.astype(np.float32), b.data.astype(np.float32)
        acc = np.zeros((x.shape[0], y.shape[1]), dtype=np.float32)
        for kk in range(x.shape[1]):
            acc += x[:, kk, None] * y[None, kk, :]
        return interpreter.TensorHandle(acc + d.data, d.dtype.scalar)

    stock_dot = interpreter.InterpreterBuilder.create_dot
    interpreter.InterpreterBuilder.create_dot = _mma_like_dot
else:
    for dt in T.KERNEL_DTYPES:
        T.check_canonical_cuda(dev, dt)
torch.set_default_device(dev)
DTYPES = ((torch.float32, 2e-6), (torch.float16, 2e-3)) + (() if on_cpu else ((torch.bfloat16, 1.6e-2),))


def same_as_cpu_formula(got, ref):
    """Under the interpreter every elementwise op is one IEEE numpy op, as torch's: the CPU op's bits; on a GPU the
    kernels' bits need not be the CPU's."""
    if on_cpu:
        assert torch.equal(got, ref)
    else:
        close(got, ref.double(), 1e-2 if got.dtype == torch.bfloat16 else 2e-3, "cpu formula")


torch.manual_seed(0)
checks = []


def close(got, ref, tol, what):
    err = (got.double() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), (what, err)


# ---- linear: accuracy, M invariance, the K tree, TP cuts
for dtype, tol in DTYPES:
    for K in (128, 192):                                  # 4 leaves (2**2), 6 leaves (odd part 3, 2 groups)
        x = torch.randn(37, K).to(dtype)
        w = (torch.randn(48, K) / 8).to(dtype)
        b = torch.randn(48).to(dtype)
        full = T.linear(x, w, b)
        close(full, x.double() @ w.double().T + b.double(), tol, ("linear", dtype, K))
        root = T.tree_linear_partial(x, w)
        close(root, x.double() @ w.double().T, 2e-6, ("root", dtype, K))
        for m in (1, 3, 16, 33):                          # the batch: any M, rows in other tiles
            assert torch.equal(T.linear(x[:m], w, b), full[:m]), ("M", dtype, K, m)
        other = torch.cat([torch.randn(20, K).to(dtype), x[5:6], torch.randn(2, K).to(dtype)])
        assert torch.equal(T.linear(other, w, b)[20], full[5]), ("position", dtype, K)
        assert torch.equal(T.linear(x.view(1, 37, K), w, b)[0], full)
        for tp in ((2, 4) if K == 128 else (2,)):         # TP cuts of whole subtrees -> TP = 1's bits
            s = K // tp
            roots = [T.tree_linear_partial(x[:, r * s:(r + 1) * s], w[:, r * s:(r + 1) * s]) for r in range(tp)]
            assert torch.equal(T.linear_from_roots(roots, out_dtype=torch.float32), root), ("TP", dtype, K, tp)
            assert torch.equal(T.linear_from_roots(roots, b, out_dtype=dtype), full), ("TP bias", dtype, K, tp)
        # negative control: another BLOCK_K (leaf 16: another tree) changes the bits
        assert not torch.equal(T.tree_linear_partial(x, w, leaf_width=16), root), ("leaf 16", dtype, K)
        checks.append(f"linear {dtype} K={K}")
if on_cpu:
    # negative control of the position checks: with the interpreter's stock (BLAS) dot, rows moved by 7 places in
    # their tiles change bits, and the same comparison catches it
    x, w = torch.randn(64, 128), torch.randn(48, 128)
    interpreter.InterpreterBuilder.create_dot = stock_dot
    try:
        moved = not torch.equal(T.linear(x.roll(7, 0), w).roll(-7, 0), T.linear(x, w))
    finally:
        interpreter.InterpreterBuilder.create_dot = _mma_like_dot
    assert moved and torch.equal(T.linear(x.roll(7, 0), w).roll(-7, 0), T.linear(x, w))
# the router's logits: fp32 out of 16-bit inputs keeps the root
xh, wh = torch.randn(9, 64).half(), torch.randn(8, 64).half()
assert torch.equal(T.linear(xh, wh, out_dtype=torch.float32), T.tree_linear_partial(xh, wh))

# by construction: 4 leaves whose partials are b = [1, 0, u, u] / [1, u, u, 0] (u = 2**-24, half an ulp of 1):
# each leaf's product is one nonzero x * w, so the order of the adds alone decides the result
u = 2.0 ** -24
x = torch.zeros(1, 128)
x[0, ::32] = 1.0
w = torch.zeros(2, 128)
w[0, ::32] = torch.tensor([1.0, 0.0, u, u])
w[1, ::32] = torch.tensor([1.0, u, u, 0.0])
root = T.tree_linear_partial(x, w)
# tree (1 + 0) + (u + u) = 1 + 2**-23, where a running sum ((1 + 0) + u) + u rounds to 1 (ties to even)
assert root[0, 0].item() == 1.0 + 2.0 ** -23, root
one = torch.tensor(1.0)                                                # fp32
assert ((one + 0.0) + u) + u == 1.0 and (one + 0.0) + (u + u) == 1.0 + 2.0 ** -23
# tree (1 + u) + (u + 0) = 1, but a cut after the first leaf (not a subtree: chain 1 | chain 3) gives 1 + (u + u)
assert root[0, 1].item() == 1.0
cut = T.linear_from_roots([T.tree_linear_partial(x[:, :32], w[:, :32]),
                           T.tree_linear_partial(x[:, 32:], w[:, 32:])], out_dtype=torch.float32)
assert cut[0, 1].item() == 1.0 + 2.0 ** -23 and not torch.equal(cut, root)
# and the subtree cut (2 | 2) gives the tree's bits on the same inputs
half = T.linear_from_roots([T.tree_linear_partial(x[:, :64], w[:, :64]),
                            T.tree_linear_partial(x[:, 64:], w[:, 64:])], out_dtype=torch.float32)
assert torch.equal(half, root)
checks.append("tree by construction")

# ---- RMSNorm and log-softmax: accuracy, row invariance
for dtype, tol in DTYPES:
    x = torch.randn(11, 300).to(dtype)
    wt = (torch.rand(300) + 0.5).to(dtype)
    y = T.rms_norm(x, wt, 1e-6)
    xd = x.double()
    close(y, xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * wt.double(), tol, ("norm", dtype))
    assert torch.equal(T.rms_norm(x[4:5], wt, 1e-6), y[4:5])
    assert torch.equal(T.rms_norm(torch.cat([x[7:8], x]), wt, 1e-6)[0], y[7])
    assert torch.equal(T.rms_norm(x, None, 1e-6)[2], T.rms_norm(x[2:3], None, 1e-6)[0])
    ls = T.log_softmax(x)
    assert ls.dtype == torch.float32
    close(ls, torch.log_softmax(x.double(), -1), 2e-6, ("log_softmax", dtype))
    assert torch.equal(T.log_softmax(x[3:4]), ls[3:4])
    assert torch.equal(T.log_softmax(torch.cat([torch.randn(5, 300).to(dtype), x[3:4]]))[5], ls[3])
    assert torch.equal(T.log_softmax(x.t(), 0), ls.t())
checks.append("norm, log_softmax")
x = torch.randn(3, 40)
x[1, 7] = float("-inf")
ls = T.log_softmax(x)
assert ls[1, 7].item() == float("-inf") and torch.isfinite(ls[1, :7]).all()

# ---- exp / log from basic ops: accuracy, and a value's bits do not depend on where it sits (silu_mul: elementwise)
g = torch.randn(1, 97) * 6
gu = torch.cat([g, torch.ones(1, 97)], 1)
act = T.silu_mul(gu, torch.float32)
close(act, g.double() / (1 + torch.exp(-g.double())), 3e-7, "silu")
for shift in (1, 5, 31, 64):
    moved = torch.cat([torch.randn(1, shift) * 6, g], 1)
    moved_gu = torch.cat([moved, torch.ones_like(moved)], 1)
    assert torch.equal(T.silu_mul(moved_gu, torch.float32)[0, shift:], act[0]), shift
    rows = torch.cat([torch.randn(shift, 97 * 2), gu])
    assert torch.equal(T.silu_mul(rows, torch.float32)[shift], act[0]), shift
wide = torch.tensor([[-200.0, -104.0, -87.0, -20.0, -1e-3, 0.0, 1e-3, 1.0, 20.0, 88.0, 89.0, 200.0]])
sm = T.silu_mul(torch.cat([-wide, torch.ones_like(wide)], 1), torch.float32)   # 1 + exp(wide) over the range
close(sm, -wide.double() / (1 + torch.exp(wide.double())), 1e-6, "exp range")
checks.append("exp, log")

# ---- RoPE: the elementwise formula
xr = torch.randn(5, 3, 20)
cos, sin = torch.randn(5, 8), torch.randn(5, 8)
same_as_cpu_formula(T.rope(xr, cos, sin), C.c_rope(xr, cos, sin))
same_as_cpu_formula(T.rope(xr.half(), cos, sin), C.c_rope(xr.half(), cos, sin))
assert torch.equal(T.rope(xr[2:3], cos[2:3], sin[2:3]), T.rope(xr, cos, sin)[2:3])
checks.append("rope")

# ---- attention: accuracy, decode vs full, padding, own key sets; negative control: another key block
for dtype, tol in DTYPES:
    L, H, d = 36, 1, 16                                               # two key blocks of 32
    q = torch.randn(L, H, d).to(dtype)
    k = torch.randn(1, L, H, d).to(dtype)
    v = torch.randn(1, L, H, d).to(dtype)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    full = T.attention(q, k, v, causal, prefix=True)
    s = torch.einsum("qhd,lhd->qlh", q.double(), k[0].double()) / math.sqrt(d)
    p = torch.softmax(s.masked_fill(~causal[:, :, None], float("-inf")), 1)
    close(full, torch.einsum("qlh,lhd->qhd", p, v[0].double()), tol, ("attention", dtype))
    for t in ((0, 31, 32, L - 1) if dtype == torch.float32 else (L - 1,)):   # a decode step over t + 1 keys
        one = torch.ones(1, t + 1, dtype=torch.bool)
        assert torch.equal(T.attention(q[t:t + 1], k[:, :t + 1], v[:, :t + 1], one, prefix=True), full[t:t + 1]), t
    # left padding: 3 masked keys in front (ragged batch), compacted away -> the same bits
    pad = torch.randn(1, 3, H, d).to(dtype)
    kp, vp = torch.cat([pad, k], 1), torch.cat([pad, v], 1)
    keep_p = torch.cat([torch.zeros(L, 3, dtype=torch.bool), causal], 1)
    assert torch.equal(T.attention(q, kp, vp, keep_p), full)
    if dtype == torch.float32:
        # each query row with its own key set [Q, L, H, d]
        kq, vq = k.expand(L, -1, -1, -1).contiguous(), v.expand(L, -1, -1, -1).contiguous()
        assert torch.equal(T.attention(q, kq, vq, causal), full)
        # negative control: another key block (8 keys) changes the bits of the rows past the first block
        T._KEY_BLOCK = 8
        try:
            other = T.attention(q, k, v, causal, prefix=True)
        finally:
            T._KEY_BLOCK = 32
        assert not torch.equal(other[8:], full[8:]) and torch.equal(other[:8], full[:8])
checks.append("attention")

# ---- router: top-k (ties: the lower id; ascending), gates, their row invariance
lg = torch.randn(9, 24)
lg[0, 5] = lg[0, 2] = lg[0, 11] = 9.0                                   # a three-way tie, two chosen of it
lg[1, :] = 0.0
lg[2, 3] = float("-inf")
for kk in (1, 2, 4):
    assert torch.equal(T.topk(lg, kk), C.c_topk(lg, kk)), kk
assert T.topk(lg, 2)[0].tolist() == [2, 5] and T.topk(lg, 3)[1].tolist() == [0, 1, 2]
ids = C.c_topk(lg, 4)
for renorm in (True, False):
    gt = T.gates(lg, ids, renormalize=renorm)
    close(gt, C.c_gates(lg.double(), ids, renormalize=renorm), 3e-7, ("gates", renorm))
    assert torch.equal(T.gates(lg[4:5], ids[4:5], renormalize=renorm), gt[4:5])
logits = T.linear(torch.randn(6, 32).half(), torch.randn(24, 32).half(), out_dtype=torch.float32)
assert logits.dtype == torch.float32
checks.append("router")

# ---- experts: accuracy, the same tree linear per pair, per-token invariance; the combine
for dtype, tol in ((torch.float32, 2e-6), (torch.float16, 5e-3)) + DTYPES[2:]:
    E, I, Hd, T_, kk = 5, 64, 32, 9, 2
    w13 = (torch.randn(E, 2 * I, Hd) / 4).to(dtype)
    w2 = (torch.randn(E, Hd, I) / 4).to(dtype)
    x = torch.randn(T_, Hd).to(dtype)
    ids = C.c_topk(torch.randn(T_, E), kk)
    y = T.experts(x, ids, w13, w2)
    gu = torch.einsum("tkih,th->tki", w13[ids].double(), x.double())
    ref_act = (gu[..., :I] / (1 + torch.exp(-gu[..., :I])) * gu[..., I:]).to(dtype).double()
    close(y, torch.einsum("tkhi,tki->tkh", w2[ids].double(), ref_act), tol, ("experts", dtype))
    for t, j in ((0, 0), (8, 1)):                                       # the pair through the same tree linear
        e = ids[t, j].item()
        act = T.silu_mul(T.tree_linear_partial(x[t:t + 1], w13[e]), dtype)
        assert torch.equal(T.tree_linear_partial(act, w2[e])[0], y[t, j]), (dtype, t, j)
    assert torch.equal(T.experts(x[4:5], ids[4:5], w13, w2), y[4:5])   # alone
    crowd = ids.clone()
    crowd[5:] = ids[4]                        # more tokens on token 4's experts (it sits elsewhere in their tiles)
    crowd[:4] = torch.tensor([ids[4, 0].item(), (ids[4, 1].item() + 1) % E]).sort().values
    assert torch.equal(T.experts(x, crowd, w13, w2)[4], y[4])
    if dtype == torch.float32:
        # expert TP = 2: each rank holds half of the intermediate axis (gate and up rows, down columns); the down
        # projection's subtree roots recombined by the same tree give TP = 1's bits
        shard = [T.experts(x, ids, torch.cat([w13[:, r * I // 2:(r + 1) * I // 2],
                                              w13[:, I + r * I // 2:I + (r + 1) * I // 2]], 1),
                           w2[:, :, r * I // 2:(r + 1) * I // 2]) for r in range(2)]
        assert torch.equal(T.linear_from_roots(shard, out_dtype=torch.float32), y)
    if dtype == torch.float32:                # past one 32-row tile on token 4's experts: it lands in the second
        many = torch.cat([torch.randn(40, Hd).to(dtype), x[4:5]])
        many_ids = torch.cat([ids[4:5].expand(40, -1), ids[4:5]])
        assert torch.equal(T.experts(many, many_ids, w13, w2)[40], y[4])
    gts = T.gates(torch.randn(T_, E), ids, renormalize=True)
    comb = T.combine(y, gts, dtype)
    same_as_cpu_formula(comb, C.c_combine(y, gts, dtype))
    assert torch.equal(T.combine(y[4:5], gts[4:5], dtype), comb[4:5])
# negative control: another BLOCK_K changes the experts' bits
assert not torch.equal(T.experts(x, ids, w13, w2, leaf_width=16), y)
checks.append("experts, combine")

where = f"{dev}" + (f" (interpreter; its stock tl.dot moves with the row: {stock_moves})" if on_cpu else f" ({torch.cuda.get_device_name(dev)})")
print(f"RESULT ok on {where}: " + "; ".join(checks))
