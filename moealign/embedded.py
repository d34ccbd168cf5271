"""The embedded models shipped with the package, named ``embedded:NAME`` wherever a command takes ``--model``.

* ``embedded:tiny_moe`` (the default): a small Qwen3-MoE, built reproducibly by ``tools/build_tiny_moe.py``
  (byte-level BPE and a brief training run on the Python standard library's own source); its ``prompts.json`` is
  the default prompt set of ``moealign mismatch`` (for every embedded model: they share the tokenizer).
* ``embedded:tiny_deepseek``: a tiny DeepSeek-V3 (MLA, one shared expert, the sigmoid grouped router with
  ``e_score_correction_bias``, a first dense layer), built by ``tools/build_tiny_deepseek.py`` on the same corpus
  and tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError, MissingFileError

__all__ = ["EMBEDDED_MODEL_DIR", "EMBEDDED_MODELS", "EMBEDDED_PREFIX", "embedded_model_path", "checkpoint_path",
           "model_label", "default_prompts"]

#: The most bytes a prompt file may hold.
MAX_PROMPTS_BYTES = 64 << 20
_ASSETS = Path(__file__).resolve().parent / "assets"
#: ``embedded:NAME`` -> (directory, the script that rebuilds it); the first is the default model.
EMBEDDED_MODELS = {"tiny_moe": (_ASSETS / "tiny_moe", "tools/build_tiny_moe.py"),
                   "tiny_deepseek": (_ASSETS / "tiny_deepseek", "tools/build_tiny_deepseek.py")}
EMBEDDED_PREFIX = "embedded:"
DEFAULT_EMBEDDED = "tiny_moe"
EMBEDDED_MODEL_DIR = EMBEDDED_MODELS[DEFAULT_EMBEDDED][0]


def embedded_model_path(name: str = DEFAULT_EMBEDDED) -> Path:
    """The directory of the embedded model ``name`` (``tiny_moe``, the default, or ``tiny_deepseek``)."""
    if name not in EMBEDDED_MODELS:
        raise ConfigError(f"--model {EMBEDDED_PREFIX}{name}: no such embedded model (embedded: "
                          f"{', '.join(EMBEDDED_PREFIX + n for n in EMBEDDED_MODELS)})")
    root, script = EMBEDDED_MODELS[name]
    needed = ("config.json", "model.safetensors")
    missing = [n for n in needed if not (root / n).is_file()]
    if missing:
        raise MissingFileError(f"the embedded model {name} is missing {missing} under {root}; rebuild it "
                               f"with `python {script}`")
    return root


def checkpoint_path(model: str | None) -> str:
    """The checkpoint a command loads: the embedded model's directory for None or ``embedded:NAME``, else ``model``."""
    if not model:
        return str(embedded_model_path())
    model = str(model)
    if model.startswith(EMBEDDED_PREFIX):
        return str(embedded_model_path(model[len(EMBEDDED_PREFIX):]))
    return model


def model_label(model: str | None) -> str:
    """How a report names the checkpoint: ``embedded:NAME`` for an embedded model (named, defaulted or given by its
    directory), else the path as given."""
    path = checkpoint_path(model)
    for name, (root, _) in EMBEDDED_MODELS.items():
        if Path(path).resolve() == root:
            return EMBEDDED_PREFIX + name
    return path


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
