"""A checkpoint's ``config.json``, read once, the same way by every command (``record convert --model``, ``record
inspect --model``, ``mismatch --model``, the embedded model).

:func:`read_model_config` reads it through the input-file guard (:func:`moealign._files.read_json_file`: a regular
file of bounded size, bounded JSON nesting, no ``NaN``) and checks the fields moealign sizes anything by before any
of them is used: each is an integer (not a bool, not ``1e11``) within the bounds a record can hold
(:data:`MAX_LAYERS`, :data:`MAX_EXPERTS`, :data:`MAX_VOCAB`, which a record obeys too).
:func:`moe_layers` is the config's MoE layer numbers through its family (:mod:`moealign.families`).
:func:`check_max_new_tokens` is the one length check of the commands that generate (``mismatch``, ``rl-check``).
Every problem is one :class:`~moealign.errors.ConfigError` naming the flag, the directory and the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import types
from pathlib import Path

from ._files import parse_json, read_input_bytes
from .errors import ConfigError, MissingFileError
from ._validate import short_repr
from .errors import RecordError
from .families import arch_keys
from .routing_replay.routes import INT16_MAX_EXPERTS

__all__ = ["MAX_LAYERS", "MAX_EXPERTS", "MAX_VOCAB", "config_fingerprint", "MAX_CONFIG_BYTES", "INT_FIELDS", "read_model_config", "ConfigView", "moe_layers", "check_max_new_tokens",
           "checkpoint_fingerprint"]

#: The most bytes a config.json may hold.
#: The most decoder layers a record (and a config.json moealign reads) may state.
MAX_LAYERS = 10_000
#: The most experts: what a compact route table holds (int16 ids).
MAX_EXPERTS = INT16_MAX_EXPERTS
#: The largest vocabulary: kept-set ids are int32.
MAX_VOCAB = 2 ** 31 - 1


MAX_CONFIG_BYTES = 16 << 20
#: Integer fields checked when present: ``name -> (lowest, highest)``. ``num_hidden_layers`` is required.
INT_FIELDS = {
    "num_hidden_layers": (1, MAX_LAYERS),
    "vocab_size": (1, MAX_VOCAB),
    "num_experts": (0, MAX_EXPERTS),
    "num_local_experts": (0, MAX_EXPERTS),
    "n_routed_experts": (0, MAX_EXPERTS),
    "num_experts_per_tok": (1, MAX_EXPERTS),
    "decoder_sparse_step": (0, MAX_LAYERS),
    "max_position_embeddings": (1, 1 << 31),
}
#: config attribute aliases (transformers' attribute_map), so a config.json read without transformers resolves them
_ALIASES = {"num_experts": ("num_local_experts", "n_routed_experts"), "num_local_experts": ("num_experts",),
            "n_routed_experts": ("num_experts", "num_local_experts")}


class ConfigView(types.SimpleNamespace):
    """A config.json as attributes, with transformers' aliases of the expert count."""

    def __getattr__(self, name):
        for alias in _ALIASES.get(name, ()):
            if alias in self.__dict__:
                return self.__dict__[alias]
        raise AttributeError(name)


def read_model_config(model_dir: str | os.PathLike, flag: str = "--model") -> dict:
    """``model_dir/config.json`` as a dict, its size-deciding fields checked (see the module docstring)."""
    root = Path(model_dir)
    where = f"{flag} {os.fspath(model_dir)}"
    if not root.is_dir():
        raise ConfigError(f"{where}: not a local checkpoint directory with a config.json")
    path = root / "config.json"
    if not os.path.lexists(path):
        raise MissingFileError(f"{where}: no config.json")
    config = parse_json(read_input_bytes(path, f"{where}: config.json", max_bytes=MAX_CONFIG_BYTES),
                        f"{where}: config.json")
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ConfigError(f"{where}: config.json must be a JSON object with a model_type")
    if config.get("num_hidden_layers") is None:
        raise ConfigError(f"{where}: config.json lacks num_hidden_layers")
    for name, (lo, hi) in INT_FIELDS.items():
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(f"{where}: config.json {name} must be an integer in [{lo}, {hi}], got "
                              f"{short_repr(value, 60)}")
    dense = config.get("mlp_only_layers")
    if dense is not None and (not isinstance(dense, list) or len(dense) > MAX_LAYERS
                              or not all(isinstance(x, int) and not isinstance(x, bool) for x in dense)):
        raise ConfigError(f"{where}: config.json mlp_only_layers must be a list of layer numbers, got {short_repr(dense, 60)}")
    return config


def moe_layers(config: dict, where: str = "--model") -> tuple[int, ...]:
    """The decoder layers ``config`` (from :func:`read_model_config`) runs as MoE, through its family; a config its
    family cannot read is a :class:`ConfigError` naming ``where``."""
    from .families import get_family

    family = get_family(config.get("model_type"))
    try:
        pattern = family.moe_layer_pattern(ConfigView(**config))
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: config.json lacks a field the {family.model_type} family needs "
                          f"({type(exc).__name__}: {exc})") from None
    return tuple(i for i, sparse in enumerate(pattern) if sparse)


def check_max_new_tokens(config: dict, max_new_tokens: int, model: str = "the model") -> None:
    """Refuse ``--max-new-tokens`` that reaches the ``max_position_embeddings`` of ``config`` (from
    :func:`read_model_config`): the prompt takes positions too, so ``max_new_tokens`` must stay below it.
    ``model`` names the checkpoint in the error (``"the embedded model"``, ``"--model DIR"``)."""
    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and max_new_tokens >= limit:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: {model} holds at most {limit} positions "
                          f"(max_position_embeddings), prompt included")


def checkpoint_fingerprint(model_dir, flag: str = "--model") -> str:
    """The record fingerprint of the checkpoint in ``model_dir``: :func:`config_fingerprint` of its ``config.json``
    as written (read by :func:`moealign.model_config.read_model_config`; ``flag`` names the option in its errors).

    The one definition every engine uses (:func:`moealign.patches.hf.record_meta`,
    :func:`moealign.patches.vllm.record_meta`, ``record convert``): never an engine's config object, which the
    engine may have edited after reading the file (vLLM writes ``sliding_window=None`` over a checkpoint's ``0``)."""
    return config_fingerprint(read_model_config(model_dir, flag))


def config_fingerprint(config: dict) -> str:
    """SHA-256 (hex, 16 chars) of the architecture fields of a model config (dtype-independent). The fields are
    the family's ``arch_keys`` (:func:`moealign.families.arch_keys`; :data:`moealign.families.ARCH_KEYS` for a
    model_type no family is registered for)."""
    picked = {k: config[k] for k in arch_keys(config.get("model_type")) if k in config and config[k] is not None}
    if "model_type" not in picked:
        raise RecordError("config_fingerprint: the config has no model_type")
    text = json.dumps(picked, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
