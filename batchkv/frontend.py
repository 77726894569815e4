"""Options the front ends share (`batchkv run` and `batchkv serve`): store sizing, scheduling, K/V
storage dtype and speculation.

Each turns command-line values into what the `Engine` takes; both commands add the same flags with
`add_scheduling_options` and `add_engine_options`, so the two stay in step.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch

from batchkv.cache.config import MAX_POSITIONS, MAX_STEP_TOKENS
from batchkv.cli import bounded
from batchkv.dtypes import STORAGE_DTYPES, dtype_named
from batchkv.errors import ConfigError

MODES = {"auto": "auto", "on": True, "off": False}  # --graphs, --overlap -> the Engine's values


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


CPU_MAX_SEQS = 16  # `--max-seqs` by default on the CPU where a command's default is per device (serve)


def add_scheduling_options(group: argparse._ArgumentGroup, *, max_seqs: int | None, help_max_seqs: str) -> None:
    """--max-seqs (a number, or auto with --memory-fraction), --prefill-budget, --overlap.
    `max_seqs` None: auto on CUDA, `CPU_MAX_SEQS` on the CPU (resolved by `scheduling_kwargs`)."""
    default = f"auto on CUDA, {CPU_MAX_SEQS} on the CPU" if max_seqs is None else "%(default)s"
    group.add_argument(
        "--max-seqs",
        type=or_auto(bounded(int, 1, MAX_POSITIONS)),
        default=max_seqs,
        help=f"{help_max_seqs}; auto: 256, the store sized to --memory-fraction (default {default})",
    )
    group.add_argument(
        "--memory-fraction",
        type=bounded(float, 0.0, 1.0, open_lo=True),
        default=0.9,
        metavar="F",
        help="with --max-seqs auto: share of the device's memory for weights, activations, graphs and K/V "
        "(default %(default)s)",
    )
    group.add_argument(
        "--prefill-budget",
        type=bounded(int, 1, MAX_STEP_TOKENS),
        metavar="N",
        help="most prompt tokens per step, all prompts, while samples are running (default: half of "
        "--max-step-tokens, at least one prefill chunk; with none running a step fills the step)",
    )
    group.add_argument(
        "--overlap",
        choices=tuple(MODES),
        default="auto",
        help="plan step N+1 while the device runs step N (default %(default)s: on CUDA unless speculating)",
    )
    group.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="recompute every prompt (default: reuse the K/V of prefixes the store holds; off under dflash)",
    )


def add_tensor_parallel(group: argparse._ArgumentGroup, flag: str) -> None:
    """`flag` (run: --tensor-parallel, serve: --tensor-parallel-size, as vLLM names it) -> args.tensor_parallel."""
    group.add_argument(
        flag,
        dest="tensor_parallel",
        type=bounded(int, 1, 64),
        default=1,
        metavar="N",
        help="processes that shard the model, one per GPU of this host (gloo processes on the CPU); N > 1 needs a "
        "preset or a model directory (default 1)",
    )


def model_source(
    name: str, *, seed: int, dtype: torch.dtype | None = None, quantization: str | None = None
) -> functools.partial:
    """What each tensor-parallel rank builds its share from: a preset, or a model directory (a GGUF file
    is converted here, once, before the ranks start)."""
    from batchkv.tp.models import load, resolve

    return functools.partial(load, resolve(name), seed=seed, dtype=dtype, quantization=quantization)


def scheduling_kwargs(args: argparse.Namespace, device: torch.device | str | None = None) -> dict[str, Any]:
    """The Engine's keywords from `add_scheduling_options`' flags; `device` (where the engine runs)
    resolves a per-device --max-seqs default: auto on CUDA, `CPU_MAX_SEQS` elsewhere."""
    max_seqs = args.max_seqs
    if max_seqs is None:
        max_seqs = "auto" if device is not None and torch.device(device).type == "cuda" else CPU_MAX_SEQS
    return {
        "max_seqs": max_seqs,
        "memory_fraction": args.memory_fraction,
        "prefill_budget": args.prefill_budget,
        "overlap": MODES[args.overlap],
        "prefix_cache": args.prefix_cache,
    }


def add_engine_options(group: argparse._ArgumentGroup) -> None:
    """--kv-dtype, --quantization, --speculative, --spec-block, --spec-layers, --drafter."""
    add_quantization(group)
    group.add_argument(
        "--kv-dtype",
        choices=("model", "fp8", *STORAGE_DTYPES),
        default="model",
        help="K/V storage dtype (model: the model's; fp8: float8_e4m3fn, e4m3 with a scale per position and head)",
    )
    group.add_argument(
        "--speculative",
        choices=("off", "ngram", "dflash"),
        default="off",
        help="ngram: prompt lookup; dflash: a DFlash block drafter (random weights unless --drafter)",
    )
    group.add_argument(
        "--spec-block", type=int, metavar="N", help="verify rows per sample per step (default 16; ngram 8)"
    )
    group.add_argument("--spec-layers", type=int, default=1, metavar="N", help="dflash: layers of a random drafter")
    group.add_argument("--drafter", metavar="DIR", help="dflash: drafter checkpoint folder (config.json + safetensors)")


def add_quantization(group: argparse._ArgumentGroup) -> None:
    """--quantization (run, serve and score): FP8 compute for the decoder's linear layers."""
    group.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="fp8: e4m3 weights (per-channel scales computed at load) and per-token e4m3 activations in the "
        "decoder's linear layers (an FP8 checkpoint loads as published without it)",
    )


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
