"""`batchkv run`: replay a workload through the engine; print a summary, write metrics and tokens.

Everything a user can get wrong (options, files, the device) is refused before the model is
built, with one line that names the flag (a workload's lines once the model's tokenizer is known);
Ctrl-C stops the replay and still prints the summary. A real model with a tokenizer replays text:
`TEXT_PROMPTS` through its chat template, or a workload's "prompt" lines, and --output writes the
decoded text beside the token ids.
"""

from __future__ import annotations

import argparse
import os
import sys

from batchkv.cli.common import COMMANDS, EXIT_INTERRUPTED, EXIT_REFUSED, Help, bounded, one_line
from batchkv.cli.options import (
    CPU_MODEL,
    add_engine_options,
    add_model_options,
    build_engine,
    load_model,
    resolve_device,
    set_threads,
)
from batchkv.cli.report import TOKENS_HELP
from batchkv.cli.workload import JSONL_HELP
from batchkv.errors import ConfigError
from batchkv.models.config import MODEL_PRESETS

MODELS = tuple(MODEL_PRESETS)  # model presets `batchkv run` can build


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
        description="Replay a workload through the continuous-batching engine, with a progress bar on stderr and "
        "a summary table at the end: synthetic by default (random token ids on a preset; on a real model with a "
        "tokenizer, a few built-in questions through its chat template), or a JSONL file of prompts (token ids, or "
        "text for a model with a tokenizer).",
        epilog=RUN_EPILOG,
        formatter_class=Help,
    )
    add_model_options(p.add_argument_group("model"), default=CPU_MODEL)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", metavar="PATH", help="JSONL file, one request per line (format below)")
    w.add_argument("--requests", type=bounded(int, 0), default=32, help="synthetic: number of requests")
    w.add_argument(
        "--prompt-len",
        type=_length_range,
        default="8:64",
        metavar="MIN:MAX",
        help="synthetic: prompt length range, uniform (random token ids; a model with a tokenizer asks its "
        "built-in questions instead)",
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
    add_engine_options(p.add_argument_group("engine"), p.add_argument_group("storage and speculative decoding"))
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the metrics as JSON here (checked before the run)")
    o.add_argument(
        "--output",
        metavar="PATH",
        help="write every request's generated tokens here, and their text with a tokenizer (format below)",
    )
    o.add_argument("--allow-refused", action="store_true", help="exit 0 even when the engine refused some requests")
    o.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="progress bar on stderr (auto: when stderr is a terminal)",
    )
    p.set_defaults(func=cmd_run)


# Asked of a real model that has a tokenizer when no --workload is given (through its chat template).
TEXT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "Give me one tip for writing clear code.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Why is the sky blue? Answer in one sentence.",
)


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


def _read_workload(path: str, tokenizer) -> list:
    from batchkv.cli.workload import load_jsonl

    encode = None if tokenizer is None else lambda text: tokenizer.encode(text)
    try:
        return load_jsonl(path, encode)
    except OSError as exc:
        raise ConfigError(f"--workload {path}: cannot read it: {exc.strerror or exc}") from None


def _bind_tokenizer(args: argparse.Namespace, engine, tokenizer) -> None:
    """Constrained lines are compiled against the model's tokenizer (xgrammar); none: refused."""
    if tokenizer is None:
        raise ConfigError(
            f"--workload {args.workload}: a line carries a constraint, and {args.model} has no tokenizer to compile "
            "it against (a preset); drop the constraints or run a model with a tokenizer"
        )
    engine.use_tokenizer(tokenizer)


def cmd_run(args: argparse.Namespace) -> int:
    from batchkv.cli.workload import replay
    from batchkv.executor.graphs import freeze_heap

    for flag, path in (("--json", args.json), ("--output", args.output)):
        if path:
            _check_writable(path, flag)
    if args.workload and not os.path.isfile(args.workload):  # before the model loads
        problem = "is a directory" if os.path.isdir(args.workload) else "no such file"
        raise ConfigError(f"--workload {args.workload}: cannot read it: {problem}")
    device = resolve_device(args)
    set_threads(args)
    served = load_model(args, device)
    items = _read_workload(args.workload, served.tokenizer) if args.workload else None
    engine = build_engine(args, served, device)
    if engine.sizing is not None:
        print(f"batchkv run: sized the store: {engine.sizing.describe()}", file=sys.stderr)
    with engine:  # leaving stops the other tensor-parallel ranks
        if items is not None and any(item.request.params.constraint is not None for item in items):
            _bind_tokenizer(args, engine, served.tokenizer)
        items = items if items is not None else _synthetic(args, engine.vocab_size, served.tokenizer)
        progress = _Progress(args, sum(item.request.params.n for item in items))
        freeze_heap()  # as batchkv serve does once warm: no full pass of the collector walks the model in a step
        result = replay(engine, items, progress.on_step, stop_on_interrupt=True)
        progress.close(len(result.refusals))
        return _report(args, engine, device, items, result, progress, served.tokenizer)


def text_prompts(tokenizer) -> list[list[int]]:
    """`TEXT_PROMPTS` as token ids: each a user message through the chat template when the tokenizer
    has one, else the plain text."""
    if getattr(tokenizer, "chat_template", None):
        return [
            list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"])
            for text in TEXT_PROMPTS
        ]  # fmt: skip
    return [list(tokenizer.encode(text)) for text in TEXT_PROMPTS]


def _synthetic(args: argparse.Namespace, vocab_size: int, tokenizer) -> list:
    from batchkv.cli.workload import synthetic
    from batchkv.executor import SamplingParams

    return synthetic(
        args.requests,
        vocab_size=vocab_size,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        arrival_gap=args.arrival_gap,
        seed=args.seed,
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, n=args.n),
        prompts=None if tokenizer is None else text_prompts(tokenizer),
    )


class _Progress:
    """Finished samples and generated tokens so far, drawn as a progress bar on stderr."""

    def __init__(self, args: argparse.Namespace, total: int) -> None:
        from batchkv.cli.report import ProgressBar

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


def _report(args: argparse.Namespace, engine, device: str, items: list, result, progress: _Progress, tokenizer) -> int:
    """Print the refusals and the summary, write --json and --output; returns the exit status."""
    import json

    from batchkv.cli.report import summary_table, token_lines

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
    decode = None if tokenizer is None else lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    if decode is not None:
        _print_first_answer(items, result, decode)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in token_lines(result, items, decode))
    if result.interrupted:
        done = f"{progress.finished} of {progress.total} samples had finished"
        print(f"batchkv run: interrupted; {done} (the summary covers what ran)", file=sys.stderr)
        return EXIT_INTERRUPTED
    if result.refusals and not args.allow_refused:
        refused = f"{len(result.refusals)} of {len(items)} requests were refused"
        print(f"batchkv run: {refused}; exit status {EXIT_REFUSED} (--allow-refused exits 0)", file=sys.stderr)
        return EXIT_REFUSED
    return 0


def _print_first_answer(items: list, result, decode) -> None:
    """The first request's prompt and answer, decoded (a real model: a few words, not only numbers)."""
    for index, output in result.outputs(items):
        if output is not None and output.tokens[0]:
            prompt = decode(list(items[index].request.prompt_ids))
            print(one_line(f"request {index}: {prompt.strip()} -> {decode(output.tokens[0]).strip()}"))
            return
