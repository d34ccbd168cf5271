"""How a child process ended, in words: the one place moealign turns an exit status into a sentence.

Every child moealign starts or waits on (vLLM engines and their workers, Megatron / gloo ranks, the diagnosis'
forked decode workers, the GPU check's steps) is described the same way when it fails::

    >>> describe_exit(-4)
    'killed by SIGILL (illegal instruction)'
    >>> describe_exit(132)            # a shell's 128 + N
    'exited with code 132 (128 + SIGILL: illegal instruction)'
    >>> describe_exit(1)
    'exited with code 1'

:func:`last_meaningful_line` picks, from a child's captured output, the line a user needs (the exception's
message, not the traceback's frames, progress bars or library warnings); :func:`child_failure` puts both in one
line. Engine-free and pure (``signal`` and ``os`` only).
"""

from __future__ import annotations

import os
import re
import signal

__all__ = ["describe_exit", "describe_wait_status", "last_meaningful_line", "child_failure"]

#: Lines a child prints that never explain its end: traceback frames and markers, progress, warnings of libraries.
_NOISE = re.compile(r"^(\s*$|\s*File \"|\s+\^+\s*$|\s*~+\^*~*\s*$|Traceback \(most recent call last\)|"
                    r"During handling of the above exception|The above exception was the direct cause|"
                    r".*\b(UserWarning|FutureWarning|DeprecationWarning|RuntimeWarning)\b|\s*warnings\.warn\(|"
                    r".*\d+%\|.*\|)")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")


def _signal_words(number: int) -> str:
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
    text = signal.strsignal(number) or ""
    text = re.sub(r":\s*\d+$", "", text).strip()
    return f"{name} ({text[:1].lower() + text[1:]})" if text else name


def describe_exit(code: int | None) -> str:
    """An exit code as :mod:`subprocess` / :mod:`multiprocessing` report it (negative: killed by that signal), in
    words. ``None``: still running."""
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {_signal_words(-code)}"
    if 128 < code < 128 + 65:
        words = _signal_words(code - 128)
        name, _, text = words.partition(" (")
        return f"exited with code {code} (128 + {name}{': ' + text.rstrip(')') if text else ''})"
    return f"exited with code {code}"


def describe_wait_status(status: int) -> str:
    """A raw :func:`os.waitpid` status in words."""
    if os.WIFSIGNALED(status):
        return describe_exit(-os.WTERMSIG(status))
    if os.WIFEXITED(status):
        return describe_exit(os.WEXITSTATUS(status))
    return f"stopped (wait status {status})"


def last_meaningful_line(text: str | bytes | None, *, limit: int = 300) -> str:
    """The line of a child's output that says why it ended: the last exception line if there is one, else the last
    line that is not a traceback frame, a progress bar or a library warning (``""`` when none)."""
    if not text:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    lines = [line.rstrip() for line in text.splitlines()]
    exceptions = [line for line in lines if _EXCEPTION.match(line.strip())]
    if exceptions:
        return exceptions[-1].strip()[:limit]
    for line in reversed(lines):
        if not _NOISE.match(line):
            return line.strip()[:limit]
    return ""


def child_failure(what: str, code: int | None, output: str | bytes | None = None) -> str:
    """``"<what> killed by SIGILL (illegal instruction): <last meaningful line>"`` (one line)."""
    line = last_meaningful_line(output)
    return f"{what} {describe_exit(code)}" + (f": {line}" if line else "")
