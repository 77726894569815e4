"""`batchkv run`: replay a workload through the engine; print a summary, write metrics and tokens.

Everything a user can get wrong (options, files, the device) is refused before the model is
built, with one line that names the flag; Ctrl-C stops the replay and still prints the summary.
"""

from __future__ import annotations

import argparse
import os
import sys

from batchkv.cache.config import MAX_POSITIONS, MAX_STEP_TOKENS
from batchkv.cli import COMMANDS, EXIT_INTERRUPTED, EXIT_REFUSED, Help, bounded, one_line
from batchkv.errors import ConfigError
from batchkv.executor.report import TOKENS_HELP
from batchkv.executor.sizing import DEFAULT_CAPACITY, DEFAULT_PREFILL_CHUNK, DEFAULT_STEP_TOKENS
from batchkv.executor.workload import JSONL_HELP
from batchkv.frontend import (
    MODES,
    add_engine_options,
    add_scheduling_options,
    add_tensor_parallel,
    kv_dtype_option,
    model_source,
    or_auto,
    scheduling_kwargs,
    speculative_option,
)
from batchkv.presets import KV_PRESETS

MODELS = tuple(KV_PRESETS)  # model presets `batchkv run` can build
CPU_MODEL = "sensenova-u1-tiny"  # the one preset small enough for a CPU


def _length_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX (e.g. 16:96) or one integer") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r} needs 1 <= MIN <= MAX")
    return bounds


RUN_EPILOG = f"""\
{JSONL_HELP}

{TOKENS_HELP}

exit status: 0 done; 1 some request was refused (0 with --allow-refused); 2 a bad option or file;
130 interrupted (Ctrl-C stops the run and prints the summary of what finished)."""


def add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help=COMMANDS["run"],
        description="Replay a workload (synthetic by default, or a JSONL file of token-id prompts) through the "
        "continuous-batching engine, with a progress bar on stderr and a summary table at the end.",
        epilog=RUN_EPILOG,
        formatter_class=Help,
    )
    positions = MAX_POSITIONS  # int32 positions on the device
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=CPU_MODEL,
        metavar="PRESET_OR_PATH",
        help=f"a preset ({', '.join(MODELS)}: random weights) or a real model: a transformers directory "
        "(Llama, Qwen3, SenseNova-U1) or a GGUF file",
    )
    m.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    m.add_argument("--seed", type=bounded(int, 0), default=0, help="seed of the weights, the workload and the sampling")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", metavar="PATH", help="JSONL file, one request per line (format below)")
    w.add_argument("--requests", type=bounded(int, 0), default=32, help="synthetic: number of requests")
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
        type=bounded(float, 0.0),
        default=1.0,
        metavar="STEPS",
        help="synthetic: mean engine steps between arrivals (0: all at once)",
    )
    w.add_argument("--temperature", type=bounded(float, 0.0), default=0.0, help="synthetic: 0 is greedy")
    w.add_argument("--top-k", type=bounded(int, 0), default=0, help="synthetic: keep the k most likely tokens (0: off)")
    w.add_argument("--top-p", type=bounded(float, 0.0, 1.0, open_lo=True), default=1.0, help="synthetic: nucleus mass")
    w.add_argument("--n", type=bounded(int, 1, 64), default=1, help="synthetic: parallel samples per request")
    e = p.add_argument_group("engine")
    add_scheduling_options(e, max_seqs=8, help_max_seqs="resident sequences (columns)")
    e.add_argument(
        "--capacity",
        type=or_auto(bounded(int, 2, positions)),
        help=f"most positions per sequence (default: min({DEFAULT_CAPACITY}, the model's limit), as serve; "
        f"auto: the model's limit, else {DEFAULT_CAPACITY})",
    )
    steps = bounded(int, 1, MAX_STEP_TOKENS)
    e.add_argument("--max-step-tokens", type=steps, default=DEFAULT_STEP_TOKENS, help="token budget of one step")
    e.add_argument(
        "--prefill-chunk",
        type=bounded(int, 1),
        help=f"most prompt tokens per sequence per step (default: {DEFAULT_PREFILL_CHUNK}, within --capacity "
        "and --max-step-tokens)",
    )
    e.add_argument("--graphs", choices=tuple(MODES), default="auto", help="CUDA graphs (auto: on CUDA)")
    add_tensor_parallel(e, "--tensor-parallel")
    e.add_argument(
        "--threads",
        type=bounded(int, 0, 4096),
        default=1,
        help="CPU threads for torch; the tiny model's small ops run fastest on one (0: torch's default)",
    )
    add_engine_options(p.add_argument_group("storage and speculative decoding"))
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the metrics as JSON here (checked before the run)")
    o.add_argument("--output", metavar="PATH", help="write every request's generated tokens here (format below)")
    o.add_argument("--allow-refused", action="store_true", help="exit 0 even when the engine refused some requests")
    o.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="progress bar on stderr (auto: when stderr is a terminal)",
    )
    p.set_defaults(func=cmd_run)


def _build_model(preset: str, device: str, seed: int, quantization: str | None = None):
    """A preset's SenseNova-U1 model with random weights, or the model a path names (a transformers
    directory or a GGUF file, loaded as `batchkv serve` loads it). Imported lazily: heavy, optional."""
    if preset not in MODELS:
        from batchkv.serve.loading import load_served_model

        return load_served_model(preset, device, seed=seed, quantization=quantization).model
    try:
        from batchkv.models import build_model
    except ImportError as exc:
        raise ConfigError(
            f"model {preset!r} is unavailable: batchkv.models.sensenova cannot be imported ({exc})"
        ) from exc
    return build_model(preset, device, seed=seed, quantization=quantization)


def _capacity(flag: int | str | None, limit: int | None) -> int | None:
    """--capacity: None (the default) min(4096, the model's limit); auto: the Engine's (the limit, else 4096)."""
    if flag == "auto":
        return None
    return flag if flag is not None else min(DEFAULT_CAPACITY, limit or DEFAULT_CAPACITY)


def _check_writable(path: str, flag: str) -> None:
    """Refuse, before the run, a path the run could not write at its end (ConfigError naming the flag)."""
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a directory; give a file path")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write there: {exc.strerror or exc}") from None
    if not existed:
        os.remove(path)  # a run that fails leaves nothing behind


def _run_device(args: argparse.Namespace) -> str:
    """The device `batchkv run` uses, or a ConfigError whose advice works on this machine."""
    import torch

    from batchkv import ops

    cuda = torch.cuda.is_available()
    if args.model not in MODELS and not os.path.exists(args.model):
        raise ConfigError(
            f"--model {args.model}: neither a preset ({', '.join(MODELS)}) nor an existing directory or GGUF file"
        )
    small = args.model not in MODELS or args.model == CPU_MODEL  # a real model runs wherever it fits
    device = ("cuda" if cuda else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not cuda:
        fix = "use --device cpu (or auto)" if small else f"{args.model} needs a GPU: here use --model {CPU_MODEL}"
        raise ConfigError(f"--device cuda, but CUDA is not available on this machine; {fix}")
    if device == "cpu" and not small:
        fix = "use --device cuda (or auto)" if cuda else f"this machine has no CUDA GPU: use --model {CPU_MODEL} here"
        raise ConfigError(f"--model {args.model} is too large for the CPU; {fix}")
    if args.graphs == "on" and device != "cuda":
        raise ConfigError("--graphs on needs a CUDA device (CUDA graphs); on the CPU use --graphs auto or off")
    if args.graphs == "on" and not ops.triton_available(torch.device(device)):
        raise ConfigError("--graphs on needs Triton (pip install 'batchkv[triton]'); use --graphs auto or off")
    return device


def _read_workload(path: str) -> list:
    from batchkv.executor.workload import load_jsonl

    try:
        return load_jsonl(path)
    except OSError as exc:
        raise ConfigError(f"--workload {path}: cannot read it: {exc.strerror or exc}") from None


def cmd_run(args: argparse.Namespace) -> int:
    import torch

    from batchkv.executor import Engine
    from batchkv.executor.workload import replay

    for flag, path in (("--json", args.json), ("--output", args.output)):
        if path:
            _check_writable(path, flag)
    items = _read_workload(args.workload) if args.workload else None
    device = _run_device(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tensor_parallel > 1:  # every rank builds its share from the source
        model = model_source(args.model, seed=args.seed, quantization=args.quantization)
        limit = _model_limit(args.model)
    else:
        model = _build_model(args.model, device, args.seed, args.quantization)
        limit = getattr(model, "max_positions", None)
    capacity = _capacity(args.capacity, limit)
    speculative = speculative_option(args, model if args.tensor_parallel == 1 else None)
    engine = Engine(
        model,
        tensor_parallel=args.tensor_parallel,
        **scheduling_kwargs(args),
        capacity=capacity,
        max_step_tokens=args.max_step_tokens,
        prefill_chunk=args.prefill_chunk,  # None: the Engine's default, within capacity and the step budget
        device=device,
        use_graphs=MODES[args.graphs],
        seed=args.seed,
        kv_dtype=kv_dtype_option(args.kv_dtype),
        speculative=speculative,
    )
    if engine.sizing is not None:
        print(f"batchkv run: sized the store: {engine.sizing.describe()}", file=sys.stderr)
    with engine:  # leaving stops the other tensor-parallel ranks
        items = items if items is not None else _synthetic(args, engine.vocab_size)
        progress = _Progress(args, sum(item.request.params.n for item in items))
        result = replay(engine, items, progress.on_step, stop_on_interrupt=True)
        progress.close(len(result.refusals))
        return _report(args, engine, device, items, result, progress)


def _model_limit(name: str) -> int | None:
    """A model directory's max_position_embeddings (presets have none), read without its weights."""
    if name in MODELS:
        return None
    from batchkv.serve.loading import load_served_model

    return load_served_model(name, "cpu", weights=False).max_positions


def _synthetic(args: argparse.Namespace, vocab_size: int) -> list:
    from batchkv.executor import SamplingParams
    from batchkv.executor.workload import synthetic

    return synthetic(
        args.requests,
        vocab_size=vocab_size,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        arrival_gap=args.arrival_gap,
        seed=args.seed,
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, n=args.n),
    )


class _Progress:
    """Finished samples and generated tokens so far, drawn as a progress bar on stderr."""

    def __init__(self, args: argparse.Namespace, total: int) -> None:
        from batchkv.executor.report import ProgressBar

        enabled = args.progress == "on" or (args.progress == "auto" and sys.stderr.isatty())
        self.total, self.finished, self.tokens = total, 0, 0
        self.bar = ProgressBar(total, sys.stderr, enabled=enabled)

    def on_step(self, events: list) -> None:
        self.finished += sum(1 for ev in events if ev.finish_reason is not None)
        self.tokens += sum(1 for ev in events if ev.token is not None)
        self.bar.update(self.finished, self.tokens)

    def close(self, refused: int) -> None:
        self.bar.update(self.finished + refused, self.tokens, force=True)
        self.bar.close()


def _report(args: argparse.Namespace, engine, device: str, items: list, result, progress: _Progress) -> int:
    """Print the refusals and the summary, write --json and --output; returns the exit status."""
    import json

    from batchkv.executor.report import summary_table, token_lines

    for index, message in result.refusals:
        print(one_line(f"batchkv run: request {index} refused: {message}"), file=sys.stderr)
    summary = engine.metrics.summary()
    mode = ("graphs" if engine.uses_graphs else "eager") + (", overlap" if engine.overlap else "")
    cache = engine.cache
    title = f"batchkv run: {args.model} on {device} ({mode}), max_seqs {cache.max_seqs}, capacity {cache.capacity}"
    if args.tensor_parallel > 1:
        title += f", tensor parallel {args.tensor_parallel}"
    title += f", prefill budget {engine.scheduler.prefill_budget}"
    if args.kv_dtype != "model":
        title += f", kv {args.kv_dtype}"
    sizing = engine.sizing.describe() if engine.sizing is not None else None
    print(summary_table(summary, title, graphs=engine.uses_graphs, sizing=sizing))
    if args.json:
        record = {"model": args.model, "device": device, "graphs": engine.uses_graphs, "overlap": engine.overlap,
                  "tensor_parallel": args.tensor_parallel,
                  "max_seqs": cache.max_seqs, "capacity": cache.capacity, "sizing": sizing,
                  "prefill_budget": engine.scheduler.prefill_budget, **summary}  # fmt: skip
        record["interrupted"] = result.interrupted
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.writelines(line + "\n" for line in token_lines(result, items))
    if result.interrupted:
        done = f"{progress.finished} of {progress.total} samples had finished"
        print(f"batchkv run: interrupted; {done} (the summary covers what ran)", file=sys.stderr)
        return EXIT_INTERRUPTED
    if result.refusals and not args.allow_refused:
        refused = f"{len(result.refusals)} of {len(items)} requests were refused"
        print(f"batchkv run: {refused}; exit status {EXIT_REFUSED} (--allow-refused exits 0)", file=sys.stderr)
        return EXIT_REFUSED
    return 0
