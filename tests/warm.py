"""Warm Python children for the tests: ``run(cmd, ...)`` is ``subprocess.run`` for ``[sys.executable, ...]``
commands, but the child is forked from a server process that has already imported torch, transformers,
Megatron-core and vLLM (about 8 s of CPU per child on the CI machines, and the suite starts ~30 such children).

The child is still its own process (its own engine, its own class-level patches, its own exit), started
with the command's arguments, environment and working directory, and it runs the script / module / ``-c`` code
exactly as ``python`` would (``runpy``, ``__main__``, ``sys.argv``, ``sys.path[0]``, atexit handlers, exit status,
captured stdout / stderr). Only the import of those libraries is shared, done once before the fork, and the child leaves with ``os._exit``
after the interpreter's exit steps (non-daemon threads joined, atexit handlers run, streams flushed) but without
tearing the preloaded modules down.

Falls back to a plain ``subprocess.run`` (a cold interpreter) whenever the warm child could differ:

* the command is not ``[sys.executable, SCRIPT | -m MODULE | -c CODE, ...]`` (interpreter flags such as ``-W``);
* the environment differs from the server's in anything but ``MOEALIGN_*`` (the server does not import moealign),
  ``NVTE_*`` (Megatron-core reads them when it builds a model), the ``VLLM_*`` variables that the server's imports
  did not read (recorded while it imported: vLLM reads the others when an engine starts, in the child) and the
  variables the imports set, with their values (so ``OMP_NUM_THREADS``, ``PYTHONPATH``, ``LD_PRELOAD``,
  ``TRITON_INTERPRET``, ``VLLM_LOGGING_LEVEL`` must match: they are read at start or at import), and a new server for
  that environment cannot be started (``MAX_STARTS``);
* ``OMP_NUM_THREADS`` is not 1 (the test command's xdist workers set it);
* output is not captured, or stdin is given;
* the server has threads other than its main one (a fork would copy a half-held lock), or cannot start;
* ``MOEALIGN_TEST_WARM=0``.

``MOEALIGN_TEST_WARM_LOG=PATH`` appends a line per child that ran cold (developers).

One server per test process (per xdist worker) at a time, started on first use with the children's environment
(less the variables read lazily), started anew when the children's environment changes (at most ``MAX_STARTS``
times), stopped at exit; one request at a time.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile

PRELOAD = ("torch", "transformers", "transformers.models.qwen3_moe.modeling_qwen3_moe", "safetensors.torch",
           "megatron.core", "megatron.core.models.gpt", "vllm", "vllm.entrypoints.llm")


def _base_env(env: dict[str, str]) -> dict[str, str]:
    """The variables that must match the server's but for vLLM's (:meth:`_Server._key`): all but moealign's own
    (moealign is not preloaded), Transformer Engine's attention flags (Megatron-core sets and checks them when it
    builds a model, not at import) and pytest's name of the running test (set in the child all the same)."""
    return {k: v for k, v in env.items()
            if not (k.startswith(("MOEALIGN_", "NVTE_")) or k == "PYTEST_CURRENT_TEST")}


class _Server:
    def __init__(self, env: dict[str, str]):
        self.dir = tempfile.mkdtemp(prefix="moealign-warm-")
        self.sock = os.path.join(self.dir, "s")
        self.env = _base_env(env)               # started with the children's environment, less what they set each
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", self.sock],
                                     env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, cwd=self.dir)
        # after the imports the server prints READY {what they set and read}, or why not
        answered, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT)
        line = self.proc.stdout.readline().strip() if answered else f"no answer within {START_TIMEOUT} s"
        self.ok = line.startswith("READY ")
        self.why = line
        facts = json.loads(line[len("READY "):]) if self.ok else {"added": {}, "read": []}
        #: variables the imports set (vLLM sets TORCHINDUCTOR_CACHE_DIR, ...): a request may hold them, these values
        self.added = facts["added"]
        #: the vLLM variables the imports read (its logging's): these must match; vLLM reads the others when an
        #: engine starts, in the child
        self.vllm_read = frozenset(k for k in facts["read"] if k.startswith("VLLM_"))
        self.own_key = self._key(self.env)
        if not self.ok:
            self.close()

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def compatible(self, env: dict[str, str]) -> bool:
        if not self.ok or self.proc.poll() is not None:
            return False
        return self._key(env) == self.own_key

    def _key(self, env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in _base_env(env).items() if not (k in self.added and v == self.added[k])
                and not (k.startswith("VLLM_") and k not in self.vllm_read)}


_SERVER: _Server | None = None
_STARTS = 0
#: servers started per test process at most: an in-process vLLM engine sets variables its children then inherit
#: (LD_PRELOAD, TORCHINDUCTOR_CPP_DYNAMIC_THREADS, ...), after which a server started with them serves the rest
MAX_STARTS = 4
START_TIMEOUT = 180                 # seconds for a server's imports; past it, the children run cold
_COLD_RUN = subprocess.run          # the fallback, also while a test has monkeypatched subprocess.run to run()


def _server(env: dict[str, str]) -> _Server | None:
    """The server whose children would be this environment's cold children: the running one, or a new one."""
    global _SERVER, _STARTS
    if os.environ.get("MOEALIGN_TEST_WARM", "1") == "0" or env.get("OMP_NUM_THREADS") != "1":
        return None     # one OpenMP thread (the test command's xdist workers): no thread pool a fork could break
    if _SERVER is not None and _SERVER.compatible(env):
        return _SERVER
    if _STARTS >= MAX_STARTS:
        return None
    if _SERVER is not None:
        if os.environ.get("MOEALIGN_TEST_WARM_LOG"):
            mine, theirs = _SERVER._key(env), _SERVER.own_key
            with open(os.environ["MOEALIGN_TEST_WARM_LOG"], "a") as f:
                f.write(f"new server: {sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))}\n")
        _SERVER.close()
    _STARTS += 1
    _SERVER = _Server(env)
    atexit.register(_SERVER.close)
    return _SERVER if _SERVER.ok else None


def _how(cmd) -> tuple[str, str, list[str]] | None:
    """``(kind, target, argv)`` for ``[sys.executable, SCRIPT | -m MOD | -c CODE, args...]``, else None."""
    cmd = [str(c) for c in cmd]
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    if cmd[1] in ("-m", "-c"):
        if len(cmd) < 3:
            return None
        return ("module" if cmd[1] == "-m" else "code"), cmd[2], cmd[3:]
    if cmd[1].startswith("-"):
        return None
    return "script", cmd[1], cmd[2:]


def run(cmd, *, capture_output: bool = False, text: bool = False, timeout: float | None = None,
        env: dict[str, str] | None = None, cwd=None, check: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, ...)``, through a warm child when it would be the same run (module docstring)."""
    def cold():
        return _COLD_RUN(cmd, capture_output=capture_output, text=text, timeout=timeout, env=env, cwd=cwd,
                         check=check, **kwargs)

    how = _how(cmd)
    child_env = dict(os.environ if env is None else env)
    server = _server(child_env) if how is not None and capture_output and not kwargs else None
    if server is None:
        if how is not None and capture_output and os.environ.get("MOEALIGN_TEST_WARM_LOG"):
            with open(os.environ["MOEALIGN_TEST_WARM_LOG"], "a") as f:    # why a child ran cold (developers)
                f.write(f"cold: {' '.join(map(str, cmd[:3]))}\n")
        return cold()
    kind, target, argv = how
    with tempfile.TemporaryDirectory(prefix="moealign-warm-run-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        request = {"kind": kind, "target": target, "argv": argv, "env": child_env, "added": sorted(server.added),
                   "cwd": os.path.abspath(str(cwd)) if cwd is not None else os.getcwd(), "out": out, "err": err}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(server.sock)
            conn.sendall(json.dumps(request).encode() + b"\n")
            reader = conn.makefile("r")
            first = reader.readline()
        except OSError:
            first = ""
        if not first.strip():                   # the server is gone before forking: this command runs cold
            conn.close()
            server.close()
            return cold()
        pid = int(first)
        conn.settimeout(timeout)
        try:
            line = reader.readline()
        except TimeoutError:
            try:
                os.killpg(pid, 9)               # the child and its own children (its process group)
            except ProcessLookupError:
                pass
            conn.close()
            raise subprocess.TimeoutExpired(cmd, timeout, output=_read(out, text), stderr=_read(err, text)) from None
        conn.close()
        if not line.strip():
            raise RuntimeError(f"the warm-child server died while running {cmd[:3]} (tests/warm.py; "
                               "MOEALIGN_TEST_WARM=0 runs the children cold)")
        returncode = int(line)
        proc = subprocess.CompletedProcess(cmd, returncode, _read(out, text), _read(err, text))
    if check:
        proc.check_returncode()
    return proc


def _read(path: str, text: bool):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        data = b""
    return data.decode(errors="replace") if text else data


# ----------------------------------------------------------------------------------------------------------------
# the server (``python tests/warm.py --serve SOCKET``): imports, then forks one child per request
# ----------------------------------------------------------------------------------------------------------------

def _serve(sock_path: str) -> None:
    import importlib
    import threading

    before = dict(os.environ)
    read: set[str] = set()                      # the variables the imports read (through os.environ)
    original = os._Environ.__getitem__

    def recording(self, key):
        read.add(key)
        return original(self, key)

    os._Environ.__getitem__ = recording
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:         # not installed here (vLLM on a GPU machine): its children import it
                continue
            except Exception as e:      # noqa: BLE001 - a library that fails to import: the tests run cold
                print(f"cannot import {name}: {type(e).__name__}", flush=True)
                return
    finally:
        os._Environ.__getitem__ = original
    import torch

    if torch.cuda.is_initialized():             # a forked child could not use CUDA
        print("CUDA was initialised by the imports: forking is unsafe", flush=True)
        return
    if threading.active_count() != 1:
        print(f"{threading.active_count()} threads after the imports: forking is unsafe", flush=True)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(1)
    listener.settimeout(5.0)
    parent = os.getppid()
    added = {k: v for k, v in os.environ.items() if before.get(k) != v}
    print("READY " + json.dumps({"added": added, "read": sorted(k for k in read if isinstance(k, str))}), flush=True)
    while True:
        try:
            conn, _ = listener.accept()
        except (socket.timeout, TimeoutError):
            if os.getppid() != parent:          # the test process is gone
                return
            continue
        conn.settimeout(None)
        request = json.loads(conn.makefile("r").readline())
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            _child(request)                     # never returns (os._exit)
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        try:
            conn.sendall(f"{code}\n".encode())
        except OSError:                         # the client gave up (a timeout): it killed the child
            pass
        conn.close()


def _child(request: dict) -> None:
    import runpy

    os.setsid()                                 # its own process group: a timeout kills it with its workers
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        f = os.open(path, flags, 0o644)
        os.dup2(f, fd)
        os.close(f)
    added = {k: v for k, v in os.environ.items() if k not in request["env"] and k in request["added"]}
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(added)                    # what the preloaded imports set, as they would in a cold child
    os.chdir(request["cwd"])
    kind, target = request["kind"], request["target"]
    if kind == "script":
        sys.argv = [target, *request["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runner = lambda: runpy.run_path(target, run_name="__main__")       # noqa: E731
    elif kind == "module":
        sys.argv = [target, *request["argv"]]   # runpy replaces argv[0] with the module's file
        sys.path[0] = os.getcwd()
        runner = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)     # noqa: E731
    else:
        import types

        sys.argv = ["-c", *request["argv"]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")     # as ``python -c``: a __main__ with no file
        sys.modules["__main__"] = main
        runner = lambda: exec(compile(target, "<string>", "exec"), main.__dict__)   # noqa: E731
    import atexit as _atexit
    import threading

    try:
        runner()
        code = 0
    except SystemExit as e:                     # as the interpreter maps it
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:                       # noqa: BLE001 - uncaught: the traceback on stderr, status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    # the interpreter's exit, in its order: join the non-daemon threads, run the atexit handlers (vLLM's engine
    # shutdown, multiprocessing's joins, weakref finalizers), flush; then leave without tearing down the modules
    # the server imported (1.5 s of finalisation that a cold child importing them pays as well, but no test reads)
    threading._shutdown()
    _atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:                       # noqa: BLE001 - a closed stream: nothing left to flush
            pass
    os._exit(code & 0xFF if code >= 0 else 256 + code if code > -256 else 1)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        _serve(sys.argv[2])
