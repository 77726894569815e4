"""`batchkv serve`: its options, and what they become (the engine, the `Limits` on each request,
the `Access` rules), then the server of `batchkv.serve.server` over them. Argparse only at import:
the server's imports wait for `cmd_serve`.

Limits default to what a server facing untrusted clients wants (see `limits`); access defaults
to a loopback server with no key that answers only to loopback Host names. An API key comes from
--api-key or the BATCHKV_API_KEY environment variable (the flag wins), never from --help's text.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from batchkv.cli.common import COMMANDS, Help, bounded
from batchkv.cli.options import (
    add_engine_options,
    add_model_options,
    build_engine,
    load_model,
    resolve_device,
    set_threads,
)
from batchkv.errors import ConfigError, DependencyError, RequestError
from batchkv.serve.access import Access, is_loopback, loopback_hosts
from batchkv.serve.limits import Limits

MAX_DRAIN_SECONDS = 86400.0
KEY_VARIABLE = "BATCHKV_API_KEY"
_DEFAULTS = Limits()


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing; give a comma-separated list")
    return names


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


def add_serve(sub: argparse._SubParsersAction) -> None:
    """The `serve` subcommand."""
    p = sub.add_parser(
        "serve",
        help=COMMANDS["serve"],
        description="Serve a transformers model directory (Llama, Qwen3, SenseNova-U1), a GGUF file (converted once "
        "to such a directory) or a preset over /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics (needs batchkv[serve]). vLLM's spellings of the shared options are accepted beside batchkv's.",
        formatter_class=Help,
    )
    add_arguments(p)
    p.set_defaults(func=cmd_serve)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `batchkv serve`: the model (also its first positional argument, as vLLM takes
    it) and the model and engine options every command shares (`batchkv.cli.options`), then serve's own."""
    m = p.add_argument_group("model")
    m.add_argument("model_argument", nargs="?", metavar="MODEL", help="the model, as --model (vLLM's spelling)")
    add_model_options(m)
    m.add_argument("--served-model-name", metavar="NAME", help="the name clients send as `model` (default: --model)")
    m.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "mistral"),
        help="how tool calls are read from the model's output (default: from its chat template)",
    )
    e = p.add_argument_group("engine")
    add_engine_options(e, p.add_argument_group("storage and speculative decoding"))
    e.add_argument(
        "--max-waiting",
        type=bounded(int, 1),
        default=256,
        metavar="N",
        help="requests queued for columns before 429s; a batch of more prompts is a 400",
    )
    e.add_argument(
        "--engine-process",
        choices=("auto", "on", "off"),
        default="auto",
        help="run the engine in a process of its own (on), or on a thread of the HTTP process (off); auto: on "
        "with a CUDA device, off on the CPU (docs/design.md, 'HTTP server')",
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
    p.add_argument_group("ray serve").add_argument(
        "--ray-replicas",
        type=bounded(int, 0, 4096),
        default=0,
        metavar="N",
        help="serve N engine replicas on Ray Serve (the cluster at RAY_ADDRESS, else one started here) behind "
        "this endpoint, with prefix-affinity routing; needs batchkv[ray] (0, the default: no Ray)",
    )


def model_of(args: argparse.Namespace) -> str:
    """The served model: the positional MODEL or --model (one of them; the same if both)."""
    given = {name for name in (args.model_argument, args.model) if name is not None}
    if not given:
        raise ConfigError("serve needs a model: batchkv serve MODEL (or --model MODEL); see batchkv serve --help")
    if len(given) > 1:
        raise ConfigError(f"the model is given twice, as {args.model_argument!r} and --model {args.model!r}; give one")
    return given.pop()


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model, build the engine, serve until a signal stops the server; returns the exit status."""
    import logging

    from batchkv.serve import server

    server.require_extra()
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    args.model = model_of(args)
    device = resolve_device(args)
    set_threads(args)
    key = api_key(args)
    sock = server.listen(args.host, args.port)  # before the model loads: an address in use fails at once
    try:
        bound = sock.getsockname()[0]
        if key is None and not is_loopback(bound):
            print(
                f"batchkv serve: warning: listening on {args.host} (not a loopback address) without an API key: "
                "anyone who reaches this address can use the server (set --api-key or BATCHKV_API_KEY)",
                file=sys.stderr,
                flush=True,
            )
        access = access_from(args, bound)
        if in_process_of_its_own(args, device):
            return _serve_from_process(args, device, access, sock)
        served = load_model(args, device)
        with build_engine(args, served, device) as engine:  # leaving stops the other tensor-parallel ranks
            info = _model_info(args, served, engine)
            constraints = use_tokenizer(engine, served.tokenizer)
            _announce(args, served, engine, info, device, sock.getsockname()[1], access, constraints)
            return server.run(engine, info, access, sock, max_waiting=args.max_waiting,
                              drain_timeout=args.drain_timeout, log_level=args.log_level,
                              access_log=args.access_log)  # fmt: skip
    finally:
        sock.close()


def in_process_of_its_own(args: argparse.Namespace, device: str) -> bool:
    """--engine-process: whether the engine runs in a process of its own (auto: with CUDA)."""
    return args.engine_process == "on" or (args.engine_process == "auto" and device == "cuda")


def _serve_from_process(args: argparse.Namespace, device: str, access: Access, sock) -> int:
    """`cmd_serve` with the engine in a process of its own (`serve.process`): that process loads the
    model, builds the engine and announces it; this one serves HTTP over it."""
    import functools

    from batchkv.serve import server
    from batchkv.serve.metrics import ServerMetrics
    from batchkv.serve.process import ProcessWorker

    port = sock.getsockname()[1]
    factory = functools.partial(served_engine, args, device, access, port)
    worker = ProcessWorker(factory, max_waiting=args.max_waiting, request_timeout=limits_from(args).request_timeout,
                           log_level=args.log_level)  # fmt: skip
    try:
        info, max_seqs = worker.launch()
        worker.metrics = metrics = ServerMetrics(max_seqs)
        return server.serve(worker, info, metrics, access, sock, drain_timeout=args.drain_timeout,
                            log_level=args.log_level, access_log=args.access_log)  # fmt: skip
    finally:
        worker.stop()


def served_engine(args: argparse.Namespace, device: str, access: Access, port: int):
    """(In the engine process) load the model, build the engine, announce it and capture its graphs:
    (engine, (the served model's ModelInfo, max_seqs))."""
    from batchkv.serve import server

    set_threads(args)
    served = load_model(args, device)
    engine = build_engine(args, served, device)
    try:
        info = _model_info(args, served, engine)
        constraints = use_tokenizer(engine, served.tokenizer)
        _announce(args, served, engine, info, device, port, access, constraints)
        server.warm(engine)  # the engine process serves until it exits
    except BaseException:
        engine.close()
        raise
    return engine, (info, engine.cache.max_seqs)


def use_tokenizer(engine, tokenizer) -> str:
    """Bind the tokenizer for constrained decoding when it can be; says whether it was (and why not)."""
    if tokenizer is None:
        return "off (no tokenizer)"
    try:
        engine.use_tokenizer(tokenizer)
    except (DependencyError, RequestError) as exc:
        return f"off ({exc})"
    return "on"


def _model_info(args: argparse.Namespace, served, engine):
    from batchkv.serve.jobs import ModelInfo
    from batchkv.serve.tools import check_parser

    max_seqs = engine.cache.max_seqs  # what --max-seqs auto chose, else --max-seqs
    limits = replace(limits_from(args), max_n=min(args.max_n, max_seqs))  # n samples take n columns: one bound
    name = args.served_model_name or args.model
    return ModelInfo(name, served.tokenizer, engine.cache.capacity, served.eos_ids, limits,
                     tool_parser=check_parser(args.tool_call_parser), vocab_size=engine.vocab_size)  # fmt: skip


def _announce(
    args: argparse.Namespace, served, engine, info, device: str, port: int, access: Access, constraints: str
) -> None:
    """The startup line on stderr: what is served, how, and where."""
    mode = ("graphs" if engine.uses_graphs else "eager") + (", overlap" if engine.overlap else "")
    mode += ", engine process" if in_process_of_its_own(args, device) else ""
    mode += f", tensor parallel {args.tensor_parallel}" if args.tensor_parallel > 1 else ""
    text = "text and token ids" if served.tokenizer is not None else "token ids only (no tokenizer)"
    extras = f", kv {args.kv_dtype}" if args.kv_dtype != "model" else ""
    if args.speculative != "off":
        extras += f", speculative {args.speculative} (block {engine.speculator.block_size})"
    if args.prefill_budget is not None:
        extras += f", prefill budget {args.prefill_budget}"
    extras += ", API key required" if access.api_key else ""
    extras += f", structured outputs {constraints}"
    print(
        f"batchkv serve: {info.name} ({served.kind}, {text}) on {device} ({mode}), max_seqs {engine.cache.max_seqs}, "
        f"capacity {info.capacity}{extras}; http://{args.host}:{port}/v1",
        file=sys.stderr,
        flush=True,
    )
    if engine.sizing is not None:
        print(f"batchkv serve: sized the store: {engine.sizing.describe()}", file=sys.stderr, flush=True)
