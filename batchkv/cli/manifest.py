"""`batchkv export` (write a manifest: the KV cache geometry an exported model needs) and `batchkv
inspect` (validate one and print its geometry and memory)."""

from __future__ import annotations

import argparse
import sys

from batchkv.cli.common import COMMANDS, EXIT_USER_ERROR, one_line
from batchkv.errors import ConfigError, ManifestError

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


def add_export(sub: argparse._SubParsersAction) -> None:
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


def add_inspect(sub: argparse._SubParsersAction) -> None:
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
