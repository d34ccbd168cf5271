"""moealign.mismatch.workers: shares of work run at once in forked processes, one intra-op thread each."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from moealign.mismatch import workers
from moealign.mismatch.workers import can_fork, fork_map, intra_op_threads

needs_fork = pytest.mark.skipif(not can_fork(), reason="forking is not safe here (not Linux, or CUDA initialised)")


def _where(share):
    """What a share saw: its items, the process it ran in, its intra-op threads."""
    return list(share), os.getpid(), torch.get_num_threads()


@needs_fork
def test_shares_run_in_order_in_this_process_and_forked_children():
    threads = torch.get_num_threads()
    results, failures = fork_map(_where, [[1, 2], [3], [4, 5, 6]])
    assert failures == []
    assert [r[0] for r in results] == [[1, 2], [3], [4, 5, 6]]
    pids = [r[1] for r in results]
    assert pids[0] == os.getpid() and len(set(pids)) == 3          # the first share here, the others forked
    assert [r[2] for r in results] == [1, 1, 1]                    # one intra-op thread each
    assert torch.get_num_threads() == threads                     # this process's count restored


@needs_fork
def test_a_child_changes_only_its_own_copy():
    state = {"n": 0}

    def bump(share):
        state["n"] += len(share)
        return state["n"]

    results, _ = fork_map(bump, [[1], [1, 1, 1]])
    assert results == [1, 3] and state["n"] == 1                   # the child's +3 stayed in the child


@needs_fork
def test_tensors_come_back_bitwise():
    def make(share):
        g = torch.Generator().manual_seed(share[0])
        return torch.randn(64, 33, generator=g, dtype=torch.float32)

    results, _ = fork_map(make, [[0], [1]])
    for seed, got in zip((0, 1), results):
        assert torch.equal(got, torch.randn(64, 33, generator=torch.Generator().manual_seed(seed)))


@needs_fork
def test_a_failing_child_has_its_share_run_here():
    parent = os.getpid()

    def fn(share):
        if os.getpid() != parent:
            raise ValueError("planted")
        return sum(share), os.getpid()

    results, failures = fork_map(fn, [[1], [2, 3]])
    assert results == [(1, parent), (5, parent)]
    assert len(failures) == 1 and "ValueError: planted" in failures[0]

    def slow_exit(share):          # the child answers, then is still exiting when the parent reaps (kills) it
        if os.getpid() != parent:
            real_exit = os._exit
            os._exit = lambda code: (time.sleep(30), real_exit(code))
            raise ValueError("planted, then a slow exit")
        return sum(share)

    start = time.monotonic()
    results, failures = fork_map(slow_exit, [[1], [2, 3]])
    assert results == [1, 5] and time.monotonic() - start < 20
    assert len(failures) == 1 and "ValueError: planted, then a slow exit" in failures[0], failures  # its own error


@needs_fork
def test_a_child_that_dies_without_answering_has_its_share_run_here():
    parent = os.getpid()

    def fn(share):
        if os.getpid() != parent:
            os._exit(3)
        return share

    results, failures = fork_map(fn, [["a"], ["b"]])
    assert results == [["a"], ["b"]] and "could not be read" in failures[0]


@needs_fork
def test_a_child_that_hangs_is_killed_and_its_share_run_here(monkeypatch):
    parent = os.getpid()
    monkeypatch.setattr(workers, "GRACE_S", 1.0)

    def fn(share):
        if os.getpid() != parent:
            time.sleep(600)
        return share

    t0 = time.monotonic()
    results, failures = fork_map(fn, [[1], [2]])
    assert results == [[1], [2]] and "did not answer" in failures[0]
    assert time.monotonic() - t0 < 30


@needs_fork
def test_an_error_here_is_raised_and_the_children_reaped(monkeypatch):
    parent, forked = os.getpid(), []
    real = workers._fork

    def fork(fn, share):
        pid, fd = real(fn, share)
        forked.append(pid)
        return pid, fd

    def fn(share):
        if os.getpid() == parent:
            raise KeyError("here")
        time.sleep(600)

    monkeypatch.setattr(workers, "_fork", fork)
    with pytest.raises(KeyError, match="here"):
        fork_map(fn, [[1], [2], [3]])
    assert len(forked) == 2
    for pid in forked:                                            # killed and reaped: no longer our child
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_without_forking_every_share_runs_here_on_one_thread(monkeypatch):
    monkeypatch.setattr(workers, "can_fork", lambda: False)
    results, failures = fork_map(_where, [[1], [2], []])
    assert failures == [] and [r[1] for r in results] == [os.getpid()] * 3 and {r[2] for r in results} == {1}


def test_intra_op_threads_restores_the_count():
    before = torch.get_num_threads()
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with intra_op_threads(None):
        assert torch.get_num_threads() == before


@needs_fork
@pytest.mark.skipif("libgomp" not in " ".join(os.listdir(os.path.join(os.path.dirname(torch.__file__), "lib"))),
                    reason="torch here is not built with GNU OpenMP (the trap is libgomp's)")
def test_the_trap_a_child_forked_after_an_openmp_team_hangs_with_two_threads():
    """Why every share runs on one intra-op thread: torch's GNU OpenMP cannot start a thread team in a child forked
    after the parent used one. Shown in a fresh interpreter: with two threads the child does not finish one
    parallel op in 5 s (it is killed; a working one takes milliseconds); with one it does."""
    script = textwrap.dedent("""
        import os, sys, time, torch
        torch.set_num_threads(2)
        x = torch.randn(512, 512)
        (x @ x).sum()                                  # the parent's OpenMP team is up
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(int(sys.argv[1]))
            torch.randn(1 << 22).sum(); (x @ x).sum()
            os._exit(0)
        t = time.time()
        while time.time() - t < 5:
            if os.waitpid(pid, os.WNOHANG)[0]:
                print("finished"); break
            time.sleep(0.05)
        else:
            os.kill(pid, 9); os.waitpid(pid, 0); print("hung")
    """)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run = lambda n: subprocess.run([sys.executable, "-c", script, str(n)], capture_output=True, text=True,  # noqa: E731
                                   timeout=120, env=env).stdout.strip()
    assert run(1) == "finished"
    assert run(2) == "hung"
