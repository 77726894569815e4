"""The options of `batchkv serve`, and what they become: the engine's, the `Limits` on each
request and the `Access` rules (argparse only at import: the server's imports wait for `serve`).

Limits default to what a server facing untrusted clients wants (see `limits`); access defaults
to a loopback server with no key that answers only to loopback Host names. An API key comes from
--api-key or the BATCHKV_API_KEY environment variable (the flag wins), never from --help's text.
"""

from __future__ import annotations

import argparse
import ipaddress
import os

from batchkv.cache.config import MAX_POSITIONS, MAX_STEP_TOKENS
from batchkv.cli import bounded
from batchkv.errors import ConfigError
from batchkv.executor.sizing import DEFAULT_CAPACITY, DEFAULT_PREFILL_CHUNK, DEFAULT_STEP_TOKENS
from batchkv.frontend import MODES, add_engine_options, add_scheduling_options, add_tensor_parallel
from batchkv.serve.access import Access, loopback_hosts
from batchkv.serve.limits import Limits

MAX_DRAIN_SECONDS = 86400.0
KEY_VARIABLE = "BATCHKV_API_KEY"
_DEFAULTS = Limits()


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing; give a comma-separated list")
    return names


def is_loopback(address: str) -> bool:
    """Whether a bound (numeric) address is a loopback one."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return address == "localhost"


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $BATCHKV_API_KEY, else None; an empty key is a ConfigError."""
    key = args.api_key if args.api_key is not None else os.environ.get(KEY_VARIABLE) or None
    if key is not None and not key.strip():
        raise ConfigError("--api-key is empty; give a key, or leave it out to serve without one")
    return key


def limits_from(args: argparse.Namespace) -> Limits:
    """The per-request Limits the flags ask for."""
    return Limits(
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_prompt_chars=args.max_prompt_chars,
        max_stop_strings=args.max_stop_strings,
        max_stop_length=args.max_stop_length,
        max_stop_token_ids=args.max_stop_token_ids,
        max_n=args.max_n,
        max_json_depth=args.max_json_depth,
        request_timeout=args.request_timeout or None,
        chat_template_timeout=args.chat_template_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
    )


def access_from(args: argparse.Namespace, bound: str) -> Access:
    """The Access rules for a server bound to the numeric address `bound`."""
    hosts = args.allowed_hosts
    if hosts is None:
        hosts = loopback_hosts(bound) if is_loopback(bound) else None
    elif "*" in hosts:
        hosts = None
    return Access(
        api_key=api_key(args),
        public_metrics=args.public_metrics,
        allowed_hosts=hosts,
        allowed_origins=args.allowed_origins or (),
    )


def _add_limits(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    g = p.add_argument_group("request limits")
    g.add_argument(
        "--max-body-bytes",
        type=bounded(int, 1),
        default=d.max_body_bytes,
        metavar="N",
        help="a larger request body is refused with 413 before it is read (%(default)s)",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=bounded(int, 1),
        metavar="N",
        help="tokens in one prompt (default: --capacity less one)",
    )
    g.add_argument(
        "--max-prompt-chars",
        type=bounded(int, 1),
        metavar="N",
        help="characters in one text prompt or conversation, refused before tokenising "
        "(default: 8 per prompt token allowed)",
    )
    g.add_argument(
        "--max-stop-strings",
        type=bounded(int, 0),
        default=d.max_stop_strings,
        metavar="N",
        help="stop strings per request (%(default)s; OpenAI allows 4)",
    )
    g.add_argument(
        "--max-stop-length",
        type=bounded(int, 1),
        default=d.max_stop_length,
        metavar="N",
        help="characters per stop string (%(default)s)",
    )
    g.add_argument(
        "--max-stop-token-ids",
        type=bounded(int, 0),
        default=d.max_stop_token_ids,
        metavar="N",
        help="stop_token_ids per request (%(default)s)",
    )
    g.add_argument(
        "--max-n",
        type=bounded(int, 1, 64),
        default=d.max_n,
        metavar="N",
        help="samples per prompt, n (%(default)s; at most --max-seqs)",
    )
    g.add_argument(
        "--max-json-depth",
        type=bounded(int, 2, 512),
        default=d.max_json_depth,
        metavar="N",
        help="nesting of the request's JSON (%(default)s)",
    )
    g.add_argument(
        "--request-timeout",
        type=bounded(float, 0.0),
        default=d.request_timeout,
        metavar="S",
        help="seconds from arrival to the last token; then the request ends with finish_reason "
        "'timeout' (%(default)s; 0: no limit)",
    )
    g.add_argument(
        "--chat-template-timeout",
        type=bounded(float, 0.0, open_lo=True),
        metavar="S",
        default=d.chat_template_timeout,
        help="seconds one chat template render may take (%(default)s)",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render chat templates that requests supply (refused by default: a template is a program)",
    )


def _add_access(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("access")
    g.add_argument(
        "--api-key", metavar="KEY", help=f"require 'Authorization: Bearer KEY' (default: ${KEY_VARIABLE}; none: no key)"
    )
    g.add_argument("--public-metrics", action="store_true", help="serve /metrics without the key (/health always is)")
    g.add_argument(
        "--allowed-hosts",
        type=_names,
        metavar="NAMES",
        help="Host header names answered, comma-separated; * any (default: the loopback names on a "
        "loopback --host, else any)",
    )
    g.add_argument(
        "--allowed-origins",
        type=_names,
        metavar="ORIGINS",
        help="CORS origins, comma-separated (default: none, no CORS headers)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `batchkv serve`."""
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        required=True,
        metavar="PATH_OR_PRESET",
        help="a transformers model directory, a GGUF file or a preset",
    )
    m.add_argument("--served-model-name", metavar="NAME", help="the name clients send as `model` (default: --model)")
    m.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "mistral"),
        help="how tool calls are read from the model's output (default: from its chat template)",
    )
    m.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto (default): cuda when available"
    )
    m.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float16", "float32"),
        default="auto",
        help="auto (default): the config's",
    )
    m.add_argument(
        "--seed", type=bounded(int, 0), default=0, help="seed of a preset's random weights and of unseeded sampling (0)"
    )
    e = p.add_argument_group("engine")
    add_scheduling_options(e, max_seqs=None, help_max_seqs="resident sequences (cache columns); n samples take n")
    e.add_argument(
        "--capacity",
        type=bounded(int, 2, MAX_POSITIONS),
        help=f"positions per sequence, prompt + max_tokens (default min({DEFAULT_CAPACITY}, max_position_embeddings))",
    )
    e.add_argument(
        "--max-step-tokens",
        type=bounded(int, 1, MAX_STEP_TOKENS),
        default=DEFAULT_STEP_TOKENS,
        help="token budget of one step (%(default)s)",
    )
    e.add_argument(
        "--prefill-chunk",
        type=bounded(int, 1),
        help=f"most prompt tokens per sequence per step (default {DEFAULT_PREFILL_CHUNK}, within --capacity and "
        "--max-step-tokens)",
    )
    e.add_argument(
        "--max-waiting",
        type=bounded(int, 1),
        default=256,
        help="requests queued for columns before 429s; a batch of more prompts is a 400 (%(default)s)",
    )
    e.add_argument("--graphs", choices=tuple(MODES), default="auto", help="CUDA graphs (auto, the default: on CUDA)")
    add_tensor_parallel(e, "--tensor-parallel-size")
    e.add_argument(
        "--threads", type=bounded(int, 0, 4096), default=0, help="CPU threads for torch (0: torch's default)"
    )
    add_engine_options(p.add_argument_group("storage and speculative decoding"))
    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s)")
    h.add_argument("--port", type=bounded(int, 0, 65535), default=8000, help="0: any free port (%(default)s)")
    h.add_argument(
        "--drain-timeout",
        type=bounded(float, 0.0, MAX_DRAIN_SECONDS),
        default=30.0,
        help="seconds in-flight requests get at shutdown (%(default)s)",
    )
    h.add_argument(
        "--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info", help="(%(default)s)"
    )
    h.add_argument("--access-log", action="store_true", help="log every HTTP request")
    _add_limits(p)
    _add_access(p)
    p.add_argument_group("ray serve").add_argument(
        "--ray-replicas",
        type=bounded(int, 0, 4096),
        default=0,
        metavar="N",
        help="serve N engine replicas on Ray Serve (the cluster at RAY_ADDRESS, else one started here) behind "
        "this endpoint, with prefix-affinity routing; needs batchkv[ray] (0, the default: no Ray)",
    )
