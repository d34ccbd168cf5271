"""AMX tiles (issue 34): on a CPU with AMX, a vLLM process whose GEMMs moealign replaced (the tree forward, the
canonical ops with stock attention) died by SIGILL in vLLM's own AMX attention kernel, because Linux grants AMX
tiles only to a process that asked (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) and only oneDNN's GEMMs used to ask.
moealign now asks in every vLLM process it patches (``open_llm``, the plugin in every worker, each ``apply_*``).

The engine tests run only on a CPU with AMX (they say so and skip elsewhere); the request itself and where it is
made are checked on every CPU, and nothing here decides anything from the CPU the tests ran on: the request is made
at run time wherever the code runs."""

from __future__ import annotations

import pathlib
import sys

import pytest

import warm
from moealign.exits import describe_exit
from moealign.handle import PatchHandle
from moealign.precision.capability import amx_tiles_permitted, request_amx_tiles
from vllm_util import child_env

HERE = pathlib.Path(__file__).parent


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


HAS_AMX = "amx_tile" in _cpu_flags()


def test_request_grants_tiles_exactly_where_the_cpu_has_them():
    granted = request_amx_tiles()
    assert granted is amx_tiles_permitted()
    assert granted is (HAS_AMX and sys.platform == "linux")
    assert request_amx_tiles() is granted                  # idempotent


def test_the_plugin_asks_for_tiles_in_every_process_it_patches(monkeypatch):
    from moealign.patches.vllm import plugin, tree_reduce

    asked = []
    monkeypatch.setattr(plugin, "request_amx_tiles", lambda: asked.append(True) or False)
    monkeypatch.setattr(tree_reduce, "apply_tree_reductions", lambda **kw: PatchHandle("fake tree", "process"))
    monkeypatch.setenv(plugin.ENV, "")
    plugin.load()
    assert asked == []                                      # inert when nothing is patched
    monkeypatch.setenv(plugin.ENV, "tree")
    try:
        plugin.load()
        assert asked == [True]
    finally:
        plugin.unload("tree")


def _run(mode: str, patches: str):
    env = child_env({"MOEALIGN_VLLM_PATCHES": patches})
    return warm.run([sys.executable, str(HERE / "vllm_amx_child.py"), mode], capture_output=True, text=True,
                    timeout=600, env=env)


@pytest.mark.heavy
@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX (no amx_tile in /proc/cpuinfo): the SIGILL it guards "
                                        "against cannot happen here")
@pytest.mark.parametrize("patches", ["tree", "canonical:skip=attention"])
def test_patched_vllm_runs_on_an_amx_cpu(patches):
    proc = _run("fixed", patches)
    assert proc.returncode == 0 and "RESULT " in proc.stdout, describe_exit(proc.returncode) + proc.stderr[-2000:]


@pytest.mark.heavy
@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX (no amx_tile in /proc/cpuinfo): the SIGILL it guards "
                                        "against cannot happen here")
def test_negative_control_without_the_request_dies_by_sigill():
    proc = _run("unfixed", "tree")
    assert proc.returncode in (-4, 132), (describe_exit(proc.returncode), proc.stderr[-2000:])
