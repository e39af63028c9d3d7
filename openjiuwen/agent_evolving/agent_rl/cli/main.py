"""`openjiuwen-rl`: one command for the project's processes and tools."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="openjiuwen-rl", description="Online RL for LLM agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    service = sub.add_parser(
        "service", help="run the RL Service (normally started by the gateway)", add_help=False
    )
    service.add_argument("rest", nargs=argparse.REMAINDER)
    args, rest = parser.parse_known_args(argv)
    if args.command == "service":
        from ..online.service import main as service_main

        return service_main(list(args.rest) + rest)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
