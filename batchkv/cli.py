"""The `batchkv` command: run | bench | export | inspect.

Each subcommand adds its own options (`_add_*`) and runs in its own function (`_cmd_*`); heavy
imports happen inside them so `batchkv --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from batchkv.errors import BatchKVError


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="replay a workload through the executor and print a summary")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from batchkv.demo import demo

    demo()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BatchKVError as exc:
        print(f"batchkv {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
