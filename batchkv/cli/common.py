"""What every `batchkv` subcommand shares without importing torch: the commands' help lines, exit
statuses, the parser class (one-line errors), the help formatter, `bounded` argparse types and
`one_line` messages. A leaf: it imports nothing of batchkv's."""

from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_USER_ERROR, EXIT_REFUSED, EXIT_INTERRUPTED = 2, 1, 130
COMMANDS = {  # each subcommand's help line, in `batchkv --help` order
    "run": "replay a workload through the executor and print a summary",
    "serve": "serve a model over an OpenAI-compatible HTTP API",
    "export": "write a manifest: the KV cache geometry an exported model needs",
    "inspect": "validate a manifest, then print its cache geometry and memory",
    "score": "check a K/V storage dtype on your own text: perplexity, top-1 agreement, KL",
}


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: `batchkv run: error: ... (see batchkv run --help)`."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, one_line(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n")


class Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each option (none where the default is None: the help says what None
    means); the epilog (the workload format) printed as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def bounded(kind: type, lo: float, hi: float | None = None, *, open_lo: bool = False):
    """An argparse type: `kind` (int or float) in [lo, hi] ((lo, hi] when open_lo)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value != value or (value <= lo if open_lo else value < lo) or (hi is not None and value > hi):
            bounds = f"{'(' if open_lo else '['}{lo}, {hi if hi is not None else 'inf'}]"
            raise argparse.ArgumentTypeError(f"{text} is outside {bounds}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its fallback message
    return parse


def one_line(text: str) -> str:
    """Control characters escaped, so an error is exactly one line whatever the file held."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
