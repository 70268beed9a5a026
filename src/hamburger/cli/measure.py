"""The commands that measure: `eval` (quality and fidelity to the base), `bench` (decode speed against what users
run instead) and `bench-serve` (load on the server)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hamburger.cli.common import (
    BENCH_SETS,
    BENCH_SYSTEMS,
    DEFAULT_TASKS,
    MAX_NEW_TOKENS,
    TASKS,
    add_decode_threads_arg,
    add_engine_arg,
    add_lookup_arg,
    add_model_args,
    add_output_args,
    add_quantize_args,
    command,
    load_model,
    parse_kv_memory,
    say_start,
)
from hamburger.errors import HamburgerError
from hamburger.model.config import DRAFT_ROWS, MODES, check_lookup, parse_draft_rows


def register(sub: argparse._SubParsersAction) -> None:
    register_eval(sub)
    register_bench(sub)
    register_bench_serve(sub)


def add_report_args(parser: argparse.ArgumentParser, what: str, force: bool = True, plot: str | None = None) -> None:
    """--json (`what` written there), --force (overwrite it), --plot (figures in a folder): what a measuring command
    writes besides its printed table."""
    group = parser.add_argument_group("report")
    group.add_argument("--json", default=None, help=f"write {what} to this file")
    if force:
        group.add_argument("--force", action="store_true", help="overwrite the --json file if it exists")
    if plot:
        group.add_argument("--plot", default=None, help=f"write {plot} to this folder")


def register_eval(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "eval", "task quality and fidelity to the base: HumanEval, GSM, chat, your prompts")
    p.add_argument("--tasks", default=None, help=f"comma list from {','.join(TASKS)} "
                   f"(default: {','.join(DEFAULT_TASKS)}; with --prompts: prompts)")
    p.add_argument("--confidence", default=None,
                   help="one confidence or a comma sweep, e.g. 0.5,0.6,0.7,0.8,0.9 (default: the checkpoint's)")
    p.add_argument("--mode", default="trust", help="trust (the confidence sweep), verify (lossless drafts "
                   "checked by the base, at the checkpoint's verify confidence), or trust,verify")
    add_lookup_arg(p)
    p.add_argument("--limit", type=int, default=None, help="items per task (a seeded random subset; default: all)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="per reply; default " + ", ".join(f"{t} {n}" for t, n in MAX_NEW_TOKENS.items()))
    p.add_argument("--batch-size", type=int, default=16, help="prompts decoded together")
    add_engine_arg(p)
    p.add_argument("--prompts", default=None, help="JSONL of your prompts (`messages` or `prompt` per line)")
    p.add_argument("--gsm-per-template", type=int, default=3, help="GSM variants per held-out template")
    p.add_argument("--test-timeout", type=float, default=10.0, help="seconds per HumanEval test program")
    add_report_args(p, "rows, the table and per-item outputs", plot="the quality vs KV compression figure")
    p.add_argument("--from-json", default=None, help="print the table (and --plot) of a saved --json run")
    p.add_argument("--seed", type=int, default=0, help="chooses the --limit subset (decoding is greedy)")
    add_model_args(p)
    add_quantize_args(p)
    add_output_args(p)
    p.set_defaults(func=cmd_eval)


def register_bench(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "bench", "decode speed, TTFT, KV entries and memory against HF generate, prompt lookup, "
                "INT8 speculative decoding and the base in the same engine")
    p.add_argument("--systems", default=None,
                   help=f"comma list from {', '.join(BENCH_SYSTEMS)} (default: all that apply)")
    p.add_argument("--sets", default=",".join(BENCH_SETS), help=f"prompt sets, from {', '.join(BENCH_SETS)}")
    p.add_argument("--prompts-per-set", type=int, default=1, help="prompts from each set")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens of a reply")
    p.add_argument("--batch-sizes", default="1,16", help="comma list: each system runs at each batch size")
    p.add_argument("--confidence", default=None,
                   help="one value or a comma sweep (the sweep runs at batch 1); default: the checkpoint's")
    p.add_argument("--verify-confidence", type=float, default=None,
                   help="hamburger_verify and hamburger_compress drafting threshold (default: the checkpoint's verify "
                   "confidence)")
    p.add_argument("--draft-rows", type=parse_draft_rows, default="auto", metavar="N",
                   help="hamburger_verify drafts only in batches of at most N rows; beyond, its steps are plain base "
                        f"steps. 'auto' (default): {DRAFT_ROWS} on a GPU and with fp16 weights on a CPU, 0 with float "
                        "weights on a CPU (measured on 2 cores); 'all': at every batch size")
    add_lookup_arg(p)
    p.add_argument("--runs", type=int, default=3, help="timed runs per system (the median is reported)")
    p.add_argument("--forced-steps", default=None, metavar="SEGMENTED_JSONL",
                   help="adds the system hamburger_forced: step lengths drawn from this data's segmentation")
    p.add_argument("--profile", action="store_true", help="also profile macro-steps of 2 tokens (torch.profiler)")
    add_report_args(p, "the results", plot="PNG plots")
    add_model_args(p)
    add_quantize_args(p, many=True, default="none")  # the float model unless asked: the figures' reference
    p.set_defaults(func=cmd_bench)


def register_bench_serve(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "bench-serve", "load benchmark of the server: req/s, tokens/s, TTFT and TPOT percentiles")
    p.add_argument("--models", default=None,
                   help="comma list of models served in turn, e.g. default,SmolLM2-135M-Instruct (default: --model)")
    p.add_argument("--url", default=None, help="benchmark a server already running there instead of starting one")
    p.add_argument("--api-key", default=None, help="with --url: the server's API key")
    p.add_argument("--requests", type=int, default=64, help="requests at each concurrency level")
    p.add_argument("--warmup", type=int, default=1,
                   help="requests sent before each level's measured ones (the server's first-call costs, and its "
                        "admission estimates learned from served replies: 8 replies of a mode)")
    p.add_argument("--concurrency", default="1,8,32", help="comma list of concurrent clients")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="each request's max_tokens (0: none sent, so the server gives each request all its row holds)")
    p.add_argument("--max-len", type=int, default=1024, help="KV entries per batch row of the in-process server")
    p.add_argument("--kv-memory", type=parse_kv_memory, default=None, metavar="SIZE",
                   help="the in-process server's KV cache by memory (512MB, 2GiB, 40000entries): as many rows of "
                        "--max-len entries as it holds, and that many concurrent clients (in place of --concurrency)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="requests go on past the end-of-sequence token (vLLM's ignore_eos): replies as long as "
                        "max_tokens or the row allows, what a capacity measurement needs")
    p.add_argument("--confidence", type=float, default=None, help="sent with each request (default: the server's)")
    add_lookup_arg(p)
    p.add_argument("--modes", default="trust",
                   help="comma list of trust,verify,compress: each model served in each mode")
    p.add_argument("--sets", default="chat,code,math", help="built-in prompt sets (hamburger.evaluation.bench)")
    p.add_argument("--per-set", type=int, default=None, metavar="N",
                   help="the first N prompts of each set, in turn (default: --requests of each, the first sets' first)")
    add_report_args(p, "the rows", force=False)
    add_model_args(p)
    add_quantize_args(p)
    add_decode_threads_arg(p)  # the in-process server's
    add_output_args(p)
    p.set_defaults(func=cmd_bench_serve)


# --- eval --------------------------------------------------------------------------------------------------------


def _check_eval_args(args: argparse.Namespace) -> tuple[list[str], list[float] | None]:
    from hamburger.evaluation.evaluate import parse_confidences, parse_tasks

    tasks = parse_tasks(args.tasks, args.prompts)
    confidences = parse_confidences(args.confidence)
    for name in ("limit", "max_new_tokens", "batch_size", "gsm_per_template"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise HamburgerError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.test_timeout <= 0:
        raise HamburgerError(f"--test-timeout must be > 0, got {args.test_timeout}")
    if args.json:
        path = Path(args.json)
        if path.is_dir() or (path.exists() and not args.force):
            raise HamburgerError(f"{path} exists" + ("" if path.is_dir() else ": pass --force to overwrite it"))
        try:  # a new folder is made (e.g. runs/eval/); nothing existing is touched
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HamburgerError(f"cannot write {path}: {exc.strerror or exc}") from None
    return tasks, confidences


def cmd_eval(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from hamburger.evaluation.evaluate import evaluate_task, parse_modes, print_table, replot, table_cells
    from hamburger.evaluation.tasks import load_items
    from hamburger.inference.engine import check_merger
    from hamburger.model.hamburger_model import HamburgerModel

    if args.from_json:
        return replot(args)
    tasks, confidences = _check_eval_args(args)
    from hamburger.inference.modes import COMPRESS, TRUST, VERIFY, parse_mode

    modes = [parse_mode(m) for m in parse_modes(args.mode)]
    items = {task: load_items(task, args) for task in tasks}  # bad prompt files fail before the model loads
    for task, found in items.items():
        if not found:
            raise HamburgerError(f"task {task!r} has no items")
    model, trained, scheme = load_model(args)
    if trained:
        base_system = HamburgerModel.plain(model.base, model.tokenizer)  # the same base weights, one token per step
        systems = [("base", 1.0, "trust")]
        if TRUST in modes:
            systems += [(f"hamburger@{c:g}", c, TRUST.name) for c in confidences or [model.config.default_confidence]]
        for mode in (VERIFY, COMPRESS):  # drafts checked by the base: one system at the verify confidence
            if mode in modes:
                conf = mode.default_confidence(model)
                systems.append((f"{mode.name}@{conf:g}", conf, mode.name))
        if any(m.merged for m in modes):
            check_merger(model)  # before any task runs
    else:
        print(f"note: {args.model} is a base model, not a HAMburger checkpoint: evaluating the base only",
              file=sys.stderr)
        base_system, systems = model, [("base", 1.0, "trust")]
    say_start(args, model, trained, scheme, ",".join(m.name for m in modes))
    rows: list[dict] = []
    per_item: list[dict] = []
    with Progress(console=Console(stderr=True), disable=args.quiet or not sys.stderr.isatty()) as progress:
        for task in tasks:
            task_rows, task_items = evaluate_task(task, items[task], model, base_system, systems, args, progress)
            rows += task_rows
            per_item += task_items
    header, body = table_cells(rows, tasks)
    print_table(header, body, f"hamburger eval: {args.model}")
    if args.json:
        try:  # mode "x": a file that appeared during the run is not overwritten either
            with open(args.json, "w" if args.force else "x", encoding="utf-8") as f:
                json.dump({"model": args.model, "hamburger": trained, "tasks": tasks, "seed": args.seed, "rows": rows,
                           "table": {"columns": header, "rows": body}, "per_item": per_item}, f, indent=1)
        except OSError as exc:
            raise HamburgerError(f"could not write {args.json}: {exc}") from exc
    if args.plot:
        from hamburger.evaluation.figures import plot_eval

        print(f"wrote {plot_eval(rows, args.plot, args.model)}", file=sys.stderr)
    return 0


# --- bench -------------------------------------------------------------------------------------------------------


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise HamburgerError(f"{what} must be a comma list of integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise HamburgerError(f"{what} must be positive integers, got {text!r}")
    return values


def _bench_plan(args: argparse.Namespace) -> tuple[list[int], object, list[str], list[str], list[str]]:
    """bench's options checked before any loading: (batch sizes, device, schemes, systems, prompt sets)."""
    from hamburger.loading import parse_schemes, resolve

    batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
    # every scheme resolved and checked against --device and --dtype before any loading
    resolved = [resolve(args.device, s, args.dtype, args.group_size, args.model, args.base)
                for s in parse_schemes(args.quantize, many=True)]
    device, schemes = resolved[0][0], list(dict.fromkeys(scheme for _, scheme in resolved))
    if args.lookup is not None:
        check_lookup(args.lookup)
    if args.max_new_tokens < 1 or args.runs < 1 or args.prompts_per_set < 1:
        raise HamburgerError("--max-new-tokens, --runs and --prompts-per-set must be >= 1")
    systems = [s.strip() for s in (args.systems or ",".join(BENCH_SYSTEMS)).split(",") if s.strip()]
    if unknown := [s for s in systems if s not in BENCH_SYSTEMS]:
        raise HamburgerError(f"unknown systems {unknown}: choose from {', '.join(BENCH_SYSTEMS)}")
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    if unknown := [s for s in sets if s not in BENCH_SETS]:
        raise HamburgerError(f"unknown prompt sets {unknown}: choose from {', '.join(BENCH_SETS)}")
    if args.json and Path(args.json).exists() and not args.force:
        raise HamburgerError(f"{args.json} exists: pass --force to overwrite it")
    return batch_sizes, device, schemes, systems, sets


def _bench_systems(args: argparse.Namespace, systems: list[str], model, trained: bool) -> list[str]:
    """The systems that apply to this model: HAMburger's need a checkpoint, compress its merger (when not named)."""
    from hamburger.evaluation.bench_systems import TRAINED_ONLY

    if not args.forced_steps:
        systems = [s for s in systems if s != "hamburger_forced"]
    if not trained:
        systems = [s for s in systems if s not in TRAINED_ONLY]
        print(f"note: {args.model} is a base model, not a HAMburger checkpoint: HAMburger systems are skipped",
              file=sys.stderr)
    elif args.systems is None and model.merger is None and "hamburger_compress" in systems:
        systems.remove("hamburger_compress")  # named explicitly, it fails with the reason instead
        print("note: the checkpoint has no KV merger: hamburger_compress is skipped", file=sys.stderr)
    return systems


def cmd_bench(args: argparse.Namespace) -> int:
    from hamburger.evaluation.bench import run_bench
    from hamburger.evaluation.bench_costs import profile_steps
    from hamburger.evaluation.bench_report import plot, print_table
    from hamburger.evaluation.bench_systems import ForcedSteps, bench_messages
    from hamburger.evaluation.evaluate import parse_confidences
    from hamburger.loading import hide_progress_bars, load
    from hamburger.model.base import encode_chat

    batch_sizes, device, schemes, systems, sets = _bench_plan(args)
    if not sys.stderr.isatty():
        hide_progress_bars()
    model, trained = load(args.model, args.base, args.dtype, str(device), "none")

    def load_quantized(scheme: str):
        log(f"loading the model again, quantized {scheme}")
        return load(args.model, args.base, args.dtype, str(device), scheme, args.group_size, quiet=False)[0]

    def log(s: str) -> None:
        print(f"bench: {s}", file=sys.stderr, flush=True)

    forced = ForcedSteps(args.forced_steps, model.config.max_step_tokens) if args.forced_steps else None
    systems = _bench_systems(args, systems, model, trained)
    confidences = parse_confidences(args.confidence) or [model.config.default_confidence]
    messages = [m for name in sets for m in bench_messages(name, args.prompts_per_set)]
    prompts = [encode_chat(model.tokenizer, m) for m in messages]
    result = run_bench(model, prompts, systems, batch_sizes, confidences, args.max_new_tokens, args.runs,
                       log=log, forced=forced, verify_confidence=args.verify_confidence,
                       schemes=schemes, load_quantized=load_quantized, draft_rows=args.draft_rows, lookup=args.lookup)
    result.update(model=args.model, dtype=args.dtype, sets=sets, prompts=len(prompts), runs=args.runs,
                  max_new_tokens=args.max_new_tokens, quantize=schemes,
                  draft_rows="all" if args.draft_rows is None else args.draft_rows,
                  group_size=args.group_size)
    if args.profile:
        result["profile"] = profile_steps(model, max(prompts, key=len))
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        for path in plot(result, Path(args.plot)):
            print(f"wrote {path}", file=sys.stderr)
    return 0


# --- bench-serve -------------------------------------------------------------------------------------------------


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from hamburger.evaluation.bench_serve import ServeBench, bench_model, print_table
    from hamburger.loading import hide_progress_bars, parse_schemes

    try:
        import httpx  # noqa: F401 - the load clients
    except ImportError as exc:
        raise HamburgerError("bench-serve needs httpx: pip install httpx") from exc
    try:
        levels = sorted({int(c) for c in args.concurrency.split(",")})
    except ValueError:
        raise HamburgerError(f"--concurrency must be a comma list of integers, got {args.concurrency!r}") from None
    if not levels or levels[0] < 1 or args.requests < 1 or args.max_tokens < 0 or args.warmup < 0 or (
            args.per_set is not None and args.per_set < 1):
        raise HamburgerError("--concurrency levels, --requests and --per-set must be >= 1, --max-tokens and --warmup "
                             ">= 0")
    if args.url is not None and (args.quantize != "auto" or args.decode_threads is not None
                                 or args.kv_memory is not None):
        raise HamburgerError("--quantize, --decode-threads and --kv-memory apply to the in-process server; a server at "
                             "--url was started with its own (hamburger serve --quantize ... --kv-memory ...)")
    parse_schemes(args.quantize)
    if args.lookup is not None:
        check_lookup(args.lookup)
    names = [m.strip() for m in (args.models or args.model).split(",") if m.strip()]
    bad = [m for m in args.modes.split(",") if m.strip() not in MODES]
    if bad or not args.modes.strip():
        raise HamburgerError(f"--modes is a comma list of {', '.join(MODES)} (the server's modes), got {args.modes!r}")
    if args.quiet or not sys.stderr.isatty():
        hide_progress_bars()
    run = ServeBench(requests=args.requests, warmup=args.warmup, max_tokens=args.max_tokens,
                     sets=tuple(s.strip() for s in args.sets.split(",") if s.strip()), per_set=args.per_set,
                     confidence=args.confidence,
                     modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()), url=args.url,
                     api_key=args.api_key, base=args.base, dtype=args.dtype, device=args.device,
                     quantize=args.quantize, group_size=args.group_size, max_len=args.max_len,
                     decode_threads=args.decode_threads, lookup=args.lookup, verbose=args.verbose, quiet=args.quiet,
                     kv_memory=args.kv_memory, ignore_eos=args.ignore_eos)
    rows = [row for name in names for row in bench_model(run, name, levels)]
    print_table(rows)
    if args.json:
        meta = {k: getattr(args, k) for k in ("requests", "max_tokens", "sets", "per_set", "dtype", "device",
                                              "confidence", "modes", "url", "quantize", "decode_threads", "max_len",
                                              "kv_memory", "ignore_eos", "warmup")}
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    return 0
