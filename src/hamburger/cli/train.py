"""The commands that make a checkpoint: `distill` (the base's replies), `segment` (cut into steps by entropy),
`train` (the HAMburger modules), `export` (a checkpoint for shipping), `train-drafter` (verify mode's drafter)
and `train-merger` (compress mode's KV merger)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from hamburger.cli.common import (
    BUILTIN_SOURCES,
    MERGER_WEIGHTS,
    add_dataclass_args,
    add_engine_arg,
    add_model_args,
    add_quantize_args,
    command,
    load_model,
)
from hamburger.errors import HamburgerError
from hamburger.model.config import MODES as DECODING_MODES
from hamburger.training.args import BASE_TRAINING, DrafterArgs, MergerArgs, TrainArgs


class Renamed(argparse.Action):
    """An option that was renamed: using it is an error that names the new one."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kwargs) -> None:
        self.new = new
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string} was renamed: {self.new}")


def add_run_args(p: argparse.ArgumentParser, data_help: str, out_help: str, resume: bool = True) -> None:
    """--data, --out and --resume: what a training or data command reads and the folder it writes (or continues)."""
    group = p.add_argument_group("run")
    group.add_argument("--data", required=True, help=data_help)
    group.add_argument("--out", required=True, help=out_help)
    if resume:
        group.add_argument("--resume", action="store_true", help="continue the run in --out")


def add_bf16_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="float32 compute, no bf16 autocast")


RUN_FOLDER = "run folder: state/ to resume, hamburger/ the checkpoint, log.jsonl"


def register(sub: argparse._SubParsersAction) -> None:
    for add in (register_distill, register_segment, register_export, register_train, register_train_drafter,
                register_train_merger):
        add(sub)


def register_distill(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "distill", "generate the base model's replies to offline prompts (resumable JSONL)")
    p.add_argument("--sources", default="gsm,chat,code",
                   help=f"comma list of {', '.join(BUILTIN_SOURCES)} and/or JSONL files")
    p.add_argument("--split", default="train", choices=("train", "heldout"), help="which prompts of the sources")
    p.add_argument("--out", required=True, help="JSONL to append to (an existing file is resumed; at the end its rows "
                   "are put in the prompts' order)")
    add_model_args(p)
    add_quantize_args(p, default="none")  # the training data: the float base's replies unless asked otherwise
    add_engine_arg(p)
    p.add_argument("--batch-size", type=int, default=32, help="prompts per batch (sorted by length)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens of a reply")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--per-template", type=int, default=10, help="GSM variants generated per template")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts per source (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts' variants and the sampling")
    p.set_defaults(func=cmd_distill)


def register_segment(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "segment", "cut distilled replies into steps by the base's entropy")
    add_run_args(p, "JSONL of chats (`messages`, or `prompt` + `response`)",
                 "JSONL of {id, input_ids, prompt_len, steps}; a summary lands beside it (a killed run, run again, "
                 "goes on from OUT.partN)", resume=False)
    add_model_args(p)
    p.add_argument("--max-step-tokens", type=int, default=4, help="K: the most tokens of a step")
    p.add_argument("--abs-threshold", type=float, default=0.05,
                   help="a token joins the step if its entropy is below this...")
    p.add_argument("--rel-threshold", type=float, default=0.3,
                   help="...or below this times the largest entropy already in the step")
    p.add_argument("--batch-size", type=int, default=8, help="replies per base pass")
    p.add_argument("--include-unfinished", action="store_true", help="also use replies cut off at max_new_tokens")
    p.add_argument("--teacher-top-k", type=int, default=0, metavar="K",
                   help="also cache the base's top-K next tokens and log-probabilities at every response token in "
                        "OUT.teacher/ (safetensors shards), read by `train --kd-weight` instead of a second base "
                        "forward per batch (32: about 6 bytes x 32 per token)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file (and its teacher cache)")
    p.set_defaults(func=cmd_segment)


def register_export(sub: argparse._SubParsersAction) -> None:
    e = command(sub, "export", "write a checkpoint for shipping (smaller dtype, LoRA merged)")
    e.add_argument("checkpoint", help="a HAMburger checkpoint folder (e.g. RUN/hamburger)")
    e.add_argument("out", help="the folder to write")
    e.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                   help="the weights' dtype on disk")
    e.add_argument("--merge-lora", action="store_true", help="merge LoRA adapters into the base's weights (the "
                   "LoRA then acts in every mode: verify and compress check against the adapted base)")
    e.add_argument("--micro-vocab", default=None, metavar="SEGMENTED_JSONL",
                   help="store a shortlist of the most frequent response tokens of this data: the fast engine's "
                   "micro-steps choose among them (a cheaper LM head)")
    e.add_argument("--micro-vocab-size", type=int, default=8192, help="tokens in the shortlist")
    e.add_argument("--slot-adapter-rank", type=int, default=None,
                   help="cut the slot adapters to this rank (best approximation by SVD) for a smaller checkpoint")
    e.add_argument("--default-confidence", type=float, default=None,
                   help="the confidence trust mode uses when none is given (e.g. the best point of an eval sweep)")
    e.add_argument("--verify-confidence", type=float, default=None,
                   help="the confidence verify and compress mode draft at when none is given (e.g. the fastest point "
                   "of `benchmarks/verify_ab.py`)")
    e.add_argument("--merge-window", type=int, default=None, metavar="W",
                   help="compress mode keeps the latest W positions' steps unmerged (0: merge each step at once)")
    e.add_argument("--lookup", type=int, default=None, metavar="N",
                   help="verify and compress mode draft by lookup where the last N..3 tokens occurred before (0: off)")
    e.add_argument("--default-mode", choices=DECODING_MODES, default=None,
                   help="the mode generate, demo and the server use when none is asked for (bench and eval: "
                   "the rule in docs/RESULTS.md, the fastest mode within the quality bar)")
    e.add_argument("--replies", default=None, metavar="DISTILLED_JSONL",
                   help="store the base's replies of this data (`hamburger distill`): verify mode drafts from them by "
                   "lookup where a reply's own history offers nothing")
    e.add_argument("--force", action="store_true", help="replace the files of a non-empty OUT")
    e.set_defaults(func=cmd_export)


def register_train(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "train", "train the HAMburger modules on segmented data (accelerate launch for DDP)")
    add_run_args(p, "segmented JSONL from `hamburger segment`", RUN_FOLDER)
    p.add_argument("--model", default="default",
                   help="a base model to wrap with fresh modules (default: the embedded base), or a HAMburger "
                   "checkpoint folder whose modules training continues (the shipped one is "
                   "hamburger/checkpoints/SmolLM2-135M-Instruct in the package)")
    p.add_argument("--base-training", choices=BASE_TRAINING, default="frozen",
                   help="how the base learns: frozen: not at all (only the new modules); lora: a LoRA on it (attached "
                   "to a checkpoint that has none; trust mode decodes with it, verify and compress without); full: "
                   "all its weights")
    p.add_argument("--mode", action=Renamed, new="--base-training frozen|lora|full", nargs="?")
    p.add_argument("--max-step-tokens", type=int, default=4, help="K: the most tokens of a step")
    p.add_argument("--micro-layers", type=int, default=4, help="layers of the micro-step decoder")
    p.add_argument("--lora-rank", type=int, default=16, help="the LoRA's rank with --base-training lora")
    p.add_argument("--slot-adapter-rank", type=int, default=0,
                   help="adapters on the base that act only at merged slots (the base stays exact on plain tokens)")
    add_bf16_arg(p)
    add_train_loss_args(p)
    p.add_argument("--report-to", default="none",
                   help="also send the training and held-out metrics to an accelerate tracker: tensorboard "
                   "(pip install tensorboard; written under OUT/tracker), wandb, mlflow, ...")
    add_dataclass_args(p, TrainArgs, ("data", "out", "base_training", "lora_rank", "bf16", "verified_stops",
                                      "kd_weight", "state_weight", "report_to", "teacher_cache", "partial_steps"))
    p.set_defaults(func=cmd_train)


def add_train_loss_args(p: argparse.ArgumentParser) -> None:
    """The options of `train`'s loss."""
    group = p.add_argument_group("loss")
    group.add_argument("--verified-stops", action="store_true",
                       help="train the stop head to also end a step before a token the micro-step decoder gets wrong")
    group.add_argument("--kd-weight", type=float, default=0.0,
                       help="dense loss: KL(unmerged base || model) of the next-token distribution at every target, "
                       "token 0 after a smashed slot and the micro tokens (--base-training frozen)")
    group.add_argument("--state-weight", type=float, default=0.0,
                       help="dense loss: each merged slot's states at every layer regressed onto the unmerged base's "
                       "states at the step's last token (relative squared error; --base-training frozen)")
    group.add_argument("--partial-steps", type=float, default=0.0, metavar="P",
                       help="cut each training step of >= 2 tokens in two at a random point with probability P, so the "
                       "base also learns to read step prefixes (inference ends steps early; held-out figures keep "
                       "the data's steps)")
    group.add_argument("--no-teacher-cache", dest="teacher_cache", action="store_false",
                       help="with --kd-weight, run the base for the teacher even where DATA.teacher/ holds a cached "
                       "one (the full KL instead of the top-k one)")


def register_train_drafter(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "train-drafter", "distil the micro-step decoder into a drafter for every position "
                                      "(KL to the frozen base; for verify mode)")
    add_model_args(p)
    add_run_args(p, "segmented JSONL (hamburger segment), or distilled JSONL (hamburger distill) read unsegmented: "
                 "the drafter learns at every response position", RUN_FOLDER)
    add_bf16_arg(p)
    p.add_argument("--draft-stop-head", action="store_true",
                   help="train a stop head of verify/compress mode's own and leave trust mode's as it is (so one "
                        "checkpoint serves both); a checkpoint that has one always trains that one")
    add_dataclass_args(p, DrafterArgs, ("data", "out", "bf16", "draft_stop_head"))
    p.set_defaults(func=cmd_train_drafter)


def register_train_merger(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "train-merger", "fit a KV merger ('process, then compress': one KV entry per step) "
                                     "to a frozen base by KL to its unmerged self")
    add_model_args(p)
    add_run_args(p, "segmented JSONL (the data's steps, or --random-steps)",
                 f"run folder: {MERGER_WEIGHTS}, state/ to resume, log.jsonl")
    p.add_argument("--random-steps", action="store_true", help="cut responses into random steps of 1..K")
    p.add_argument("--gates", action="store_true", help="per-channel gates on merged keys and values")
    p.add_argument("--channels", action="store_true", help="merge weights per channel (not per head): "
                   "head_dim times the parameters")
    add_dataclass_args(p, MergerArgs, ("data", "out", "random_steps", "gates", "channels"))
    p.set_defaults(func=cmd_train_merger)


def cmd_distill(args: argparse.Namespace) -> int:
    from hamburger.inference.sampling import SamplingParams
    from hamburger.training.distill import distill
    from hamburger.training.sources import BUILTIN, load_prompts

    if args.batch_size < 1 or args.max_new_tokens < 1:
        raise HamburgerError("--batch-size and --max-new-tokens must be >= 1")
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    for s in sources:
        if s not in BUILTIN and not Path(s).exists():
            raise HamburgerError(f"unknown source {s!r}: use {', '.join(BUILTIN)} or a JSONL file / datasets folder")
    prompts = load_prompts(sources, split=args.split, per_template=args.per_template, seed=args.seed, limit=args.limit)
    model, _, _ = load_model(args)
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    counts = distill(model, prompts, Path(args.out), args.batch_size, args.max_new_tokens, sampling, engine=args.engine)
    print(json.dumps(counts), file=sys.stderr)
    return 0


def cmd_segment(args: argparse.Namespace) -> int:
    import torch
    from accelerate import PartialState

    from hamburger.model.base import fingerprint
    from hamburger.training.segment import (
        Thresholds,
        check_unique_ids,
        join_segment_parts,
        open_part,
        part_header,
        part_writer,
        read_chats,
        segment_rows,
    )
    from hamburger.training.teacher import TeacherWriter, teacher_dir

    th = Thresholds(args.max_step_tokens, args.abs_threshold, args.rel_threshold)
    if th.max_step_tokens < 1 or args.batch_size < 1:
        raise HamburgerError("--max-step-tokens and --batch-size must be >= 1")
    if args.teacher_top_k < 0:
        raise HamburgerError("--teacher-top-k must be >= 0 (0: no teacher cache)")
    out = Path(args.out)
    cache = teacher_dir(out)
    for path in (out, cache):
        if path.exists() and not args.force:
            raise HamburgerError(f"{path} exists: pass --force to replace it")
    rows = read_chats(Path(args.data))
    if args.teacher_top_k:
        check_unique_ids(rows, args.data)
    state = PartialState(cpu=not torch.cuda.is_available())  # cpu=True lets torchrun workers use gloo
    if state.num_processes > 1 and state.device.type != "cpu":
        args.device = str(state.device)  # one accelerator per process
    model, _, _ = load_model(args)
    mine = rows[state.process_index :: state.num_processes]
    part = out.with_name(f"{out.name}.part{state.process_index}")
    header = part_header(Path(args.data), th, model, batch_size=args.batch_size,
                         include_unfinished=args.include_unfinished, processes=state.num_processes)
    done = open_part(part, header, resume=not args.teacher_top_k)  # a killed run's batches (not with a teacher cache)
    building = cache.with_name(cache.name + ".tmp")
    writer = None
    if args.teacher_top_k:
        if state.is_main_process and building.exists():
            shutil.rmtree(building)  # a crashed run's leftovers
        state.wait_for_everyone()
        writer = TeacherWriter(building, args.teacher_top_k, fingerprint(model.base), f"part{state.process_index}")
    segment_rows(model, mine, th, args.batch_size, progress=state.is_local_main_process,
                 include_unfinished=args.include_unfinished, teacher=writer, teacher_k=args.teacher_top_k, done=done,
                 write=part_writer(part))
    if writer is not None:
        writer.flush()
    state.wait_for_everyone()
    if state.is_main_process:
        summary = join_segment_parts(out, state.num_processes, th, building if writer is not None else None,
                                     {"source": str(args.data), "teacher_top_k": args.teacher_top_k})
        print(json.dumps(summary, indent=2), file=sys.stderr)
        if writer is not None:
            print(f"teacher: top-{args.teacher_top_k} of the base at every response token in {cache}/",
                  file=sys.stderr)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import torch
    from accelerate import PartialState

    from hamburger.model.base import load_base
    from hamburger.model.config import HamburgerConfig
    from hamburger.model.hamburger_model import HamburgerModel
    from hamburger.training.teacher import teacher_dir
    from hamburger.training.train import Trainer

    targs = TrainArgs(**{f: getattr(args, f) for f in TrainArgs.__dataclass_fields__})
    out = check_run(targs.data, targs.report_to, targs.out, args.resume)
    state = PartialState(cpu=not torch.cuda.is_available())
    device = str(state.device)
    torch.manual_seed(targs.seed)  # the new modules' initialisation, identical on every process
    if HamburgerConfig.is_checkpoint(args.model):  # continue training a checkpoint's modules
        model = HamburgerModel.from_pretrained(args.model, device=device)
        print(f"continuing the modules of checkpoint {args.model}", file=sys.stderr)
        if args.slot_adapter_rank and not model.config.slot_adapter_rank:
            model.attach_slot_adapters(args.slot_adapter_rank)
    else:
        base, tokenizer = load_base(args.model, device=device)
        cfg = HamburgerConfig(max_step_tokens=args.max_step_tokens, micro_layers=args.micro_layers,
                              lora_rank=args.lora_rank if targs.base_training == "lora" else 0,
                              slot_adapter_rank=args.slot_adapter_rank)
        model = HamburgerModel.wrap(base, tokenizer, cfg)
        print(f"fresh modules around base {model.config.base_model}", file=sys.stderr)
    if targs.base_training == "lora" and not model.config.lora_rank:
        print(f"a LoRA of rank {targs.lora_rank} on the base (trust mode decodes with it, verify and compress "
              "without)", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(model, targs)
    if targs.kd_weight:
        print(f"kd teacher: the base's top-{trainer.teacher_top_k} cached in {teacher_dir(Path(targs.data))}/"
              if trainer.teacher_top_k else "kd teacher: the base, run a second time per batch (cache it with "
              "`hamburger segment --teacher-top-k 32`)", file=sys.stderr)
    if args.resume and trainer.resume():
        print(f"resumed at step {trainer.step}", file=sys.stderr)
    metrics = trainer.fit()
    if state.is_main_process:
        print(json.dumps({"final": metrics, "checkpoint": str(out / "hamburger")}), file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hamburger.training.export import export_checkpoint

    written = export_checkpoint(args.checkpoint, Path(args.out), args.dtype, args.merge_lora, args.micro_vocab,
                                args.micro_vocab_size, args.slot_adapter_rank, args.default_confidence,
                                args.verify_confidence, args.merge_window, args.lookup, args.default_mode, args.force,
                                replies=args.replies)
    print(json.dumps(written), file=sys.stderr)
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    import torch

    from hamburger.training.atomic import settle_dir
    from hamburger.training.drafter import DrafterTrainer, adapt_micro

    dargs = DrafterArgs(**{f: getattr(args, f) for f in DrafterArgs.__dataclass_fields__})
    if dargs.micro_context < -1:
        raise HamburgerError(f"--micro-context must be a number of positions >= 0 (or -1: the checkpoint's), "
                             f"got {dargs.micro_context}")
    if dargs.micro_layers < 0:
        raise HamburgerError(f"--micro-layers must be a number of layers >= 1 (or 0: all the checkpoint's), "
                             f"got {dargs.micro_layers}")
    out = check_run(dargs.data, dargs.report_to, dargs.out, args.resume, distilled=True)
    if args.dtype != "float32":
        raise HamburgerError("train-drafter keeps float32 weights and trains under bf16 autocast (--no-bf16: float32 "
                             f"compute): leave --dtype out instead of --dtype {args.dtype}")
    model, trained, _ = load_model(args)  # --model, --base, --device
    if not trained or model.config.max_step_tokens < 2:
        raise HamburgerError(f"{args.model} is not a HAMburger checkpoint with a micro-step decoder: "
                             "train one with `hamburger train` first")
    for line in adapt_micro(model, dargs.micro_context, dargs.micro_layers, args.model):
        print(line, file=sys.stderr)
    saved = out / "state" / "trainer.json"
    if args.resume:
        settle_dir(saved.parent)  # a save killed between its renames: finish it before reading
    if args.resume and saved.is_file() and json.loads(saved.read_text())["args"].get("draft_stop_head"):
        dargs.draft_stop_head = True  # the run being resumed trains a draft stop head
    if dargs.draft_stop_head and model.draft_stop_head is None:
        model.add_draft_stop_head()
        print("stop heads: a draft stop head for verify and compress mode (trust mode keeps its own)", file=sys.stderr)
    torch.manual_seed(dargs.seed)
    out.mkdir(parents=True, exist_ok=True)
    trainer = DrafterTrainer(model, dargs)
    if args.resume and trainer.resume():
        print(f"resumed at step {trainer.step}", file=sys.stderr)
    metrics = trainer.fit()
    print(json.dumps({"final": metrics, "checkpoint": str(out / "hamburger")}), file=sys.stderr)
    return 0


def cmd_train_merger(args: argparse.Namespace) -> int:
    import torch

    from hamburger.training.train_merger import MergerTrainer

    margs = MergerArgs(**{f: getattr(args, f) for f in MergerArgs.__dataclass_fields__})
    out = check_run(margs.data, margs.report_to, margs.out, args.resume)
    model, _, _ = load_model(args)  # a HAMburger checkpoint stands for its base
    torch.manual_seed(margs.seed)
    trainer = MergerTrainer(model.base, margs)
    if args.resume and trainer.resume():
        print(f"resumed at step {trainer.step}", file=sys.stderr)
    metrics = trainer.fit()
    size = (out / MERGER_WEIGHTS).stat().st_size if (out / MERGER_WEIGHTS).is_file() else 0
    print(json.dumps({"final": metrics, "merger": str(out / MERGER_WEIGHTS) if size else None, "bytes": size,
                      "parameters": sum(p.numel() for p in trainer.merger.parameters())}), file=sys.stderr)
    return 0


def check_run(data: str, report_to: str, out: str, resume: bool, distilled: bool = False) -> Path:
    """Before loading a model: the data reads, the tracker exists, and the run folder is new (or resumed)."""
    from hamburger.training.examples import read_examples
    from hamburger.training.tracking import check_tracker

    read_examples(Path(data), distilled=distilled)
    check_tracker(report_to)
    run = Path(out)
    if run.exists() and any(run.iterdir()) and not resume:
        raise HamburgerError(f"{run} is not empty: pass --resume to continue that run, or pick a new --out")
    return run
