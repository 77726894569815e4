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

from batchkv.cli import bounded
from batchkv.errors import ConfigError
from batchkv.frontend import add_engine_options, add_model_options
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
        help="a larger request body is refused with 413 before it is read",
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
        help="stop strings per request (OpenAI allows 4)",
    )
    g.add_argument(
        "--max-stop-length",
        type=bounded(int, 1),
        default=d.max_stop_length,
        metavar="N",
        help="characters per stop string",
    )
    g.add_argument(
        "--max-stop-token-ids",
        type=bounded(int, 0),
        default=d.max_stop_token_ids,
        metavar="N",
        help="stop_token_ids per request",
    )
    g.add_argument(
        "--max-n",
        type=bounded(int, 1, 64),
        default=d.max_n,
        metavar="N",
        help="samples per prompt, n (at most --max-seqs)",
    )
    g.add_argument(
        "--max-json-depth",
        type=bounded(int, 2, 512),
        default=d.max_json_depth,
        metavar="N",
        help="nesting of the request's JSON",
    )
    g.add_argument(
        "--request-timeout",
        type=bounded(float, 0.0),
        default=d.request_timeout,
        metavar="S",
        help="seconds from arrival to the last token; then the request ends with finish_reason 'timeout' (0: no limit)",
    )
    g.add_argument(
        "--chat-template-timeout",
        type=bounded(float, 0.0, open_lo=True),
        metavar="S",
        default=d.chat_template_timeout,
        help="seconds one chat template render may take",
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
    """The options of `batchkv serve`: the model (also its first positional argument, as vLLM takes
    it) and engine options every command shares (`batchkv.frontend`), then serve's own."""
    m = p.add_argument_group("model")
    m.add_argument("model_argument", nargs="?", metavar="MODEL", help="the model, as --model (vLLM's spelling)")
    add_model_options(m)
    m.add_argument("--served-model-name", metavar="NAME", help="the name clients send as `model` (default: --model)")
    e = p.add_argument_group("engine")
    add_engine_options(e, p.add_argument_group("storage and speculative decoding"))
    e.add_argument(
        "--max-waiting",
        type=bounded(int, 1),
        default=256,
        metavar="N",
        help="requests queued for columns before 429s; a batch of more prompts is a 400",
    )
    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on")
    h.add_argument("--port", type=bounded(int, 0, 65535), default=8000, help="0: any free port")
    h.add_argument(
        "--drain-timeout",
        type=bounded(float, 0.0, MAX_DRAIN_SECONDS),
        default=30.0,
        metavar="S",
        help="seconds in-flight requests get at shutdown",
    )
    h.add_argument(
        "--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info", help="uvicorn's"
    )
    h.add_argument("--access-log", action="store_true", help="log every HTTP request")
    _add_limits(p)
    _add_access(p)


def model_of(args: argparse.Namespace) -> str:
    """The served model: the positional MODEL or --model (one of them; the same if both)."""
    given = {name for name in (args.model_argument, args.model) if name is not None}
    if not given:
        raise ConfigError("serve needs a model: batchkv serve MODEL (or --model MODEL); see batchkv serve --help")
    if len(given) > 1:
        raise ConfigError(f"the model is given twice, as {args.model_argument!r} and --model {args.model!r}; give one")
    return given.pop()
