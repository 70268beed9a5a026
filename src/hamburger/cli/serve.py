"""`hamburger serve`: the OpenAI-compatible server (`serving/server.py`) on a host and port."""

from __future__ import annotations

import argparse
import signal
import sys

from hamburger.cli.common import (
    PREFILL_TOKENS,
    add_decode_threads_arg,
    add_kv_cache_arg,
    add_lookup_arg,
    add_mode_arg,
    add_model_args,
    add_output_args,
    add_quantize_args,
    command,
    load_model,
    parse_kv_memory,
)
from hamburger.errors import HamburgerError
from hamburger.model.config import DRAFT_ROWS, check_confidence, parse_draft_rows

DEFAULT_MAX_LEN = 2048  # per row: 8 rows of SmolLM2-135M then hold 0.7 GB of float32 keys and values
def register(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "serve", "OpenAI-compatible HTTP server with streaming and continuous batching")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="rows of the batch (requests decoded together); default: 8, or as many as --kv-memory holds")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait for a row; more get 429")
    p.add_argument("--max-len", type=int, default=None, help=f"KV entries per row (prompt + max_tokens in verify "
                   "mode; a compress or trust reply keeps about one entry per step, so it may be longer); default: "
                   f"the model's context, at most {DEFAULT_MAX_LEN}")
    p.add_argument("--kv-memory", type=parse_kv_memory, default=None, metavar="SIZE",
                   help="size the base's KV cache by memory instead of --max-batch-size: as many rows of --max-len "
                        "entries as SIZE holds (bytes: 512MB, 2GiB; or entries over all rows: 40000entries)")
    p.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS,
                   help="waiting prompts are prefilled together, shortest first, in passes of at most this many padded "
                        "tokens (1: each alone)")
    p.add_argument("--interleave-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="one prefill pass per step between macro-steps, so a burst's shortest prompts get their first "
                        "tokens early and running requests never wait for a whole burst's prefill; "
                        "--no-interleave-prefill: prefill every waiting prompt that has a free row in one step")
    add_decode_threads_arg(p)
    add_mode_arg(p, "the mode of requests that name none; default: the checkpoint's")
    add_lookup_arg(p)
    add_kv_cache_arg(p)
    p.add_argument("--draft-rows", type=parse_draft_rows, default="auto", metavar="N",
                   help="verify-mode requests draft only while at most N requests run; beyond, their steps are plain "
                        f"base steps, their output the same. 'auto' (default): {DRAFT_ROWS} on a GPU and with fp16 "
                        "weights on a CPU, 0 with float weights on a CPU (measured on 2 cores); 'all': always")
    p.add_argument("--default-confidence", type=float, default=None,
                   help="confidence for requests that do not send one (default: the checkpoint's)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM before they are cancelled")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no line per request on stderr (method, path, status, tokens, seconds)")
    add_model_args(p)
    add_quantize_args(p)
    add_output_args(p)
    p.set_defaults(func=cmd_serve)


def kv_bytes(model, kv_memory: tuple[int, str] | None, kv_dtype: str | None = None) -> int | None:
    """`--kv-memory` in bytes of the loaded model's base cache (in the dtype the engine keeps it in)."""
    if kv_memory is None:
        return None
    from hamburger.inference.runner import engine_kv_dtype
    from hamburger.inference.stats import kv_bytes_per_entry

    amount, unit = kv_memory
    return amount * kv_bytes_per_entry(model.base.config, engine_kv_dtype(model, kv_dtype)) if unit == "entries" \
        else amount


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hamburger.loading import describe_run, resolve_device
    from hamburger.serving.server import Service, create_app
    from hamburger.serving.service import decode_threads

    for name in ("port", "max_batch_size", "max_queue", "max_len", "prefill_tokens"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "port" else 1):
            raise HamburgerError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.default_confidence is not None:
        check_confidence(args.default_confidence)
    if args.kv_memory is not None and args.max_batch_size is not None:
        raise HamburgerError("--kv-memory sizes the batch: give it or --max-batch-size, not both")
    threads = decode_threads(args.decode_threads, resolve_device(args.device))
    model, trained, scheme = load_model(args, decode_only=True)  # the scheduler: the fast engine only
    service = Service(model, args.model, args.max_batch_size or 8, args.max_queue, args.max_len or DEFAULT_MAX_LEN,
                      args.default_confidence, args.api_key, prefill_tokens=args.prefill_tokens,
                      interleave_prefill=args.interleave_prefill, decode_threads=threads, draft_rows=args.draft_rows,
                      default_mode=args.mode, lookup=args.lookup,
                      kv_memory=kv_bytes(model, args.kv_memory, args.kv_cache_dtype), kv_dtype=args.kv_cache_dtype)
    config = uvicorn.Config(create_app(service, args.access_log), host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    # uvicorn re-raises the SIGTERM it handled after its graceful shutdown; a no-op handler makes that a clean exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    if not args.quiet:
        run = describe_run(model, trained, scheme, args.quantize == "auto", service.default_mode.name, args.lookup)
        sched = service.scheduler
        print(f"hamburger: serving {args.model} on http://{args.host}:{args.port}/v1 ({sched.batch.size} rows x "
              f"{sched.max_len} KV entries, {sched.kv_bytes() / 1e6:.0f} MB"
              + (f"; decode on {threads} of {service.scheduler.prefill_threads} threads" if threads else "")
              + f"): {run}", file=sys.stderr, flush=True)
    uvicorn.Server(config).run()
    return 0
