"""The device a run uses is the one asked for (issue 26): ``--device auto`` resolves to CUDA where CUDA is
available, ``--device cpu`` / ``init_single_process(device="cpu")`` pin the CPU on any machine (the tests whose
claims rest on CPU kernels use them), and the GPU-capable paths run on CUDA (``@pytest.mark.gpu``: skipped
cleanly without a CUDA device)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moealign.embedded import resolve_device
from moealign.errors import ConfigError, EngineError

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def test_auto_resolves_by_cuda_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda" and resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cuda:1") == "cuda:1"


def test_init_single_process_device_argument_is_checked():
    pytest.importorskip("megatron.core")
    from moealign.patches import megatron as mg

    with pytest.raises(EngineError, match="expected 'auto', 'cpu' or 'cuda'"):
        mg.init_single_process(device="tpu")
    if not CUDA:
        with pytest.raises(EngineError, match="CUDA is not available"):
            mg.init_single_process(device="cuda")


def test_megatron_engine_refuses_cuda_without_cuda():
    pytest.importorskip("megatron.core")
    if CUDA:
        pytest.skip("this machine has CUDA")
    from moealign.embedded import embedded_model_path
    from moealign.mismatch.engines import MegatronTrainEngine

    with pytest.raises(ConfigError, match="runs on cpu, or on cuda where CUDA is available"):
        MegatronTrainEngine(str(embedded_model_path()), "fp32", "cuda")


def test_cpu_pin_where_cuda_is_available(monkeypatch):
    """``init_single_process(device="cpu")`` where ``torch.cuda.is_available()`` says True: the CPU mode and a
    gloo world, and a Megatron model built, run forward and backward on the CPU in it. On a CPU machine CUDA's
    presence is simulated by patching ``is_available``: the one CUDA query found on this path is torch.compile's
    (Megatron's jit_fuser asks the current CUDA device's properties), which the pinned mode turns off; that
    query fails here as on a GPU machine, so the simulation catches it. On a GPU machine it runs unpatched."""
    from torch import _dynamo
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from megatron_util import build, config, inputs

    from moealign.patches import megatron as mg

    if not CUDA:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(EngineError, match="refuses to run where CUDA is available"):
        mg.enable_megatron_cpu()                 # without the pin, the CPU mode still refuses on a GPU machine
    with mg.init_single_process(seed=3, device="cpu") as world:
        assert world.cpu_mode is not None and "CPU mode, gloo" in world.target
        assert mg.megatron_cpu_mode_active() and dist.get_backend() == "gloo"
        torch.manual_seed(0)
        model = build(config(moe_enable_routing_replay=False)).eval()
        ids, pos, mask = inputs(3)
        out = model(ids, pos, attention_mask=mask)
        out.float().sum().backward()
        assert out.device.type == "cpu" and all(p.device.type == "cpu" for p in model.parameters())
        assert torch.isfinite(out).all() and _dynamo.config.disable
    assert not mg.megatron_cpu_mode_active() and not dist.is_initialized() and not _dynamo.config.disable


# ------------------------------------------------------------------------------------------------------------
# on a GPU: the GPU-capable paths


@pytest.mark.gpu
@needs_cuda
def test_mismatch_hf_on_cuda(tmp_path):
    """The main job's transformers path on CUDA (``--device auto`` picks it): runs, writes its report, and
    routing replay makes the trainer run the recorded experts (zero flips: a claim of the replay protocol, not
    of a kernel)."""
    pytest.importorskip("transformers")
    from moealign.cli import main

    out = tmp_path / "r.json"
    assert main(["mismatch", "-q", "--rollout", "hf", "--train", "hf", "--num-prompts", "4", "--max-new-tokens",
                 "12", "--batch-size", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = {r["name"]: r["metrics"] for r in report["runs"]}
    assert runs["routing_replay"]["router_flip_rate"] == 0.0
    assert runs["routing_replay+sampling_mask"]["support_mismatch_rate"] == 0.0
    assert all(math.isfinite(v) for m in runs.values() for v in m.values() if isinstance(v, float))


@pytest.mark.gpu
@needs_cuda
def test_megatron_engine_on_cuda_replays_exactly():
    """The Megatron training engine on CUDA (NCCL world, no CPU mode) scores a transformers record with
    replay: the trainer's experts are the recorded ones."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    from moealign.cli import main

    assert main(["mismatch", "-q", "--device", "cuda", "--rollout", "hf", "--train", "megatron", "--num-prompts",
                 "2",                 "--max-new-tokens", "8", "--batch-size", "2", "--fail-above", "router_flip_rate=0"]) == 0
