"""The options `batchkv run`, `batchkv serve` and `batchkv score` share, and the one construction of a
model and an engine from them (`load_model`, `build_engine`).

Every engine or model option is declared once, here, with one spelling, one default and one help
line: `add_model_options` (what model, where, in what dtype; run, serve and score) and
`add_engine_options` (store sizing, scheduling, graphs, tensor parallelism, K/V storage,
speculation; run and serve). vLLM's and llama.cpp's spellings are aliases of the same option
(`--max-num-seqs` is `--max-seqs`, `-m` is `--model`), listed beside it in `--help`. A new model or
engine option is one `add_argument` line in one of those two functions, read where `load_model` or
`build_engine` turns options into what the loader and the `Engine` take.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

import torch

from batchkv.cache.config import MAX_POSITIONS, MAX_STEP_TOKENS
from batchkv.cli.common import bounded
from batchkv.dtypes import STORAGE_DTYPES, dtype_named
from batchkv.errors import ConfigError
from batchkv.executor.request import MAX_SAMPLE_ROWS
from batchkv.executor.sizing import DEFAULT_CAPACITY, DEFAULT_PREFILL_CHUNK, DEFAULT_STEP_TOKENS
from batchkv.models.config import MODEL_PRESETS

MODES = {"auto": "auto", "on": True, "off": False}  # --graphs, --overlap -> the Engine's values
CPU_MODEL = "sensenova-u1-tiny"  # the one preset small enough for a CPU
CPU_MAX_SEQS = 16  # --max-seqs on the CPU, where "auto" would size the store to the host's memory
DEFAULT_MEMORY_FRACTION = 0.9  # --memory-fraction with --max-seqs auto, as vLLM's gpu_memory_utilization
MODEL_DTYPES = ("auto", "bfloat16", "float16", "float32")  # --dtype


def or_auto(parse):
    """An argparse type: "auto", or what `parse` accepts."""

    def parse_or_auto(text: str):
        if text == "auto":
            return text
        try:
            return parse(text)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc}, nor auto") from None

    parse_or_auto.__name__ = parse.__name__
    return parse_or_auto


def add_model_options(group: argparse._ArgumentGroup, *, default: str | None = None) -> None:
    """-m/--model, --device, --dtype, --seed, --quantization, --threads (run, serve, score). `default` None: --model is
    required (serve also takes it as its first positional argument, as vLLM does)."""
    group.add_argument(
        "-m",
        "--model",
        default=default,
        metavar="MODEL",
        help=f"a transformers model directory (Llama, Qwen3, SenseNova-U1), a GGUF file, or a preset "
        f"({', '.join(MODEL_PRESETS)}: random weights, token ids only)",
    )
    group.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when available")
    group.add_argument(
        "--dtype", choices=MODEL_DTYPES, default="auto", help="the weights' and activations' dtype (auto: the model's)"
    )
    group.add_argument(
        "--seed", type=bounded(int, 0), default=0, help="seed of a preset's random weights, workloads and sampling"
    )
    group.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="fp8: e4m3 weights (per-channel scales computed at load) and per-token e4m3 activations in the "
        "decoder's linear layers (an FP8 checkpoint loads as published without it)",
    )
    group.add_argument(
        "-t",
        "--threads",
        type=bounded(int, 0, 4096),
        default=0,
        help=f"CPU threads for torch (0: torch's default, except one for {CPU_MODEL}, whose small ops run fastest "
        "on one)",
    )


def add_engine_options(group: argparse._ArgumentGroup, storage: argparse._ArgumentGroup) -> None:
    """The Engine's options (run, serve): sizing and scheduling in `group`, K/V storage and
    speculative decoding in `storage`."""
    _add_sizing(group)
    _add_scheduling(group)
    _add_storage(storage)


def _add_sizing(group: argparse._ArgumentGroup) -> None:
    """How many sequences, how long, in how much memory, and how many tokens a step takes."""
    group.add_argument(
        "--max-seqs",
        "--max-num-seqs",
        type=or_auto(bounded(int, 1, MAX_POSITIONS)),
        metavar="N|auto",
        help=f"resident sequences (cache columns; n samples take n); auto: the store sized to "
        f"--memory-fraction, then up to {MAX_SAMPLE_ROWS} sequences it holds (default: auto on CUDA, "
        f"{CPU_MAX_SEQS} on the CPU)",
    )
    group.add_argument(
        "--memory-fraction",
        "--gpu-memory-utilization",
        type=bounded(float, 0.0, 1.0, open_lo=True),
        metavar="F",
        help="share of the device's memory for weights, activations, graphs and K/V; the store is allocated whole "
        f"to fit it (default: {DEFAULT_MEMORY_FRACTION} with --max-seqs auto; without it, the store of --max-seqs N "
        "grows on demand)",
    )
    group.add_argument(
        "--capacity",
        "--max-model-len",
        type=or_auto(bounded(int, 2, MAX_POSITIONS)),
        metavar="N|auto",
        help=f"positions per sequence, prompt + generated tokens; auto: the model's max_position_embeddings "
        f"(default: min({DEFAULT_CAPACITY}, the model's))",
    )
    group.add_argument(
        "--max-step-tokens",
        "--max-num-batched-tokens",
        type=or_auto(bounded(int, 1, MAX_STEP_TOKENS)),
        default="auto",
        metavar="N|auto",
        help=f"token budget of one step; auto: {DEFAULT_STEP_TOKENS} for an 8B model's 16 GB of bf16 weights and on "
        "the CPU, more for smaller models on CUDA, up to 8192 (a step's matmuls cost about the same)",
    )
    group.add_argument(
        "--prefill-chunk",
        type=bounded(int, 1),
        metavar="N",
        help=f"most prompt tokens per sequence per step (default: {DEFAULT_PREFILL_CHUNK}, within --capacity and "
        "--max-step-tokens)",
    )
    group.add_argument(
        "--prefill-budget",
        type=bounded(int, 1, MAX_STEP_TOKENS),
        metavar="N",
        help="most prompt tokens per step, all prompts, while samples are running (default: half of "
        "--max-step-tokens, at least one prefill chunk; with none running a step fills the step)",
    )


def _add_scheduling(group: argparse._ArgumentGroup) -> None:
    """Prefix reuse, overlap, graphs and tensor parallelism."""
    group.add_argument(
        "--prefix-cache",
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the K/V of prompt prefixes the store holds (off under dflash); --no-prefix-cache recomputes "
        "every prompt",
    )
    group.add_argument(
        "--overlap", choices=tuple(MODES), default="auto", help="plan step N+1 while the device runs step N "
        "(auto: on CUDA unless speculating)"
    )  # fmt: skip
    group.add_argument("--graphs", choices=tuple(MODES), default="auto", help="CUDA graphs (auto: on CUDA)")
    group.add_argument(
        "-tp",
        "--tensor-parallel",
        "--tensor-parallel-size",
        dest="tensor_parallel",
        type=bounded(int, 1, 64),
        default=1,
        metavar="N",
        help="processes that shard the model, one per GPU of this host (gloo processes on the CPU); N > 1 needs "
        "a preset or a model directory",
    )


def _add_storage(storage: argparse._ArgumentGroup) -> None:
    """K/V storage dtype and speculative decoding."""
    storage.add_argument(
        "--kv-dtype",
        choices=("model", "fp8", *STORAGE_DTYPES),
        default="model",
        help="K/V storage dtype (model: the model's; fp8: float8_e4m3fn, e4m3 with a scale per position and head)",
    )
    storage.add_argument(
        "--speculative",
        choices=("off", "ngram", "dflash"),
        default="off",
        help="ngram: prompt lookup; dflash: a DFlash block drafter (random weights unless --drafter)",
    )
    storage.add_argument(
        "--spec-block", type=int, metavar="N", help="verify rows per sample per step (default: 16; ngram 8)"
    )
    storage.add_argument("--spec-layers", type=int, default=1, metavar="N", help="dflash: layers of a random drafter")
    storage.add_argument(
        "--drafter", metavar="DIR", help="dflash: drafter checkpoint folder (config.json + safetensors)"
    )


# ---- options -> a device, a model, an engine ------------------------------------------------------
def resolve_device(args: argparse.Namespace) -> str:
    """The device a command runs on, or a ConfigError whose advice works on this machine; refuses
    a --model that is neither a preset nor an existing path."""
    from batchkv import ops

    cuda = torch.cuda.is_available()
    if args.model not in MODEL_PRESETS and not os.path.exists(args.model):
        raise ConfigError(
            f"--model {args.model}: neither a preset ({', '.join(MODEL_PRESETS)}) nor an existing directory or "
            "GGUF file"
        )
    small = args.model not in MODEL_PRESETS or args.model == CPU_MODEL  # a real model runs wherever it fits
    device = ("cuda" if cuda else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not cuda:
        fix = "use --device cpu (or auto)" if small else f"{args.model} needs a GPU: here use --model {CPU_MODEL}"
        raise ConfigError(f"--device cuda, but CUDA is not available on this machine; {fix}")
    if device == "cpu" and not small:
        fix = "use --device cuda (or auto)" if cuda else f"this machine has no CUDA GPU: use --model {CPU_MODEL} here"
        raise ConfigError(f"--model {args.model} is too large for the CPU; {fix}")
    graphs = getattr(args, "graphs", "auto")
    if graphs == "on" and device != "cuda":
        raise ConfigError("--graphs on needs a CUDA device (CUDA graphs); on the CPU use --graphs auto or off")
    if graphs == "on" and not ops.triton_available(torch.device(device)):
        raise ConfigError("--graphs on needs Triton (pip install 'batchkv[triton]'); use --graphs auto or off")
    return device


def set_threads(args: argparse.Namespace) -> None:
    """--threads: torch's CPU threads (0: torch's default, one for the tiny preset)."""
    threads = args.threads or (1 if args.model == CPU_MODEL else 0)
    if threads:
        torch.set_num_threads(threads)


def torch_dtype(name: str) -> torch.dtype | None:
    """--dtype: None for auto (the model's own)."""
    return None if name == "auto" else dtype_named(name)


def load_model(args: argparse.Namespace, device: str, *, quantized: bool = True):
    """The `ServedModel` (model, tokenizer, stop ids, limit) --model names; with --tensor-parallel > 1
    everything but the weights, which each rank loads (`build_engine`)."""
    from batchkv.serve.loading import load_served_model

    weights = getattr(args, "tensor_parallel", 1) == 1
    quantization = args.quantization if quantized else None  # quantized=False: the float model (score's reference)
    return load_served_model(args.model, device, dtype=args.dtype, seed=args.seed, weights=weights,
                             quantization=quantization)  # fmt: skip


def resolve_capacity(flag: int | str | None, limit: int | None) -> int:
    """--capacity: None min(DEFAULT_CAPACITY, the model's limit); auto the limit (else DEFAULT_CAPACITY);
    a number beyond the limit is a ConfigError."""
    if flag is None:
        return min(DEFAULT_CAPACITY, limit or DEFAULT_CAPACITY)
    if flag == "auto":
        return limit or DEFAULT_CAPACITY
    if limit and flag > limit:
        raise ConfigError(f"--capacity {flag} is beyond the model's max_position_embeddings {limit}; lower it")
    return int(flag)


def build_engine(args: argparse.Namespace, served, device: str):
    """The Engine the options ask for, over `served` (from `load_model`): the one construction every
    command uses."""
    from batchkv.executor import Engine

    tp = args.tensor_parallel
    model = served.model if tp == 1 else model_source(args.model, seed=args.seed, dtype=torch_dtype(args.dtype),
                                                      quantization=args.quantization)  # fmt: skip
    return Engine(
        model,
        tensor_parallel=tp,
        **scheduling_kwargs(args, device),
        capacity=resolve_capacity(args.capacity, served.max_positions),
        max_step_tokens=args.max_step_tokens,
        prefill_chunk=args.prefill_chunk,  # None: the Engine's default, within capacity and the step budget
        device=device,
        use_graphs=MODES[args.graphs],
        seed=args.seed,
        kv_dtype=kv_dtype_option(args.kv_dtype),
        speculative=speculative_option(args, served.model),
    )


def model_source(
    name: str, *, seed: int, dtype: torch.dtype | None = None, quantization: str | None = None
) -> functools.partial:
    """What each tensor-parallel rank builds its share from: a preset, or a model directory (a GGUF file
    is converted here, once, before the ranks start)."""
    from batchkv.models.loading import load, resolve

    return functools.partial(load, resolve(name), seed=seed, dtype=dtype, quantization=quantization)


def scheduling_kwargs(args: argparse.Namespace, device: torch.device | str | None = None) -> dict[str, Any]:
    """The Engine's sizing and scheduling keywords from `add_engine_options`' flags; `device` (where
    the engine runs) resolves the per-device --max-seqs default: auto on CUDA, `CPU_MAX_SEQS`
    elsewhere. A --memory-fraction given with a number of sequences sizes the store for them
    (`kv_positions="auto"`), as vLLM's gpu_memory_utilization does."""
    max_seqs = args.max_seqs
    if max_seqs is None:
        max_seqs = "auto" if device is not None and torch.device(device).type == "cuda" else CPU_MAX_SEQS
    sized = args.memory_fraction is not None and max_seqs != "auto"
    return {
        "max_seqs": max_seqs,
        "memory_fraction": args.memory_fraction if args.memory_fraction is not None else DEFAULT_MEMORY_FRACTION,
        "kv_positions": "auto" if sized else None,
        "prefill_budget": args.prefill_budget,
        "overlap": MODES[args.overlap],
        "prefix_cache": args.prefix_cache,
    }


def kv_dtype_option(name: str) -> torch.dtype | None:
    """--kv-dtype: None for "model" (the model's dtype), else the storage dtype ("fp8" is e4m3)."""
    return None if name == "model" else dtype_named("float8_e4m3fn" if name == "fp8" else name)


def speculative_option(args: argparse.Namespace, model) -> object | None:
    """The engine's `SpeculativeConfig` from --speculative/--spec-block/--spec-layers/--drafter, or None.
    `model` None (tensor parallelism): the drafter is a factory each rank builds against its share."""
    from batchkv.executor import SpeculativeConfig

    if args.speculative == "off":
        if args.drafter or args.spec_block is not None:
            raise ConfigError("--drafter and --spec-block need --speculative ngram|dflash")
        return None
    if args.speculative == "ngram":
        return SpeculativeConfig("ngram", block_size=args.spec_block or 8)
    kwargs = {"num_layers": args.spec_layers, "block_size": args.spec_block or 16, "seed": getattr(args, "seed", 0),
              "checkpoint": args.drafter}  # fmt: skip
    if model is None:
        factory = functools.partial(drafter, **kwargs)
        return SpeculativeConfig("dflash", block_size=kwargs["block_size"], drafter=factory)
    return SpeculativeConfig("dflash", block_size=args.spec_block, drafter=drafter(model, **kwargs))


def drafter(target, *, num_layers: int, block_size: int, seed: int, checkpoint: str | None):
    """A DFlash drafter for `target` tapping `default_target_layers` (random unless `checkpoint`)."""
    from batchkv.models.dflash import build_drafter, default_target_layers

    layers = default_target_layers(target.cache_spec()["num_layers"])
    return build_drafter(target, num_layers=num_layers, target_layer_ids=layers, block_size=block_size, seed=seed,
                         checkpoint=checkpoint)  # fmt: skip
