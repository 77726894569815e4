"""The `batchkv` command: run | serve | score | export | inspect (benchmarks live in bench/, run as scripts).

Each subcommand adds its own options (`_add_*`) and runs in its own function (`_cmd_*`); `run`
lives in `batchkv.cli_run`. A user error is one line on stderr and exit status 2, never a
traceback (`main`); heavy imports happen inside the commands. Nothing at this module's top
imports torch: `batchkv --help` and `--version` answer from a parser of the commands' names and
help lines alone (`COMMANDS`), without the ~2 s torch import.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from batchkv import __version__
from batchkv.errors import BatchKVError, ConfigError, ManifestError

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


# Manifest fields and the export flags that set them, for error messages.
_EXPORT_FLAGS = {
    "num_layers": "--num-layers",
    "kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "dtype": "--dtype",
    "kv_dtype": "--kv-dtype",
    "model": "--model",
    "maximum_capacity": "--capacity",
    "max_write": "--max-write",
    "max_seqs": "--max-kv-seqs",
    "max_segments": "--max-segments",
    "max_cells": "--max-cells",
    "max_sample_rows": "--max-sample-rows",
    "step_widths": "--widths",
    "layers": "--window-every/--window",
}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def one_line(text: str) -> str:
    """Control characters escaped, so an error is exactly one line whatever the file held."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _add_export(sub: argparse._SubParsersAction) -> None:
    from batchkv.dtypes import MODEL_DTYPES, STORAGE_DTYPES
    from batchkv.presets import KV_PRESETS

    p = sub.add_parser(
        "export",
        help=COMMANDS["export"],
        description="Write a manifest (JSON or msgpack): the KV cache an exported model needs -- its layout, "
        "sequences, capacity, per-layer flat/ring storage and KV geometry -- for `batchkv inspect` to check and "
        "`batchkv.from_manifest` to build. The geometry comes from --preset or from --num-layers, --kv-heads, "
        "--head-dim and --dtype (which also override the preset); head_dim must be one the kernels run.",
    )
    p.add_argument("--preset", choices=sorted(KV_PRESETS), help="model KV geometry (layers, kv heads, head_dim, dtype)")
    p.add_argument("--num-layers", type=int, help="layers (overrides the preset)")
    p.add_argument("--kv-heads", type=int, help="KV heads per layer (overrides the preset)")
    p.add_argument("--head-dim", type=int, help="head dimension (overrides the preset)")
    p.add_argument("--dtype", choices=tuple(MODEL_DTYPES), help="the model's K/V dtype")
    p.add_argument("--kv-dtype", choices=tuple(STORAGE_DTYPES), help="K/V storage dtype (default --dtype)")
    p.add_argument("--model", help="model name recorded in the manifest (default: the preset's name)")
    p.add_argument(
        "--kv-layout",
        required=True,
        choices=("sequence", "batched-sequence", "cell"),
        help="sequence: one sequence per cache (single-request decode); batched-sequence: --max-kv-seqs sequences, "
        "one column each, in one store (continuous batching); cell: a shared cell pool (described, not built)",
    )
    p.add_argument("--max-kv-seqs", type=int, default=1, metavar="N", help="resident sequences (default 1)")
    p.add_argument("--capacity", type=int, required=True, metavar="N", help="most positions per sequence")
    p.add_argument(
        "--max-write", type=int, metavar="N", help="most tokens per sequence per step (default min(512, capacity))"
    )
    p.add_argument("--max-segments", type=int, metavar="N", help="most runs per step (default 2 * max-kv-seqs)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None, help="(batched-sequence)")
    p.add_argument("--max-cells", type=int, metavar="N", help="cell pool size (default max-kv-seqs * capacity)")
    p.add_argument("--window-every", type=int, default=0, metavar="K", help="layers K-1, 2K-1, ... become rings")
    p.add_argument("--window", type=int, default=0, metavar="W", help="the ring layers' sliding window")
    p.add_argument("--widths", type=_int_list, metavar="1,2,4", help="captured step widths (default 1,2,4..N)")
    p.add_argument("--max-sample-rows", type=int, default=64, metavar="N", help="logits rows per step")
    p.add_argument("--draft-layers", type=int, metavar="N", help="also a DFlash drafter of N layers: write the pair")
    p.add_argument(
        "--spec-block", type=int, default=16, metavar="N", help="the pair's block size (with --draft-layers)"
    )
    p.add_argument("-o", "--output", required=True, metavar="FILE", help=".json or .msgpack")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    from batchkv import ops
    from batchkv.dtypes import dtype_named
    from batchkv.manifest import dump_manifest, make_manifest
    from batchkv.manifest.report import human_bytes
    from batchkv.presets import KV_PRESETS

    preset = KV_PRESETS[args.preset] if args.preset else None
    geometry = {}
    for name in ("num_layers", "kv_heads", "head_dim", "dtype"):
        value = getattr(args, name) if getattr(args, name) is not None else getattr(preset, name, None)
        if value is None:
            raise ConfigError(f"export needs --preset or {_EXPORT_FLAGS[name]} (the model's KV geometry)")
        geometry[name] = value
    problem = ops.kernel_problem(geometry["head_dim"], dtype_named(args.kv_dtype or geometry["dtype"]))
    if problem:
        print(one_line(f"batchkv export: $.head_dim (--head-dim): {problem}"), file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        manifest = make_manifest(
            layout=args.kv_layout,
            capacity=args.capacity,
            max_seqs=args.max_kv_seqs,
            max_write=args.max_write,
            max_segments=args.max_segments,
            causal=args.causal,
            max_cells=args.max_cells,
            window_every=args.window_every,
            window=args.window,
            step_widths=args.widths,
            max_sample_rows=args.max_sample_rows,
            model=args.model or (preset.name if preset else None),
            kv_dtype=args.kv_dtype,
            **geometry,
        )
    except ManifestError as exc:
        field = exc.path[2:].split("[")[0].split(".")[0]
        flag = f" ({_EXPORT_FLAGS[field]})" if field in _EXPORT_FLAGS else ""
        print(f"batchkv export: {exc.path}{flag}: {one_line(exc.rule)}", file=sys.stderr)
        return 2
    if args.draft_layers is not None:
        return _export_pair(args, manifest)
    try:
        dump_manifest(manifest, args.output)
    except OSError as exc:
        print(one_line(f"batchkv export: cannot write {args.output}: {exc.strerror or exc}"), file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {manifest.layout}, {human_bytes(manifest.kv_bytes)} of K/V at full capacity")
    return 0


def _export_pair(args: argparse.Namespace, manifest) -> int:
    """`export --draft-layers N`: the target's manifest and its DFlash drafter's, in one JSON file."""
    from batchkv.manifest.pair import dump_pair, make_pair
    from batchkv.manifest.report import human_bytes

    if manifest.layout != "batched-sequence" or not args.output.endswith(".json"):
        raise ConfigError("a DFlash pair needs --kv-layout batched-sequence and a .json output")
    try:
        pair = make_pair(manifest, draft_layers=args.draft_layers, block_size=args.spec_block)
        dump_pair(pair, args.output)
    except ManifestError as exc:
        flag = {"$.drafter.num_layers": " (--draft-layers)", "$.block_size": " (--spec-block)"}.get(exc.path, "")
        print(f"batchkv export: {exc.path}{flag}: {one_line(exc.rule)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as exc:
        print(one_line(f"batchkv export: cannot write {args.output}: {exc.strerror or exc}"), file=sys.stderr)
        return EXIT_USER_ERROR
    total = human_bytes(pair.target.kv_bytes + pair.drafter.kv_bytes)
    print(f"wrote {args.output}: DFlash pair (block {pair.block_size}), {total} of K/V at full capacity")
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help=COMMANDS["inspect"])
    p.add_argument("file", help="a .json or .msgpack manifest")
    p.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from batchkv import ops
    from batchkv.dtypes import dtype_named
    from batchkv.manifest import load_manifest
    from batchkv.manifest.pair import decode_pair, is_pair, read_source
    from batchkv.manifest.report import describe

    try:
        data = read_source(args.file)
        pair = decode_pair(data) if is_pair(data) else None
        parts = [load_manifest(args.file)] if pair is None else [pair.target, pair.drafter]  # suffix picks format
    except ManifestError as exc:
        problem = str(exc)
    except OSError as exc:
        problem = f"cannot read: {exc.strerror or exc}"
    else:
        problem = next(
            filter(None, (ops.kernel_problem(m.head_dim, dtype_named(m.storage_dtype)) for m in parts)), None
        )
        problem = problem and f"$.head_dim: {problem}"
    if problem:
        print(one_line(f"batchkv inspect: {args.file}: {problem}"), file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"{'file':<16} {args.file}")
    if pair is None:
        print(describe(parts[0]))
        return 0
    print(f"{'pair':<16} DFlash target + drafter, block_size {pair.block_size}")
    for name, part in (("target", pair.target), ("drafter", pair.drafter)):
        print(f"\n[{name}]\n{describe(part)}")
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help=COMMANDS["serve"],
        description="Serve a transformers model directory (Qwen3, Llama, SenseNova-U1) or a preset over "
        "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics (needs batchkv[serve]).",
    )
    from batchkv.serve.options import add_arguments  # argparse only; the server's imports wait for _cmd_serve

    add_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from batchkv.serve.server import serve

    return serve(args)


def _add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score",
        help=COMMANDS["score"],
        description="Teacher-force each text file through the model twice, K/V stored as --kv-dtype and as "
        "--reference (batchkv.score), and print perplexity under each, top-1 agreement and mean KL.",
        formatter_class=Help,
    )
    p.add_argument("--model", required=True, metavar="PATH", help="a transformers directory or a GGUF file")
    p.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files (tokenized with the model's tokenizer)")
    p.add_argument("--kv-dtype", default=None, help="storage dtype tested (fp8 is e4m3; default fp8, or with "
                   "--quantization the reference's)")  # fmt: skip
    from batchkv.frontend import add_quantization

    add_quantization(p)
    p.add_argument("--reference", default="bfloat16", help="storage dtype compared against")
    p.add_argument("--chunk", type=bounded(int, 1, 1 << 16), default=64, help="tokens per prompt chunk")
    p.add_argument("--max-tokens", type=bounded(int, 2), default=4096, help="score at most this many tokens per file")
    p.add_argument("--key-rotation", action="store_true", help="rotate e4m3 keys (CacheConfig.key_rotation)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    p.add_argument("--threads", type=bounded(int, 0, 4096), default=0, help="CPU threads for torch (0: its default)")
    p.set_defaults(func=_cmd_score)


def _cmd_score(args: argparse.Namespace) -> int:
    import torch

    from batchkv.dtypes import dtype_named
    from batchkv.score import make_cache, score_caches
    from batchkv.serve.loading import load_served_model

    texts = []
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    kv_dtype = args.kv_dtype or (args.reference if args.quantization else "fp8")
    tested_dtype, reference_dtype = (dtype_named("float8_e4m3fn" if d == "fp8" else d) for d in
                                     (kv_dtype, args.reference))  # fmt: skip
    served = load_served_model(args.model, device)
    if served.tokenizer is None:
        raise ConfigError(f"--model {args.model} has no tokenizer; batchkv score reads text")
    tested_model = served.model
    if args.quantization:
        tested_model = load_served_model(args.model, device, quantization=args.quantization).model
    label = f"{args.quantization} " * bool(args.quantization) + kv_dtype
    print(f"{'file':<32} {'tokens':>7} {'ppl ' + args.reference:>14} {'ppl ' + label:>14} "
          f"{'change':>8} {'top-1':>7} {'KL':>9}")  # fmt: skip
    for path, text in zip(args.files, texts, strict=True):
        ids = served.tokenizer(text).input_ids[: args.max_tokens]
        extra = {"key_rotation": True} if args.key_rotation else {}
        tested = make_cache(tested_model, tested_dtype, max(len(ids), 2), args.chunk, **extra)
        reference = make_cache(served.model, reference_dtype, max(len(ids), 2), args.chunk)
        s = score_caches(served.model, ids, [tested], reference, args.chunk, [tested_model])[0]
        print(f"{path[-32:]:<32} {s.tokens:>7} {s.reference_ppl:>14.4f} {s.ppl:>14.4f} {s.ppl_change:>+8.2%} "
              f"{s.top1_agreement:>7.2%} {s.kl_mean:>9.5f}")  # fmt: skip
    return 0


def build_parser(full: bool = True) -> Parser:
    """The `batchkv` parser; `full=False` gives the commands their help lines only (no imports)."""
    top = Parser(prog="batchkv", description=__doc__.splitlines()[0])
    top.add_argument("--version", action="version", version=f"batchkv {__version__}")
    sub = top.add_subparsers(dest="command", required=True)
    if not full:
        for name, line in COMMANDS.items():
            sub.add_parser(name, help=line)
        return top
    from batchkv.cli_run import add_run  # imports this module: here, not at the top

    add_run(sub)
    _add_serve(sub)
    _add_export(sub)
    _add_inspect(sub)
    _add_score(sub)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `batchkv` and `python -m batchkv`; returns the exit status.

    A user error (a bad option, an unreadable or unwritable file, a refused configuration) prints
    one line on stderr and returns 2, never a traceback; Ctrl-C returns 130.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"], ["--version"]):
        build_parser(full=False).parse_args(argv)  # prints and exits: the top level needs no command's options
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
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


if __name__ == "__main__":
    sys.exit(main())
