"""The embedded default model: a small Qwen3-MoE checkpoint shipped with the package.

Built reproducibly by ``tools/build_tiny_moe.py`` (byte-level BPE and a brief training run on the
Python standard library's own source); ``prompts.json`` is the default prompt set of ``moealign mismatch``.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError, MissingFileError

__all__ = ["EMBEDDED_MODEL_DIR", "embedded_model_path", "default_prompts"]

#: The most bytes a prompt file may hold.
MAX_PROMPTS_BYTES = 64 << 20
EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "tiny_moe"


def embedded_model_path() -> Path:
    needed = ("config.json", "model.safetensors")
    missing = [name for name in needed if not (EMBEDDED_MODEL_DIR / name).is_file()]
    if missing:
        raise MissingFileError(f"the embedded model is missing {missing} under {EMBEDDED_MODEL_DIR}; rebuild it "
                                f"with `python tools/build_tiny_moe.py`")
    return EMBEDDED_MODEL_DIR


def checkpoint_path(model: str | None) -> str:
    """The checkpoint a command loads: ``model`` when given, else the embedded model's directory."""
    return str(model) if model else str(embedded_model_path())


def resolve_device(device: str) -> str:
    """``"auto"`` -> ``"cuda"`` when CUDA is available, else ``"cpu"``; any other value as given."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def default_prompts(path: str | Path | None = None) -> list[str]:
    """The default prompt set (``prompts.json``: a JSON list of strings), or the one at ``path``."""
    from ._files import read_json_file      # the input-file guard: no FIFO or /dev/zero, bounded size

    path = Path(path) if path is not None else EMBEDDED_MODEL_DIR / "prompts.json"
    prompts = read_json_file(path, "prompts file", max_bytes=MAX_PROMPTS_BYTES)
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ConfigError(f"{path} must hold a non-empty JSON list of non-empty strings")
    return prompts
