"""The import graph: core packages stay engine-free, and each engine is imported only by its own adapter.

Rules, checked on every ``moealign/**/*.py`` with :mod:`ast` (nothing is imported):

* a core package (:data:`CORE`: ``moealign.correction``, ``routing_replay``, ``precision``, ``families``,
  ``record``, ``errors``, ``handle``) imports no engine (:data:`ENGINES`) and neither ``moealign.patches``
  nor ``moealign.mismatch``;
* no import runs back up into ``moealign.record``: the core packages it is built on (:data:`BELOW_RECORD`:
  ``routing_replay``, ``families``, ``errors``, ``handle``) do not import it;
* an engine is imported only inside its own adapter package (:data:`ENGINES`: transformers in
  ``moealign/patches/hf/``, Megatron and transformer-engine in ``moealign/patches/megatron/``, vLLM in
  ``moealign/patches/vllm/``, SGLang in ``moealign/patches/sglang/``).

Every import counts, also the lazy ones inside functions and those under ``if TYPE_CHECKING:``; relative
imports are resolved against the file's package. A string first argument of ``require(...)``,
``probe(...)`` (:mod:`moealign._optional`), ``import_module(...)`` or ``__import__(...)`` counts as an
import of that module; :data:`STRING_NAMERS` (``_optional.py``, ``info.py``) may name modules as strings
(the backend table, ``moealign info``'s probes).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moealign"

#: engine (top-level module) -> the only package directory that may import it
ENGINES = {
    "transformers": "moealign/patches/hf/",
    "megatron": "moealign/patches/megatron/",
    "transformer_engine": "moealign/patches/megatron/",
    "vllm": "moealign/patches/vllm/",
    "sglang": "moealign/patches/sglang/",
}
#: core packages / modules (paths relative to the repository root; a trailing "/" is a package)
CORE = (
    "moealign/correction/",
    "moealign/routing_replay/",
    "moealign/precision/",
    "moealign/families/",
    "moealign/record/",
    "moealign/errors.py",
    "moealign/handle.py",
)
#: moealign packages a core package must not import
NOT_FROM_CORE = ("moealign.patches", "moealign.mismatch")
#: core packages that ``moealign.record`` imports, which must not import it back
BELOW_RECORD = ("moealign/routing_replay/", "moealign/families/", "moealign/errors.py", "moealign/handle.py")
#: calls whose string first argument is a module imported at run time
IMPORTING_CALLS = {"require", "probe", "import_module", "__import__"}
#: files that may name modules as strings (the optional-backend table and the environment report)
STRING_NAMERS = ("moealign/_optional.py", "moealign/info.py")
#: (file, engine module) pairs allowed despite the rules, each with its reason. Keep this empty or justified.
ALLOWED: dict[tuple[str, str], str] = {
    ("moealign/precision/policy.py", "transformer_engine"):
        "to_megatron_config_fields(te_available=None) probes whether transformer-engine imports "
        "(availability only, no use of its API); callers that know pass te_available",
}


@dataclass(frozen=True)
class Import:
    file: str       # path relative to the repository root
    line: int
    module: str     # absolute module name
    how: str        # "import" or "string"


@dataclass(frozen=True)
class Violation:
    imp: Import
    rule: str

    def __str__(self) -> str:
        return f"{self.imp.file}:{self.imp.line}: {self.imp.module} ({self.imp.how}): {self.rule}"


def _package_of(rel: str) -> list[str]:
    """``moealign/mismatch/engines.py`` -> ``["moealign", "mismatch"]`` (the package its relative imports
    resolve against; a package's ``__init__.py`` is its own package)."""
    parts = rel[:-3].split("/")
    return parts[:-1]


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def imports_of(source: str, rel: str) -> list[Import]:
    """Every module ``source`` (the file ``rel``) imports, statements and string imports, resolved."""
    tree = ast.parse(source, filename=rel)
    package = _package_of(rel)
    out: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(rel, node.lineno, alias.name, "import") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level > len(package):
                    raise AssertionError(f"{rel}:{node.lineno}: relative import above the top-level package")
                base = ".".join(package[:len(package) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            out.append(Import(rel, node.lineno, base, "import"))
            # ``from pkg import sub``: ``sub`` may be a submodule (``from ..patches import hf``)
            out += [Import(rel, node.lineno, f"{base}.{alias.name}", "import") for alias in node.names
                    if alias.name != "*"]
        elif isinstance(node, ast.Call) and _call_name(node.func) in IMPORTING_CALLS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and rel not in STRING_NAMERS:
                out.append(Import(rel, node.lineno, first.value, "string"))
    return out


def _in(rel: str, places) -> bool:
    return any(rel.startswith(p) if p.endswith("/") else rel == p for p in places)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(source: str, rel: str) -> list[Violation]:
    found = []
    for imp in imports_of(source, rel):
        engine = imp.module.split(".")[0]
        if engine in ENGINES and (rel, engine) in ALLOWED:
            continue
        if _in(rel, CORE):
            if engine in ENGINES:
                found.append(Violation(imp, "a core package imports an engine"))
                continue
            bad = [p for p in NOT_FROM_CORE if _under(imp.module, p)]
            if bad:
                found.append(Violation(imp, f"a core package imports {bad[0]}"))
                continue
        if _in(rel, BELOW_RECORD) and _under(imp.module, "moealign.record"):
            found.append(Violation(imp, "an import runs back up: a package below moealign.record imports it"))
            continue
        if engine in ENGINES and not rel.startswith(ENGINES[engine]):
            found.append(Violation(imp, f"{engine} is imported outside {ENGINES[engine]}"))
    return found


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text()


# --------------------------------------------------------------------------------------------------
# the package
# --------------------------------------------------------------------------------------------------


def test_import_graph():
    found = [str(v) for rel, src in _sources() for v in violations(src, rel)]
    assert not found, "import-graph violations:\n  " + "\n  ".join(found)


def test_the_walk_sees_the_adapters():
    """The walk is not vacuous: the adapters' own engine imports are found (and allowed)."""
    seen = {(rel, imp.module.split(".")[0]) for rel, src in _sources() for imp in imports_of(src, rel)}
    assert any(rel.startswith("moealign/patches/hf/") and e == "transformers" for rel, e in seen)
    assert any(rel.startswith("moealign/patches/megatron/") and e == "megatron" for rel, e in seen)
    assert any(rel.startswith("moealign/patches/vllm/") and e == "vllm" for rel, e in seen)
    assert {p.rstrip("/").split("/")[-1] for p in CORE if p.endswith("/")} <= {
        p.name for p in PACKAGE.iterdir() if p.is_dir()}                    # every core package exists


def test_allowed_exceptions_are_still_needed():
    """An allowance whose import is gone is removed from :data:`ALLOWED`."""
    sources = dict(_sources())
    for (rel, engine), reason in ALLOWED.items():
        assert rel in sources, rel
        assert any(imp.module.split(".")[0] == engine for imp in imports_of(sources[rel], rel)), (rel, engine, reason)


# --------------------------------------------------------------------------------------------------
# negative controls: synthetic sources that break each rule
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rel, source, rule", [
    ("moealign/correction/x.py", "import transformers\n", "core package imports an engine"),
    ("moealign/record/io.py", "def f():\n    from megatron.core import parallel_state\n", "core package imports an engine"),
    ("moealign/record/inspect.py", "def f():\n    from ..mismatch.engines import HFTrainEngine\n",
     "imports moealign.mismatch"),
    ("moealign/routing_replay/x.py", "from ..record import RolloutRecord\n", "an import runs back up"),
    ("moealign/families/x.py", "def f():\n    from moealign.record.formats import RouteRows\n",
     "an import runs back up"),
    ("moealign/routing_replay/x.py", "from ..patches import hf\n", "imports moealign.patches"),
    ("moealign/precision/x.py", "from ..mismatch.engines import DTYPES\n", "imports moealign.mismatch"),
    ("moealign/families/x.py", "from moealign.patches.megatron import capture\n", "imports moealign.patches"),
    ("moealign/handle.py", "from . import mismatch\n", "imports moealign.mismatch"),
    ("moealign/errors.py", "import vllm.config\n", "core package imports an engine"),
    ("moealign/precision/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import sglang\n",
     "core package imports an engine"),
    ("moealign/mismatch/engines.py", "from .._optional import require\nt = require('transformers', 'why')\n",
     "transformers is imported outside moealign/patches/hf/"),
    ("moealign/mismatch/engines.py", "import importlib\nm = importlib.import_module('megatron.core')\n",
     "megatron is imported outside moealign/patches/megatron/"),
    ("moealign/patches/hf/x.py", "import megatron.core\n", "megatron is imported outside moealign/patches/megatron/"),
    ("moealign/patches/megatron/x.py", "from transformers import AutoConfig\n",
     "transformers is imported outside moealign/patches/hf/"),
    ("moealign/patches/vllm/x.py", "import transformer_engine.pytorch as te\n",
     "transformer_engine is imported outside moealign/patches/megatron/"),
    ("moealign/cli.py", "def main():\n    import vllm\n", "vllm is imported outside moealign/patches/vllm/"),
    ("moealign/precision/policy.py", "import megatron\n", "core package imports an engine"),  # ALLOWED is per engine
])
def test_violations_are_caught(rel, source, rule):
    found = violations(source, rel)
    assert found and rule in str(found[0]), found


@pytest.mark.parametrize("rel, source", [
    ("moealign/patches/hf/x.py", "import transformers\nfrom transformers import AutoModelForCausalLM\n"),
    ("moealign/patches/megatron/x.py", "from megatron.core import parallel_state\nimport transformer_engine\n"),
    ("moealign/patches/vllm/x.py", "from vllm.model_executor import layers\n"),
    ("moealign/mismatch/engines.py", "from ..patches import hf\nfrom ..patches.megatron import capture\n"),
    ("moealign/correction/x.py", "from ..record import RolloutRecord\nimport torch\nname = 'transformers'\n"),
    ("moealign/_optional.py", "import importlib\nm = importlib.import_module('vllm')\n"),   # may name modules
    ("moealign/info.py", "from ._optional import probe\nprobe('megatron.core')\n"),
    ("moealign/patches/hf/x.py", "from .._optional import require\nrequire('transformers', 'why')\n"),
    ("moealign/routing_replay/x.py", "from .. import patchesque\n"),                      # prefix, not package
    ("moealign/routing_replay/x.py", "from .. import recorder\n"),                        # prefix, not package
    ("moealign/record/x.py", "from ..routing_replay.routes import route_dtype\nfrom . import formats\n"),
    ("moealign/mismatch/x.py", "from ..record.inspect import compare_routes\n"),
])
def test_allowed_imports_pass(rel, source):
    assert violations(source, rel) == []


def test_relative_imports_resolve():
    mods = {i.module for i in imports_of("from ..patches import hf\nfrom . import b\nfrom .c import d\n",
                                         "moealign/mismatch/a.py")}
    assert {"moealign.patches", "moealign.patches.hf", "moealign.mismatch.b", "moealign.mismatch.c"} <= mods
    init = {i.module for i in imports_of("from .engines import X\n", "moealign/mismatch/__init__.py")}
    assert "moealign.mismatch.engines" in init
