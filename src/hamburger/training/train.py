"""Training on segmented data with accelerate: one script for 1 CPU, `accelerate launch` DDP, or FSDP.

How the base learns (`--base-training`): `frozen` (base untouched, only the embedder, micro-step decoder, stop head
and slot adapters learn: a small checkpoint), `lora` (a LoRA on the base learns too, at the base learning rate,
attached to a model that has none; still small; it serves trust mode only, verify and compress decode with it off),
`full` (the base learns too, at its own learning rate; the checkpoint carries the base). The loss is
`training.loss.hamburger_loss`. Batches are cut and sharded by
this module itself (a seeded permutation per epoch, length-bucketed so a batch holds examples of similar
length; each global batch is split over the processes), so a run resumes exactly from (epoch, batch) with
the optimizer, scheduler and RNG states that accelerate saves. The resumable state holds only the weights
that train (the base is reloaded from its reference, and checked by fingerprint) unless the base trains too.
A save writes `state/` and `hamburger/` whole beside themselves and swaps them in (`training.atomic`), so a run
killed at any point resumes from its last complete save, to the same weights as a run never stopped.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)
from transformers import get_cosine_schedule_with_warmup

from hamburger.errors import HamburgerError
from hamburger.model.base import fingerprint
from hamburger.model.hamburger_model import (
    NEW_MODULES,
    HamburgerModel,
    is_trained_key,
)
from hamburger.training.args import BASE_TRAINING, TrainArgs
from hamburger.training.atomic import read_lines, replace_dir, settle_dir, staging, write_text
from hamburger.training.data import collate, cut_steps
from hamburger.training.examples import (
    attach_teacher,
    epoch_batches,
    evaluate,
    read_examples,
    split_eval,
)
from hamburger.training.loss import bind_loss
from hamburger.training.precision import bf16_autocast
from hamburger.training.tracking import check_tracker


def configure_optimizer(model: HamburgerModel, args: TrainArgs) -> torch.optim.Optimizer:
    new = [p for name in NEW_MODULES for p in getattr(model, name).parameters()]
    groups = [{"params": new, "lr": args.lr}]
    if args.base_training == "full":
        groups.append({"params": list(model.base.parameters()), "lr": args.base_lr})
        return torch.optim.AdamW(groups, weight_decay=args.weight_decay)
    model.base.requires_grad_(False)
    if args.base_training == "lora":
        if not model.config.lora_rank:
            raise HamburgerError("--base-training lora needs a model with a LoRA (HamburgerModel.attach_lora)")
        lora = [p for n, p in model.base.named_parameters() if ".lora_" in n]
        for p in lora:
            p.requires_grad_(True)
        groups.append({"params": lora, "lr": args.base_lr})
    return torch.optim.AdamW(groups, weight_decay=args.weight_decay)


class Trainer:
    def __init__(self, model: HamburgerModel, args: TrainArgs) -> None:
        from accelerate import Accelerator  # noqa: PLC0415

        if args.base_training not in BASE_TRAINING:
            raise HamburgerError(f"--base-training must be one of {BASE_TRAINING}, got {args.base_training!r}")
        if not 0 <= args.partial_steps <= 1:
            raise HamburgerError(f"--partial-steps is a probability in [0, 1], got {args.partial_steps}")
        if args.kd_weight < 0 or args.state_weight < 0:
            raise HamburgerError("--kd-weight and --state-weight must be >= 0")
        if (args.kd_weight or args.state_weight) and args.base_training != "frozen":
            raise HamburgerError("--kd-weight and --state-weight distil the unmerged base, which only stays the "
                                 f"base in --base-training frozen (not {args.base_training})")
        self.args, self.out = args, Path(args.out)
        rows = read_examples(Path(args.data))
        self.teacher_top_k = attach_teacher(rows, Path(args.data), model) if args.kd_weight and args.teacher_cache else 0
        bf16 = bf16_autocast(args.bf16, "cuda" if torch.cuda.is_available() else "cpu")
        tracker = check_tracker(args.report_to)
        self.acc = Accelerator(gradient_accumulation_steps=args.grad_accum, mixed_precision="bf16" if bf16 else "no",
                               cpu=not torch.cuda.is_available(),  # cpu=True lets torchrun workers use gloo
                               log_with=tracker, project_dir=str(self.out / "tracker") if tracker else None)
        torch.manual_seed(args.seed)
        if args.base_training == "lora" and not model.config.lora_rank:
            model.attach_lora(args.lora_rank)  # B starts at zero: the run starts from the model as it was
        model.config.base_in_checkpoint = args.base_training == "full"
        train, held = split_eval(rows, args.eval_fraction)
        self.train_ids, self.train = [r[0] for r in train], [r[1] for r in train]
        self.held = [r[1] for r in held]
        self.lengths = [ex.num_slots for ex in self.train]
        self.k = model.config.max_step_tokens
        for ex in self.train + self.held:
            ex.validate(self.k)
        self.pad = getattr(model.tokenizer, "pad_token_id", None) or 0
        global_batch = args.batch_size * self.acc.num_processes
        self.batches_per_epoch = len(self.train) // global_batch
        if self.batches_per_epoch < args.grad_accum:
            raise HamburgerError(f"{len(self.train)} training examples are too few for a global batch of "
                                 f"{global_batch} x {args.grad_accum} accumulation steps")
        steps_per_epoch = self.batches_per_epoch // args.grad_accum
        self.total_steps = args.max_steps or steps_per_epoch * args.epochs
        optimizer = configure_optimizer(model, args)
        scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(args.warmup_ratio * self.total_steps),
                                                    self.total_steps)
        self.model, self.optimizer, self.scheduler = self.acc.prepare(bind_loss(model), optimizer, scheduler)
        self.hamburger = model
        if tracker:  # under out/tracker/hamburger; every logged row goes there too, by optimizer step
            config = {k: v for k, v in asdict(args).items() if isinstance(v, (int, float, str, bool))}
            self.acc.init_trackers("hamburger", config=config)
        self.step, self.seen = 0, []  # optimizer steps done; ids this process trained on (for tests and logs)
        # Without the base training, the resumable state stores only the weights that train (not the whole base).
        from accelerate.utils import DistributedType  # noqa: PLC0415

        self.base_in_state = args.base_training == "full" or self.acc.distributed_type in (
            DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
        if not self.base_in_state:
            self.acc.register_save_state_pre_hook(self._keep_trained_weights)
            self.acc.register_load_state_pre_hook(self._load_trained_weights)

    # --- checkpoints ---------------------------------------------------------------------------------

    @staticmethod
    def _trained(key: str) -> bool:
        return is_trained_key(key.removeprefix("module."))  # DDP wraps the model as `module`

    def _keep_trained_weights(self, models, weights: list[dict], output_dir: str) -> None:
        """accelerate save hook: drop the frozen base's weights from the state to be written."""
        for state in weights:
            for key in [key for key in state if not self._trained(key)]:
                del state[key]

    def _load_trained_weights(self, models: list, input_dir: str) -> None:
        """accelerate load hook: load the trained weights (strictly: all of them, nothing else) ourselves."""
        from safetensors.torch import load_file  # noqa: PLC0415

        for i, model in enumerate(models):
            path = Path(input_dir) / ("model.safetensors" if i == 0 else f"model_{i}.safetensors")
            state = load_file(str(path), device=str(self.acc.device))
            missing, unexpected = model.load_state_dict(state, strict=False)
            missing = [key for key in missing if self._trained(key)]
            if missing or unexpected:
                raise HamburgerError(f"{path} does not match this model: missing {missing[:5]}, "
                                     f"unexpected {unexpected[:5]}")
        models.clear()  # loaded: accelerate goes on with the optimizer, scheduler and RNG states

    def save(self) -> None:
        """Resumable state (trained weights, optimizer, scheduler, RNG) plus a plain HAMburger checkpoint to ship.

        Each is written whole as `NAME.new/` (`trainer.json`, the step, last) and then swapped in: a kill at any
        point leaves the last complete `state/` and `hamburger/`, never a half-written file under their names."""
        state, ship = self.out / "state", self.out / "hamburger"
        if self.acc.is_main_process:
            settle_dir(state)
            settle_dir(ship)
        self.acc.wait_for_everyone()
        self.acc.save_state(str(staging(state)))
        self.acc.wait_for_everyone()  # every process's files written before the folder moves
        if self.acc.is_main_process:
            row = {"step": self.step, "args": asdict(self.args), "base_in_state": self.base_in_state,
                   "base_fingerprint": self.hamburger.config.base_fingerprint}
            write_text(staging(state) / "trainer.json", json.dumps(row))
            replace_dir(state)
            self.acc.unwrap_model(self.model).save_pretrained(staging(ship))
            replace_dir(ship)
        self.acc.wait_for_everyone()

    def resume(self) -> bool:
        """Continue from the last complete save in `out` (False: there is none): its weights, optimizer, scheduler, RNG
        and step; the log keeps only the rows up to that step, as a run never stopped would have them."""
        if self.acc.is_main_process:
            settle_dir(self.out / "state")  # a kill between a swap's renames: finish it
            settle_dir(self.out / "hamburger")
        self.acc.wait_for_everyone()
        state = self.out / "state" / "trainer.json"
        if not state.is_file():
            return False
        saved = json.loads(state.read_text())
        if not saved.get("base_in_state", True):  # (states written before this key held the whole model)
            if self.base_in_state:
                was = saved["args"].get("base_training", saved["args"].get("mode"))  # (`mode` before the rename)
                raise HamburgerError(f"{state.parent} holds no base weights (saved with --base-training {was}): "
                                     f"resume with that, not --base-training {self.args.base_training}")
            if saved.get("base_fingerprint") != self.hamburger.config.base_fingerprint:
                raise HamburgerError(f"{state.parent} was trained on base {saved.get('base_fingerprint')} (not stored "
                                     f"in the state) but this run's base is {self.hamburger.config.base_fingerprint}: "
                                     "resume with the same --model")
        self.acc.load_state(str(self.out / "state"))
        self.step = saved["step"]
        if self.acc.is_main_process:
            self.trim_log()
        return True

    def trim_log(self) -> None:
        """Drop the log rows of steps after the resumed one (the killed run's, which this run logs again) and a
        torn last line."""
        log = self.out / "log.jsonl"
        lines = read_lines(log)
        keep = [line for line in lines if json.loads(line).get("step", 0) <= self.step]
        if keep != lines:
            write_text(log, b"".join(keep).decode("utf-8"))

    # --- the loop ------------------------------------------------------------------------------------

    def batches(self):
        """(micro-batch number, example indices) of each micro-batch of this process from the current step on,
        in a fixed order."""
        a, world, rank = self.args, self.acc.num_processes, self.acc.process_index
        per_epoch = (self.batches_per_epoch // a.grad_accum) * a.grad_accum
        start = self.step * a.grad_accum
        cached = (None, None)
        for micro in range(start, self.total_steps * a.grad_accum):
            epoch, i = divmod(micro, per_epoch)
            if cached[0] != epoch:
                cached = (epoch, epoch_batches(len(self.train), a.batch_size * world, epoch, a.seed, self.lengths,
                                               a.bucket_pool))
            yield micro, cached[1][i][rank * a.batch_size : (rank + 1) * a.batch_size]

    def fit(self, progress: bool = True) -> dict[str, float]:
        a = self.args
        metrics: dict[str, float] = {}
        columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeRemainingColumn())
        show = progress and self.acc.is_local_main_process
        with Progress(*columns, disable=not show, console=Console(stderr=True)) as bar:
            task = bar.add_task("train", total=self.total_steps, completed=self.step, info="")
            tokens, t0 = 0, time.perf_counter()
            said = t0
            self.model.train()
            for micro, idx in self.batches():
                self.seen.extend(self.train_ids[j] for j in idx)
                examples = [self.train[j] for j in idx]
                if a.partial_steps:  # seeded by the micro-batch: a resumed run cuts the same steps
                    rng = random.Random((a.seed * 1_000_003 + micro) * 1_000_003 + self.acc.process_index)
                    examples = [cut_steps(ex, rng, a.partial_steps) for ex in examples]
                batch = collate(examples, self.k, self.pad).to(self.acc.device)
                with self.acc.accumulate(self.model):
                    out = self.model(batch, verified_stops=a.verified_stops, kd_weight=a.kd_weight,
                                     state_weight=a.state_weight)
                    self.acc.backward(out.loss)
                    if self.acc.sync_gradients:
                        self.acc.clip_grad_norm_(self.model.parameters(), a.max_grad_norm)
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad()
                tokens += out.targets.numel()
                if not self.acc.sync_gradients:
                    continue
                self.step += 1
                rate = tokens * self.acc.num_processes / (time.perf_counter() - t0)
                info = f"loss {out.loss.item():.3f} {rate:.0f} tok/s"
                if out.kd_loss is not None:
                    info += f" (ce {out.ce_loss.item():.3f} kd {out.kd_loss.item():.3f}"
                    info += f" state {out.state_loss.item():.3f})" if out.state_loss is not None else ")"
                bar.update(task, completed=self.step, info=info)
                if a.report_to != "none":
                    parts = {"loss": out.loss, "ce_loss": out.ce_loss, "kd_loss": out.kd_loss, "state_loss": out.state_loss}
                    row = {f"train/{k}": v.item() for k, v in parts.items() if v is not None}
                    self.acc.log({**row, "train/tokens_per_s": rate, "train/lr": self.scheduler.get_last_lr()[0]},
                                 step=self.step)
                if show and not bar.console.is_terminal and (time.perf_counter() - said > 60
                                                             or self.step == self.total_steps):
                    said = time.perf_counter()  # a log file gets a plain line a minute instead of a live bar
                    print(f"step {self.step}/{self.total_steps} {info} elapsed {said - t0:.0f}s", file=sys.stderr,
                          flush=True)
                out_of_time = a.max_minutes > 0 and time.perf_counter() - t0 > 60 * a.max_minutes
                metrics = self.checkpoint(rate, out_of_time) or metrics
                if out_of_time:
                    print(f"stopped at step {self.step}/{self.total_steps}: --max-minutes {a.max_minutes:g} reached",
                          file=sys.stderr, flush=True)
                    break
        self.record_process()
        if a.report_to != "none":
            self.acc.end_training()
        return metrics

    def checkpoint(self, rate: float, last: bool) -> dict[str, float] | None:
        """After an optimizer step: evaluate and save where due (every step of the schedule's end, or `last`, a
        run stopped early); the metrics if it evaluated."""
        a, metrics = self.args, None
        end = last or self.step == self.total_steps
        if self.held and (self.step % a.eval_every == 0 or end):
            metrics = self.evaluate()
            self.log({"step": self.step, **metrics, "tokens_per_s": rate})
            if a.report_to != "none":
                self.acc.log({f"eval/{k}": v for k, v in metrics.items()}, step=self.step)
        if self.step % a.save_every == 0 or end:
            self.save()
        return metrics

    def record_process(self) -> None:
        """What this process trained on and a hash of its weights: DDP replicas must agree on the latter."""
        model = self.acc.unwrap_model(self.model)
        digest = {name: fingerprint(getattr(model, name), samples_per_tensor=1 << 30) for name in NEW_MODULES}
        row = {"process": self.acc.process_index, "seen": self.seen, "weights": digest}
        write_text(self.out / f"process-{self.acc.process_index}.json", json.dumps(row))

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        with self.acc.autocast():
            metrics = evaluate(self.acc.unwrap_model(self.model), self.held, self.k, self.pad, self.args.batch_size,
                               self.acc.device, dense=self.args.base_training == "frozen")
        self.model.train()
        return metrics

    def log(self, row: dict) -> None:
        if self.acc.is_main_process:
            with (self.out / "log.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), file=sys.stderr)
