"""The value of ``MOEALIGN_VLLM_PATCHES`` (:data:`ENV`): the patches moealign's ``vllm.general_plugins`` entry point
(:mod:`.plugin`) applies in every vLLM process, their options, and the checked parse of the variable. Engine-free: the
commands, the engine opener and the plugin read the one definition here."""

from __future__ import annotations

from ...errors import ConfigError

__all__ = ["ENV", "PATCHES", "parse_spec", "spec_for"]

ENV = "MOEALIGN_VLLM_PATCHES"

#: patch name -> (option name -> type) it accepts
PATCHES = {"tree": {"leaf_width": int}, "precision": {"policy": str}, "canonical": {"skip": str}, "quiet": {}}


def parse_spec(text: str) -> list[tuple[str, dict]]:
    """``"tree:leaf_width=16,other"`` -> ``[("tree", {"leaf_width": 16}), ("other", {})]`` (checked)."""
    result = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, opts = item.partition(":")
        if name not in PATCHES:
            raise ConfigError(f"{ENV}: unknown patch {name!r}; known: {sorted(PATCHES)}")
        options = {}
        for opt in filter(None, (o.strip() for o in opts.split(":"))):
            key, sep, value = opt.partition("=")
            if not sep or key not in PATCHES[name]:
                raise ConfigError(f"{ENV}: patch {name!r} takes {sorted(PATCHES[name])} as key=value, got {opt!r}")
            try:
                options[key] = PATCHES[name][key](value)
            except ValueError:
                raise ConfigError(f"{ENV}: {name}:{key} must be {PATCHES[name][key].__name__}, got {value!r}") from None
        result.append((name, options))
    return result


def spec_for(*, tree: bool = False, leaf_width: int | None = None, precision: str | None = None,
             canonical: bool = False, canonical_skip=()) -> str:
    """The :data:`ENV` value asking for these patches (``""``: none)."""
    parts = []
    if canonical:
        parts.append("canonical" + (f":skip={'+'.join(canonical_skip)}" if canonical_skip else ""))
    if precision is not None:
        parts.append(f"precision:policy={precision}")
    if tree:
        parts.append("tree" if leaf_width is None else f"tree:leaf_width={leaf_width}")
    return ",".join(parts)
