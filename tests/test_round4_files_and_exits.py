"""Issue 34, items 2 and 6f: a child that dies is named by its signal and its last meaningful line (every kind of
child moealign waits on), and atomic writes keep the mode of the file they replace, else the umask's."""

from __future__ import annotations

import faulthandler
import os
import signal
import stat

import pytest

from moealign import _files
from moealign.exits import child_failure, describe_exit, describe_wait_status, last_meaningful_line
from moealign.mismatch.workers import can_fork, fork_map

# ---------------------------------------------------------------- exit statuses in words


def test_exit_codes_in_words():
    assert describe_exit(-4) == "killed by SIGILL (illegal instruction)"
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV (segmentation fault)"
    assert describe_exit(-9).startswith("killed by SIGKILL")
    assert describe_exit(132) == "exited with code 132 (128 + SIGILL: illegal instruction)"
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(0) == "exited with code 0"


def test_wait_statuses_in_words():
    pid = os.fork()
    if pid == 0:
        faulthandler.disable()
        os.kill(os.getpid(), signal.SIGILL)
        os._exit(0)
    assert describe_wait_status(os.waitpid(pid, 0)[1]) == "killed by SIGILL (illegal instruction)"
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    assert describe_wait_status(os.waitpid(pid, 0)[1]) == "exited with code 3"


def test_the_last_meaningful_line_skips_frames_warnings_and_progress():
    text = ("Loading shards: 100%|##########| 1/1 [00:00<00:00]\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    f()\n    ^^^\n"
            "moealign.errors.EngineError: the engine is gone\n"
            "/x/y.py:3: UserWarning: Apex is not installed\n  warnings.warn(\n\n")
    assert last_meaningful_line(text) == "moealign.errors.EngineError: the engine is gone"
    assert last_meaningful_line("INFO starting\nWARNING something\n\n") == "WARNING something"
    assert last_meaningful_line("") == "" and last_meaningful_line(None) == ""
    assert child_failure("vLLM at TP=2 (tree)", -4, b"boom\n") == \
        "vLLM at TP=2 (tree) killed by SIGILL (illegal instruction): boom"


@pytest.mark.skipif(not can_fork(), reason="this process cannot fork (not Linux, or CUDA initialised)")
def test_a_forked_worker_killed_by_a_signal_is_named_by_it():
    parent = os.getpid()

    def share(n):
        if n == 2 and os.getpid() != parent:               # dies in its child; the parent's re-run succeeds
            faulthandler.disable()                          # (pytest's handler would print a stack first)
            os.kill(os.getpid(), signal.SIGSEGV)
        return n * 10

    results, failures = fork_map(share, [1, 2])
    assert results == [10, 20]                             # the share was run again in the parent
    assert len(failures) == 1 and "killed by SIGSEGV (segmentation fault)" in failures[0], failures


def _rank_dies(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGILL)
    import torch.distributed as dist

    dist.barrier()                                         # rank 0 would wait for rank 1 forever
    return rank


def test_a_gloo_rank_killed_by_a_signal_is_named_and_the_others_stop():
    from moealign.errors import EngineError
    from moealign.tp_check import run_gloo

    with pytest.raises(EngineError, match=r"gloo rank 1 of 2 killed by SIGILL \(illegal instruction\); the other "
                                          r"ranks were stopped"):
        run_gloo(2, _rank_dies, timeout=120)


# ---------------------------------------------------------------- atomic writes keep the file's mode


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_write_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")
    for mode in (0o644, 0o640, 0o600, 0o664):
        os.chmod(path, mode)
        _files.atomic_write(path, lambda tmp: open(tmp, "w").write("new"), flag="--json")
        assert _mode(path) == mode and path.read_text() == "new"


def test_a_new_file_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        _files.atomic_write(tmp_path / "a.json", lambda tmp: open(tmp, "w").write("x"), flag="--json")
        assert _mode(tmp_path / "a.json") == 0o644                   # was 0600 (mkstemp's)
        os.umask(0o077)
        _files.atomic_write(tmp_path / "b.json", lambda tmp: open(tmp, "w").write("x"), flag="--json")
        assert _mode(tmp_path / "b.json") == 0o600
        os.umask(0o002)
        _files.atomic_write(tmp_path / "c.json", lambda tmp: open(tmp, "w").write("x"), flag="--json")
        assert _mode(tmp_path / "c.json") == 0o664
    finally:
        os.umask(old)
