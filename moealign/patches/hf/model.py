"""transformers adapter: live-router discovery (:func:`describe_model`) and the record metadata of a model
(:func:`record_meta`). The family knowledge (router class, scoring, experts) comes from the registry in
:mod:`moealign.families`; ``FAMILIES``, ``MoEFamily`` and ``register_family`` are re-exported from there."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from ...errors import UnsupportedModelError
from ...families import FAMILIES, MoEFamily, get_family, register_family
from ...record import RecordMeta, config_fingerprint, router_samples, router_signature
from ...model_config import checkpoint_fingerprint
from ...routing_replay.gates import (
    RouterScoring,
)
from .._version import check_engine_version, engine_version

__all__ = ["SUPPORTED_TRANSFORMERS", "FAMILIES", "MoEFamily", "register_family", "MoEModelInfo", "describe_model",
           "checkpoint_dir", "model_fingerprint", "record_meta"]

SUPPORTED_TRANSFORMERS = ">=5.0,<6"


# --------------------------------------------------------------------------------------------------
# model description
# --------------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class MoEModelInfo:
    family: MoEFamily
    routers: tuple[tuple[int, torch.nn.Module], ...]   # (decoder layer number, router module), ascending
    num_layers: int
    num_experts: int
    top_k: int
    vocab_size: int
    scoring: RouterScoring
    transformers_version: str

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer, _ in self.routers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Decoder layers the model runs dense (a record's routes for them are refused at ``set_routes``)."""
        return tuple(layer for layer in range(self.num_layers) if layer not in self.moe_layers)


def transformers_version() -> str:
    _, version = engine_version("transformers", "moealign.patches.hf needs transformers")
    check_engine_version("transformers", version, SUPPORTED_TRANSFORMERS)
    return str(version)


def describe_model(model: torch.nn.Module) -> MoEModelInfo:
    """Find the family and the live routers of ``model`` (by decoder layer number); raise if unknown."""
    version = transformers_version()
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = get_family(model_type)
    routers = []
    for name, module in model.named_modules():
        if type(module).__name__ != family.router_class:
            continue
        match = _LAYER_RE.search(name + ".")
        if match is None:
            raise UnsupportedModelError(f"router {name!r} is not under a 'layers.<n>.' module; cannot tell its layer")
        for attr in ("weight", "top_k", "hidden_dim"):
            if not hasattr(module, attr):
                raise UnsupportedModelError(f"{family.router_class} at {name!r} has no {attr!r}: this transformers "
                                            f"version's router differs from the one the adapter targets")
        routers.append((int(match.group(1)), module))
    if not routers:
        raise UnsupportedModelError(f"no {family.router_class} modules found in this {model_type} model")
    routers.sort(key=lambda item: item[0])
    layers = [layer for layer, _ in routers]
    if len(set(layers)) != len(layers):
        raise UnsupportedModelError(f"several routers share a decoder layer number: {layers}")
    top_k = {int(m.top_k) for _, m in routers}
    if len(top_k) != 1:
        raise UnsupportedModelError(f"routers disagree on top_k: {sorted(top_k)}")
    return MoEModelInfo(
        family=family,
        routers=tuple(routers),
        num_layers=int(config.num_hidden_layers),
        num_experts=int(family.num_experts(config)),
        top_k=top_k.pop(),
        vocab_size=int(config.vocab_size),
        scoring=family.scoring(config),
        transformers_version=version,
    )


def checkpoint_dir(model: torch.nn.Module) -> str | None:
    """The local checkpoint directory ``model`` was loaded from (its ``config._name_or_path`` holding a
    config.json), or None (a model built in memory, or loaded from a hub name)."""
    path = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not isinstance(path, str) or not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    return path


def model_fingerprint(model: torch.nn.Module) -> str:
    """The record fingerprint of ``model``: of its checkpoint's config.json as written
    (:func:`~moealign.model_config.checkpoint_fingerprint`, the definition every engine uses), or, for a model with
    no local checkpoint, of its config as ``save_pretrained`` would write it (``config.to_dict()``)."""
    path = checkpoint_dir(model)
    if path is not None:
        return checkpoint_fingerprint(path)
    return config_fingerprint(model.config.to_dict())


def record_meta(model: torch.nn.Module, *, engine: str = "transformers", info: MoEModelInfo | None = None) -> RecordMeta:
    """The :class:`RecordMeta` of ``model`` (fingerprint from its checkpoint's config, :func:`model_fingerprint`,
    and its router weights)."""
    info = info or describe_model(model)
    dtype = next(model.parameters()).dtype
    return RecordMeta(
        engine=engine,
        engine_version=info.transformers_version,
        model_fingerprint=model_fingerprint(model),
        num_layers=info.num_layers,
        moe_layers=info.moe_layers,
        num_experts=info.num_experts,
        top_k=info.top_k,
        vocab_size=info.vocab_size,
        dtype=str(dtype).replace("torch.", ""),
        router_signature=router_signature(m.weight for _, m in info.routers),
        router_samples=router_samples(m.weight for _, m in info.routers),
        model_name=str(getattr(model.config, "_name_or_path", "") or ""),
    )
