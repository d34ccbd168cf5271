"""What every command does with its result: the ``--json`` path checked before any work, the table printed, the JSON
report written atomically, each warning and failure named on stderr, and the exit code (3 on a failure). One place
for ``moealign mismatch``, ``rl-check``, ``tp-check`` and ``record inspect`` (:mod:`moealign.cli`,
:mod:`moealign.rl.cli`)."""

from __future__ import annotations

import json
import sys

__all__ = ["check_json_path", "write_json_report", "finish_command"]


def check_json_path(json_path: str | None, inputs: dict[str, str | None] | None = None, outputs=(),
                     created_dirs=()) -> None:
    """``--json`` is checked before any work starts (:func:`moealign._files.check_outputs`, the one output guard):
    a regular file (or none) in a writable directory, neither an input of the command (the record, the prompts,
    any file of the checkpoint) nor one of its other ``outputs``."""
    if json_path is None:
        return
    from ._files import check_outputs

    check_outputs([("--json", json_path), *outputs], inputs or {}, created_dirs=created_dirs)


def write_json_report(path: str, report: dict) -> None:
    """The JSON report, written atomically (:func:`moealign._files.atomic_write`)."""
    from ._files import atomic_write

    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")

    atomic_write(path, write, flag="--json")


def finish_command(command: str, table: str, report: dict, json_path: str | None, failures: list[str],
            warned: list[str] = ()) -> int:
    """Print the table, write the JSON report if asked (atomically), name each warning (``moealign COMMAND:
    WARNING ...``, even with ``-q``) and each failure on stderr; exit 3 on failure."""
    print(table)
    if json_path:
        write_json_report(json_path, report)
    for line in warned:
        print(f"moealign {command}: WARNING {line}", file=sys.stderr)
    for line in failures:
        print(f"moealign {command}: FAIL {line}", file=sys.stderr)
    return 3 if failures else 0
