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
    from triton_interp import install_mma_like_dot      # tests/ is this script's sys.path[0]

    # The interpreter's tl.dot is numpy's BLAS, whose bits for a row depend on the row's place in the tile (OpenBLAS
    # sgemm): the stand-in MMA (tests/triton_interp.py) sums each element's products in K order.
    a0 = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)
    a1 = np.roll(a0, 7, axis=0)
    stock_moves = not np.array_equal(np.matmul(a1, a0, dtype=np.float32)[7:],
                                     np.matmul(a0, a0, dtype=np.float32)[:-7])

    stock_dot = install_mma_like_dot()
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
    from triton.runtime import interpreter

    interpreter.InterpreterBuilder.create_dot = stock_dot
    try:
        moved = not torch.equal(T.linear(x.roll(7, 0), w).roll(-7, 0), T.linear(x, w))
    finally:
        install_mma_like_dot()
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

# ---- autograd: the public names are differentiable (TRITON_OPS' entries), the forward's bits are the forward-only
# kernel's, the gradients agree with the CPU definition's autograd in float64 (relative to the largest entry) and
# with a central finite difference of the kernels' own forward along a random direction
GRAD_TOL = 1e-4                 # fp32 kernels against float64: fp32 rounding of short sums and matmuls
FD_TOL = 1e-2                   # fp32 central differences: rounding / eps and the eps**2 term


def grad_close(got, ref, tol, what):
    scale = max(1e-30, ref.abs().max().item())
    err = (got.double() - ref).abs().max().item() / scale
    assert err <= tol, (what, err)
    # negative control of the comparison itself: the same gradient scaled by 1 + 4 tol fails it
    assert (got.double() * (1 + 4 * tol) - ref).abs().max().item() / scale > tol, (what, "tolerance too loose")


def check_grads(what, tri, cpu, inputs, *, fwd=None, fd=True, tol=GRAD_TOL):
    xs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = tri(*xs)
    assert out.grad_fn is not None, what
    if fwd is not None:                                          # the wrapper changes no bit of the forward
        assert torch.equal(out, fwd(*inputs)), (what, "forward bits")
    gen = torch.Generator(device="cpu").manual_seed(len(checks))
    r = torch.randn(out.shape, generator=gen, device="cpu").to(dev)
    got = torch.autograd.grad(out, xs, r.to(out.dtype))
    refs_in = [t.detach().double().requires_grad_(True) for t in inputs]
    ref = torch.autograd.grad(cpu(*refs_in), refs_in, r.double())
    for i, (g, rf) in enumerate(zip(got, ref)):
        assert g.dtype == inputs[i].dtype and g.shape == inputs[i].shape, (what, i)
        grad_close(g, rf, tol, (what, i))
    if fd:
        vs = [torch.randn(t.shape, generator=gen, device="cpu").to(dev) for t in inputs]
        eps = 1e-2
        with torch.no_grad():
            f = [(tri(*[t + sgn * eps * v for t, v in zip(inputs, vs)]).double() * r).sum().item() for sgn in (1, -1)]
        want = sum((g.double() * v).sum().item() for g, v in zip(got, vs))
        assert abs((f[0] - f[1]) / (2 * eps) - want) <= FD_TOL * max(1.0, abs(want)), (what, "fd", f, want)
    checks.append(f"grad {what}")


table = {fn for functions in T.TRITON_OPS.values() for fn in functions.values()}
assert table == {T.linear, T.rms_norm, T.rope, T.attention, T.topk, T.gates, T.experts, T.combine, T.log_softmax}
f32 = torch.float32
x, w, b = torch.randn(2, 5, 64), torch.randn(48, 64) / 8, torch.randn(48)
check_grads("linear", T.linear, C.c_linear, [x, w, b], fwd=T.linear_forward)


def one_sided(fn, inputs):
    """Each input's gradient alone (the others without requires_grad: a Function saves only what that needs) is
    the one it gets beside the others."""
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    cot = torch.randn(out.shape)
    both = torch.autograd.grad(out, leaves, cot)
    for i, t in enumerate(leaves):
        alone = [t if j == i else u for j, u in enumerate(inputs)]
        assert torch.equal(torch.autograd.grad(fn(*alone), t, cot)[0], both[i]), i


one_sided(lambda x, w: T.linear(x, w, b), [x, w])
check_grads("router logits fp32", lambda x, w: T.linear(x.half(), w.half(), out_dtype=f32),
            lambda x, w: C.c_linear(x, w), [x, w], fwd=lambda x, w: T.linear_forward(x.half(), w.half(), out_dtype=f32),
            fd=False, tol=3e-3)
check_grads("tp=2 partials + roots", lambda x, w: T.linear_from_roots(
    [T.tree_linear_partial(x[..., r * 32:(r + 1) * 32], w[:, r * 32:(r + 1) * 32]) for r in range(2)], out_dtype=f32),
    lambda x, w: C.c_linear(x, w), [x, w], fwd=lambda x, w: T.tree_linear_partial_forward(x, w))
xn, wn = torch.randn(4, 300) * 3, torch.rand(300) + 0.5
check_grads("rms_norm", lambda x, w: T.rms_norm(x, w, 1e-6), lambda x, w: C.c_rms_norm(x, w, 1e-6), [xn, wn],
            fwd=lambda x, w: T.rms_norm_forward(x, w, 1e-6))
check_grads("rms_norm no weight", lambda x: T.rms_norm(x, None, 1e-6), lambda x: C.c_rms_norm(x, None, 1e-6), [xn])
xr, cos, sin = torch.randn(5, 3, 20), torch.randn(5, 8), torch.randn(5, 8)
check_grads("rope", T.rope, C.c_rope, [xr, cos, sin], fwd=T.rope_forward)
check_grads("rope cos / sin broadcast", lambda x, c, s: T.rope(x, c[:1], s[:1]),
            lambda x, c, s: C.c_rope(x, c[:1], s[:1]),
            [xr, cos, sin], fd=False)
L, H, d = 36, 2, 16
q, k, v = torch.randn(L, H, d), torch.randn(1, L, H, d), torch.randn(1, L, H, d)
causal = torch.ones(L, L, dtype=torch.bool).tril()
check_grads("attention", lambda q, k, v: T.attention(q, k, v, causal, prefix=True, max_elements=7 * L * H),
            lambda q, k, v: C.c_attention(q, k, v, causal, prefix=True), [q, k, v],
            fwd=lambda q, k, v: T.attention_forward(q, k, v, causal, prefix=True), fd=False)
# (above: shared keys, the backward in chunks of 7 query rows) per-row key sets, left padding compacted away, the
# backward in chunks of 5 query rows
keep_p = torch.cat([torch.zeros(L, 3, dtype=torch.bool), causal], 1)
kq, vq = torch.randn(L, L + 3, H, d), torch.randn(L, L + 3, H, d)
check_grads("attention per-row keys, chunked",
            lambda q, k, v: T.attention(q, k, v, keep_p, max_elements=5 * (L + 3) * H * d),
            lambda q, k, v: C.c_attention(q, k, v, keep_p), [q, kq, vq], fd=False)
# a row with no kept key: NaN forward (as on the CPU), no gradient from it (finite, zero for its query)
keep_e = causal.clone()
keep_e[4] = False
qe, ke, ve = (t.clone().requires_grad_(True) for t in (q, k, v))
oe = T.attention(qe, ke, ve, keep_e, prefix=False)
assert torch.isnan(oe[4]).all() and torch.isfinite(oe[torch.arange(L) != 4]).all()
dq, dk, dv = torch.autograd.grad(oe, (qe, ke, ve), torch.ones_like(oe))
assert (dq[4] == 0).all() and all(torch.isfinite(t).all() for t in (dq, dk, dv))
lg = torch.randn(6, 24)
ids = C.c_topk(lg, 4)
for renorm in (True, False):
    check_grads(f"gates renormalize={renorm}", lambda z: T.gates(z, ids, renormalize=renorm),
                lambda z: C.c_gates(z, ids, renormalize=renorm), [lg],
                fwd=lambda z: T.gates_forward(z, ids, renormalize=renorm))
# negative control by construction: the two modes' gradients differ, and the comparison tells them apart
za, zb = (lg.clone().requires_grad_(True) for _ in range(2))
ga = torch.autograd.grad(T.gates(za, ids, renormalize=True).sum(), za)[0]        # zero: the gates sum to 1
gb = torch.autograd.grad(T.gates(zb, ids, renormalize=False).sum(), zb)[0]
assert ga.abs().max().item() < 1e-6 < gb.abs().max().item()
check_grads("silu_mul", lambda gu: T.silu_mul(gu, f32),
            lambda gu: gu[:, :40] / (1 + torch.exp(-gu[:, :40])) * gu[:, 40:], [torch.randn(7, 80) * 3],
            fwd=lambda gu: T.silu_mul_forward(gu, f32))
# experts: 40 tokens, top-2 of 4 experts, expert 3 never chosen (zero gradient), expert 0 chosen by 36 tokens (its
# pairs span two 32-row blocks of the weight-gradient loop and two tiles of the forward)
E, I, Hd, Tn = 4, 64, 32, 40
w13, w2 = torch.randn(E, 2 * I, Hd) / 4, torch.randn(E, Hd, I) / 4
xe = torch.randn(Tn, Hd)
eids = torch.stack([torch.zeros(Tn, dtype=torch.long), torch.randint(1, 3, (Tn,))], 1)
eids[36:, 0] = 1
eids[36:, 1] = 2
check_grads("experts", lambda x, a, b: T.experts(x, eids, a, b), lambda x, a, b: C.c_experts(x, eids, a, b),
            [xe, w13, w2], fwd=lambda x, a, b: T.experts_forward(x, eids, a, b))
one_sided(lambda x, a, b: T.experts(x, eids[:12], a, b), [xe[:12], w13, w2])
w13g = w13.clone().requires_grad_(True)
assert (torch.autograd.grad(T.experts(xe, eids, w13g, w2).sum(), w13g)[0][3] == 0).all()
yp, gp = torch.randn(7, 3, 40), torch.rand(7, 3)
check_grads("combine", lambda p, g: T.combine(p, g, f32), lambda p, g: C.c_combine(p, g, torch.float64), [yp, gp],
            fwd=lambda p, g: T.combine_forward(p, g, f32))
one_sided(lambda p, g: T.combine(p, g, f32), [yp, gp])
xs = torch.randn(5, 300) * 4
check_grads("log_softmax", T.log_softmax, C.c_log_softmax, [xs], fwd=T.log_softmax_forward)
check_grads("log_softmax dim 0", lambda x: T.log_softmax(x.t(), 0), lambda x: C.c_log_softmax(x.t(), 0), [xs], fd=False)
# 16-bit: the backward's matmuls in the activation dtype with fp32 accumulation (the experts' Triton GEMMs), against
# float64 (bf16 on CUDA only: the interpreter misreads it)
for dtype, tol in ((torch.float16, 5e-3),) + (() if on_cpu else ((torch.bfloat16, 4e-2),)):
    check_grads(f"experts {dtype}", lambda x, a, b: T.experts(x.to(dtype), eids, a.to(dtype), b.to(dtype)),
                lambda x, a, b: C.c_experts(x, eids, a, b), [xe, w13, w2], fd=False, tol=tol)
    check_grads(f"linear {dtype}", lambda x, w, b: T.linear(x.to(dtype), w.to(dtype), b.to(dtype)), C.c_linear,
                [x, w, b], fd=False, tol=tol)

where = f"{dev}" + (f" (interpreter; its stock tl.dot moves with the row: {stock_moves})" if on_cpu else f" ({torch.cuda.get_device_name(dev)})")
print(f"RESULT ok on {where}: " + "; ".join(checks))
