"""`hamburger train-merger`: fit the KV merger (compress mode) by KL(unmerged base || merged base) on every
response position of segmented data, the base frozen; resumable, with held-out agreement figures."""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from hamburger.errors import HamburgerError
from hamburger.model.base import fingerprint
from hamburger.model.merger import WEIGHTS, KVMerger, Layout, forward_layout
from hamburger.training.args import MergerArgs
from hamburger.training.atomic import replace_dir, settle_dir, staging, write_text
from hamburger.training.examples import read_examples, split_eval
from hamburger.training.tracking import Tracker


def clip_example(ids: list[int], prompt_len: int, steps: list[int], max_len: int) -> tuple[list[int], list[int]]:
    """The first `max_len` tokens, and the steps that cover them (the last one cut short)."""
    ids, left, out = ids[:max_len], max_len - prompt_len, []
    for n in steps:
        if left <= 0:
            break
        out.append(min(n, left))
        left -= out[-1]
    return ids, out


def random_steps(n: int, k: int, gen: torch.Generator) -> list[int]:
    """Uniform step lengths in 1..k covering n tokens (the last one cut short)."""
    return clip_example([], 0, torch.randint(1, k + 1, (n,), generator=gen).tolist(), n)[1]


def kl_per_position(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) at each position: (B, R, V) logits -> (B, R)."""
    return F.kl_div(F.log_softmax(student.float(), -1), F.log_softmax(teacher.float(), -1), log_target=True,
                    reduction="none").sum(-1)


@torch.no_grad()
def evaluate_merger(base, merger: KVMerger, examples: list[tuple[list[int], int, list[int]]],
                    batch_size: int = 1, window: int = 0) -> dict[str, float]:
    """Held-out agreement of the merged base's argmax with the base's own greedy token (unmerged) at each
    response position: at step starts (what a decoder's next step begins with) and over all tokens; and KL."""
    sums = torch.zeros(5, dtype=torch.float64)  # right at starts, starts, right, positions, KL
    for i in range(0, len(examples), batch_size):
        lay = Layout.build(*zip(*examples[i : i + batch_size]), next(base.parameters()).device)
        teacher, student = forward_layout(base, None, lay, merged=False), forward_layout(base, merger, lay, window=window)
        ok = student.argmax(-1) == teacher.argmax(-1)
        kl = kl_per_position(student, teacher)[lay.valid].sum()
        sums += torch.stack([ok[lay.starts].sum(), lay.starts.sum(), ok[lay.valid].sum(), lay.valid.sum(), kl]).cpu()
    starts, n = max(1.0, float(sums[1])), max(1.0, float(sums[3]))
    return {"step_start_acc": float(sums[0]) / starts, "all_acc": float(sums[2]) / n, "kl": float(sums[4]) / n}


class MergerTrainer:
    """KL(unmerged base || merged base) on every response position; only the merger learns. The state
    (merger, optimizer, schedule, step, RNG) resumes a run exactly; the example order is a seeded function."""

    def __init__(self, base, args: MergerArgs) -> None:
        self.base, self.args, self.out = base, args, Path(args.out)
        k = args.max_step_tokens
        rows = read_examples(Path(args.data))
        for _, ex in rows:
            ex.validate(k)
        train, held = split_eval(rows, args.eval_fraction)
        # An example whose prompt fills max_len has no response to learn from.
        self.train = [ex for _, ex in train if ex.prompt_len < args.max_len]
        if not self.train:
            raise HamburgerError(f"no training examples with a prompt shorter than --max-len {args.max_len}")
        # Held-out examples keep the data's steps, so runs with and without --random-steps compare.
        self.held: list[tuple[list[int], int, list[int]]] = []
        for _, ex in held[: args.eval_examples]:
            if ex.prompt_len < args.max_len:
                ids, steps = clip_example(ex.input_ids, ex.prompt_len, ex.steps, args.max_len)
                self.held.append((ids, ex.prompt_len, steps))
        base.requires_grad_(False)
        base.eval()
        self.merger = KVMerger.for_base(base.config, k, args.gates, args.channels).to(next(base.parameters()).device)
        if args.init:
            if not Path(args.init).is_file():
                raise HamburgerError(f"--init {args.init}: no such merger file (a merger.safetensors)")
            start = KVMerger.load(args.init)
            if start.meta.get("base_fingerprint", "") not in ("", fingerprint(base)):
                raise HamburgerError(f"{args.init} was fitted to another base")
            try:
                self.merger.load_state_dict(start.state_dict())
            except RuntimeError as exc:
                raise HamburgerError(f"{args.init} does not fit this merger's shape (--gates, --channels, "
                                     f"--max-step-tokens): {str(exc).splitlines()[0]}") from None
        self.opt = torch.optim.Adam(self.merger.parameters(), lr=args.lr)
        total = max(1, args.max_steps)  # cosine from lr to lr/10: the late steps refine
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
        self.step = 0
        self.gen = torch.Generator().manual_seed(args.seed)  # random step lengths
        self.fingerprint = fingerprint(base)  # stored with the merger: it fits only this base
        self.tracker = Tracker(args.report_to, self.out, "train-merger", asdict(args))

    def order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.train)))
        random.Random(self.args.seed * 1_000_003 + epoch).shuffle(idx)
        return idx

    def batch(self) -> Layout:
        """The examples of the current step, cut to max_len, with the data's or random steps."""
        a, out = self.args, []
        for j in range(self.step * a.batch_size, (self.step + 1) * a.batch_size):
            epoch, i = divmod(j, len(self.train))
            ex = self.train[self.order(epoch)[i]]
            ids, steps = clip_example(ex.input_ids, ex.prompt_len, ex.steps, a.max_len)
            if a.random_steps:
                steps = random_steps(len(ids) - ex.prompt_len, a.max_step_tokens, self.gen)
            out.append((ids, ex.prompt_len, steps))
        return Layout.build(*zip(*out), next(self.base.parameters()).device)

    def train_step(self) -> float:
        lay = self.batch()
        with torch.no_grad():
            teacher = forward_layout(self.base, None, lay, merged=False)
        student = forward_layout(self.base, self.merger, lay, window=self.args.merge_window)
        loss = kl_per_position(student, teacher)[lay.valid].mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.merger.parameters(), 1.0)
        self.opt.step()
        self.sched.step()
        self.step += 1
        return loss.item()

    def save(self) -> None:
        """The merger's weights (through a temporary file) and state/ (written whole beside itself and swapped in,
        `training.atomic`): a kill leaves the last complete ones."""
        state, weights = self.out / "state", self.out / WEIGHTS
        settle_dir(state)
        new = staging(state)
        new.mkdir(parents=True)
        tmp = weights.with_name(weights.name + ".tmp")
        self.merger.save(tmp, base=str(getattr(self.base.config, "hamburger_ref", "")),
                         base_fingerprint=self.fingerprint)
        tmp.replace(weights)
        torch.save({"merger": self.merger.state_dict(), "optimizer": self.opt.state_dict(),
                    "scheduler": self.sched.state_dict(), "rng": self.gen.get_state()}, new / "state.pt")
        write_text(new / "trainer.json", json.dumps({"step": self.step, "args": asdict(self.args)}))
        replace_dir(state)

    def resume(self) -> bool:
        state = self.out / "state"
        settle_dir(state)  # a kill between a swap's renames: finish it
        if not (state / "trainer.json").is_file():
            return False
        saved = torch.load(state / "state.pt", weights_only=True)
        # A run saved before per-channel weights existed keeps (L, kvh, K) logits: the same numbers, one dim less.
        params = dict(self.merger.named_parameters())
        saved["merger"] = {k: v.view(params[k].shape) if k in params and v.numel() == params[k].numel() else v
                           for k, v in saved["merger"].items()}
        shapes = [p.shape for p in self.merger.parameters()]
        for i, st in saved["optimizer"]["state"].items():
            for key, v in st.items():
                if v.dim() and v.shape != shapes[i] and v.numel() == shapes[i].numel():
                    st[key] = v.view(shapes[i])
        self.merger.load_state_dict(saved["merger"])
        self.opt.load_state_dict(saved["optimizer"])
        self.sched.load_state_dict(saved["scheduler"])
        self.gen.set_state(saved["rng"])
        self.step = json.loads((state / "trainer.json").read_text())["step"]
        return True

    def log(self, row: dict) -> None:
        row = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
        with (self.out / "log.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        self.tracker.log(row, row["step"], "train" if "train_kl" in row else "eval")

    def evaluate(self) -> dict[str, float]:
        return {f"heldout_{k}": v for k, v in evaluate_merger(self.base, self.merger, self.held,
                                                               self.args.batch_size, self.args.merge_window).items()}

    def fit(self, log_every: int = 10) -> dict[str, float]:
        a = self.args
        self.out.mkdir(parents=True, exist_ok=True)
        metrics: dict[str, float] = {}
        t0, done0, losses = time.perf_counter(), self.step, []
        if self.step == 0 and self.held:
            metrics = self.evaluate()
            self.log({"step": 0, **metrics})
        t1 = time.perf_counter()
        while self.step < a.max_steps:
            losses.append(self.train_step())
            if self.step % log_every == 0:
                self.log({"step": self.step, "train_kl": sum(losses) / len(losses), "lr": self.sched.get_last_lr()[0],
                          "s_per_step": (time.perf_counter() - t1) / (self.step - done0)})
                losses = []
            out_of_time = bool(a.max_minutes) and time.perf_counter() - t0 > 60 * a.max_minutes
            last = out_of_time or self.step == a.max_steps
            if self.held and (self.step % a.eval_every == 0 or last):
                metrics = self.evaluate()
                self.log({"step": self.step, **metrics})
            if self.step % a.save_every == 0 or last:
                self.save()
            if out_of_time:
                break
        self.tracker.end()
        return metrics
