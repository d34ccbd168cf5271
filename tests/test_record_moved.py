"""The record package's moved paths (issue 25): ``moealign.record_convert`` / ``record_inspect`` / ``record_stitch`` /
``routing_replay.formats`` (and the format names ``moealign.routing_replay`` exported) stay importable for one release,
re-export the very objects of their new home and warn naming it; nothing inside moealign uses them; ``moealign.record``
still exports every public name the former ``moealign/record.py`` did, without a warning."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

import moealign
import moealign.record
import moealign.routing_replay
from moealign import _deprecated

#: old path -> new path
MOVED = {
    "moealign.record_convert": "moealign.record.convert",
    "moealign.record_inspect": "moealign.record.inspect",
    "moealign.record_stitch": "moealign.record.stitch",
    "moealign.routing_replay.formats": "moealign.record.formats",
}
#: the names moealign.routing_replay exported from its formats module
FORMAT_NAMES = ("RouteRows", "routes_from_nemo_rl", "routes_from_sglang", "routes_from_slime", "routes_from_trtllm",
                "routes_from_verl", "routes_from_vllm_0_21", "routes_to_nemo_rl", "routes_to_slime", "routes_to_verl")
#: every public name the former moealign/record.py defined or exported (its __all__ plus with_meta, ROUTER_SAMPLES)
RECORD_NAMES = ("FORMAT_VERSION", "MAX_LAYERS", "MAX_EXPERTS", "MAX_VOCAB", "MIN_TEMPERATURE", "RecordError",
                "RecordFormatError", "RecordMismatchError", "SamplingParams", "RecordMeta", "Sample", "RolloutRecord",
                "PaddedBatch", "PackedBatch", "config_fingerprint", "router_signature", "router_samples",
                "routes_from_all_layers", "concat_kept_sets", "with_meta", "ROUTER_SAMPLES")


def _fresh_import(monkeypatch, name: str) -> types.ModuleType:
    """Import ``name`` anew (its module body runs again, so its warning fires again), the old entry restored after."""
    monkeypatch.delitem(sys.modules, name, raising=False)
    parent, _, leaf = name.rpartition(".")
    monkeypatch.delattr(sys.modules[parent], leaf, raising=False)
    __import__(name)                                  # the builtin: this function is the importer, no importlib frame
    return sys.modules[name]


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_path_warns_and_reexports_the_same_objects(monkeypatch, old, new):
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}\b") as caught:
        shim = _fresh_import(monkeypatch, old)
    assert len([w for w in caught if w.category is DeprecationWarning]) == 1
    assert caught[0].filename == __file__                    # attributed to the importer, past importlib's frames
    module = importlib.import_module(new)
    assert set(module.__all__) <= set(shim.__all__)
    public = [n for n in vars(module) if not (n.startswith("__") and n.endswith("__"))]
    assert len(public) > 5 and all(getattr(shim, n) is getattr(module, n) for n in public)   # identical objects


def test_the_old_inspect_path_keeps_the_router_check(monkeypatch):   # moved to mismatch/: record runs no model
    from moealign.mismatch import router_check as moved

    with pytest.warns(DeprecationWarning):
        shim = _fresh_import(monkeypatch, "moealign.record_inspect")
    assert shim.router_check is moved.router_check and shim.ROUTER_BATCH == moved.ROUTER_BATCH


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_routing_replay_format_names_warn_once_and_are_the_same_objects(monkeypatch, name):
    import moealign.record.formats as formats

    monkeypatch.delitem(vars(moealign.routing_replay), name, raising=False)   # bound by an earlier access
    with pytest.warns(DeprecationWarning, match=rf"moealign.routing_replay.{name} moved to moealign.record.formats"
                                                rf".{name}") as caught:
        exec(f"from moealign.routing_replay import {name} as got", ns := {})
    assert len(caught) == 1 and caught[0].filename != _deprecated.__file__
    assert ns["got"] is getattr(formats, name)
    assert name not in moealign.routing_replay.__all__
    with pytest.raises(AttributeError):
        moealign.routing_replay.routes_from_nowhere   # noqa: B018 (only the moved names)


def test_the_record_package_exports_every_former_public_name():
    import moealign.record.layouts as layouts
    import moealign.record.meta as meta
    import moealign.record.rollout as rollout
    import moealign.record.sample as sample
    from moealign import errors

    homes = [layouts, meta, rollout, sample, errors]
    for name in RECORD_NAMES:
        obj = getattr(moealign.record, name)
        assert any(getattr(m, name, None) is obj for m in homes), name


def _import_all(extra: str = "") -> subprocess.CompletedProcess:
    code = f"""
import importlib, pkgutil, sys, moealign
shims = {sorted(MOVED)!r}
for info in pkgutil.walk_packages(moealign.__path__, "moealign."):
    if info.name in shims or "_triton" in info.name or info.name.endswith("__main__"):
        continue
    importlib.import_module(info.name)
import moealign.cli
from moealign.record import {", ".join(RECORD_NAMES)}
{extra}
loaded = [s for s in shims if s in sys.modules]
assert not loaded, loaded
print("CLEAN")
"""
    return subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True,
                          text=True, timeout=600)


def test_nothing_inside_moealign_imports_an_old_path():
    done = _import_all()
    assert done.returncode == 0 and "CLEAN" in done.stdout, done.stderr[-3000:]
    bad = _import_all("import moealign.record_stitch")         # negative control: an old path is caught
    assert bad.returncode != 0 and "moealign.record_stitch moved to moealign.record.stitch" in bad.stderr


def test_the_cli_imports_under_deprecation_errors():
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", "import moealign.cli"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
