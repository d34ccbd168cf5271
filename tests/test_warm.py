"""tests/warm.py, the warm-child launcher the engine tests use: a warm child behaves as ``subprocess.run`` of the same
command would (output, exit status, argv, working directory, environment, ``__main__``, atexit, timeouts), and the
launcher falls back to a cold interpreter whenever a warm child could differ."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import warm

needs_warm = pytest.mark.skipif(os.environ.get("OMP_NUM_THREADS") != "1" or os.environ.get("MOEALIGN_TEST_WARM") == "0",
                                reason="warm children only under OMP_NUM_THREADS=1 (the test command's xdist workers)")

PROBE = ("import atexit, os, sys, __main__; "
         "atexit.register(lambda: print('atexit ran', flush=True)); "
         "print(sys.argv, os.getcwd(), os.environ.get('MOEALIGN_PROBE'), hasattr(__main__, '__file__'), "
         "os.getpid() != int(sys.argv[1])); print('torch', 'torch' in sys.modules); "
         "sys.stderr.write('to stderr'); sys.exit(int(sys.argv[2]))")


def _both(cmd, **kw):
    return warm.run(cmd, **kw), subprocess.run(cmd, **kw)


@needs_warm
def test_a_warm_child_is_the_cold_child_but_for_preloaded_modules(tmp_path, monkeypatch):
    monkeypatch.setattr(warm, "_STARTS", 0)         # earlier files in this worker may have used up the starts
    env = dict(os.environ, MOEALIGN_PROBE="x")
    w, c = _both([sys.executable, "-c", PROBE, str(os.getpid()), "7"], capture_output=True, text=True, cwd=tmp_path,
                 env=env, timeout=120)
    assert w.returncode == c.returncode == 7
    assert w.stderr == c.stderr == "to stderr"
    # same argv, cwd, environment, a file-less __main__, a new process, atexit handlers run; torch: preloaded warm only
    assert w.stdout.replace("torch True", "torch False") == c.stdout, (w.stdout, c.stdout)
    assert "atexit ran" in w.stdout and "torch True" in w.stdout and "False True\n" in w.stdout
    assert warm._SERVER is not None and warm._SERVER.ok


@needs_warm
def test_scripts_modules_exceptions_and_timeouts(tmp_path, monkeypatch):
    monkeypatch.setattr(warm, "_STARTS", 0)
    script = tmp_path / "s.py"
    script.write_text("import sys, os\nprint(__name__, sys.argv[1:], sys.path[0] == os.path.dirname(__file__))\n"
                      "raise ValueError('boom')\n")
    w, c = _both([sys.executable, str(script), "a", "b"], capture_output=True, text=True, timeout=120)
    assert w.returncode == c.returncode == 1
    assert w.stdout == c.stdout == "__main__ ['a', 'b'] True\n"
    assert w.stderr.strip().endswith("ValueError: boom") and c.stderr.strip().endswith("ValueError: boom")
    w, c = _both([sys.executable, "-m", "moealign", "--version"], capture_output=True, text=True, timeout=120)
    assert w.returncode == c.returncode == 0 and w.stdout == c.stdout
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([sys.executable, "-c", "import time; time.sleep(60)"], capture_output=True, timeout=1)
    after = warm.run([sys.executable, "-c", "print('next')"], capture_output=True, text=True, timeout=60)
    assert after.stdout == "next\n"                 # the server serves the next request after a timeout


def test_falls_back_to_a_cold_interpreter_where_a_warm_child_could_differ(monkeypatch):
    calls = []
    real = warm._COLD_RUN

    def cold(cmd, **kw):
        calls.append(cmd)
        return real(cmd, **kw)

    monkeypatch.setattr(warm, "_COLD_RUN", cold)
    code = "import sys; print('torch' in sys.modules)"
    # an interpreter flag; output not captured; an environment no server may be started for
    p = warm.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout == "False\n"
    warm.run([sys.executable, "-c", "pass"], timeout=60)
    monkeypatch.setattr(warm, "_STARTS", warm.MAX_STARTS)
    p = warm.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                 env=dict(os.environ, PYTHONHASHSEED="123"))
    assert p.stdout == "False\n"
    assert len(calls) == 3


@needs_warm
def test_the_lazily_read_variables_keep_the_server_and_others_start_a_new_one(monkeypatch):
    monkeypatch.setattr(warm, "_STARTS", 0)
    code = "import sys; print('torch' in sys.modules, hash('moealign'))"
    # a server started without vLLM's variables (an earlier test in this process may have set some: open_llm in the
    # test process sets VLLM_CPU_KVCACHE_SPACE)
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    first = warm.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=base)
    server = warm._SERVER
    lazy = warm.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                    env=dict(base, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0",
                             MOEALIGN_VLLM_PATCHES="tree"))
    assert warm._SERVER is server and lazy.stdout.startswith("True") and first.stdout.startswith("True")
    assert "VLLM_CPU_KVCACHE_SPACE" not in server.vllm_read
    if importlib.util.find_spec("vllm") is not None:             # preloaded: its logging read its variables
        assert "VLLM_LOGGING_LEVEL" in server.vllm_read
    # PYTHONHASHSEED is read when the interpreter starts: a child of the running server would hash differently
    env = dict(base, PYTHONHASHSEED="123")
    w, c = _both([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert warm._SERVER is not server and w.stdout.startswith("True")
    assert w.stdout.split()[1] == c.stdout.split()[1]


@needs_warm
def test_a_dead_server_means_a_cold_child_not_a_failure(monkeypatch):
    monkeypatch.setattr(warm, "_STARTS", 0)
    warm.run([sys.executable, "-c", "pass"], capture_output=True, timeout=60)
    server = warm._SERVER
    os.kill(server.proc.pid, 9)
    server.proc.wait()
    monkeypatch.setattr(warm, "_STARTS", warm.MAX_STARTS)            # no new server: the child must run cold
    p = warm.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True, text=True,
                 timeout=60)
    assert p.returncode == 0 and p.stdout == "False\n"
