"""Issue 24, item 3: the batch-invariant matmul kernel (moealign/precision/batch_invariant_triton.py) checked on
the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, in a child process: the interpreter is chosen when the
kernels are defined). Correct against torch (bias, ragged edges in M / N / K), bitwise row-invariant (a row's
result does not depend on the batch it is in, whatever ``M``), with a negative control (another ``BLOCK_K``, i.e.
another K order, changes the bits). Shapes are tiny (the interpreter runs each program in Python). bf16 is not
checked here: the interpreter mis-reads bf16 tensors (the stock kernel gives 1e10 errors there too); fp16 runs the
same code path. The speed of the kernel is measured only on a GPU (tools/bench_batch_invariant.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import torch
from moealign.precision import batch_invariant_triton as T

torch.manual_seed(0)
cfg = (16, 16, 16, 1, 1)
# the configuration is a function of (N, K, dtype): the same for every M
assert T.matmul_config(4096, 4096, torch.bfloat16) == T._NARROW_CONFIGS[torch.bfloat16]
assert T.matmul_config(16384, 4096, torch.bfloat16) == T.MATMUL_CONFIGS[torch.bfloat16]
assert "M" not in T.matmul_config.__code__.co_varnames
# Hopper (compute capability 9.x) uses the measured configuration for 16-bit dtypes at every N, others do not
# (the device's facts, read once per device, stand in for a GPU: (capability major, SM count))
real_facts = T._cuda_facts
try:
    T._cuda_facts = lambda index: (9, 132)
    for n in (4096, 16384):
        assert T.matmul_config(n, 4096, torch.bfloat16, torch.device("cuda", 0)) == T.HOPPER_CONFIGS[torch.bfloat16]
    assert T.matmul_config(4096, 4096, torch.float32, torch.device("cuda", 0)) == T._NARROW_CONFIGS[torch.float32]
    T._cuda_facts = lambda index: (8, 108)
    assert T.matmul_config(4096, 4096, torch.bfloat16, torch.device("cuda", 0)) == T._NARROW_CONFIGS[torch.bfloat16]
finally:
    T._cuda_facts = real_facts
for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
    for k, n in ((48, 32), (40, 36)):                      # K a multiple of BLOCK_K or not; N ragged
        a = torch.randn(37, k).to(dtype)
        b = torch.randn(k, n).to(dtype)
        bias = torch.randn(n).to(dtype)
        full = T.matmul(a, b, bias, config=cfg)
        ref = a.double() @ b.double() + bias.double()
        err = (full.double() - ref).abs().max().item()
        assert err <= tol * max(1.0, ref.abs().max().item()), (dtype, k, n, err)
        for m in (1, 3, 16, 17):
            assert torch.equal(T.matmul(a[:m], b, bias, config=cfg), full[:m]), (dtype, k, n, m)
        # the row in another batch (other rows around it, another position)
        other = torch.cat([torch.randn(20, k).to(dtype), a[5:6], torch.randn(2, k).to(dtype)])
        assert torch.equal(T.matmul(other, b, bias, config=cfg)[20], full[5]), (dtype, k, n)
        # b as the transpose of a [N, K] weight (F.linear's layout)
        w = b.t().contiguous()
        assert torch.equal(T.matmul(a[:3], w.t(), bias, config=cfg), T.matmul(a, w.t(), bias, config=cfg)[:3])
# negative control: another K order (BLOCK_K 8) changes the bits, so the equalities above can fail
a, b = torch.randn(37, 48), torch.randn(48, 32)
assert not torch.equal(T.matmul(a, b, config=(16, 16, 8, 1, 1)), T.matmul(a, b, config=cfg))
# the default configuration (no override) on a small shape
a, b = torch.randn(5, 64), torch.randn(64, 24)
out = T.matmul(a, b)
assert torch.equal(out[:2], T.matmul(a[:2], b))
assert (out.double() - a.double() @ b.double()).abs().max().item() < 1e-4
print("RESULT ok")
'''


def _interpreter_breaks_on_this_numpy() -> str | None:
    """Triton 3.6's interpreter converts a program id (a 1-element array) with ``int(array)``, which NumPy 2.4
    made an error (triton 3.9 squeezes first; 3.6 checked failing, 3.9 passing, versions between treated as
    3.6): the interpreter cannot run any kernel there. The kernel compiled
    for a GPU is not the interpreter's code and is unaffected."""
    import numpy
    import triton
    from packaging.version import Version

    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)      # NumPy 1.25-2.3 only warn
            int(numpy.zeros(1))
        return None
    except TypeError:
        pass
    if Version(triton.__version__) < Version("3.9"):
        return f"triton {triton.__version__}'s interpreter cannot index with NumPy {numpy.__version__} arrays"
    return None


def test_matmul_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    reason = _interpreter_breaks_on_this_numpy()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "RESULT ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_tile_sweep_dry_run_under_the_interpreter():
    """tools/sweep_bi_matmul.py (the data behind HOPPER_CONFIGS) compiles each configuration with the persistent loop
    flattened and not, and checks each variant's row invariance: its dry run lists every variant as invariant."""
    pytest.importorskip("triton")
    reason = _interpreter_breaks_on_this_numpy()
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "tools/sweep_bi_matmul.py", "--device", "cpu", "--quick"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    variants = [ln for ln in proc.stdout.splitlines() if ln.startswith("flatten=")]
    assert len(variants) == 4 and all("invariant True" in ln for ln in variants), proc.stdout
    assert {ln.split()[0] for ln in variants} == {"flatten=True", "flatten=False"}
