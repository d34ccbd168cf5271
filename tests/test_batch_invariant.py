"""Batch-invariant ops: a row computed alone equals the same row inside batches, bitwise; stock ops do not.

Each bitwise claim (``torch.equal``) sits next to a negative control that differs *by construction*: a
naive op whose reduction order depends on the batch explicitly (a row alone is reduced in one piece, rows
inside a batch in two pieces, split where no kernel's blocking splits; for matmuls each piece rounded to the
output dtype from an exact fp64 product, so no BLAS enters the bits) run through the same comparison must
show differing rows, so the comparison can fail. Whether the *stock* ops are batch-variant depends on the
BLAS, its kernels and thread split on the machine, so no test relies on it. That the mode's kernels (not the
stock ones) computed a result is shown by recording their calls (:func:`override_calls`), not by comparing
bits with the stock op (on some machines the two agree).
"""

import threading

import pytest
import torch
import warm
import torch.nn.functional as F

from moealign.precision.batch_invariant import (
    DEFAULT_ROW_TILE,
    BatchInvariantError,
    batch_invariant_mode,
    bi_linear,
    bi_log_softmax,
    bi_matmul,
    bi_mean,
    bi_rms_norm,
    fixed_tree_sum,
    is_batch_invariant_mode_enabled,
    triton_available,
)

BATCH_SIZES = (1, 3, 8, 33, 128)
# Rows checked: the last row of every batch size plus a few inside.
ROWS = (0, 1, 2, 7, 16, 32, 64, 127)


def row_mismatches(fn, xb):
    """(rows whose value inside a batch differs from the row computed alone, rows checked)."""
    alone = {i: fn(xb[i:i + 1]) for i in ROWS}
    bad = checked = 0
    for m in BATCH_SIZES:
        out = fn(xb[:m])
        for i in ROWS:
            if i < m:
                checked += 1
                bad += not torch.equal(out[i:i + 1], alone[i])
    return bad, checked


def split_when_batched(whole, halves):
    """A naive op, batch-dependent by construction: ``whole(x)`` for one row, ``halves(x)`` (the reduction
    done as two pieces combined, split where the whole reduction does not split) for a batch of rows."""
    return lambda x: whole(x) if x.shape[0] == 1 else halves(x)


def assert_invariant_and_control(ours, naive, datasets):
    """``ours`` is batch-invariant on every dataset; ``naive`` (batch-dependent by construction, see
    :func:`split_when_batched`) differs somewhere, so the comparison can fail."""
    if isinstance(datasets, torch.Tensor):
        datasets = [datasets]
    stock_bad = 0
    for xb in datasets:
        bad, checked = row_mismatches(ours, xb)
        assert checked == 22
        assert bad == 0, f"{bad}/{checked} rows differ between batch sizes"
        stock_bad += row_mismatches(naive, xb)[0]
    assert stock_bad > 0, "negative control: the split reduction was not caught by the comparison"


@pytest.fixture
def override_calls(monkeypatch):
    """``[(aten op, thread name)]`` for every call of the mode's kernels while the test runs: the direct
    evidence that the mode's kernel, not the stock one, produced a value. (The mode registers the functions
    of ``_OVERRIDES`` when it is first entered, so the recording wrappers go in there.)"""
    from moealign.precision import batch_invariant as bi

    assert not is_batch_invariant_mode_enabled()
    calls = []
    for op, fn in list(bi._OVERRIDES.items()):
        def recording(*args, _op=op, _fn=fn, **kwargs):
            calls.append((_op, threading.current_thread().name))
            return _fn(*args, **kwargs)

        monkeypatch.setitem(bi._OVERRIDES, op, recording)
    return calls


@pytest.fixture(autouse=True)
def at_least_two_threads():
    """Stock CPU reductions split a long row across threads only when there are several threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- matmul


def whole_and_pieces(w, bias=None):
    """``x @ w (+ bias)`` two ways, both independent of the BLAS: ``whole`` rounds the fp64 product (exact
    fp32 / bf16 products, an fp64 sum ~2^-29 of an fp32 ulp from exact) once to the dtype; ``pieces`` splits K
    at a third, rounds each piece's product to the dtype and adds them (and the bias) in the dtype: a second
    rounding, by construction. ``w`` is ``[K, N]`` or batched ``[B, K, N]``."""
    w64 = w.double()
    h = w.shape[-2] // 3

    def whole(x):
        out = x.double() @ w64
        return (out if bias is None else out + bias.double()).to(x.dtype)

    def pieces(x):
        out = (x[..., :h].double() @ w64[..., :h, :]).to(x.dtype) + (x[..., h:].double() @ w64[..., h:, :]).to(x.dtype)
        return out if bias is None else out + bias

    return whole, pieces


def naive_matmul(w, bias=None):
    return split_when_batched(*whole_and_pieces(w, bias))


@pytest.mark.parametrize("dtype,k,n,n_sets", [(torch.float32, 256, 200, 1), (torch.bfloat16, 4096, 1024, 1)])
def test_matmul_rows_invariant_and_close(dtype, k, n, n_sets):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(k, n, generator=gen).to(dtype)
    sets = [torch.randn(128, k, generator=gen).to(dtype) for _ in range(n_sets)]
    xb = sets[0]
    assert_invariant_and_control(lambda x: bi_matmul(x, w), naive_matmul(w), sets)
    ref = xb.double() @ w.double()
    tol = 1e-4 if dtype == torch.float32 else 1.0  # bf16 output: |y| ~ 64, half an ulp ~ 0.25
    assert (bi_matmul(xb, w).double() - ref).abs().max() < tol
    assert (bi_matmul(xb, w).double() - (xb @ w).double()).abs().max() < tol


@pytest.mark.parametrize("row_tile", [1, 8, 64])
def test_any_fixed_row_tile_is_invariant(row_tile):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=gen)
    xb = torch.randn(128, 96, generator=gen)
    bad, _ = row_mismatches(lambda x: bi_matmul(x, w, row_tile=row_tile), xb)
    assert bad == 0


def test_matmul_shapes_noncontiguous_and_misaligned_inputs():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 48, generator=gen)
    x = torch.randn(5, 7, 64, generator=gen)
    out = bi_matmul(x, w)
    assert out.shape == (5, 7, 48)
    assert torch.equal(out.reshape(35, 48), bi_matmul(x.reshape(35, 64), w))
    # A transposed view and a row slice at an odd offset give the same bits as a fresh contiguous copy.
    xt = torch.randn(64, 35, generator=gen).t()
    assert torch.equal(bi_matmul(xt, w), bi_matmul(xt.contiguous(), w))
    big = torch.randn(41, 64, generator=gen)
    assert torch.equal(bi_matmul(big[3:4], w), bi_matmul(big[3:4].clone(), w))
    assert bi_matmul(torch.randn(64, generator=gen), w).shape == (48,)
    assert bi_matmul(torch.randn(0, 64), w).shape == (0, 48)


def test_linear_with_bias_invariant_and_equals_mode_linear(override_calls):
    gen = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(128, 80)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 128, generator=gen))
        lin.bias.copy_(torch.randn(80, generator=gen))
    xb = torch.randn(128, 128, generator=gen)
    with torch.no_grad():
        assert_invariant_and_control(lambda x: bi_linear(x, lin.weight, lin.bias),
                                     naive_matmul(lin.weight.t(), lin.bias), xb)
        assert (bi_linear(xb, lin.weight, lin.bias) - lin(xb)).abs().max() < 1e-4
        with batch_invariant_mode():
            moded = lin(xb)
            moded_3d = lin(xb.reshape(4, 32, 128))
    assert torch.equal(moded, bi_linear(xb, lin.weight, lin.bias))
    assert torch.equal(moded_3d.reshape(128, 80), moded)
    assert [op for op, _ in override_calls] == ["addmm", "addmm"]     # the mode's kernel computed both


def test_bmm_rows_invariant_across_rows_and_batch_entries():
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(4, 128, 96, generator=gen)
    b = torch.randn(4, 96, 72, generator=gen)
    # rows of every batch entry: the row axis goes first for row_mismatches
    rows_first = a.transpose(0, 1)
    whole, pieces = whole_and_pieces(b)
    assert_invariant_and_control(lambda x: bi_matmul(x.transpose(0, 1).contiguous(), b).transpose(0, 1),
                                 split_when_batched(lambda x: whole(x.transpose(0, 1)).transpose(0, 1),
                                                    lambda x: pieces(x.transpose(0, 1)).transpose(0, 1)),
                                 rows_first)
    # the number of batch entries does not matter either
    assert torch.equal(bi_matmul(a[:1], b[:1]), bi_matmul(a, b)[:1])
    assert (bi_matmul(a, b) - torch.bmm(a, b)).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------ reductions


def test_fixed_tree_sum_accuracy_padding_and_dims():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 1001, generator=gen)
    ref = x.double().sum(-1)
    assert (fixed_tree_sum(x) - ref).abs().max() < 1e-4
    padded = torch.cat([x, torch.zeros(6, 3000)], dim=1)  # padding with zeros keeps the bits
    assert torch.equal(fixed_tree_sum(padded), fixed_tree_sum(x))
    x3 = torch.randn(5, 6, 7, generator=gen)
    assert torch.equal(fixed_tree_sum(x3, dim=1), fixed_tree_sum(x3.transpose(1, 2).contiguous(), dim=2))
    assert torch.allclose(fixed_tree_sum(x3, dim=0), x3.sum(0), atol=1e-5)
    assert torch.equal(fixed_tree_sum(torch.ones(3, 1)), torch.ones(3))
    assert torch.equal(fixed_tree_sum(torch.ones(3, 0)), torch.zeros(3))
    # the tree is not the sequential order: a cancellation example where the two differ
    y = torch.tensor([[1e8, 1.0, -1e8, 1.0]])  # tree: (1e8 + -1e8) + (1 + 1); sequential loses a 1
    sequential = ((y[0, 0] + y[0, 1]) + y[0, 2]) + y[0, 3]
    assert fixed_tree_sum(y).item() == 2.0 and sequential.item() == 1.0


def test_mean_rows_invariant_and_close():
    gen = torch.Generator().manual_seed(6)
    xb = torch.randn(128, 65536, generator=gen)
    h = xb.shape[-1] // 3   # not a half: pairwise summation already splits in halves
    assert_invariant_and_control(lambda x: bi_mean(x, -1), split_when_batched(
        lambda x: x.mean(-1), lambda x: (x[:, :h].sum(-1) + x[:, h:].sum(-1)) / x.shape[-1]), xb)
    assert (bi_mean(xb, -1).double() - xb.double().mean(-1)).abs().max() < 1e-7
    x3 = torch.randn(4, 5, 6, generator=gen)
    assert torch.allclose(bi_mean(x3, (0, 2), keepdim=True), x3.mean((0, 2), keepdim=True), atol=1e-6)
    assert torch.allclose(bi_mean(x3), x3.mean(), atol=1e-6)
    half = x3.bfloat16()
    assert bi_mean(half, -1).dtype == torch.bfloat16
    assert torch.allclose(bi_mean(half, -1, dtype=torch.float32), half.float().mean(-1), atol=1e-6)
    assert torch.isnan(bi_mean(torch.ones(3, 0), -1)).all()


def test_log_softmax_rows_invariant_and_close():
    gen = torch.Generator().manual_seed(7)
    sets = [torch.randn(128, 50000, generator=gen) * 3 for _ in range(4)]
    xb = sets[0]
    h = xb.shape[-1] // 2

    def lse_halves(x):
        m = x.amax(-1, keepdim=True)
        return x - (m + torch.log(torch.exp(x[:, :h] - m).sum(-1, keepdim=True) +
                                  torch.exp(x[:, h:] - m).sum(-1, keepdim=True)))

    assert_invariant_and_control(lambda x: bi_log_softmax(x, -1), split_when_batched(
        lambda x: torch.log_softmax(x, -1), lse_halves), sets)
    assert (bi_log_softmax(xb) - torch.log_softmax(xb, -1)).abs().max() < 1e-5
    xh = xb[:4].bfloat16()
    out = bi_log_softmax(xh, dtype=torch.float32)
    assert out.dtype == torch.float32
    assert (out - torch.log_softmax(xh.float(), -1)).abs().max() < 1e-5
    x3 = torch.randn(3, 9, 4, generator=gen)
    assert torch.allclose(bi_log_softmax(x3, dim=1), torch.log_softmax(x3, 1), atol=1e-6)


def test_rms_norm_rows_invariant_and_close():
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(40000, generator=gen)
    sets = [torch.randn(128, 40000, generator=gen) for _ in range(3)]
    xb = sets[0]

    def stock(x):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    h = xb.shape[-1] // 3   # not a half: pairwise summation already splits in halves

    def halves(x):
        ms = (x[:, :h].pow(2).sum(-1, keepdim=True) + x[:, h:].pow(2).sum(-1, keepdim=True)) / x.shape[-1]
        return w * (x * torch.rsqrt(ms + 1e-6))

    assert_invariant_and_control(lambda x: bi_rms_norm(x, w, 1e-6), split_when_batched(stock, halves), sets)
    assert (bi_rms_norm(xb, w) - stock(xb)).abs().max() < 1e-4
    xh = xb[:3, :512].bfloat16()
    wh = w[:512].bfloat16()
    got = bi_rms_norm(xh, wh)
    ref = wh * (xh.float() * torch.rsqrt(xh.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert got.dtype == torch.bfloat16 and (got.float() - ref.float()).abs().max() < 0.05


# ---------------------------------------------------------------------------------------------- the mode


class HFRMSNorm(torch.nn.Module):
    """transformers' Llama/Qwen RMSNorm, verbatim math (built on mean.dim)."""

    def __init__(self, hidden, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(hidden))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


class TinyBlock(torch.nn.Module):
    """Norm -> gated MLP -> residual -> norm -> LM head -> log-probs: the ops a decoder's logits go through."""

    def __init__(self, hidden=96, inner=160, vocab=40000):
        super().__init__()
        self.norm1 = HFRMSNorm(hidden)
        self.up = torch.nn.Linear(hidden, 2 * inner)
        self.down = torch.nn.Linear(inner, hidden, bias=False)
        self.norm2 = HFRMSNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        gate, up = self.up(self.norm1(x)).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * up)
        return torch.log_softmax(self.head(self.norm2(x)), dim=-1)


def naive_linears(monkeypatch):
    """Negative control by construction: every ``nn.Linear`` splits its K reduction in two pieces (at a third)
    when the leading (batch) dimension is above 1, and not for a single sample."""
    stock = F.linear

    def linear(x, weight, bias=None):
        if x.shape[0] == 1:
            return stock(x, weight, bias)
        h = weight.shape[1] // 3
        out = stock(x[..., :h], weight[:, :h]) + stock(x[..., h:], weight[:, h:])
        return out if bias is None else out + bias

    monkeypatch.setattr(torch.nn.functional, "linear", linear)


def test_mode_makes_a_model_batch_invariant(monkeypatch):
    torch.manual_seed(9)
    block = TinyBlock().eval()
    xb = torch.randn(128, 96)
    with torch.no_grad():
        with batch_invariant_mode():
            bad, checked = row_mismatches(block, xb)
        naive_linears(monkeypatch)
        naive_bad, _ = row_mismatches(block, xb)
    assert bad == 0, f"{bad}/{checked} rows differ with the mode on"
    assert naive_bad > 0, "negative control: a batch-dependent linear was not caught by the comparison"


def test_mode_ops_equal_direct_functions(override_calls):
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(37, 300, generator=gen)
    w = torch.randn(300, 50, generator=gen)
    norm = HFRMSNorm(300)
    with torch.no_grad(), batch_invariant_mode():
        mm, lsm, mean = x @ w, torch.log_softmax(x, -1), x.mean(-1)
        mean_keep = torch.mean(x, dim=(0, 1), keepdim=True)
        normed = norm(x)
        addmm = torch.addmm(torch.randn(37, 50, generator=gen), x, w, beta=0.5, alpha=2.0)
    # each value came from the mode's kernel (RMSNorm through mean.dim)
    assert [op for op, _ in override_calls] == ["mm", "_log_softmax", "mean.dim", "mean.dim", "mean.dim", "addmm"]
    assert torch.equal(mm, bi_matmul(x, w))
    assert torch.equal(lsm, bi_log_softmax(x))
    assert torch.equal(mean, bi_mean(x, -1))
    assert torch.equal(mean_keep, bi_mean(x, (0, 1), keepdim=True))
    assert torch.equal(normed, bi_rms_norm(x, norm.weight.detach()))
    gen2 = torch.Generator().manual_seed(10)
    torch.randn(37, 300, generator=gen2), torch.randn(300, 50, generator=gen2)
    bias = torch.randn(37, 50, generator=gen2)
    assert (addmm - (0.5 * bias + 2.0 * (x @ w))).abs().max() < 1e-4


def test_mode_is_reversible_nested_and_exception_safe(override_calls):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, 512, generator=gen)
    w = torch.randn(512, 512, generator=gen)
    stock = x @ w
    assert not is_batch_invariant_mode_enabled()
    with batch_invariant_mode():
        inside = x @ w
        with batch_invariant_mode():
            assert torch.equal(x @ w, inside)
        assert is_batch_invariant_mode_enabled()
        assert torch.equal(x @ w, inside)  # the inner exit kept the outer registration
    assert not is_batch_invariant_mode_enabled()
    # the override was really active (its kernel computed the three products, with the fixed-tile matmul's
    # bits) and is now gone (no further call, the stock bits again)
    assert [op for op, _ in override_calls] == ["mm"] * 3
    assert torch.equal(inside, bi_matmul(x, w))
    assert torch.equal(x @ w, stock)
    assert len(override_calls) == 3
    with pytest.raises(RuntimeError, match="boom"):
        with batch_invariant_mode():
            raise RuntimeError("boom")
    assert not is_batch_invariant_mode_enabled()
    assert torch.equal(x @ w, stock)
    with batch_invariant_mode(enabled=False):
        assert not is_batch_invariant_mode_enabled()
        x @ w
    assert len(override_calls) == 3


def test_mode_is_process_wide_across_threads(override_calls):
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(1, 256, generator=gen)
    w = torch.randn(256, 256, generator=gen)
    results = {}

    def worker():
        results["thread"] = x @ w

    with batch_invariant_mode():
        t = threading.Thread(target=worker, name="other-thread")
        t.start()
        t.join(timeout=30)
    assert override_calls == [("mm", "other-thread")]    # the mode's kernel ran in the other thread
    assert torch.equal(results["thread"], bi_matmul(x, w))


def test_gradients_flow_through_direct_functions_and_mode():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(9, 64, generator=gen, requires_grad=True)
    w = torch.randn(32, 64, generator=gen, requires_grad=True)
    b = torch.randn(32, generator=gen, requires_grad=True)
    target = torch.randint(0, 32, (9,), generator=gen)

    def loss_of(linear, log_softmax):
        return -log_softmax(linear(x, w, b), -1).gather(-1, target[:, None]).mean()

    ref = torch.autograd.grad(loss_of(F.linear, torch.log_softmax), (x, w, b))
    ours = torch.autograd.grad(loss_of(bi_linear, bi_log_softmax), (x, w, b))
    with batch_invariant_mode():
        moded = torch.autograd.grad(loss_of(F.linear, torch.log_softmax), (x, w, b))
    for r, o, m in zip(ref, ours, moded):
        assert torch.allclose(r, o, atol=1e-5) and torch.allclose(r, m, atol=1e-5)
    # forward bits do not depend on grad mode
    with torch.no_grad():
        no_grad_out = bi_linear(x, w, b)
    assert torch.equal(no_grad_out, bi_linear(x, w, b).detach())


def test_embedded_moe_model_logits_batch_invariant_under_mode(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from moealign.embedded import default_prompts, embedded_model_path

    path = embedded_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    length = 16  # equal-length prompts: no padding, so only the batch size changes
    ids = [tok(p).input_ids[:length] for p in default_prompts()]
    ids = torch.tensor([i for i in ids if len(i) == length][:8])
    assert ids.shape == (8, length)

    def same_logits():
        with torch.no_grad():
            alone = model(input_ids=ids[:1], use_cache=False).logits
            return [torch.equal(model(input_ids=ids[:b], use_cache=False).logits[:1], alone) for b in (3, 8)]

    with batch_invariant_mode():
        moded = same_logits()
    naive_linears(monkeypatch)
    naive = same_logits()
    assert all(moded), f"logits of prompt 0 differ inside batches with the mode on: {moded}"
    assert not any(naive), "negative control: batch-dependent linears were not caught by the comparison"


# ---------------------------------------------------------------------------------------------- errors


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 8)
    with pytest.raises(BatchInvariantError, match="inner dims"):
        bi_matmul(x, torch.randn(7, 3))
    with pytest.raises(BatchInvariantError, match="dtype"):
        bi_matmul(x, torch.randn(8, 3, dtype=torch.float64))
    with pytest.raises(BatchInvariantError, match="float16, bfloat16"):
        bi_matmul(x.long(), torch.ones(8, 3, dtype=torch.long))
    with pytest.raises(BatchInvariantError, match="row_tile"):
        bi_matmul(x, torch.randn(8, 3), row_tile=0)
    with pytest.raises(BatchInvariantError, match="backend"):
        bi_matmul(x, torch.randn(8, 3), backend="cuda-magic")
    with pytest.raises(BatchInvariantError, match="batched matmul"):
        bi_matmul(torch.randn(2, 4, 8), torch.randn(3, 8, 5))
    with pytest.raises(BatchInvariantError, match="weight must be"):
        bi_linear(x, torch.randn(8))
    with pytest.raises(BatchInvariantError, match="bias must be"):
        bi_linear(x, torch.randn(3, 8), torch.randn(4))
    with pytest.raises(BatchInvariantError, match="out of range"):
        bi_log_softmax(x, dim=2)
    with pytest.raises(BatchInvariantError, match="twice"):
        bi_mean(x, (1, -1))
    with pytest.raises(BatchInvariantError, match="weight must be"):
        bi_rms_norm(x, torch.randn(5))
    with pytest.raises(BatchInvariantError, match="eps"):
        bi_rms_norm(x, eps=-1.0)
    with pytest.raises(TypeError, match="torch.Tensor"):
        bi_mean([1.0, 2.0])
    if not torch.cuda.is_available():
        with pytest.raises(BatchInvariantError, match="triton"):
            bi_matmul(x, torch.randn(8, 3), backend="triton")


def test_mode_leaves_unsupported_dtypes_to_stock_kernels():
    a = torch.arange(12).reshape(3, 4)
    b = torch.arange(8).reshape(4, 2)
    with batch_invariant_mode():
        assert torch.equal(a @ b, torch.tensor([[28, 34], [76, 98], [124, 162]]).long())
        c = torch.randn(3, 4, dtype=torch.complex64)
        assert torch.allclose(c.mean(-1), c.sum(-1) / 4)
    assert DEFAULT_ROW_TILE >= 1


# ---------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_ops_rows_invariant(backend, dtype):
    if backend == "triton" and not triton_available():
        pytest.skip("triton not installed")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 768, device="cuda", generator=gen).to(dtype)
    xb = torch.randn(128, 1024, device="cuda", generator=gen).to(dtype)
    bias = torch.randn(768, device="cuda", generator=gen).to(dtype)
    wide = torch.randn(128, 50000, device="cuda", generator=gen).to(dtype)
    norm_w = torch.randn(1024, device="cuda", generator=gen).to(dtype)
    cases = {
        "matmul": (lambda x: bi_matmul(x, w, backend=backend), xb),
        "linear": (lambda x: bi_linear(x, w.t().contiguous(), bias, backend=backend), xb),
        "log_softmax": (lambda x: bi_log_softmax(x, dtype=torch.float32, backend=backend), wide),
        "mean": (lambda x: bi_mean(x, -1, backend=backend), wide),
        "rms_norm": (lambda x: bi_rms_norm(x, norm_w, backend=backend), xb),
    }
    for name, (fn, data) in cases.items():
        bad, checked = row_mismatches(fn, data)
        assert bad == 0, f"{name}: {bad}/{checked} rows differ"
    tol = 1e-2 if dtype == torch.float32 else 0.5
    assert (bi_matmul(xb, w, backend=backend).float() - (xb.float() @ w.float())).abs().max() < tol
    assert (bi_log_softmax(wide, dtype=torch.float32, backend=backend)
            - torch.log_softmax(wide.float(), -1)).abs().max() < 1e-4


@pytest.mark.gpu
@gpu
def test_gpu_mode_makes_a_model_batch_invariant():
    torch.manual_seed(1)
    block = TinyBlock().cuda().eval()
    xb = torch.randn(128, 96, device="cuda")
    with torch.no_grad(), batch_invariant_mode():
        bad, checked = row_mismatches(block, xb)
    assert bad == 0, f"{bad}/{checked} rows differ on CUDA with the mode on"


# ---------------------------------------------------------------------------------------------- tool


def test_bench_batch_invariant_smoke(tmp_path):
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "bench.json"
    proc = warm.run(
        [sys.executable, str(root / "tools" / "bench_batch_invariant.py"), "--m", "1,40", "--k", "64", "--n", "48",
         "--reductions", "--vocab", "300", "--hidden", "32", "--repeats", "2", "--threads", "1",
         "--attention", "--attention-shapes", "2x8,3x12",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ratio" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["matmul", "matmul", "log_softmax", "rms_norm", "log_softmax", "rms_norm",
                                       "bi_attn", "bi_attn@64", "bi_attn", "bi_attn@64"]
    assert all(r["stock_ms"] > 0 and r["ours_ms"] > 0 and r["ratio"] > 0 for r in rows)
