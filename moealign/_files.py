"""Output files: the one check of an output path and the one atomic write (stdlib only).

* :func:`check_output_path` refuses, before any work starts, a target that exists and is not a regular file
  (a directory, FIFO or device node: saving onto ``/dev/null`` must not replace it) and a missing or
  unwritable parent directory.
* :func:`atomic_write` writes a temporary file next to the target, named ``.NAME.moealign-tmp-XXXXXXXX`` (a
  killed process leaves a file one can recognise), fsyncs it, renames it over the target and fsyncs the
  directory. On any exception, ``KeyboardInterrupt`` included, the temporary file is removed and the old
  target is left as it was.
"""

from __future__ import annotations

import os
import stat
import tempfile
from typing import Callable

from .errors import ConfigError

__all__ = ["TMP_MARKER", "atomic_write", "check_output_path"]

#: Part of every temporary file name: ``.NAME.moealign-tmp-XXXXXXXX`` next to the target ``NAME``.
TMP_MARKER = ".moealign-tmp-"


def check_output_path(path: str | os.PathLike, flag: str, error_cls: type[Exception] = ConfigError) -> None:
    """Refuse an output path before any work starts: a directory, a special file (FIFO, device), or a
    missing or unwritable parent directory. ``flag`` names the path in the message (``--json``, ``path``)."""
    path = _fspath(path, flag, error_cls)
    try:
        st = os.stat(path)            # follows symlinks: a link to a regular file is written through
    except FileNotFoundError:
        st = None
    except (OSError, ValueError) as exc:   # ValueError: an embedded NUL byte
        raise error_cls(f"{flag} {path!r}: cannot be inspected ({getattr(exc, 'strerror', None) or exc})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise error_cls(f"{flag} {path}: exists and is not a regular file (refusing to replace it)")
    parent = os.path.dirname(os.path.realpath(path)) or "."
    if not os.path.isdir(parent):
        raise error_cls(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise error_cls(f"{flag} {path}: the directory {parent} is not writable")


def atomic_write(path: str | os.PathLike, writer: Callable[[str], None], *, flag: str = "output",
                 error_cls: type[Exception] = ConfigError) -> None:
    """``writer(tmp)`` writes the whole file at ``tmp``; then ``tmp`` is fsynced and renamed over ``path``.

    ``path`` is checked first (:func:`check_output_path`); a symlink is written through (the link stays). The
    temporary file is removed on any exception, ``KeyboardInterrupt`` included; the old ``path`` is untouched.
    """
    check_output_path(path, flag, error_cls)
    target = os.path.realpath(_fspath(path, flag, error_cls))
    directory, name = os.path.split(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}{TMP_MARKER}", dir=directory)
    try:
        os.close(fd)
        writer(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _fspath(path, flag: str, error_cls: type[Exception]) -> str:
    """``path`` as a non-empty ``str`` (a ``str`` or ``os.PathLike`` of one), else ``error_cls`` naming it."""
    try:
        text = os.fspath(path)
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        raise error_cls(f"{flag} must be a non-empty path (str or os.PathLike), got {path!r}")
    return text


def _fsync_directory(directory: str) -> None:
    """Make the rename durable where the platform allows it (best effort: not every filesystem / OS can)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
