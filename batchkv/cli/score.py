"""`batchkv score`: a K/V storage dtype checked on your own text (perplexity, top-1 agreement, KL;
the arithmetic is `batchkv.score`'s)."""

from __future__ import annotations

import argparse

from batchkv.cli.common import COMMANDS, Help, bounded
from batchkv.errors import ConfigError


def add_score(sub: argparse._SubParsersAction) -> None:
    from batchkv.cli.options import add_model_options
    from batchkv.dtypes import STORAGE_DTYPES

    names = ("fp8", *STORAGE_DTYPES)  # fp8 is float8_e4m3fn

    p = sub.add_parser(
        "score",
        help=COMMANDS["score"],
        description="Teacher-force each text file through the model twice, K/V stored as --kv-dtype and as "
        "--reference (batchkv.score), and print perplexity under each, top-1 agreement and mean KL.",
        formatter_class=Help,
    )
    add_model_options(p.add_argument_group("model"))
    p.add_argument("files", nargs="+", metavar="FILE", help="UTF-8 text files (tokenized with the model's tokenizer)")
    p.add_argument(
        "--kv-dtype",
        choices=names,
        default=None,
        help="storage dtype tested (fp8 is e4m3; default fp8, or with --quantization the reference's)",
    )
    p.add_argument("--reference", choices=names, default="bfloat16", help="storage dtype compared against")
    p.add_argument("--chunk", type=bounded(int, 1, 1 << 16), default=64, help="tokens per prompt chunk")
    p.add_argument("--max-tokens", type=bounded(int, 2), default=4096, help="score at most this many tokens per file")
    p.add_argument("--key-rotation", action="store_true", help="rotate e4m3 keys (CacheConfig.key_rotation)")
    p.set_defaults(func=_cmd_score)


def _cmd_score(args: argparse.Namespace) -> int:
    from batchkv.cli.options import kv_dtype_option, load_model, resolve_device, set_threads
    from batchkv.score import make_cache, score_caches

    if args.model is None:
        raise ConfigError("score needs --model MODEL (a transformers directory or a GGUF file)")
    texts = []
    for path in args.files:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    device = resolve_device(args)
    set_threads(args)
    kv_dtype = args.kv_dtype or (args.reference if args.quantization else "fp8")
    tested_dtype, reference_dtype = kv_dtype_option(kv_dtype), kv_dtype_option(args.reference)
    served = load_model(args, device, quantized=False)  # the reference: the model as it is
    if served.tokenizer is None:
        raise ConfigError(f"--model {args.model} has no tokenizer; batchkv score reads text")
    tested_model = load_model(args, device).model if args.quantization else served.model  # FP8 compute
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
