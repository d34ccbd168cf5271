"""`--aligned` on the CUDA path, run on the CPU: the canonical ops' dispatch to their Triton kernels and both
bindings (transformers, Megatron-core) end to end, under Triton's interpreter, in one process (tests/
test_aligned_cuda_path.py starts it with MOEALIGN_CANONICAL_BACKEND=triton: every ``c_*`` call runs its Triton
kernel, as on CUDA tensors).

    TRITON_INTERPRET=1 MOEALIGN_CANONICAL_BACKEND=triton python tests/aligned_cuda_path_child.py

(TRITON_INTERPRET must be set when the process starts: triton.language's own helpers, ``tl.cdiv`` among them, are
jitted when triton is imported, so the child runs cold, never forked from a server that imported triton.)

As tests/canonical_triton_child.py, the interpreter's ``tl.dot`` (numpy's BLAS, whose bits for a row move with its
place in the tile) is replaced by an MMA-like dot (each element its row's and column's products in K order). fp32
only (the interpreter misreads bf16). A tiny random qwen3_moe built here (hidden 64, 2 layers, 4 experts top-2).
Prints ``RESULT ok ...`` on success.
"""

import copy
import os
import sys
import time
import warnings

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 in the environment (read when triton is imported)")

import torch  # noqa: E402
from triton_interp import install_mma_like_dot  # noqa: E402  (tests/ is this script's sys.path[0])

from moealign.errors import CanonicalError  # noqa: E402
from moealign.precision import canonical as C  # noqa: E402
from moealign.precision import canonical_triton as T  # noqa: E402

warnings.simplefilter("ignore")
t_start = time.perf_counter()
cpu = torch.zeros(1)
assert T._INTERPRET and C.on_triton(cpu) and C.on_triton(cpu, "c_attention"), \
    "MOEALIGN_CANONICAL_BACKEND=triton (read once, at import) should send every op to the kernels"


install_mma_like_dot()
torch.manual_seed(0)
checks = []

# ---- 1. the dispatch, op by op: each c_* gives its Triton function's bits
# By construction the two definitions differ on one leaf of products [1, u, u, u] (u = 2**-24, half an ulp of 1):
# the kernel's dot adds them in K order (1 + u rounds to 1, three times: 1), the CPU leaf tree in adjacent pairs
# (1 + (u + u) = 1 + 2**-23, exact).
u = 2.0 ** -24
x = torch.zeros(1, 32)
x[0, :4] = 1.0
w = torch.zeros(1, 32)
w[0, :4] = torch.tensor([1.0, u, u, u])
assert C.c_linear(x, w).item() == 1.0 and torch.equal(C.c_linear(x, w), T.linear_forward(x, w))
with C.canonical_backend("cpu", ["c_linear"]):                    # one function back on the CPU definition
    assert C.c_linear(x, w).item() == 1.0 + 2.0 ** -23 and not C.on_triton(cpu) and C.on_triton(cpu, "c_rope")
assert C.on_triton(cpu)                                          # restored
h = torch.randn(5, 64)
wt = torch.randn(48, 64) / 8
logits = torch.randn(5, 8)
ids = C.c_topk(logits, 2)
q, k, v = torch.randn(3, 2, 32), torch.randn(1, 4, 2, 32), torch.randn(1, 4, 2, 32)
keep = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
cos, sin = torch.randn(5, 16), torch.randn(5, 16)
parts, gates = torch.randn(5, 2, 64), torch.rand(5, 2)
w13, w2 = torch.randn(8, 64, 64) / 8, torch.randn(8, 64, 32) / 8
gu = torch.randn(5, 64)
e_ids = C.c_topk(torch.randn(5, 8), 2)
pairs = {
    "c_linear": (C.c_linear(h, wt, out_dtype=torch.float32), T.linear_forward(h, wt, out_dtype=torch.float32)),
    "c_rms_norm": (C.c_rms_norm(h, wt[0], 1e-6), T.rms_norm_forward(h, wt[0], 1e-6)),
    "c_rope": (C.c_rope(h.view(5, 2, 32), cos, sin), T.rope_forward(h.view(5, 2, 32), cos, sin)),
    "c_attention": (C.c_attention(q, k, v, keep), T.attention_forward(q, k, v, keep)),
    "c_topk": (ids, T.topk(logits, 2)),
    "c_gates": (C.c_gates(logits, ids, renormalize=True), T.gates_forward(logits, ids, renormalize=True)),
    "c_experts": (C.c_experts(h, e_ids, w13, w2), T.experts_forward(h, e_ids, w13, w2)),
    "c_combine": (C.c_combine(parts, gates, torch.float32), T.combine_forward(parts, gates, torch.float32)),
    "c_log_softmax": (C.c_log_softmax(logits), T.log_softmax_forward(logits)),
    "c_silu_and_mul": (C.c_silu_and_mul(gu), T.silu_mul_forward(gu, torch.float32)),
}
for name, (got, want) in pairs.items():
    assert torch.equal(got, want), name
# the CPU definition of the same call is another implementation (exp / log, sums): not asked to match bit for bit
with C.canonical_backend("cpu"):
    assert (C.c_silu_and_mul(gu) - pairs["c_silu_and_mul"][1]).abs().max() < 1e-5
    assert (C.c_log_softmax(logits) - pairs["c_log_softmax"][1]).abs().max() < 1e-5
for name, call in (("c_sigmoid", lambda: C.c_sigmoid(logits)),
                   ("c_grouped_topk", lambda: C.c_grouped_topk(logits, 2, n_group=2, topk_group=1)),
                   ("c_sigmoid_gates", lambda: C.c_sigmoid_gates(logits, ids, renormalize=True)),
                   ("c_rope_deinterleaved", lambda: C.c_rope_deinterleaved(h.view(5, 2, 32), cos, sin))):
    try:
        call()
    except CanonicalError as exc:
        assert str(exc).startswith(f"{name}: the canonical forward has no Triton kernel"), exc
    else:
        raise AssertionError(f"{name} ran on the Triton backend")
checks.append("dispatch")

# ---- 2. a tiny random qwen3_moe: transformers and Megatron from the same weights
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from moealign.patches import megatron as mg  # noqa: E402
from moealign.patches.hf.canonical import apply_canonical_forward  # noqa: E402
from moealign.patches.megatron import checkpoint as mc  # noqa: E402
from moealign.patches.megatron.canonical import apply_canonical_forward_from_hf  # noqa: E402
from moealign.mismatch.engines import resolve_precision  # noqa: E402
from moealign.precision.policy import to_megatron_config_fields  # noqa: E402

V = 96
cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
                     max_position_embeddings=64, norm_topk_prob=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     tie_word_embeddings=False, initializer_range=0.2)
cfg._attn_implementation = "eager"
hf = Qwen3MoeForCausalLM(cfg).eval()
world = mg.init_single_process(device="cpu")
mgm = mc.build_megatron_from_hf(hf, cpu=True, **to_megatron_config_fields(resolve_precision("fp32"),
                                                                          te_available=False)).eval()
hf_handle = apply_canonical_forward(hf)
mg_handle = apply_canonical_forward_from_hf(mgm, hf.config)


def logprobs(logits: torch.Tensor) -> torch.Tensor:
    with C.log_softmax_mode():                     # the scorer's canonical log-softmax (on the Triton kernel here)
        return torch.log_softmax(logits.float(), -1)


g = torch.Generator().manual_seed(1)
ids = torch.randint(3, V, (2, 6), generator=g)
with torch.no_grad():
    full = hf(input_ids=ids).logits

    # a decode step over the KV cache gives the full forward's row; a prefill its rows
    prefix = hf(input_ids=ids[:, :5], use_cache=True)
    assert torch.equal(prefix.logits, full[:, :5])
    cache = prefix.past_key_values
    step = hf(input_ids=ids[:, 5:], past_key_values=copy.deepcopy(cache), use_cache=True).logits[:, 0]
    assert torch.equal(step, full[:, 5])
    with C.canonical_backend("cpu", ["c_attention"]):     # negative control: the step's attention on the CPU definition
        other = hf(input_ids=ids[:, 5:], past_key_values=copy.deepcopy(cache), use_cache=True).logits[:, 0]
    assert not torch.equal(other, full[:, 5]) and (other - full[:, 5]).abs().max() < 1e-4
    checks.append("hf decode = full row")

    # a row's log-probs do not depend on its batch mates (left padding, other lengths)
    rows = [ids[0, :4], torch.randint(3, V, (6,), generator=g)]
    width = max(len(r) for r in rows)
    batch = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        batch[i, width - len(r):], mask[i, width - len(r):] = r, 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    together = logprobs(hf(input_ids=batch, attention_mask=mask, position_ids=pos).logits)[0, width - 4:]
    alone = logprobs(hf(input_ids=rows[0][None]).logits)[0]
    assert torch.equal(together, alone) and torch.equal(alone, logprobs(full)[0, :4])
    with C.canonical_backend("cpu", ["c_rms_norm"]):      # negative control: the lone row's norms on the CPU definition
        moved = logprobs(hf(input_ids=rows[0][None]).logits)[0]
    assert not torch.equal(moved, together)
    checks.append("hf batch mates")

    # transformers and Megatron on the same tokens: the same kernels, the same bits
    T_ = ids.shape[1]
    causal = torch.ones(T_, T_, dtype=torch.bool).triu(1)[None, None]
    positions = torch.arange(T_)[None].expand(2, -1)
    with C.canonical_backend("cpu", ["c_linear"]):        # negative control: Megatron's linears on the CPU definition
        stray = mgm(ids, positions, causal)
    assert not torch.equal(stray, full) and (stray - full).abs().max() < 1e-3
mg_logits = mgm(ids, positions, causal)                   # with gradients: the backward below runs from it
assert mg_logits.shape == full.shape and torch.equal(mg_logits.detach(), full)
assert torch.equal(logprobs(mg_logits.detach()), logprobs(full))
checks.append("hf = Megatron")

# ---- 3. the backward: finite, and close to the CPU definition's gradients on the same weights
targets = ids[:, 1:]


def grads(model_forward) -> dict:
    hf.zero_grad(set_to_none=True)
    lp = logprobs(model_forward()[:, :-1])
    (-torch.gather(lp, -1, targets[..., None]).sum()).backward()
    return {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}


tri = grads(lambda: hf(input_ids=ids).logits)
with C.canonical_backend("cpu"):
    ref = grads(lambda: hf(input_ids=ids).logits)
assert tri.keys() == ref.keys() and len(tri) == len(list(hf.parameters())), sorted(set(ref) ^ set(tri))
TOL = 1e-3
worst = 0.0
for name, gr in tri.items():
    assert torch.isfinite(gr).all(), name
    scale = max(ref[name].abs().max().item(), 1e-6)
    err = (gr - ref[name]).abs().max().item() / scale
    worst = max(worst, err)
    assert err <= TOL, (name, err)
    assert (gr * (1 + 4 * TOL) - ref[name]).abs().max().item() / scale > TOL or ref[name].abs().max() == 0, name
(-torch.gather(logprobs(mg_logits)[:, :-1], -1, targets[..., None]).sum()).backward()
mg_grads = [p.grad for p in mgm.parameters() if p.grad is not None]
assert mg_grads and all(torch.isfinite(gr).all() for gr in mg_grads)
checks.append(f"backward (hf vs CPU definition: max rel err {worst:.1e}; Megatron finite)")

hf_handle.undo()
mg_handle.undo()
world.undo()
print(f"RESULT ok {len(checks)} groups in {time.perf_counter() - t_start:.1f} s: {'; '.join(checks)}")
sys.stdout.flush()
