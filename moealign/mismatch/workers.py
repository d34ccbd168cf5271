"""Run shares of CPU work at once in processes forked from this one (pure Python and torch; no engine).

:func:`fork_map` runs ``fn(share)`` for every share: the first in this process, each other one in a child forked
from it, each with one intra-op thread, and returns what they return. It is for work that is mostly small
kernels with the interpreter between them (a KV-cache decode of a small model on a CPU): two threads of one
process take turns on the interpreter lock, two processes do not.

Why forked children, and why one thread each:

* a child starts in microseconds with this process's state (the models loaded, the record, the patches) and its
  own copy of it, so what it changes (a precision policy applied to a model) stays in it;
* torch's OpenMP (GNU libgomp) cannot start a team of threads in a child forked after the parent used one: such a
  child hangs in its first parallel region. With one intra-op thread it never starts a team
  (``tests/test_workers.py`` shows the hang with two, in a child it kills);
* a child leaves with ``os._exit``: no atexit handler, no flush of buffers it inherited, nothing of the parent's
  run twice.

A child that raises, dies, or does not answer within :data:`GRACE_S` seconds plus four times the parent's own
share's time is killed and its share run here (so an error is raised from here, with its traceback); the caller
gets a one-line description per such child. Where forking is not safe (not Linux, CUDA initialised) or there is
one share, every share runs here, one after another.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import signal
import sys
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch

from ..exits import describe_wait_status

__all__ = ["GRACE_S", "can_fork", "fork_map", "intra_op_threads"]

#: Seconds a child may take beyond four times the parent's share before it is killed and its share run here.
GRACE_S = 120.0


def can_fork() -> bool:
    """Whether :func:`fork_map` forks here: Linux, and CUDA not initialised in this process (a forked child cannot
    use it)."""
    return sys.platform.startswith("linux") and not torch.cuda.is_initialized()


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op thread count ``n`` while inside (None: unchanged); the previous count restored on exit."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fork_map(fn: Callable[[Any], Any], shares: Sequence[Any]) -> tuple[list[Any], list[str]]:
    """``([fn(share) for share in shares], failures)``, every share on one intra-op thread, at once where this
    process can fork (see the module's docstring), else one after another here: ``failures`` describes each child
    whose share had to be run here instead. ``fn``'s results are pickled in the child; an empty share is not
    forked for."""
    shares = list(shares)
    results: list[Any] = [None] * len(shares)
    if len(shares) < 2 or not can_fork():
        with intra_op_threads(1):
            return [fn(s) for s in shares], []
    children: dict[int, tuple[int, int]] = {}           # share index -> (pid, read end of its pipe), until reaped
    failures: list[str] = []
    try:
        for i in range(1, len(shares)):
            if shares[i]:
                children[i] = _fork(fn, shares[i])
        t0 = time.perf_counter()
        with intra_op_threads(1):                       # this process's share, on one thread as the children's
            results[0] = fn(shares[0])
        allowance = GRACE_S + 4 * (time.perf_counter() - t0)
        answers = _collect({i: fd for i, (_, fd) in children.items()}, time.monotonic() + allowance)
        late = []
        for i in list(children):
            status, value = answers.get(i, ("timeout", None))
            pid, ended = _reap(children, i)
            if status == "ok":
                results[i] = value
            else:
                if status == "timeout":
                    failures.append(f"(pid {pid}) did not answer within {allowance:.0f} s")
                elif status == "unreadable" and os.WIFSIGNALED(ended):   # it died on its own mid-answer
                    failures.append(f"(pid {pid}) {describe_wait_status(ended)}")
                else:       # its own error, read whole (it may still have been exiting when _reap killed it)
                    failures.append(f"(pid {pid}) failed: {value}")
                late.append(i)
        with intra_op_threads(1):
            for i in late:
                results[i] = fn(shares[i])
            for i in range(1, len(shares)):
                if not shares[i]:
                    results[i] = fn(shares[i])
    finally:
        for i in list(children):
            _reap(children, i)
    return results, failures


def _fork(fn: Callable[[Any], Any], share: Any) -> tuple[int, int]:
    r, w = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a process with threads may deadlock the child: the child here runs only
        # torch CPU kernels on one thread and this module's code, and is killed if it does not answer
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*fork.*")
        pid = os.fork()
    if pid == 0:                                        # the child: never returns
        code = 1
        try:
            os.close(r)
            torch.set_num_threads(1)
            try:
                payload = pickle.dumps(("ok", fn(share)), protocol=pickle.HIGHEST_PROTOCOL)
                code = 0
            except BaseException as e:                  # noqa: BLE001 - reported to the parent, which runs the share
                payload = pickle.dumps(("error", f"{type(e).__name__}: {e}"))
            with os.fdopen(w, "wb") as out:
                out.write(payload)
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _collect(fds: dict[int, int], deadline: float) -> dict[int, tuple[str, Any]]:
    """Read every child's pickled answer until EOF or ``deadline``."""
    chunks: dict[int, list[bytes]] = {i: [] for i in fds}
    out: dict[int, tuple[str, Any]] = {}
    with selectors.DefaultSelector() as sel:
        for i, fd in fds.items():
            sel.register(fd, selectors.EVENT_READ, i)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                data = os.read(key.fd, 1 << 20)
                if data:
                    chunks[key.data].append(data)
                    continue
                sel.unregister(key.fd)
                try:                                    # our own child's pickle (a trusted source)
                    out[key.data] = pickle.loads(b"".join(chunks[key.data]))
                except Exception as e:                  # noqa: BLE001 - a child that died mid-write
                    out[key.data] = ("unreadable", f"its answer could not be read ({type(e).__name__}: {e})")
    return out


def _reap(children: dict[int, tuple[int, int]], i: int) -> tuple[int, int]:
    """Kill child ``i`` if it still runs, reap it (once: a reaped pid may be reused) and close its pipe; its pid and
    wait status (a child that already ended keeps its own: a zombie ignores the kill)."""
    pid, fd = children.pop(i)
    try:
        os.kill(pid, signal.SIGKILL)                    # an exited child is a zombie until reaped: still its pid
    except ProcessLookupError:
        pass
    status = 0
    try:
        status = os.waitpid(pid, 0)[1]
    except ChildProcessError:
        pass
    os.close(fd)
    return pid, status
