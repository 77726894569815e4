"""The `batchkv` command: run | serve | export | inspect (benchmarks live in bench/, run as scripts).

Each subcommand adds its own options (`_add_*`) and runs in its own function (`_cmd_*`); heavy
imports happen inside them so `batchkv --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from batchkv.errors import BatchKVError, ConfigError, ManifestError
from batchkv.presets import KV_PRESETS

RUN_MODELS = tuple(KV_PRESETS)  # model presets `batchkv run` can build
KV_DTYPE_NAMES = ("bfloat16", "float16", "float32", "float8_e4m3fn")  # batchkv.ops.support.KV_DTYPES


def _length_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX (e.g. 16:96) or one integer") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r} needs 1 <= MIN <= MAX")
    return bounds


def _int_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor 'auto'") from None


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
    e.add_argument(
        "--max-seqs", type=_int_or_auto, default=8, help="resident sequences (cache columns); auto: what fits"
    )
    e.add_argument(
        "--memory-fraction",
        type=float,
        default=0.9,
        metavar="F",
        help="with --max-seqs auto: share of the device's memory for weights, activations and K/V",
    )
    e.add_argument(
        "--capacity", type=_int_or_auto, default=256, help="most positions per sequence; auto: the model's limit"
    )
    e.add_argument("--max-step-tokens", type=int, default=64, help="token budget of one step")
    e.add_argument("--prefill-chunk", type=int, default=32, help="most prompt tokens per sequence per step")
    e.add_argument(
        "--prefill-budget", type=int, metavar="N", help="most prompt tokens per step, all prompts (default: the rest)"
    )
    e.add_argument("--graphs", choices=("auto", "on", "off"), default="auto", help="CUDA graphs (auto: on CUDA)")
    e.add_argument(
        "--overlap",
        choices=("auto", "on", "off"),
        default="auto",
        help="plan step N+1 while the device runs step N (auto: unless speculating)",
    )
    s = p.add_argument_group("speculative decoding")
    s.add_argument(
        "--speculative",
        choices=("off", "ngram", "dflash"),
        default="off",
        help="ngram: prompt lookup; dflash: a DFlash block drafter (random weights unless --drafter)",
    )
    s.add_argument("--spec-block", type=int, metavar="N", help="verify rows per sample per step (default 16; ngram 8)")
    s.add_argument("--spec-layers", type=int, default=1, metavar="N", help="dflash: layers of a random drafter")
    s.add_argument("--drafter", metavar="DIR", help="dflash: drafter checkpoint folder (config.json + safetensors)")
    e.add_argument(
        "--kv-dtype",
        choices=("model", "fp8", *KV_DTYPE_NAMES),
        default="model",
        help="K/V storage dtype (model: the model's; fp8: float8_e4m3fn, e4m3 with a scale per position and head)",
    )
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


def _kv_dtype(name: str):
    """--kv-dtype: None for "model", else the torch storage dtype ("fp8" is float8_e4m3fn)."""
    from batchkv.ops.support import KV_DTYPES

    return None if name == "model" else KV_DTYPES["float8_e4m3fn" if name == "fp8" else name]


def _speculative_config(args: argparse.Namespace, model):
    """The engine's SpeculativeConfig from --speculative/--spec-block/--spec-layers/--drafter, or None."""
    from batchkv.executor import SpeculativeConfig

    if args.speculative == "off":
        if args.drafter or args.spec_block is not None:
            raise ConfigError("--drafter and --spec-block need --speculative ngram|dflash")
        return None
    if args.speculative == "ngram":
        return SpeculativeConfig("ngram", block_size=args.spec_block or 8)
    from batchkv.models.dflash import build_drafter, default_target_layers

    taps = default_target_layers(model.config.num_layers)
    block, layers = args.spec_block or 16, args.spec_layers
    drafter = build_drafter(model, num_layers=layers, target_layer_ids=taps, block_size=block, seed=args.seed,
                            checkpoint=args.drafter)  # fmt: skip
    return SpeculativeConfig("dflash", block_size=args.spec_block, drafter=drafter)


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
    speculative = _speculative_config(args, model)
    modes = {"auto": "auto", "on": True, "off": False}
    engine = Engine(
        model,
        max_seqs=args.max_seqs,
        memory_fraction=args.memory_fraction,
        capacity=None if args.capacity == "auto" else args.capacity,
        max_step_tokens=args.max_step_tokens,
        prefill_chunk=args.prefill_chunk,
        prefill_budget=args.prefill_budget,
        device=device,
        use_graphs=modes[args.graphs],
        overlap=modes[args.overlap],
        seed=args.seed,
        kv_dtype=_kv_dtype(args.kv_dtype),
        speculative=speculative,
    )
    if engine.sizing is not None:
        print(f"batchkv run: sized the store: {engine.sizing.describe()}", file=sys.stderr)
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
    mode = ("graphs" if engine.uses_graphs else "eager") + (", overlap" if engine.overlap else "")
    cache = engine.cache
    title = f"batchkv run: {args.model} on {device} ({mode}), max_seqs {cache.max_seqs}, capacity {cache.capacity}"
    if args.kv_dtype != "model":
        title += f", kv {args.kv_dtype}"
    sizing = engine.sizing.describe() if engine.sizing is not None else None
    print(summary_table(summary, title, graphs=engine.uses_graphs, sizing=sizing))
    if args.json:
        record = {"model": args.model, "device": device, "graphs": engine.uses_graphs, "overlap": engine.overlap,
                  "max_seqs": cache.max_seqs, "capacity": cache.capacity, "sizing": sizing, **summary}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


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


def _one_line(text: str) -> str:
    """Control characters escaped, so an error is exactly one line whatever the file held."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a manifest: the KV cache geometry an exported model needs")
    p.add_argument("--preset", choices=sorted(KV_PRESETS), help="model KV geometry (layers, kv heads, head_dim, dtype)")
    p.add_argument("--num-layers", type=int, help="layers (overrides the preset)")
    p.add_argument("--kv-heads", type=int, help="KV heads per layer (overrides the preset)")
    p.add_argument("--head-dim", type=int, help="head dimension (overrides the preset)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="the model's K/V dtype")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_NAMES, help="K/V storage dtype (default --dtype)")
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
    p.add_argument("--draft-layers", type=int, metavar="N", help="also a DFlash drafter of N layers: write the pair")
    p.add_argument(
        "--spec-block", type=int, default=16, metavar="N", help="the pair's block size (with --draft-layers)"
    )
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
            kv_dtype=args.kv_dtype,
            **geometry,
        )
    except ManifestError as exc:
        field = exc.path[2:].split("[")[0].split(".")[0]
        flag = f" ({_EXPORT_FLAGS[field]})" if field in _EXPORT_FLAGS else ""
        print(f"batchkv export: {exc.path}{flag}: {_one_line(exc.rule)}", file=sys.stderr)
        return 2
    if args.draft_layers is not None:
        return _export_pair(args, manifest)
    try:
        dump_manifest(manifest, args.output)
    except OSError as exc:
        print(_one_line(f"batchkv export: cannot write {args.output}: {exc.strerror or exc}"), file=sys.stderr)
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
        print(f"batchkv export: {exc.path}: {_one_line(exc.rule)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(_one_line(f"batchkv export: cannot write {args.output}: {exc.strerror or exc}"), file=sys.stderr)
        return 2
    total = human_bytes(pair.target.kv_bytes + pair.drafter.kv_bytes)
    print(f"wrote {args.output}: DFlash pair (block {pair.block_size}), {total} of K/V at full capacity")
    return 0


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="validate a manifest, then print its cache geometry and memory")
    p.add_argument("file", help="a .json or .msgpack manifest")
    p.set_defaults(func=_cmd_inspect)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from batchkv.manifest import load_manifest
    from batchkv.manifest.pair import decode_pair, is_pair, read_source
    from batchkv.manifest.report import describe

    try:
        data = read_source(args.file)
        pair = decode_pair(data) if is_pair(data) else None
        manifest = load_manifest(args.file) if pair is None else None  # the suffix picks the format
    except ManifestError as exc:
        problem = str(exc)
    except OSError as exc:
        problem = f"cannot read: {exc.strerror or exc}"
    else:
        print(f"{'file':<16} {args.file}")
        if pair is None:
            print(describe(manifest))  # type: ignore[arg-type]
            return 0
        print(f"{'pair':<16} DFlash target + drafter, block_size {pair.block_size}")
        for name, part in (("target", pair.target), ("drafter", pair.drafter)):
            print(f"\n[{name}]\n{describe(part)}")
        return 0
    print(_one_line(f"batchkv inspect: {args.file}: {problem}"), file=sys.stderr)
    return 2


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a transformers model directory (Qwen3, Llama, SenseNova-U1) or a preset over "
        "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics (needs batchkv[serve]).",
    )
    from batchkv.serve.server import add_arguments  # argparse only; the server's imports wait for _cmd_serve

    add_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from batchkv.serve.server import serve

    return serve(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_serve(sub)
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
