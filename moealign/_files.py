"""Files moealign reads and writes: the one input-file guard, the one output guard and the one atomic write
(stdlib only).

* :func:`check_outputs` is what every command runs on its outputs before any work: each output path passes
  :func:`check_output_path`, and none may be (or lie inside) any input of the command: the record, the prompts, the
  EPLB table, *any* file of a checkpoint directory (a path inside the directory, or the same file reached through a
  symlink or a hard link: compared by ``st_dev`` / ``st_ino``), nor another output of the same command.
  :func:`check_output_dir` checks a directory the command will create (``--report DIR``).
* :func:`check_input_file` / :func:`read_input_bytes` / :func:`read_json_file` are how every user file is read: a
  regular file (a FIFO, a device such as ``/dev/zero``, a directory is refused by name, checked with ``os.stat``
  before it is opened, and opened non-blocking so a file swapped for a FIFO cannot block), of bounded size; JSON
  is parsed with bounded nesting and without ``NaN`` / ``Infinity``.
* :func:`check_output_path` refuses, before any work starts, a target that exists and is not a regular file
  (a directory, FIFO or device node: saving onto ``/dev/null`` must not replace it) and a missing or
  unwritable parent directory.
* :func:`atomic_write` writes a temporary file next to the target, named ``.NAME.moealign-tmp-XXXXXXXX`` (a
  killed process leaves a file one can recognise), fsyncs it, renames it over the target and fsyncs the
  directory. On any exception, ``KeyboardInterrupt`` included, the temporary file is removed and the old
  target is left as it was.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from typing import Callable

from .errors import ConfigError, MissingFileError

__all__ = ["TMP_MARKER", "MAX_JSON_BYTES", "MAX_JSON_DEPTH", "atomic_write", "check_output_path", "check_outputs",
           "check_output_dir", "check_input_file", "read_input_bytes", "read_json_file", "parse_json", "json_depth",
           "same_file"]

#: Part of every temporary file name: ``.NAME.moealign-tmp-XXXXXXXX`` next to the target ``NAME``.
TMP_MARKER = ".moealign-tmp-"
#: The most bytes a JSON / YAML input (engine outputs, EPLB table, config.json, prompts) may hold.
MAX_JSON_BYTES = 1 << 30
#: The deepest nesting of lists / objects a JSON input may hold (engine outputs need about 6).
MAX_JSON_DEPTH = 64
#: The most entries of an input directory (a checkpoint) the output guard walks.
_MAX_DIR_ENTRIES = 100_000


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


def same_file(a: str, b: str) -> bool:
    """``a`` and ``b`` are one file (through symlinks and hard links: ``st_dev`` and ``st_ino``), or, when either
    does not exist, the same resolved path."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return os.path.realpath(a) == os.path.realpath(b)


def _inside(path: str, directory: str) -> bool:
    """``path`` (resolved) is ``directory`` (resolved) or lies under it."""
    real, root = os.path.realpath(path), os.path.realpath(directory)
    try:
        return os.path.commonpath([real, root]) == root
    except ValueError:        # different drives
        return False


def _dir_file_ids(directory: str, flag: str, error_cls: type[Exception]) -> set[tuple[int, int]]:
    """``(st_dev, st_ino)`` of every file under ``directory``, symlinks followed to their targets (a hub cache's
    snapshot links to its blobs): a hard link or a link target elsewhere is still a file of the checkpoint."""
    ids: set[tuple[int, int]] = set()
    seen = 0
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            seen += 1
            if seen > _MAX_DIR_ENTRIES:
                raise error_cls(f"{flag} {directory}: more than {_MAX_DIR_ENTRIES} entries; not a checkpoint "
                                f"directory (outputs are checked against every file of it)")
            try:
                st = os.stat(os.path.join(root, name))
            except (OSError, ValueError):
                continue
            ids.add((st.st_dev, st.st_ino))
    return ids


def _pairs(paths) -> list[tuple[str, str]]:
    items = paths.items() if hasattr(paths, "items") else paths
    return [(flag, os.fspath(p)) for flag, p in items if p is not None]


def check_outputs(outputs, inputs, *, created_dirs=(), error_cls: type[Exception] = ConfigError) -> None:
    """The one output guard, run before any work: every ``(flag, path)`` of ``outputs`` (a mapping or pairs;
    ``None`` paths skipped) passes :func:`check_output_path` (or, in one of ``created_dirs`` that does not exist
    yet, :func:`check_output_dir` of that directory), is no input of ``inputs`` (``{flag: path}``, files or
    directories) and no other output.

    An input file is matched by identity (:func:`same_file`: symlinks and hard links); an input directory (a
    checkpoint) covers every path inside it, existing or not, and every file it holds or links to, wherever that
    file is reached from.
    """
    outs = _pairs(outputs)
    created = [os.path.abspath(os.fspath(d)) for d in created_dirs if d is not None]
    for flag, path in outs:
        parent = os.path.dirname(os.path.abspath(path))
        if parent in created and not os.path.lexists(parent):
            check_output_dir(parent, flag, error_cls)
        else:
            check_output_path(path, flag, error_cls)
    for in_flag, source in _pairs(inputs):
        if os.path.isdir(source):
            ids = None
            for flag, path in outs:
                if _inside(path, source):
                    raise error_cls(f"{flag} {path} lies inside {in_flag} {source}, an input directory of this "
                                    f"command (a checkpoint): refusing to write into it")
                if os.path.exists(path):
                    ids = _dir_file_ids(source, in_flag, error_cls) if ids is None else ids
                    st = os.stat(path)
                    if (st.st_dev, st.st_ino) in ids:
                        raise error_cls(f"{flag} {path} is a file of {in_flag} {source}, an input directory of this "
                                        f"command (a checkpoint; reached through a link): refusing to overwrite it")
        else:
            for flag, path in outs:
                if same_file(path, source):
                    raise error_cls(f"{flag} {path} is also the {in_flag} file: refusing to overwrite it")
    for i, (flag, path) in enumerate(outs):
        for other_flag, other in outs[i + 1:]:
            if same_file(path, other):
                raise error_cls(f"{flag} {path} is also the {other_flag} path: one output would replace the other")


def check_output_dir(path: str | os.PathLike, flag: str, error_cls: type[Exception] = ConfigError) -> str:
    """A directory the command will create or write into: an existing directory that is writable, or a path whose
    nearest existing ancestor is a writable directory (``/dev/null/sub`` is refused here, before any work)."""
    path = _fspath(path, flag, error_cls)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise error_cls(f"{flag} {path}: exists and is not a directory")
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise error_cls(f"{flag} {path}: {probe} is not a directory, so the directory cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise error_cls(f"{flag} {path}: the directory {probe} is not writable")
    return path


def check_input_file(path: str | os.PathLike, flag: str, *, max_bytes: int | None = None,
                     error_cls: type[Exception] = ConfigError) -> os.stat_result:
    """The one input-file guard: ``path`` is a regular file (not a FIFO, device, socket or directory) of at most
    ``max_bytes`` bytes, checked with ``os.stat`` before anything opens it. A missing file is a
    :class:`~moealign.errors.MissingFileError`."""
    path = _fspath(path, flag, error_cls)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MissingFileError(f"{flag} {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise error_cls(f"{flag} {path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    _check_regular(st, path, flag, max_bytes, error_cls)
    return st


def _check_regular(st: os.stat_result, path: str, flag: str, max_bytes: int | None,
                   error_cls: type[Exception]) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
        raise error_cls(f"{flag} {path}: is {kind}, not a regular file (refusing to read it)")
    if max_bytes is not None and st.st_size > max_bytes:
        raise error_cls(f"{flag} {path}: holds {st.st_size} bytes, more than the {max_bytes} such a file may hold")


def read_input_bytes(path: str | os.PathLike, flag: str, *, max_bytes: int = MAX_JSON_BYTES,
                     error_cls: type[Exception] = ConfigError) -> bytes:
    """The bytes of a user file, through :func:`check_input_file`; opened non-blocking and checked again on the
    open descriptor, and never more than ``max_bytes`` read."""
    check_input_file(path, flag, max_bytes=max_bytes, error_cls=error_cls)
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise error_cls(f"{flag} {path}: cannot be read ({exc.strerror or exc})") from None
    try:
        _check_regular(os.fstat(fd), path, flag, max_bytes, error_cls)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise error_cls(f"{flag} {path}: cannot be read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise error_cls(f"{flag} {path}: more than the {max_bytes} bytes such a file may hold")
    return data


def _refuse_constant(name: str):
    raise ConfigError(f"{name} is not a JSON number")     # a ValueError: reported by parse_json as the caller's


def json_depth(value) -> int:
    """The nesting depth of lists / dicts in ``value`` (iterative: no recursion limit)."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            depth = max(depth, d)
            stack.extend((x, d + 1) for x in (item.values() if isinstance(item, dict) else item))
    return depth


def parse_json(text: str | bytes, what: str, *, max_depth: int = MAX_JSON_DEPTH,
               error_cls: type[Exception] = ConfigError):
    """``text`` as JSON: no ``NaN`` / ``Infinity``, no number with more digits than Python converts, nesting at
    most ``max_depth``; every failure is ``error_cls`` naming ``what``."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise error_cls(f"{what}: JSON nested too deeply (at most {max_depth} levels)") from None
    except (ValueError, TypeError) as exc:     # UnicodeDecodeError and ConfigError (NaN) are ValueErrors
        raise error_cls(f"{what} is not JSON: {' '.join(str(exc).split())[:200]}") from None
    if json_depth(value) > max_depth:
        raise error_cls(f"{what}: JSON nested too deeply (at most {max_depth} levels)")
    return value


def read_json_file(path: str | os.PathLike, flag: str, *, max_bytes: int = MAX_JSON_BYTES,
                   max_depth: int = MAX_JSON_DEPTH, error_cls: type[Exception] = ConfigError):
    """A user's JSON file through :func:`read_input_bytes` and :func:`parse_json`."""
    data = read_input_bytes(path, flag, max_bytes=max_bytes, error_cls=error_cls)
    return parse_json(data, f"{flag} {os.fspath(path)}", max_depth=max_depth, error_cls=error_cls)


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
        os.chmod(tmp, _final_mode(target))
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _umask() -> int:
    """This process's umask, read without changing it where Linux tells it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)                      # elsewhere: read by setting it, then restored at once
    os.umask(mask)
    return mask


def _final_mode(target: str) -> int:
    """The permission bits an atomic write gives ``target``: those of the file it replaces, else 0666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_umask()


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
