"""Command line: ``healthagent run|check|classify|demo|explain`` (the stable CLI of ARCHITECTURE.md)."""

from __future__ import annotations

import argparse
import sys

from healthagent import __version__
from healthagent.config import ConfigError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="healthagent",
        description="GPU and EFA health agent: detect faults, explain them, take the node out safely.",
    )
    parser.add_argument("--version", action="version", version=f"healthagent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("run", help="the DaemonSet agent loop")
    sub.add_parser("check", help="collect once, classify, print the verdict (exit 0/1/2/3)")
    sub.add_parser("classify", help="classify XID lines of kernel-log text, one JSON object per event")
    sub.add_parser("demo", help="run the agent on the bundled demo node through a scripted fault")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        print(f"healthagent {args.command}: not wired yet", file=sys.stderr)
        return 3
    except ConfigError as exc:
        print(f"healthagent: config error: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
