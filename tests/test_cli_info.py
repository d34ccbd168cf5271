import json
import sys

import pytest
import torch

from moealign import __version__, _optional
from moealign.cli import main
from moealign.info import collect_info, format_info, nvml_gpus
import warm

pytestmark = pytest.mark.heavy          # long-running (engines, CLI runs): scheduled first, tests/conftest.py


def run_cli(*args):
    return warm.run([sys.executable, "-m", "moealign", *args], capture_output=True, text=True, timeout=120)


def test_version_flag():
    out = run_cli("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"moealign {__version__}"


@pytest.fixture(scope="module")
def info_text():
    """One ``moealign info`` run (it imports every engine: seconds), read by the tests below."""
    return run_cli("info")


def test_info_text_and_json(info_text):
    out = info_text
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert f"torch    {torch.__version__}" in out.stdout
    for engine in ("transformers", "megatron-core", "vllm", "transformer-engine"):
        assert engine in out.stdout
    data = json.loads(run_cli("info", "--json").stdout)
    assert data["torch"]["version"] == torch.__version__
    assert set(data["engines"]) >= {"transformers", "megatron-core", "vllm", "transformer-engine", "cupy"}
    for e in data["engines"].values():
        # an engine is either available with no reason, or unavailable with one
        assert e["available"] == (e["reason"] is None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_info_without_driver_prints_clean_line(info_text):
    nv = nvml_gpus()
    assert "error" in nv and "gpus" not in nv
    out = info_text
    gpu_line = [line for line in out.stdout.splitlines() if line.startswith("gpus:")]
    assert len(gpu_line) == 1
    assert "NVIDIA" in gpu_line[0] or "NVML" in gpu_line[0]


def test_nvml_library_not_found_is_reported(monkeypatch):
    pynvml = pytest.importorskip("pynvml")

    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    assert nvml_gpus() == {"error": "no NVIDIA driver (NVML library not found)"}


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "info" in capsys.readouterr().out


@pytest.fixture
def broken_backend(tmp_path, monkeypatch):
    """A module that raises RuntimeError at import, as transformer-engine does without CUDA."""
    (tmp_path / "moealign_broken_backend.py").write_text(
        "raise RuntimeError('Found empty transformer-engine meta package installed')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("moealign_broken_backend", None)
    yield "moealign_broken_backend"
    sys.modules.pop("moealign_broken_backend", None)


def test_probe_catches_runtime_error(broken_backend):
    b = _optional.probe(broken_backend)
    assert not b.available
    assert b.error.startswith("RuntimeError: Found empty transformer-engine")


def test_require_names_reason(broken_backend):
    with pytest.raises(ImportError, match="needed for X.*RuntimeError"):
        _optional.require(broken_backend, "needed for X")


def test_probe_reports_version_of_real_module():
    b = _optional.probe("numpy", "numpy")
    import numpy

    assert b.available and b.version == numpy.__version__


def test_info_survives_broken_engine(broken_backend, monkeypatch):
    monkeypatch.setitem(_optional.BACKENDS, "broken-engine", (broken_backend, None))
    info = collect_info()
    assert info["engines"]["broken-engine"]["available"] is False
    text = format_info(info)
    assert "broken-engine" in text and "RuntimeError" in text
