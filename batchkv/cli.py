"""The `batchkv` command: run | export | inspect (benchmarks live in bench/, run as scripts).

Each subcommand adds its own options (`_add_*`) and runs in its own function (`_cmd_*`); heavy
imports happen inside them so `batchkv --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from batchkv.dtypes import STORAGE_DTYPES
from batchkv.errors import BatchKVError, ConfigError, ManifestError
from batchkv.presets import KV_PRESETS

RUN_MODELS = tuple(KV_PRESETS)  # model presets `batchkv run` can build


def _length_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX (e.g. 16:96) or one integer") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r} needs 1 <= MIN <= MAX")
    return bounds


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="replay a workload through the executor and print a summary",
        description="Replay a workload (synthetic by default, or a JSONL file of token-id prompts) through the "
        "continuous-batching engine, with a progress bar on stderr and a summary table at the end.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=RUN_MODELS, default="sensenova-u1-tiny", help="model preset (random weights)")
    m.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    m.add_argument("--seed", type=int, default=0, help="seed of the weights, the workload and the sampling")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", metavar="PATH", help="JSONL file, one request per line (replaces the synthetic one)")
    w.add_argument("--requests", type=int, default=32, help="synthetic: number of requests")
    w.add_argument(
        "--prompt-len",
        type=_length_range,
        default="8:64",
        metavar="MIN:MAX",
        help="synthetic: prompt length range, uniform",
    )
    w.add_argument(
        "--output-len",
        type=_length_range,
        default="8:48",
        metavar="MIN:MAX",
        help="synthetic: max_new_tokens range, uniform",
    )
    w.add_argument(
        "--arrival-gap",
        type=float,
        default=1.0,
        metavar="STEPS",
        help="synthetic: mean engine steps between arrivals (0: all at once)",
    )
    w.add_argument("--temperature", type=float, default=0.0, help="synthetic: 0 is greedy")
    w.add_argument("--top-k", type=int, default=0, help="synthetic: keep the k most likely tokens (0: off)")
    w.add_argument("--top-p", type=float, default=1.0, help="synthetic: nucleus mass (1.0: off)")
    w.add_argument("--n", type=int, default=1, help="synthetic: parallel samples per request")
    e = p.add_argument_group("engine")
    e.add_argument("--max-seqs", type=int, default=8, help="resident sequences (cache columns)")
    e.add_argument("--capacity", type=int, default=256, help="most positions per sequence")
    e.add_argument("--max-step-tokens", type=int, default=64, help="token budget of one step")
    e.add_argument("--prefill-chunk", type=int, default=32, help="most prompt tokens per sequence per step")
    e.add_argument("--graphs", choices=("auto", "on", "off"), default="auto", help="CUDA graphs (auto: on CUDA)")
    e.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch; the tiny model's small ops run fastest on one (0: torch's default)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the metrics as JSON here")
    o.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="progress bar on stderr (auto: when stderr is a terminal)",
    )
    p.set_defaults(func=_cmd_run)


def _build_model(preset: str, device: str, seed: int):
    """The SenseNova-U1 language model with random weights (imported lazily: heavy, and optional)."""
    try:
        from batchkv.models import build_model
    except ImportError as exc:
        raise ConfigError(
            f"model {preset!r} is unavailable: batchkv.models.sensenova cannot be imported ({exc})"
        ) from exc
    return build_model(preset, device, seed=seed)


def _cmd_run(args: argparse.Namespace) -> int:
    import json

    import torch

    from batchkv.executor import Engine, SamplingParams
    from batchkv.executor.report import ProgressBar, summary_table
    from batchkv.executor.workload import load_jsonl, replay, synthetic

    if args.threads:
        torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but CUDA is not available here; use --device cpu")
    if device == "cpu" and args.model != "sensenova-u1-tiny":
        raise ConfigError(f"{args.model} is too large for the CPU; use --device cuda or --model sensenova-u1-tiny")
    model = _build_model(args.model, device, args.seed)
    engine = Engine(
        model,
        max_seqs=args.max_seqs,
        capacity=args.capacity,
        max_step_tokens=args.max_step_tokens,
        prefill_chunk=args.prefill_chunk,
        device=device,
        use_graphs={"auto": "auto", "on": True, "off": False}[args.graphs],
        seed=args.seed,
    )
    if args.workload:
        items = load_jsonl(args.workload)
    else:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, n=args.n)
        items = synthetic(
            args.requests,
            vocab_size=engine.vocab_size,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            arrival_gap=args.arrival_gap,
            seed=args.seed,
            sampling=sampling,
        )
    total = sum(item.request.params.n for item in items)
    enabled = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
    bar = ProgressBar(total, sys.stderr, enabled=enabled)
    done = [0, 0]  # finished samples, tokens

    def on_step(events) -> None:
        done[0] += sum(1 for ev in events if ev.finish_reason is not None)
        done[1] += sum(1 for ev in events if ev.token is not None)
        bar.update(done[0], done[1])

    result = replay(engine, items, on_step)
    bar.update(done[0] + len(result.refusals), done[1], force=True)
    bar.close()
    for index, message in result.refusals:
        print(f"batchkv run: request {index} refused: {message}", file=sys.stderr)
    summary = engine.metrics.summary()
    mode = "graphs" if engine.uses_graphs else "eager"
    title = f"batchkv run: {args.model} on {device} ({mode}), max_seqs {args.max_seqs}, capacity {args.capacity}"
    print(summary_table(summary, title, graphs=engine.uses_graphs))
    if args.json:
        record = {"model": args.model, "device": device, "graphs": engine.uses_graphs, **summary}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
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
    p.add_argument("--dtype", choices=tuple(STORAGE_DTYPES), help="K/V storage dtype")
    p.add_argument("--model", help="model name recorded in the manifest (default: the preset's name)")
    p.add_argument("--kv-layout", required=True, choices=("sequence", "batched-sequence", "cell"))
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
