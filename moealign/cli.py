"""The ``moealign`` command."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__


def _cmd_info(args: argparse.Namespace) -> int:
    from .info import collect_info, format_info

    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moealign",
        description="Make MoE RL runs on-policy: routing replay, sampling-mask replay, precision alignment, "
        "invariant reductions and rollout correction.",
    )
    parser.add_argument("--version", action="version", version=f"moealign {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_info = sub.add_parser("info", help="torch, engines (versions or why not importable), GPUs via NVML")
    p_info.add_argument("--json", action="store_true", help="print the report as JSON")
    p_info.set_defaults(func=_cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
