"""The `batchkv` command: run | serve | score | export | inspect (benchmarks live in bench/, run as scripts).

The front end, one package: each subcommand is a module that adds its parser (`add_*`) and runs it
(`cmd_*`): `run` (a workload replayed, `workload` and `report` beside it), `serve` (its options,
then `batchkv.serve.server`), `score`, `manifest` (`export`, `inspect`). `options` declares the
model and engine options they share and builds the model and the engine from them, once for every
command; `common` holds the parser, help formatter, exit statuses and `bounded` types, importing
nothing of batchkv's. Imports point down: common <- options <- the commands <- this module.

A user error is one line on stderr and exit status 2, never a traceback (`main`); heavy imports
happen inside the commands. Nothing at this module's top imports torch: `batchkv --help` and
`--version` answer from a parser of the commands' names and help lines alone (`COMMANDS`), without
the ~2 s torch import.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from batchkv import __version__
from batchkv.cli.common import (
    COMMANDS,
    EXIT_INTERRUPTED,
    EXIT_REFUSED,
    EXIT_USER_ERROR,
    Help,
    Parser,
    bounded,
    one_line,
)
from batchkv.errors import BatchKVError

__all__ = ["COMMANDS", "EXIT_INTERRUPTED", "EXIT_REFUSED", "EXIT_USER_ERROR", "Help", "Parser", "bounded",
           "build_parser", "main", "one_line"]  # fmt: skip


def build_parser(full: bool = True) -> Parser:
    """The `batchkv` parser; `full=False` gives the commands their help lines only (no imports)."""
    top = Parser(prog="batchkv", description=__doc__.splitlines()[0])
    top.add_argument("--version", action="version", version=f"batchkv {__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    if not full:
        for name, line in COMMANDS.items():
            sub.add_parser(name, help=line)
        return top
    from batchkv.cli.manifest import add_export, add_inspect  # the commands' imports wait for a full parse
    from batchkv.cli.run import add_run
    from batchkv.cli.score import add_score
    from batchkv.cli.serve import add_serve

    add_run(sub)
    add_serve(sub)
    add_export(sub)
    add_inspect(sub)
    add_score(sub)
    top.commands = sub.choices  # name -> the subcommand's parser
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `batchkv` and `python -m batchkv`; returns the exit status.

    A user error (a bad option, an unreadable or unwritable file, a refused configuration) prints
    one line on stderr and returns 2, never a traceback; Ctrl-C returns 130.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"], ["--version"]):
        build_parser(full=False).parse_args(argv)  # prints and exits: the top level needs no command's options
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand, so the advice is its --help
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    func = _serve_on_ray if args.command == "serve" and args.ray_replicas else args.func
    try:
        return func(args)
    except BatchKVError as exc:
        message = f"batchkv {args.command}: {type(exc).__name__}: {exc}"
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        message = f"batchkv {args.command}: {where}{exc.strerror or exc}"
    except KeyboardInterrupt:
        print(f"batchkv {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(one_line(message), file=sys.stderr)
    return EXIT_USER_ERROR


def _serve_on_ray(args) -> int:
    """`batchkv serve --ray-replicas N`: engine replicas on Ray Serve (`batchkv.cli.ray`) behind one endpoint."""
    from batchkv.cli.serve import model_of
    from batchkv.errors import DependencyError

    args.model = model_of(args)
    try:
        from batchkv.cli.ray import serve_on_ray
    except ImportError as exc:
        raise DependencyError(f"--ray-replicas needs Ray Serve: pip install 'batchkv[ray]' ({exc})") from exc
    return serve_on_ray(args)
