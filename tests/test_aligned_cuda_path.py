"""Issue 40, items 1 and 3 (prep): `--aligned` on CUDA for the transformers and Megatron engines, wired to the
canonical ops' Triton kernels, checked without a GPU.

One child process (tests/aligned_cuda_path_child.py, Triton's interpreter, MOEALIGN_CANONICAL_BACKEND=triton: every
``c_*`` call runs its Triton kernel, as on CUDA tensors): the dispatch op by op (each ``c_*`` the kernel's bits; by
construction the CPU definition gives other bits on one leaf of products, and one function switched back to it
does), DeepSeek-V3's ops refused by name; a tiny random qwen3_moe with the canonical forward in transformers and
Megatron-core: a decode step equals the full forward's row (``torch.equal``), a row's log-probs do not depend on its
batch mates (left padding), transformers and Megatron bitwise equal on the same tokens, each next to a negative
control that leaves one op on the CPU definition in one of the two compared forwards; the backward finite and within
1e-3 of the CPU definition's gradients (next to a scaled negative control).

In this process (nothing launched; the GPU's facts simulated): the commands' refusals on CUDA by name (vLLM; DeepSeek;
a sharded or TP > 1 trainer; TF32 switched on, through check_canonical_cuda), what is allowed (--rollout hf with
--train hf | megatron), the backend switch (MOEALIGN_CANONICAL_BACKEND's values, canonical_backend scoped and
restored), and the Megatron binding's refusals on CUDA (TP / EP / PP > 1, MLA)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moealign.errors import CanonicalError, ConfigError, MoealignError
from moealign.precision import canonical as C

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.heavy          # one ~18 s interpreter child: scheduled first, tests/conftest.py


def test_the_cuda_path_under_the_interpreter():
    pytest.importorskip("triton")
    pytest.importorskip("megatron.core")
    from test_triton_batch_invariant_interp import _interpreter_breaks_on_this_numpy

    reason = _interpreter_breaks_on_this_numpy()
    if reason:
        pytest.skip(reason)
    # cold, not forked warm (tests/warm.py): the interpreter is chosen when triton is imported
    env = dict(os.environ, TRITON_INTERPRET="1", MOEALIGN_CANONICAL_BACKEND="triton", PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "aligned_cuda_path_child.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "RESULT ok 5 groups" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


# --------------------------------------------------------------------------------------------------------
# in this process: nothing is launched


@pytest.fixture
def gpu(monkeypatch):
    """A machine where torch sees one Hopper GPU (simulated; nothing runs on it), TF32 off as torch's default."""
    pytest.importorskip("triton")
    from moealign.precision import canonical_triton

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(canonical_triton, "_cuda_capability", lambda device: (9, 0))
    saved = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved[0]
    torch.set_float32_matmul_precision(saved[1])


def _config(**kw):
    from moealign.mismatch.rollout import MismatchConfig

    return MismatchConfig(**{"aligned": True, "device": "cuda", "num_prompts": 2, "max_new_tokens": 4, **kw})


def test_aligned_on_cuda_commands(gpu):
    from moealign.embedded import embedded_model_path
    from moealign.options import check_aligned_run

    for train in ("megatron", "hf"):                 # allowed: the transformers rollout with either trainer
        cfg = _config(rollout_engine="hf", train_engine=train)
        assert cfg.aligned and cfg.resolved_device() == "cuda"
    with pytest.raises(ConfigError, match=r"--aligned --rollout vllm on cuda: vLLM's CUDA build pins another torch "
                                          r"\(vLLM 0\.33's wheel needs torch 2\.14\).*no vLLM CUDA binding"):
        _config(rollout_engine="vllm", train_engine="megatron")
    with pytest.raises(ConfigError, match="transformers engine .* model_type 'deepseek_v3' is not covered"):
        _config(rollout_engine="hf", train_engine="megatron", model=str(embedded_model_path("tiny_deepseek")))
    common = dict(rollout_precision="bf16", train_precision="bf16", device="cuda", rollout_tp=1)
    with pytest.raises(ConfigError, match=r"--aligned on cuda covers \['qwen3_moe'\].*'deepseek_v3'.*no Triton"):
        check_aligned_run(str(embedded_model_path("tiny_deepseek")), rollout_engine="hf", **common)
    path = str(embedded_model_path())
    with pytest.raises(ConfigError, match="one rank: TP > 1 on CUDA needs .* tree_all_reduce over NCCL"):
        check_aligned_run(path, rollout_engine="hf", train_tp=2, **common)
    with pytest.raises(ConfigError, match="one rank"):
        _config(rollout_engine="hf", train_engine="megatron", train_ep=2)
    with pytest.raises(ConfigError, match="vLLM's CUDA build"):          # rl-check's call (vLLM -> Megatron)
        check_aligned_run(path, **common)
    torch.backends.cuda.matmul.allow_tf32 = True     # TF32 on: check_canonical_cuda refuses, before any work
    with pytest.raises(CanonicalError, match="TF32 is switched on"):
        _config(rollout_engine="hf", train_engine="megatron")
    torch.backends.cuda.matmul.allow_tf32 = False
    check_aligned_run(path, rollout_engine="hf", **common)
    check_aligned_run(path, rollout_engine="vllm", **{**common, "device": "cpu"})     # the CPU as before


def test_the_cli_refuses_vllm_on_cuda_in_one_line(gpu, capsys):
    from moealign.cli import main

    code = main(["mismatch", "--aligned", "--device", "cuda", "--rollout", "vllm", "--num-prompts", "2", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "vLLM's CUDA build pins another torch" in err[0], err


def test_check_device_backend(gpu):
    assert C.check_device_backend(torch.device("cuda", 0), torch.bfloat16) is True
    assert C.check_device_backend("cpu", torch.float32) is False
    torch.backends.cuda.matmul.allow_tf32 = True
    with pytest.raises(CanonicalError, match="TF32 is switched on"):
        C.check_device_backend("cuda", torch.float32)
    with C.canonical_backend("cpu"):           # the CPU definition on CUDA tensors: no kernel, nothing to refuse
        assert C.check_device_backend("cuda", torch.float32) is False
    torch.backends.cuda.matmul.allow_tf32 = False
    with pytest.raises(CanonicalError, match="cover float32, float16, bfloat16, not torch.float64"):
        C.check_device_backend("cuda", torch.float64)


def test_the_backend_switch():
    assert C.parse_backend(None) == C.parse_backend("") == "auto" and C.parse_backend(" Triton ") == "triton"
    with pytest.raises(CanonicalError, match=r"MOEALIGN_CANONICAL_BACKEND='gpu': .* auto, triton, cpu"):
        C.parse_backend("gpu")
    x = torch.zeros(2)
    assert C._BACKEND == "auto" and not C.on_triton(x) and C.on_triton(torch.device("cuda")) and C.on_triton("cuda:1")
    with C.canonical_backend("triton", ["c_rope", "c_sigmoid"]) as outer:
        assert C.on_triton(x, "c_rope") and not C.on_triton(x, "c_linear")
        with C.canonical_backend("cpu"):
            assert not C.on_triton("cuda", "c_rope") and not C.on_triton("cuda")
        assert C.on_triton(x, "c_rope") and C.on_triton("cuda") and "c_rope" in repr(outer)
        with pytest.raises(CanonicalError, match="^c_sigmoid: the canonical forward has no Triton kernel"):
            C.c_sigmoid(x)                       # refused before any kernel: DeepSeek-V3's router
    assert not C.on_triton(x, "c_rope") and C._ROUTES == {}
    with pytest.raises(CanonicalError, match="unknown functions \\['c_exp'\\]"):
        C.canonical_backend("triton", ["c_exp"])
    with pytest.raises(CanonicalError, match="backend='x'"):
        C.canonical_backend("x")
    assert issubclass(CanonicalError, MoealignError)


def test_a_bad_backend_variable_is_named_before_any_work(monkeypatch, capsys):
    """MOEALIGN_CANONICAL_BACKEND is read once, at import; a bad value is kept as its error (the import itself does
    not fail) and raised by every reader: the command's option check (one line, exit 2) and any op."""
    from moealign.cli import main

    message = "MOEALIGN_CANONICAL_BACKEND='gpu': the canonical ops' backend is one of"
    monkeypatch.setattr(C, "_BACKEND_ERROR", message + " auto, triton, cpu")
    with pytest.raises(CanonicalError, match=message):
        C.c_rms_norm(torch.ones(2, 4), None, 1e-6)
    code = main(["mismatch", "--aligned", "--device", "cpu", "--rollout", "hf", "--train", "hf", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_the_megatron_binding_runs_one_rank_on_cuda():
    from moealign.patches.megatron.canonical import _check_triton_world

    _check_triton_world(SimpleNamespace(tensor_model_parallel_size=1, expert_model_parallel_size=1))
    with pytest.raises(CanonicalError, match=r"runs on one rank; not tensor_model_parallel_size=2, "
                                             r"pipeline_model_parallel_size=2 \(TP > 1 needs .*tree_all_reduce"):
        _check_triton_world(SimpleNamespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2))
    with pytest.raises(CanonicalError, match="does not cover MLA"):
        _check_triton_world(SimpleNamespace(multi_latent_attention=True))
