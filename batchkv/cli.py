"""The `batchkv` command: run | bench | export | inspect.

Each subcommand adds its own options (`_add_*`) and runs in its own function (`_cmd_*`); heavy
imports happen inside them so `batchkv --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from batchkv.errors import BatchKVError, ConfigError

PRESETS = ("sensenova-u1-tiny", "sensenova-u1-8b")


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
    m.add_argument("--model", choices=PRESETS, default="sensenova-u1-tiny", help="model preset (random weights)")
    m.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    m.add_argument("--seed", type=int, default=0, help="seed of the weights, the workload and the sampling")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", metavar="PATH", help="JSONL file, one request per line (replaces the synthetic one)")
    w.add_argument("--requests", type=int, default=24, help="synthetic: number of requests")
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
    e.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
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
