"""The `batchkv` command: run | bench | export | inspect.

Each subcommand adds its own options (`_add_*`) and runs in its own function (`_cmd_*`); heavy
imports happen inside them so `batchkv --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from batchkv.errors import BatchKVError, ConfigError, ManifestError
from batchkv.presets import KV_PRESETS


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="replay a workload through the executor and print a summary")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from batchkv.demo import demo

    demo()
    return 0


# Manifest fields and the export flags that set them, for error messages.
_EXPORT_FLAGS = {
    "num_layers": "--num-layers",
    "kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "dtype": "--dtype",
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


def _one_line(text: str) -> str:
    """Control characters escaped, so an error is exactly one line whatever the file held."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a manifest: the KV cache geometry an exported model needs")
    p.add_argument("--preset", choices=sorted(KV_PRESETS), help="model KV geometry (layers, kv heads, head_dim, dtype)")
    p.add_argument("--num-layers", type=int, help="layers (overrides the preset)")
    p.add_argument("--kv-heads", type=int, help="KV heads per layer (overrides the preset)")
    p.add_argument("--head-dim", type=int, help="head dimension (overrides the preset)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="K/V storage dtype")
    p.add_argument("--model", help="model name recorded in the manifest (default: the preset's name)")
    p.add_argument("--kv-layout", required=True, choices=("sequence", "batched-sequence", "cell"))
    p.add_argument("--max-kv-seqs", type=int, default=1, metavar="N", help="resident sequences (default 1)")
    p.add_argument("--capacity", type=int, required=True, metavar="N", help="most positions per sequence")
    p.add_argument("--max-write", type=int, metavar="N", help="most tokens per sequence per step (default 512)")
    p.add_argument("--max-segments", type=int, metavar="N", help="most runs per step (default 2 * max-kv-seqs)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None, help="(batched-sequence)")
    p.add_argument("--max-cells", type=int, metavar="N", help="cell pool size (default max-kv-seqs * capacity)")
    p.add_argument("--window-every", type=int, default=0, metavar="K", help="layers K-1, 2K-1, ... become rings")
    p.add_argument("--window", type=int, default=0, metavar="W", help="the ring layers' sliding window")
    p.add_argument("--widths", type=_int_list, metavar="1,2,4", help="captured step widths (default 1,2,4..N)")
    p.add_argument("--max-sample-rows", type=int, default=64, metavar="N", help="logits rows per step")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help=".json or .msgpack")
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    from batchkv.manifest import dump_manifest, make_manifest
    from batchkv.manifest.report import human_bytes

    preset = KV_PRESETS[args.preset] if args.preset else None
    geometry = {}
    for name in ("num_layers", "kv_heads", "head_dim", "dtype"):
        value = getattr(args, name) if getattr(args, name) is not None else getattr(preset, name, None)
        if value is None:
            raise ConfigError(f"export needs --preset or {_EXPORT_FLAGS[name]} (the model's KV geometry)")
        geometry[name] = value
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
            **geometry,
        )
    except ManifestError as exc:
        field = exc.path[2:].split("[")[0].split(".")[0]
        flag = f" ({_EXPORT_FLAGS[field]})" if field in _EXPORT_FLAGS else ""
        print(f"batchkv export: {exc.path}{flag}: {_one_line(exc.rule)}", file=sys.stderr)
        return 2
    try:
        dump_manifest(manifest, args.output)
    except OSError as exc:
        print(_one_line(f"batchkv export: cannot write {args.output}: {exc.strerror or exc}"), file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {manifest.layout}, {human_bytes(manifest.kv_bytes)} of K/V at full capacity")
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="validate a manifest, then print its cache geometry and memory")
    p.add_argument("file", help="a .json or .msgpack manifest")
    p.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from batchkv.manifest import load_manifest
    from batchkv.manifest.report import describe

    try:
        manifest = load_manifest(args.file)
    except ManifestError as exc:
        problem = str(exc)
    except OSError as exc:
        problem = f"cannot read: {exc.strerror or exc}"
    else:
        print(f"{'file':<16} {args.file}")
        print(describe(manifest))
        return 0
    print(_one_line(f"batchkv inspect: {args.file}: {problem}"), file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_export(sub)
    _add_inspect(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BatchKVError as exc:
        print(f"batchkv {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
