"""The execution contract: each side's configuration, stated as a plain JSON-ready dict and compared field by field.

A contract says what one engine actually ran: the engine and its version, the dtype of each region (router,
attention, experts, LM head, logits), the attention and MoE kernels, the TP / EP / SP / CP sizes, the
batch-invariant and tree-reduction switches, the sampling parameters, and a SHA-256 digest of the weights as the
engine holds them after loading::

    {"engine": "transformers", "engine_version": "5.23.0",
     "dtypes": {"router": "float32", "attention": "bfloat16", "experts": "bfloat16", "lm_head": "bfloat16",
                "logits": "bfloat16"},
     "kernels": {"attention": "sdpa", "moe": "eager"},
     "parallel": {"tp": 1, "ep": 1, "sp": 1, "cp": 1},
     "switches": {"batch_invariant": False, "tree_reductions": False},
     "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 0.9, "min_p": 0.0},      # or None
     "weights": {"dtype": "bfloat16", "algorithm": "sha256",
                 "digests": {"bfloat16": {"all": "<hex>", "layers": {"embed": "<hex>", "0": "<hex>", ...,
                                                                      "norm": "<hex>", "lm_head": "<hex>"}}}}}

``dtypes.logits`` is the dtype the LM head's forward returns (every engine here computes the log-softmax in
float32 after it). Every section but ``engine`` may be absent or ``None`` ("not stated"); the comparison then
says so instead of guessing.

:func:`weight_digests` hashes tensors named with the transformers names (``model.embed_tokens.weight``,
``model.layers.{i}.``..., ``model.norm.weight``, ``lm_head.weight``), one at a time, in chunks. A digest is given
for each *rounding dtype* no wider than every tensor is held in: a float32 holder gives digests at float32,
bfloat16 and float16, a bfloat16 holder at bfloat16 only. Casting float32 to bfloat16 / float16 rounds to nearest
even on every device, so a bfloat16 holder and a float32 holder of one checkpoint agree at ``"bfloat16"``.

:func:`compare_contracts` gives one row per leaf field with status ``"same"``, ``"info"`` (differs, but not known
to cause a log-prob gap, or not comparable) or ``"gap"`` (differs in a field known to cause a gap);
:func:`gap_fields` picks the gaps, :func:`format_contract` prints the rows. :func:`check_contract` refuses a
malformed contract (:class:`~moealign.errors.RecordError`).

Engine-free: torch and the standard library only. The engines' contracts come from
``moealign.patches.<engine>.contract``.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import re
from typing import Iterable

import torch

from .errors import InputError, RecordError

__all__ = [
    "REGIONS",
    "ROUNDING_DTYPES",
    "PARALLEL_KEYS",
    "SWITCH_KEYS",
    "SAMPLING_KEYS",
    "layer_key",
    "tensor_fingerprint",
    "bulk_dtype",
    "weight_digests",
    "weight_difference",
    "name_layers",
    "check_contract",
    "compare_contracts",
    "gap_fields",
    "format_contract",
    "gap_lines",
]

#: The regions whose dtypes a contract states.
REGIONS = ("router", "attention", "experts", "lm_head", "logits")
#: The dtypes weights are rounded to before hashing, widest first.
ROUNDING_DTYPES = ("float32", "bfloat16", "float16")
PARALLEL_KEYS = ("tp", "ep", "sp", "cp")
SWITCH_KEYS = ("batch_invariant", "tree_reductions")
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")
SECTIONS = ("dtypes", "kernels", "parallel", "switches", "sampling", "weights")
_TOP_KEYS = ("engine", "engine_version", *SECTIONS, "note")

_DTYPE_NAMES = frozenset(str(d).replace("torch.", "") for d in vars(torch).values() if isinstance(d, torch.dtype))
_WIDTH = {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16}
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_CHUNK = 1 << 22   # elements cast and hashed at a time
_REGION_LABEL = {"router": "router", "attention": "attention", "experts": "experts", "lm_head": "LM head",
                 "logits": "logits"}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def bulk_dtype(tensors) -> str | None:
    """The dtype name holding most floating elements of ``tensors`` (ties by name; None without any): the dtype a
    region "is held in" when a few of its tensors (norms, biases) are kept wider."""
    counts: dict[torch.dtype, int] = {}
    for t in tensors:
        if t.is_floating_point():
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return _name(max(counts, key=lambda d: (counts[d], str(d)))) if counts else None


# --------------------------------------------------------------------------------------------------
# weight digests
# --------------------------------------------------------------------------------------------------


def layer_key(name: str) -> str:
    """The digest group of a transformers tensor name: ``"embed"``, the decoder layer number, ``"norm"``,
    ``"lm_head"``, or ``"other"``."""
    match = _LAYER_RE.match(name)
    if match:
        return str(int(match.group(1)))
    if name.startswith("model.embed_tokens."):
        return "embed"
    if name.startswith("model.norm."):
        return "norm"
    if name.startswith("lm_head."):
        return "lm_head"
    return "other"


def _roundings(held: torch.dtype) -> tuple[str, ...]:
    """The rounding dtypes a tensor held in ``held`` can be hashed at (no wider than it is held in)."""
    name = _name(held)
    if not held.is_floating_point:
        return ROUNDING_DTYPES          # integer tensors: hashed as they are, at every rounding
    if name in ("float64", "float32"):
        return ROUNDING_DTYPES
    if name in ("bfloat16", "float16"):
        return (name,)
    return ()                           # fp8 and other narrow formats: no rounding both sides can share


def _hash_tensor(h, name: str, tensor: torch.Tensor, rounding: str) -> None:
    t = tensor.detach()
    h.update(f"{name}|{tuple(t.shape)}|{rounding}|".encode())
    flat = t.reshape(-1)
    cast = t.is_floating_point()
    target = getattr(torch, rounding)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK]
        if cast:
            part = part.to(target)
        part = part.to("cpu").contiguous()
        h.update(part.view(torch.uint8).numpy().tobytes())


_FP_CHUNK = 1 << 20
_FP_KEYS: dict = {}


def _fp_keys(device) -> torch.Tensor:
    """``[3, _FP_CHUNK]`` odd int64 keys (two lanes + chunk multipliers), drawn once per device from a fixed seed."""
    key = str(device)
    if key not in _FP_KEYS:
        g = torch.Generator().manual_seed(0x6D6F65616C69676E)          # "moealign"
        keys = torch.randint(-2 ** 62, 2 ** 62, (3, _FP_CHUNK), generator=g, dtype=torch.int64) * 2 + 1
        _FP_KEYS[key] = keys.to(device)
    return _FP_KEYS[key]


def tensor_fingerprint(tensor: torch.Tensor, *, rows: bool = False):
    """A 128-bit keyed fingerprint of a tensor's bytes, computed with vectorised integer arithmetic on the tensor's
    own device (one host read): the bytes as int64 words, dotted with two fixed odd pseudo-random keys (wrapping
    arithmetic), chunks weighted by a third key, plus dtype and shape. Any single changed word changes both lanes
    (odd multipliers); a transposition or a shifted block changes them unless the keys collide (about 2^-64 per
    lane). Not a cryptographic digest (:func:`weight_digests`' SHA-256 is): it guards against bugs, not adversaries.
    ``rows=True``: one fingerprint per index of the first dimension (a list), in one pass."""
    t = tensor.detach()
    lead = t.shape[0] if rows else 1
    flat = t.contiguous().reshape(lead, -1).view(torch.uint8)
    pad = (-flat.shape[1]) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(lead, pad)], dim=1)
    words = flat.view(torch.int64)
    keys = _fp_keys(words.device)
    lanes = torch.zeros(lead, 2, dtype=torch.int64, device=words.device)
    for c, start in enumerate(range(0, words.shape[1], _FP_CHUNK)):
        part = words[:, start:start + _FP_CHUNK]
        n = part.shape[1]
        lanes += (part[:, None, :] * keys[None, :2, :n]).sum(dim=2) * keys[2, c % _FP_CHUNK]
    dtype = str(t.dtype).replace("torch.", "")
    shape = tuple(t.shape[1:]) if rows else tuple(t.shape)
    out = [(dtype, shape, a, b) for a, b in lanes.tolist()]
    return out if rows else out[0]


def weight_digests(named_tensors: Iterable[tuple[str, torch.Tensor]], num_layers: int, *,
                   roundings: Iterable[str] | None = None) -> dict:
    """The contract's ``"weights"`` entry of tensors with transformers names (see the module docstring).

    ``roundings``: hash at these rounding dtypes only (default every one the tensors allow), e.g. the one another
    side's digests were taken at: each rounding is one pass over every byte of the weights.

    Per rounding dtype: one SHA-256 per group (``embed``, each decoder layer ``"0"`` .. ``num_layers - 1``,
    ``norm``, ``lm_head``, ``other`` when a name falls in none) over its tensors sorted by name (name, shape,
    rounding dtype and the bytes of the tensor cast to it), and ``"all"`` over the groups' digests. ``dtype`` is
    the dtype holding the most elements. Tensors are cast and hashed one at a time, in chunks."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise InputError(f"weight_digests: num_layers must be an integer >= 0, got {num_layers!r}")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise InputError(f"weight_digests: expected (name, tensor) pairs, got ({name!r}, {type(tensor).__name__})")
        if name in tensors:
            raise InputError(f"weight_digests: tensor {name!r} given twice")
        key = layer_key(name)
        if key.isdigit() and int(key) >= num_layers:
            raise InputError(f"weight_digests: tensor {name!r} is in layer {key}, the model has {num_layers} layers")
        tensors[name] = tensor
    if not tensors:
        raise InputError("weight_digests: no tensors to hash")
    asked = set(ROUNDING_DTYPES) if roundings is None else set(roundings)
    unknown = sorted(str(r) for r in asked - set(ROUNDING_DTYPES))
    if unknown:
        raise InputError(f"weight_digests: unknown rounding dtypes {unknown}; known: {list(ROUNDING_DTYPES)}")
    counts: dict[str, int] = {}
    roundings = asked
    for tensor in tensors.values():
        counts[_name(tensor.dtype)] = counts.get(_name(tensor.dtype), 0) + tensor.numel()
        roundings &= set(_roundings(tensor.dtype))
    bulk = max(sorted(counts), key=lambda k: counts[k])
    groups: dict[str, list[str]] = {"embed": [], **{str(i): [] for i in range(num_layers)}, "norm": [], "lm_head": []}
    for name in sorted(tensors):
        groups.setdefault(layer_key(name), []).append(name)
    digests = {}
    for rounding in (r for r in ROUNDING_DTYPES if r in roundings):
        layers = {}
        for key, names in groups.items():
            h = hashlib.sha256(b"moealign-weights\0")
            for name in names:
                _hash_tensor(h, name, tensors[name], rounding)
            layers[key] = h.hexdigest()
        total = hashlib.sha256(b"moealign-weights-all\0")
        for key, digest in layers.items():
            total.update(f"{key}={digest};".encode())
        digests[rounding] = {"all": total.hexdigest(), "layers": layers}
    return {"dtype": bulk, "algorithm": "sha256", "digests": digests}


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


def _bad(message: str):
    raise RecordError(f"contract: {message}")


def _check_dtype_name(where: str, value) -> None:
    if not isinstance(value, str) or value not in _DTYPE_NAMES:
        _bad(f"{where} must be a torch dtype name (float32, bfloat16, ...), got {value!r}")


def _check_section(d: dict, key: str):
    value = d.get(key)
    if value is not None and not isinstance(value, dict):
        _bad(f"{key} must be an object or null, got {type(value).__name__}")
    if isinstance(value, dict) and any(not isinstance(k, str) for k in value):
        _bad(f"{key} has a key that is not a string")
    return value


def check_contract(d) -> dict:
    """Check a contract's structure and types; return it. :class:`RecordError` names the first problem (wrong
    types, unknown dtype names, sizes < 1, digests that are not 64 lowercase hex characters, unknown keys)."""
    if not isinstance(d, dict):
        _bad(f"must be an object, got {type(d).__name__}")
    unknown = sorted(str(k) for k in d if k not in _TOP_KEYS)
    if unknown:
        _bad(f"unknown keys {unknown} (known: {list(_TOP_KEYS)})")
    if not isinstance(d.get("engine"), str) or not d["engine"]:
        _bad(f"engine must be a non-empty string, got {d.get('engine')!r}")
    for key in ("engine_version", "note"):
        if d.get(key) is not None and not isinstance(d[key], str):
            _bad(f"{key} must be a string, got {d[key]!r}")
    dtypes = _check_section(d, "dtypes")
    for region, value in (dtypes or {}).items():
        if value is not None:
            _check_dtype_name(f"dtypes.{region}", value)
    kernels = _check_section(d, "kernels")
    for name, value in (kernels or {}).items():
        if value is not None and not isinstance(value, str):
            _bad(f"kernels.{name} must be a string or null, got {value!r}")
    parallel = _check_section(d, "parallel")
    for name, value in (parallel or {}).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _bad(f"parallel.{name} must be an integer >= 1, got {value!r}")
    switches = _check_section(d, "switches")
    for name, value in (switches or {}).items():
        if not isinstance(value, bool):
            _bad(f"switches.{name} must be true or false, got {value!r}")
    sampling = _check_section(d, "sampling")
    if sampling is not None:
        extra = sorted(set(sampling) - set(SAMPLING_KEYS))
        if extra:
            _bad(f"sampling has unknown keys {extra} (known: {list(SAMPLING_KEYS)})")
        for name, value in sampling.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                _bad(f"sampling.{name} must be a finite number, got {value!r}")
    weights = _check_section(d, "weights")
    if weights is not None:
        extra = sorted(set(weights) - {"dtype", "algorithm", "digests", "note"})
        if extra:
            _bad(f"weights has unknown keys {extra}")
        if weights.get("dtype") is not None:
            _check_dtype_name("weights.dtype", weights["dtype"])
        if weights.get("algorithm", "sha256") != "sha256":
            _bad(f"weights.algorithm must be 'sha256', got {weights.get('algorithm')!r}")
        if weights.get("note") is not None and not isinstance(weights["note"], str):
            _bad(f"weights.note must be a string, got {weights['note']!r}")
        digests = weights.get("digests", {})
        if not isinstance(digests, dict):
            _bad(f"weights.digests must be an object, got {type(digests).__name__}")
        for rounding, entry in digests.items():
            if rounding not in ROUNDING_DTYPES:
                _bad(f"weights.digests has rounding dtype {rounding!r}; known: {list(ROUNDING_DTYPES)}")
            if not isinstance(entry, dict) or set(entry) != {"all", "layers"} or not isinstance(entry["layers"], dict):
                _bad(f"weights.digests.{rounding} must be {{'all': hex, 'layers': {{name: hex}}}}")
            for where, value in [("all", entry["all"])] + [(f"layers.{k}", v) for k, v in entry["layers"].items()]:
                if not isinstance(value, str) or not _HEX64.match(value):
                    _bad(f"weights.digests.{rounding}.{where} must be 64 lowercase hex characters, got "
                         f"{str(value)[:80]!r}")
    return d


# --------------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------------


def _row(field: str, a, b, status: str, message: str = "") -> dict:
    return {"field": field, "rollout": a, "train": b, "status": status, "message": message}


def _narrower(a: str | None, b: str | None) -> bool:
    """``a`` is a narrower float than ``b``."""
    return a in _WIDTH and b in _WIDTH and _WIDTH[a] < _WIDTH[b]


def _model_dtype(c: dict) -> str | None:
    weights = c.get("weights") or {}
    return weights.get("dtype") or (c.get("dtypes") or {}).get("attention")


def _dtype_row(region: str, r: dict, t: dict) -> dict:
    a, b = (r.get("dtypes") or {}).get(region), (t.get("dtypes") or {}).get(region)
    field = f"dtypes.{region}"
    if a is None or b is None:
        return _missing_row(field, a, b)
    if a == b:
        return _row(field, a, b, "same")
    label = _REGION_LABEL[region]
    if region in ("router", "lm_head"):
        for side, other, mine, theirs, c in (("rollout", "train", a, b, r), ("train", "rollout", b, a, t)):
            if mine == "float32" and _narrower(theirs, mine) and _narrower(_model_dtype(c), "float32"):
                return _row(field, a, b, "gap",
                            f"{side} computes the {label} in float32, {other} in {theirs}: a one-sided fp32 {label} "
                            f"makes the mismatch worse, not better; use the same dtype on both sides")
    return _row(field, a, b, "gap", f"{label} in {a} on the rollout side, {b} on the train side: every value "
                                   f"computed there is rounded differently")


def _missing_row(field: str, a, b) -> dict:
    if a is None and b is None:
        return _row(field, a, b, "info", "not stated by either side")
    side = "rollout" if a is None else "train"
    return _row(field, a, b, "info", f"not stated by the {side} side")


def _section(c: dict, key: str):
    return c.get(key) if isinstance(c.get(key), dict) else None


def _leaf_rows(section: str, r: dict, t: dict, keys: Iterable[str]) -> list[tuple[str, object, object]]:
    rs, ts = _section(r, section), _section(t, section)
    if rs is None or ts is None:
        return []
    names = list(dict.fromkeys([*keys, *sorted(rs), *sorted(ts)]))
    return [(name, rs.get(name), ts.get(name)) for name in names if name in rs or name in ts]


def _weights_rows(r: dict, t: dict) -> list[dict]:
    rw, tw = _section(r, "weights"), _section(t, "weights")
    if rw is None or tw is None:
        return [_missing_row("weights", rw, tw)]
    rows = []
    if rw.get("dtype") != tw.get("dtype"):
        rows.append(_row("weights.dtype", rw.get("dtype"), tw.get("dtype"), "info",
                         "the weights are held in different dtypes (compared at a rounding both hold)"))
    else:
        rows.append(_row("weights.dtype", rw.get("dtype"), tw.get("dtype"), "same"))
    rd, td = rw.get("digests") or {}, tw.get("digests") or {}
    diff = weight_difference(rw, tw)
    if diff is None:
        notes = "; ".join(f"{side}: {w['note']}" for side, w in (("rollout", rw), ("train", tw)) if w.get("note"))
        rows.append(_row("weights.digests", sorted(rd), sorted(td), "info",
                         "not comparable: no rounding dtype both sides give digests at"
                         + (f" ({notes})" if notes else "")))
        return rows
    rounding, differ = diff
    a, b = rd[rounding], td[rounding]
    if not differ:
        rows.append(_row("weights.digests", f"{rounding}:{a['all'][:12]}", f"{rounding}:{b['all'][:12]}", "same",
                         f"same weights at {rounding} rounding"))
        return rows
    rows.append(_row("weights.digests", f"{rounding}:{a['all'][:12]}", f"{rounding}:{b['all'][:12]}", "gap",
                     f"weights differ in {name_layers(differ)} at {rounding} rounding: a stale or wrongly converted "
                     f"checkpoint on one side"))
    return rows


def weight_difference(a: dict | None, b: dict | None) -> tuple[str, list[str]] | None:
    """Two contracts' ``"weights"`` entries compared at the widest rounding dtype both give digests at:
    ``(rounding, [digest groups that differ])`` (an empty list: the same weights), or ``None`` when not comparable
    (either entry absent, or no common rounding)."""
    rd, td = (a or {}).get("digests") or {}, (b or {}).get("digests") or {}
    common = [x for x in ROUNDING_DTYPES if x in rd and x in td]
    if not common:
        return None
    rounding = common[0]
    x, y = rd[rounding], td[rounding]
    if x["all"] == y["all"]:
        return rounding, []
    keys = list(dict.fromkeys([*x["layers"], *y["layers"]]))
    return rounding, [k for k in keys if x["layers"].get(k) != y["layers"].get(k)]


def name_layers(groups: list[str]) -> str:
    """Digest groups in words: ``["2", "lm_head"]`` -> ``"layer 2 (and lm_head)"`` (the first 8 named)."""
    named = [f"layer {k}" if k.isdigit() else k for k in groups]
    return named[0] + (f" (and {', '.join(named[1:8])}{', ...' if len(named) > 8 else ''})" if len(named) > 1 else "")


def compare_contracts(rollout: dict, train: dict) -> list[dict]:
    """One row per leaf field: ``{"field", "rollout", "train", "status", "message"}``, status ``"same"``,
    ``"info"`` or ``"gap"`` (see the module docstring). Both contracts are checked first (:func:`check_contract`)."""
    r, t = check_contract(rollout), check_contract(train)
    rows: list[dict] = []
    for key in ("engine", "engine_version"):
        a, b = r.get(key), t.get(key)
        if a is None or b is None:
            rows.append(_missing_row(key, a, b))
        else:
            rows.append(_row(key, a, b, "same" if a == b else "info",
                             "" if a == b else "different engines or versions (their kernels differ; the fields "
                                               "below say where)"))
    # dtypes
    if _section(r, "dtypes") is None or _section(t, "dtypes") is None:
        rows.append(_missing_row("dtypes", _section(r, "dtypes"), _section(t, "dtypes")))
    else:
        rows += [_dtype_row(region, r, t) for region in REGIONS]
        for name, a, b in _leaf_rows("dtypes", r, t, REGIONS):
            if name not in REGIONS:
                rows.append(_row(f"dtypes.{name}", a, b, "same" if a == b else "gap",
                                 "" if a == b else f"{name} runs in {a} on the rollout side and {b} on the train side"))
    # kernels
    if _section(r, "kernels") is None or _section(t, "kernels") is None:
        rows.append(_missing_row("kernels", _section(r, "kernels"), _section(t, "kernels")))
    for name, a, b in _leaf_rows("kernels", r, t, ("attention", "moe")):
        if a is None or b is None:
            rows.append(_missing_row(f"kernels.{name}", a, b))
        else:
            rows.append(_row(f"kernels.{name}", a, b, "same" if a == b else "info",
                             "" if a == b else f"{name} kernels differ ({a} vs {b}): their reduction orders differ"))
    # switches and parallel sizes
    rs, ts = _section(r, "switches"), _section(t, "switches")
    rp, tp = _section(r, "parallel"), _section(t, "parallel")
    if rp is None or tp is None:
        rows.append(_missing_row("parallel", rp, tp))
    for name, a, b in _leaf_rows("parallel", r, t, PARALLEL_KEYS):
        if a is None or b is None:
            rows.append(_missing_row(f"parallel.{name}", a, b))
        elif a == b:
            rows.append(_row(f"parallel.{name}", a, b, "same"))
        elif name == "tp":
            off = [side for side, s in (("rollout", rs), ("train", ts)) if not (s or {}).get("tree_reductions")]
            if off:
                rows.append(_row("parallel.tp", a, b, "gap",
                                 f"TP sizes differ ({a} vs {b}) with tree reductions off on the {' and '.join(off)} "
                                 f"side: the all-reduce of row-parallel layers sums the partial results in another "
                                 f"order, so the outputs round differently"))
            else:
                rows.append(_row("parallel.tp", a, b, "info",
                                 f"TP sizes differ ({a} vs {b}), both sides use TP-invariant tree reductions"))
        else:
            rows.append(_row(f"parallel.{name}", a, b, "info", f"{name.upper()} sizes differ ({a} vs {b})"))
    if rs is None or ts is None:
        rows.append(_missing_row("switches", rs, ts))
    for name, a, b in _leaf_rows("switches", r, t, SWITCH_KEYS):
        if a is None or b is None:
            rows.append(_missing_row(f"switches.{name}", a, b))
        elif a == b:
            rows.append(_row(f"switches.{name}", a, b, "same"))
        elif name == "batch_invariant":
            side = "rollout" if a else "train"
            rows.append(_row("switches.batch_invariant", a, b, "info",
                             f"batch-invariant ops on the {side} side only: the other side's results depend on the "
                             f"batch composition (which sequences share a forward, their padding)"))
        else:
            rows.append(_row(f"switches.{name}", a, b, "info", f"{name} on one side only"))
    # sampling
    rsa, tsa = _section(r, "sampling"), _section(t, "sampling")
    if rsa is None or tsa is None:
        rows.append(_missing_row("sampling", rsa, tsa))
    else:
        for name, a, b in _leaf_rows("sampling", r, t, SAMPLING_KEYS):
            if a is None or b is None:
                rows.append(_missing_row(f"sampling.{name}", a, b))
            elif float(a) == float(b):
                rows.append(_row(f"sampling.{name}", a, b, "same"))
            else:
                rows.append(_row(f"sampling.{name}", a, b, "gap",
                                 f"sampling {name} differs ({a} vs {b}): the two sides score another distribution"))
    rows += _weights_rows(r, t)
    return rows


def gap_fields(rows: list[dict]) -> list[dict]:
    """The rows of :func:`compare_contracts` whose status is ``"gap"``."""
    return [row for row in rows if row["status"] == "gap"]


def gap_lines(rows: list[dict]) -> list[str]:
    """One line per gap: ``contract: FIELD differs (rollout A, train B): MESSAGE``."""
    return [f"contract: {row['field']} differs (rollout {_text(row['rollout'])}, train {_text(row['train'])}): "
            f"{row['message']}" for row in gap_fields(rows)]


def _text(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value) or "-"
    return str(value)


def format_contract(rows: list[dict]) -> str:
    """The rows as a plain text table (field, rollout, train, status, message)."""
    head = ("field", "rollout", "train", "status")
    cells = [[row["field"], _text(row["rollout"]), _text(row["train"]), row["status"]] for row in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  message",
             "  ".join("-" * w for w in widths) + "  -------"]
    for c, row in zip(cells, rows):
        lines.append("  ".join(x.ljust(w) for x, w in zip(c, widths)) + "  " + row["message"])
    gaps = len(gap_fields(rows))
    lines.append(f"{gaps} field{'s' if gaps != 1 else ''} known to cause a gap" if gaps else
                 "no field known to cause a gap differs")
    return "\n".join(lines)
