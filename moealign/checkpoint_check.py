"""A checkpoint's tensors against its ``config.json``, checked before any engine loads it (engine-free).

A ``config.json`` that disagrees with its weights (another expert count, vocabulary, layer count, head count,
intermediate size, a missing / extra / reshaped tensor) used to end in the loader's traceback minutes into a run.
:func:`check_checkpoint_tensors` reads every ``*.safetensors`` header (:func:`read_safetensors_header`: through the
input-file guard of :mod:`moealign._files`, header size bounded, no tensor data read), derives the tensors the config
implies from its family (:attr:`moealign.families.MoEFamily.checkpoint_tensors`) and refuses the checkpoint with one
:class:`~moealign.errors.CheckpointMismatchError` naming each tensor that is missing, extra or shaped otherwise (the
shape the config implies vs the one found). A family that states no tensors gets the weaker check: every name is a
decoder tensor of a layer the config has, and the embedding, routers and expert numbers agree with the vocabulary,
hidden and expert sizes. A ``model_type`` no family is registered for is left to the engine (it names it).
"""

from __future__ import annotations

import os
import re
import stat
import struct
from pathlib import Path

from ._files import check_input_file, parse_json, read_json_file
from .errors import CheckpointMismatchError, ConfigError
from .families import FAMILIES
from .model_config import ConfigView

__all__ = ["MAX_HEADER_BYTES", "read_safetensors_header", "checkpoint_shapes", "expected_tensors",
           "check_checkpoint_tensors"]

#: The largest safetensors header read (safetensors' own limit: 100 MB).
MAX_HEADER_BYTES = 100_000_000
#: Names shown per kind of problem in the error.
_SHOWN = 4
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_NUMBERED = re.compile(r"\.\d+\.")
_TOP = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def read_safetensors_header(path: str | os.PathLike, flag: str = "--model") -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` of one safetensors file, from its header only: a regular file (the input guard),
    a header of at most :data:`MAX_HEADER_BYTES` inside the file, JSON whose every entry has a dtype, a shape of
    non-negative integers and data offsets inside the file. Every problem is a :class:`ConfigError` naming the file."""
    what = f"{flag}: {os.fspath(path)}"
    st = check_input_file(path, flag)
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ConfigError(f"{what}: cannot be read ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what}: is not a regular file (refusing to read it)")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise ConfigError(f"{what}: not a safetensors file (no header)")
            (size,) = struct.unpack("<Q", prefix)
            if size > min(MAX_HEADER_BYTES, st.st_size - 8):
                raise ConfigError(f"{what}: not a safetensors file (a header of {size} bytes, the file holds "
                                  f"{st.st_size}; at most {MAX_HEADER_BYTES} read)")
            data = fh.read(size)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if len(data) != size:
        raise ConfigError(f"{what}: truncated safetensors header")
    header = parse_json(data, f"{what}: safetensors header")
    if not isinstance(header, dict):
        raise ConfigError(f"{what}: the safetensors header is not a JSON object")
    body = st.st_size - 8 - size
    shapes: dict[str, tuple[int, ...]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(entry.get("dtype") if isinstance(entry, dict) else None, str)
                and isinstance(shape, list) and all(_count(d) for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
                and offsets[0] <= offsets[1] <= body):
            raise ConfigError(f"{what}: the safetensors header entry {name!r} is malformed (dtype, shape, data "
                              f"offsets inside the file)")
        shapes[name] = tuple(shape)
    return shapes


def checkpoint_shapes(model_dir: str | os.PathLike, flag: str = "--model") -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` over the ``*.safetensors`` files of ``model_dir``: those ``model.safetensors.index.json``
    maps tensors to when it is there (as the loaders do: a ``consolidated.safetensors`` next to the shards is not
    the model's), else every one; a tensor in two files is refused."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.exists():
        content = read_json_file(index, f"{flag} {os.fspath(model_dir)}:")
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError(f"{flag} {os.fspath(model_dir)}: model.safetensors.index.json has no weight_map of "
                              f"tensor -> file")
        listed = set(weight_map.values())
        files = [f for f in files if f.name in listed]
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for file in files:
        for name, shape in read_safetensors_header(file, flag).items():
            if name in shapes:
                raise CheckpointMismatchError(f"{flag} {os.fspath(model_dir)}: tensor {name} is stored twice "
                                              f"({where[name]} and {file.name})")
            shapes[name], where[name] = shape, file.name
    return shapes


def expected_tensors(config: dict):
    """The :class:`~moealign.families.CheckpointTensors` ``config`` (a dict from
    :func:`moealign.model_config.read_model_config`) implies through its family, or None when its family states
    none (or no family is registered for its ``model_type``)."""
    family = FAMILIES.get(config.get("model_type"))
    if family is None or family.checkpoint_tensors is None:
        return None
    view = ConfigView(**config)
    try:
        return family.checkpoint_tensors(view)
    except ConfigError:
        raise
    except (AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"config.json lacks a field the {family.model_type} family needs to size its tensors "
                          f"({type(exc).__name__}: {exc})") from None


def check_checkpoint_tensors(model_dir: str | os.PathLike, config: dict, flag: str = "--model") -> None:
    """Refuse a checkpoint whose safetensors tensors are not the ones its ``config`` (from
    :func:`moealign.model_config.read_model_config`) implies: :class:`CheckpointMismatchError` naming each tensor
    missing, extra, or shaped otherwise (see the module docstring). A directory without safetensors files (a
    config-only directory, ``*.bin`` weights) and a ``model_type`` no family is registered for pass unchecked."""
    where = f"{flag} {os.fspath(model_dir)}"
    family = FAMILIES.get(config.get("model_type"))
    if family is None or not any(Path(model_dir).glob("*.safetensors")):
        return
    experts, top_k = getattr(ConfigView(**config), "num_experts", None), config.get("num_experts_per_tok")
    if isinstance(experts, int) and isinstance(top_k, int) and experts and top_k > experts:
        raise ConfigError(f"{where}: config.json num_experts_per_tok {top_k} exceeds the {experts} experts")
    found = checkpoint_shapes(model_dir, flag)
    _check_sizes(config, found, where)
    try:
        spec = expected_tensors(config)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    problems = _generic_problems(config, found) if spec is None else _compare(spec, found)
    if problems:
        raise CheckpointMismatchError(f"{where}: the checkpoint's tensors disagree with its config.json "
                                      f"({family.model_type}; {_summary(config)}): " + "; ".join(problems))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_sizes(config: dict, found: dict, where: str) -> None:
    """A config whose expert x layer count implies far more tensors than the checkpoint holds is refused before
    the expected set is built (a hostile ``num_hidden_layers`` x ``num_experts`` must not exhaust memory)."""
    view = ConfigView(**config)
    layers = config.get("num_hidden_layers") or 0
    experts = getattr(view, "num_experts", 0) or 0
    implied = layers * (3 * experts + 16)
    if implied > 4 * len(found) + 10_000:
        raise CheckpointMismatchError(f"{where}: config.json implies about {implied} tensors ({layers} layers x "
                                      f"{experts} experts), the checkpoint holds {len(found)}")


def _fits(want: tuple, got: tuple) -> bool:
    return len(want) == len(got) and all(w is None or w == g for w, g in zip(want, got))


def _shape(shape: tuple) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _listed(names: list[str]) -> str:
    names = sorted(names, key=_natural)
    return ", ".join(names[:_SHOWN]) + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")


def _layers(names: list[str]) -> str:
    numbers = sorted({int(m[1]) for m in map(_LAYER.match, names) if m})
    if not numbers:
        return "none"
    return f"{numbers[0]}-{numbers[-1]}" if numbers == list(range(numbers[0], numbers[-1] + 1)) else \
        ", ".join(map(str, numbers[:8])) + (", ..." if len(numbers) > 8 else "")


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _compare(spec, found: dict) -> list[str]:
    expected = dict(spec.required)
    for usual, other in spec.alternatives:        # the other layout when the checkpoint holds all of it
        if all(name in found for name in other) and not all(name in found for name in usual):
            for name in usual:
                expected.pop(name, None)
            expected.update(other)
    optional = {n: s for n, s in spec.optional.items() if n not in expected}
    groups: dict[tuple, list[str]] = {}        # one line per tensor kind (layer and expert numbers starred)
    for n, want in sorted({**expected, **optional}.items(), key=lambda kv: _natural(kv[0])):
        if n in found and not _fits(want, found[n]):
            groups.setdefault((_NUMBERED.sub(".*.", n), _shape(found[n]), _shape(want)), []).append(n)
    shaped = [f"{names[0] if len(names) == 1 else f'{kind} ({len(names)} tensors, layers {_layers(names)})'} has "
              f"shape {got}, config.json implies {want}" for (kind, got, want), names in groups.items()]
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected and n not in optional]
    problems = shaped[:_SHOWN] + ([f"... ({len(shaped)} shapes differ)"] if len(shaped) > _SHOWN else [])
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {_listed(missing)}")
    if extra:
        problems.append(f"{len(extra)} tensor(s) the config has no place for: {_listed(extra)}")
    return problems


def _generic_problems(config: dict, found: dict) -> list[str]:
    """A family without stated tensors: names inside the layers the config has, the embedding ``[vocab, hidden]``,
    the routers' expert count and the expert numbers."""
    view = ConfigView(**config)
    layers, vocab, hidden = config["num_hidden_layers"], config.get("vocab_size"), config.get("hidden_size")
    experts = getattr(view, "num_experts", None)
    unknown, past_layers, past_experts, routers, top, seen = [], [], [], [], [], set()
    for name, shape in found.items():
        match = _LAYER.match(name)
        if match is None:
            if name not in _TOP:
                unknown.append(name)
            elif name != "model.norm.weight" and not _fits((vocab, hidden), shape):
                top.append(f"{name} has shape {_shape(shape)}, config.json implies {_shape((vocab, hidden))}")
            continue
        layer, rest = int(match[1]), match[2]
        seen.add(layer)
        if layer >= layers:
            past_layers.append(name)
        expert = _EXPERT.search("." + rest)
        if experts is not None and expert is not None and int(expert[1]) >= experts:
            past_experts.append(name)
        if experts is not None and rest.endswith(".gate.weight") and shape and shape[0] != experts:
            routers.append(name)
    problems = top
    if routers:
        problems.append(f"{_listed(routers)} route to {found[routers[0]][0]} experts, config.json has {experts}")
    if past_layers:
        problems.append(f"{len(past_layers)} tensor(s) of layers past the {layers} config.json has: "
                        f"{_listed(past_layers)}")
    if past_experts:
        problems.append(f"{len(past_experts)} tensor(s) of experts past the {experts} config.json has: "
                        f"{_listed(past_experts)}")
    absent = [i for i in range(layers) if i not in seen]
    if absent:
        problems.append(f"no tensors for layer(s) {absent[:_SHOWN]} of the {layers} config.json has")
    if unknown:
        problems.append(f"{len(unknown)} tensor(s) outside the decoder's names: {_listed(unknown)}")
    if "model.embed_tokens.weight" not in found:
        problems.append("model.embed_tokens.weight missing")
    return problems


def _summary(config: dict) -> str:
    view = ConfigView(**config)
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "num_experts", "moe_intermediate_size", "intermediate_size")
    return ", ".join(f"{k} {getattr(view, k, None)}" for k in keys if getattr(view, k, None) is not None)
