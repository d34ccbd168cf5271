"""Issue 40, items 1-2: the canonical forward's Triton kernels (moealign/precision/canonical_triton.py) checked on the
CPU under Triton's interpreter (``TRITON_INTERPRET=1``, in ONE child process, tests/canonical_triton_child.py: the
interpreter is chosen when the kernels are defined; the same script runs on CUDA in tools/gpu_check.py). Accuracy
against float64; bitwise invariances (the batch / M, the row's position, decode vs the full sequence, a TP = 2 / 4 cut
of K combined by the same tree, a token's expert output whatever else its expert received), each next to a negative
control built to differ (a running sum and a cut off the subtree boundaries, on inputs whose block partials make the
orders round differently; another BLOCK_K; another key block). Shapes are tiny (the interpreter runs each program in
Python). bf16 is not run here (the interpreter misreads it); fp16 runs the same code paths.

In this process: the table against canonical.py's signatures, the refusals (check_canonical_cuda with the GPU facts
simulated, the wrappers' input checks), and the linear kernel compiled for sm_90 by Triton's own ptxas (no GPU
needed): its tree adds stay fp32 adds, not folded into an MMA's accumulator; the experts' weight-gradient kernel
compiled too (16-bit: tensor-core MMAs).

The backward (the public names are torch.autograd.Functions over the ``*_forward`` kernels) is checked in the same
child: gradients against the CPU definition's autograd in float64 and central finite differences, fp32 (the experts
and the linear also fp16), the forward's bits equal to the forward-only kernel's."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moealign.errors import CanonicalError, MoealignError
from moealign.precision import canonical

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - the tests that need it skip
    triton = None

ROOT = Path(__file__).resolve().parents[1]


def _interpreter_reason() -> str | None:
    from test_triton_batch_invariant_interp import _interpreter_breaks_on_this_numpy

    return _interpreter_breaks_on_this_numpy()


def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    reason = _interpreter_reason()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "canonical_triton_child.py"), "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "RESULT ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


# --------------------------------------------------------------------------------------------------------
# in this process: the table, the refusals and the input checks (nothing is launched)


@pytest.fixture
def T():
    pytest.importorskip("triton")
    from moealign.precision import canonical_triton

    return canonical_triton


def test_the_table_stands_for_the_canonical_functions(T):
    assert set(T.TRITON_OPS) <= set(canonical.SPEC)
    assert {"linear", "norm", "rope", "attention", "router", "experts", "lm_head", "log_softmax"} <= set(T.TRITON_OPS)
    for op, functions in T.TRITON_OPS.items():
        for name, fn in functions.items():
            want = inspect.signature(getattr(canonical, name))
            got = inspect.signature(fn)
            assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
                [(p.name, p.kind, p.default) for p in want.parameters.values()], (op, name)


def test_the_differentiable_names_keep_the_forward_only_kernels(T):
    for name in ("linear", "tree_linear_partial", "rms_norm", "rope", "attention", "gates", "silu_mul", "experts",
                 "combine", "log_softmax"):
        fwd = getattr(T, f"{name}_forward")
        assert fwd is not getattr(T, name) and name in T.__all__ and f"{name}_forward" in T.__all__
        assert inspect.signature(fwd) == inspect.signature(getattr(T, name)), name


@pytest.fixture
def ieee_fp32():
    """torch's TF32 switches off for the test, restored after (a CPU build keeps them as plain flags)."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def test_check_canonical_cuda_refuses_by_name(T, monkeypatch, ieee_fp32):
    monkeypatch.setattr(T, "_cuda_capability", lambda device: (9, 0))       # a Hopper card
    for dtype in T.KERNEL_DTYPES:
        T.check_canonical_cuda("cuda:0", dtype)
    T.check_canonical_cuda("cuda", torch.bfloat16)
    with pytest.raises(CanonicalError, match="float64"):
        T.check_canonical_cuda("cuda", torch.float64)
    with pytest.raises(CanonicalError, match="CUDA devices, not cpu"):
        T.check_canonical_cuda("cpu", torch.float32)
    with pytest.raises(CanonicalError, match="not a device"):
        T.check_canonical_cuda("gpu7", torch.float32)
    monkeypatch.setattr(T, "_cuda_capability", lambda device: (7, 5))
    with pytest.raises(CanonicalError, match=r"compute capability >= 8\.0; cuda:0 has 7\.5"):
        T.check_canonical_cuda("cuda:0", torch.float16)
    monkeypatch.setattr(T, "_cuda_capability", lambda device: None)
    with pytest.raises(CanonicalError, match="torch sees none"):
        T.check_canonical_cuda("cuda", torch.float16)
    monkeypatch.setattr(T, "_cuda_capability", lambda device: (8, 0))
    T.check_canonical_cuda("cuda", torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = True
    with pytest.raises(CanonicalError, match="TF32 is switched on: torch.backends.cuda.matmul.allow_tf32"):
        T.check_canonical_cuda("cuda", torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True          # torch's default: cuDNN's convolutions only, no false alarm
    T.check_canonical_cuda("cuda", torch.bfloat16)
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("high")
    with pytest.raises(CanonicalError, match="get_float32_matmul_precision.*'high'"):
        T.check_canonical_cuda("cuda", torch.float16)
    torch.set_float32_matmul_precision("highest")
    T.check_canonical_cuda("cuda", torch.float16)
    monkeypatch.setattr(T, "triton", None)
    monkeypatch.setattr(T, "_TRITON_ERROR", "ModuleNotFoundError: No module named 'triton'")
    with pytest.raises(CanonicalError, match="needs Triton.*No module named 'triton'"):
        T.check_canonical_cuda("cuda", torch.bfloat16)


def test_the_kernels_refuse_bad_input_before_any_work(T, monkeypatch):
    x, w = torch.randn(3, 64), torch.randn(8, 64)
    bad = [
        (lambda: T.linear(x.double(), w.double()), "float64"),
        (lambda: T.linear(x.long(), w), "int64"),
        (lambda: T.linear(x, torch.randn(8, 32)), "the same K"),
        (lambda: T.linear(torch.randn(3, 40), torch.randn(8, 40)), "K = 40 is not a positive multiple"),
        (lambda: T.linear(x, w, torch.randn(7)), "bias has 7 entries"),
        (lambda: T.linear(x, w, leaf_width=24), "leaf_width must be one of"),
        (lambda: T.linear(x, w, out_dtype=torch.int32), "out_dtype"),
        (lambda: T.linear_from_roots([torch.randn(2, 3)] * 3, out_dtype=torch.float32), "power-of-two"),
        (lambda: T.rms_norm(x, torch.randn(5), 1e-6), "weight has 5 entries"),
        (lambda: T.rms_norm(x, None, float("nan")), "eps"),
        (lambda: T.log_softmax(x, 2), "dim 2 is out of range"),
        (lambda: T.attention(torch.randn(2, 1, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4),
                             torch.ones(2, 4, dtype=torch.bool)), "keep"),
        (lambda: T.attention(torch.randn(2, 1, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4).half(),
                             torch.ones(2, 3, dtype=torch.bool)), "share a dtype"),
        (lambda: T.topk(torch.randn(2, 4), 5), r"k must be an integer in \[1, 4\]"),
        (lambda: T.gates(torch.randn(2, 4).half(), torch.zeros(2, 1, dtype=torch.long), renormalize=True), "float16"),
        (lambda: T.experts(torch.randn(2, 32), torch.zeros(2, 1, dtype=torch.long), torch.randn(3, 64, 32),
                           torch.randn(3, 32, 16)), "w2"),
        (lambda: T.experts(torch.randn(2, 40), torch.zeros(2, 1, dtype=torch.long), torch.randn(3, 64, 40),
                           torch.randn(3, 40, 32)), "hidden size 40"),
        (lambda: T.combine(torch.randn(2, 2, 8), torch.randn(2, 3), torch.float32), "do not fit"),
        (lambda: T.rope(torch.randn(2, 1, 8), torch.randn(2, 5), torch.randn(2, 5)), "do not fit"),
    ]
    for call, match in bad:
        with pytest.raises(CanonicalError, match=match):
            call()
    # well-formed CPU tensors outside the interpreter: refused by name (the kernels run on CUDA)
    if not T._INTERPRET:
        with pytest.raises(CanonicalError, match="run on CUDA tensors"):
            T.linear(x, w)
    monkeypatch.setattr(T, "_INTERPRET", True)
    monkeypatch.setattr(T, "triton", None)
    with pytest.raises(CanonicalError, match="Triton does not import"):
        T.rms_norm(x, None, 1e-6)
    assert issubclass(CanonicalError, MoealignError)


if triton is not None:
    @triton.jit
    def _add_dot_const_zero(a_ptr, o_ptr, B: tl.constexpr):     # t + tl.dot(a, a): a constant-zero accumulator
        tile = tl.arange(0, B)[:, None] * B + tl.arange(0, B)[None, :]
        a = tl.load(a_ptr + tile)
        tl.store(o_ptr + tile, tl.load(o_ptr + tile) + tl.dot(a, a))

    @triton.jit
    def _add_dot_seeded(a_ptr, o_ptr, zero, B: tl.constexpr):   # the kernels' way: a run-time zero seed
        tile = tl.arange(0, B)[:, None] * B + tl.arange(0, B)[None, :]
        a = tl.load(a_ptr + tile)
        seed = tl.zeros((B, B), dtype=tl.float32) + zero
        tl.store(o_ptr + tile, tl.load(o_ptr + tile) + tl.dot(a, a, seed))


def _tensor_adds_and_dots(ttir: str) -> tuple[int, list[str]]:
    """(the number of tensor fp adds, each tt.dot's accumulator operand) in a TTIR listing."""
    adds = sum(1 for ln in ttir.splitlines() if "arith.addf" in ln and ": tensor<" in ln)
    accs = [ln.split("tt.dot", 1)[1].split(",")[2].split()[0] for ln in ttir.splitlines() if "= tt.dot " in ln]
    return adds, accs


def test_compiled_for_a_gpu_the_tree_adds_stay_fp32_adds(T, tmp_path, monkeypatch):
    """Triton folds ``t + tl.dot(a, b)`` (constant-zero accumulator) into ``tl.dot(a, b, t)``: one MMA accumulating
    onto ``t``, not the tree's IEEE add (the negative control shows the check sees it). Seeded with a run-time zero,
    as the kernels' leaves are, the add stays; in the linear kernel compiled for sm_90 every leaf's dot is seeded and
    the chain and merge adds are fp32 adds."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def ttir(fn, signature, constexprs):
        try:
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
        except Exception as exc:  # noqa: BLE001 - no NVIDIA backend / ptxas in this triton
            pytest.skip(f"triton cannot compile for sm_90 here: {type(exc).__name__}: {str(exc)[:200]}")
        return compiled.asm["ttir"]

    folded = ttir(_add_dot_const_zero, {"a_ptr": "*fp16", "o_ptr": "*fp32", "B": "constexpr"}, {"B": 16})
    assert _tensor_adds_and_dots(folded)[0] == 0                        # the add is gone into the MMA
    kept = ttir(_add_dot_seeded, {"a_ptr": "*fp16", "o_ptr": "*fp32", "zero": "fp32", "B": "constexpr"}, {"B": 16})
    adds, accs = _tensor_adds_and_dots(kept)
    assert adds == 1 and accs and all(acc.startswith("%seed") for acc in accs), kept     # the tree add stays
    names = T._tree_linear_kernel.arg_names
    consts = {"GATHER": False, "HAS_BIAS": True, "FP32_IEEE": False, "LEVELS": 4, "BLOCK_M": 64, "BLOCK_N": 64,
              "BLOCK_K": 32, "NUM_PROGRAMS": 132}
    signature = {n: "constexpr" if n in consts else "*i32" if n in ("rows_ptr", "tile_expert_ptr", "tile_start_ptr",
                 "tile_end_ptr") else "*fp16" if n.endswith("_ptr") and n != "stack_ptr" else "*fp32"
                 if n == "stack_ptr" else "fp32" if n == "zero" else "i32" for n in names}
    adds, accs = _tensor_adds_and_dots(ttir(T._tree_linear_kernel, signature, consts))
    assert accs and all(acc.startswith("%seed") for acc in accs), accs
    assert adds >= 3                                         # the chain's add, the merge's add, the bias
    # the backward's grouped weight-gradient kernel compiles for the card too; bf16 runs on tensor cores
    consts = {"GATHER_B": True, "FP32_IEEE": False, "BLOCK_P": 32, "BLOCK_N": 64, "BLOCK_K": 64}
    signature = {n: "constexpr" if n in consts else "*i32" if n in ("brows_ptr", "groups_ptr") else "*fp32"
                 if n == "out_ptr" else "*bf16" if n.endswith("_ptr") else "i32" for n in T._wgrad_kernel.arg_names}
    wgrad = triton.compile(ASTSource(fn=T._wgrad_kernel, signature=signature, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})
    assert "mma" in wgrad.asm["ptx"]
