"""Dense distillation of the micro-step decoder into a drafter for every position (verify mode).

The paper's training teaches the micro-step decoder only inside entropy segments, on features of smashed
slots, with hard labels. A drafter that the base checks (verify mode) is asked to guess at *every*
position, from the features of an ordinary unmerged position, and is worth exactly as much as its guesses
agree with the base. So this objective, as EAGLE, Hydra and ReDrafter do, trains it on the base's own
distribution at every response position of unmerged text, with the base frozen:

- micro tokens: KL(base || micro) for tokens 1..K-1 after every position (teacher-forced on the data);
- stop head: a calibrated predictor of "the next micro token is the base's greedy choice" (BCE), read
  from the state that produced the current token, which is where the engines read it; with it the
  confidence knob decides whether drafting one more token is worth a micro-step.

Training state holds only what trains (micro-step decoder, stop head, feature norms), the optimizer, the
schedule, the step and the RNG, so an interrupted run resumes exactly; the base is never written.
"""

from __future__ import annotations

import json
import math
import random
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from hamburger.errors import HamburgerError
from hamburger.model.hamburger_model import HamburgerModel
from hamburger.training.args import DrafterArgs
from hamburger.training.atomic import replace_dir, settle_dir, staging, write_text
from hamburger.training.examples import read_examples, split_eval
from hamburger.training.precision import bf16_autocast
from hamburger.training.tracking import Tracker


def adapt_micro(model: HamburgerModel, micro_context: int, micro_layers: int, name: str) -> list[str]:
    """Before `train-drafter`: give the micro-step decoder a context of `micro_context` base positions (-1: as it is)
    and keep its last `micro_layers` layers (0: all). Returns what changed, one line each."""
    said = []
    if micro_context >= 0 and micro_context != model.config.micro_context:
        model.config.micro_context = micro_context
        model.micro.set_context(micro_context)
        said.append(f"micro-step decoder: context of {micro_context} base positions")
    if micro_layers and micro_layers != model.config.micro_layers:
        if micro_layers > model.config.micro_layers:
            raise HamburgerError(f"--micro-layers {micro_layers}: {name} has {model.config.micro_layers} "
                                 "micro-step layers; a drafter can keep fewer, not add more")
        model.micro.keep_top(micro_layers)
        model.config.micro_layers = micro_layers
        said.append(f"micro-step decoder: its last {micro_layers} layers")
    return said


def trained_modules(model: HamburgerModel) -> tuple[str, str]:
    """The micro-step decoder and the stop head that decides drafts: the checkpoint's draft stop head where it has
    one (trust mode's `stop_head` then stays as it was), else its only stop head. The embedder and slot adapters
    are not touched by this objective."""
    return ("micro", "draft_stop_head" if model.draft_stop_head is not None else "stop_head")


@dataclass
class DraftBatch:
    feats: torch.Tensor  # (N, m, d) raw base features at N positions s (draft_forward applies the trained norms)
    inputs: torch.Tensor  # (N, K-1) data tokens s+1 .. s+K-1 (the micro-step decoder's inputs)
    teacher: torch.Tensor  # (N, K-1, V') base log-probs of tokens s+2 .. s+K over the drafter's vocabulary V'
    greedy: torch.Tensor  # (N, K-1) the base's greedy tokens s+2 .. s+K (ids in the full vocabulary)
    h0: torch.Tensor  # (N, d) the base's final normed state at s (it produced token 0 = s+1)
    s: torch.Tensor | None = None  # (N,) the positions (with context)
    ctx_k: list[torch.Tensor] | None = None  # the base's keys (1, kv_heads, T, hd) of each micro layer's source layer
    ctx_v: list[torch.Tensor] | None = None


@torch.no_grad()
def draft_batch(model: HamburgerModel, ids: list[int], prompt_len: int, positions: int | None,
                gen: torch.Generator | None = None) -> DraftBatch | None:
    """The frozen base over one unmerged example, and what the drafter learns from at each position s.

    At position s the base's state predicts token s+1 (token 0 of a step); the micro-step decoder then takes
    tokens s+1..s+K-1 and predicts s+2..s+K. Positions run from the last prompt token to T-K-1.
    """
    k = model.config.max_step_tokens
    dev = next(model.parameters()).device
    x = torch.tensor(ids, device=dev)
    t = len(ids)
    start = max(prompt_len - 1, 0)
    s = torch.arange(start, max(start, t - k), device=dev)  # none when the response is too short (or cut by max_len)
    if len(s) == 0:
        return None
    if positions and len(s) > positions:
        s = s[torch.randperm(len(s), generator=gen)[:positions].to(dev)].sort().values
    cache = DynamicCache() if model.micro.context else None
    hidden = model.base_forward(model.embed(x[None]), torch.ones(1, t, dtype=torch.long, device=dev),
                                torch.arange(t, device=dev)[None], cache=cache)
    at = (torch.zeros_like(s), s)
    offsets = torch.arange(k, device=dev)
    rows = s[:, None] + offsets[1:]  # the positions whose next token a micro-step predicts
    # The base's head once per distinct position (neighbouring samples share most of theirs).
    unique, inverse = rows.unique(return_inverse=True)
    logits = model.lm_head(hidden[-1][0][unique]).float()
    greedy = logits.argmax(-1)[inverse]
    vocab = model.micro_vocab
    logp = F.log_softmax(logits if vocab is None else logits[:, vocab.to(dev)], -1)[inverse]
    feats = torch.stack([hidden[i][at] for i in model.micro.feature_layers], dim=-2)
    batch = DraftBatch(feats, x[s[:, None] + 1 + offsets[:-1]], logp, greedy, hidden[-1][at])
    if cache is not None:
        layers = [cache.layers[i] for i in model.micro.context_layers]
        batch.s, batch.ctx_k, batch.ctx_v = s, [c.keys for c in layers], [c.values for c in layers]
    return batch


def micro_states(model: HamburgerModel, x: torch.Tensor, b: DraftBatch, chunk: int = 128) -> torch.Tensor:
    """The micro-step decoder over (N, q, d) inputs [features, tokens] -> normed (N, q, d).

    With context, the N rows run as one sequence (up to `chunk` rows at a time) under a mask where row r's
    inputs, at positions s_r+1.., see the base's entries (s_r - context, s_r] and their own earlier inputs.
    """
    micro = model.micro
    if not micro.context:
        return micro(x)
    n, q, d = x.shape
    out = []
    for lo in range(0, n, chunk):
        s, xs = b.s[lo: lo + chunk], x[lo: lo + chunk]
        r = len(s)
        key = torch.arange(b.ctx_k[0].shape[2], device=x.device)
        seen = (key <= s[:, None]) & (key > s[:, None] - micro.context)  # (r, T)
        own = torch.block_diag(*[torch.ones(q, q, device=x.device).tril()] * r).bool()
        mask = torch.cat([seen.repeat_interleave(q, 0), own], 1)[None, None]
        positions = (s[:, None] + 1 + torch.arange(q, device=x.device)).reshape(1, -1)
        out.append(micro.forward_context(xs.reshape(1, r * q, d), positions, b.ctx_k, b.ctx_v, mask).view(r, q, d))
    return torch.cat(out)


def draft_forward(model: HamburgerModel, b: DraftBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """-> micro logits (N, K-1, V') for tokens 1..K-1 and stop logits (N, K-1) of the states of tokens 0..K-2.

    V' is the checkpoint's micro-step shortlist when it has one (what the engine drafts from), else the vocabulary.
    """
    m = model.micro.num_features
    feats = torch.stack([norm(b.feats[:, j]) for j, norm in enumerate(model.micro.feature_norms)], dim=1)
    out = micro_states(model, torch.cat([feats, model.embed(b.inputs)], 1), b)[:, m:]  # (N, K-1, d)
    states = torch.cat([b.h0[:, None], out[:, :-1]], 1)  # the states that produced tokens 0..K-2
    head = model.base.get_output_embeddings().weight
    if model.micro_vocab is not None:
        head = head[model.micro_vocab.to(head.device)]
    return F.linear(out, head).float(), model.stop_logits(states, drafting=True).float()


def drafted(model: HamburgerModel, logits: torch.Tensor) -> torch.Tensor:
    """The drafter's greedy tokens as ids of the full vocabulary."""
    choice = logits.argmax(-1)
    return choice if model.micro_vocab is None else model.micro_vocab.to(choice.device)[choice]


def draft_loss(model: HamburgerModel, b: DraftBatch, stop_weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    logits, stop_logits = draft_forward(model, b)
    kl = F.kl_div(F.log_softmax(logits, -1), b.teacher, log_target=True, reduction="none").sum(-1).mean()
    # The step should stop after token i when micro token i+1 will not be the base's greedy choice.
    wrong_next = (drafted(model, logits.detach()) != b.greedy).float()
    stop = F.binary_cross_entropy_with_logits(stop_logits, wrong_next)
    return kl + stop_weight * stop, {"kl": kl.item(), "stop_bce": stop.item()}


@torch.no_grad()
def evaluate_drafter(model: HamburgerModel, examples: list, max_len: int, bins: int = 10) -> dict[str, float]:
    """Held-out micro accuracy @1..K-1 against the base's greedy choice, chain acceptance (tokens per base
    forward if the base checked every draft), and the stop head's calibration (ECE of P(next is right))."""
    k = model.config.max_step_tokens
    right = torch.zeros(k - 1)
    chain = torch.zeros(k - 1)
    n = 0
    probs, hits = [], []
    for ex in examples:
        b = draft_batch(model, ex.input_ids[:max_len], ex.prompt_len, None)
        if b is None:
            continue
        logits, stop_logits = draft_forward(model, b)
        ok = (drafted(model, logits) == b.greedy).float().cpu()
        right += ok.sum(0)
        chain += ok.cumprod(1).sum(0)
        n += len(ok)
        probs.append(torch.sigmoid(-stop_logits).cpu().flatten())
        hits.append(ok.flatten())
    if not n:
        return {}
    p, y = torch.cat(probs), torch.cat(hits)
    which = (p * bins).clamp(max=bins - 1).long()
    ece = sum((which == i).sum() * (p[which == i].mean() - y[which == i].mean()).abs()
              for i in range(bins) if (which == i).any()) / len(p)
    row = {f"micro_acc@{i + 1}": (right[i] / n).item() for i in range(k - 1)}
    row.update(tokens_per_forward=1 + (chain / n).sum().item(), stop_ece=float(ece), positions=n)
    return row


class DrafterTrainer:
    def __init__(self, model: HamburgerModel, args: DrafterArgs) -> None:
        self.model, self.args, self.out = model, args, Path(args.out)
        self.device_type = next(model.parameters()).device.type
        self.bf16 = bf16_autocast(args.bf16, self.device_type)
        train, held = split_eval(read_examples(Path(args.data), model.tokenizer, distilled=True), args.eval_fraction)
        self.train = [ex for _, ex in train]
        self.held = [ex for _, ex in held][: args.eval_examples]
        if not self.train:
            raise HamburgerError(f"{args.data} leaves no training examples once --eval-fraction {args.eval_fraction} "
                                 "is held out")
        model.requires_grad_(False)
        self.trained = trained_modules(model)
        self.params = [p for name in self.trained for p in getattr(model, name).parameters()]
        for p in self.params:
            p.requires_grad_(True)
        gate = model.micro.context_gate
        rest = [p for p in self.params if p is not gate]
        groups = [{"params": rest}] + ([{"params": [gate], "lr": args.gate_lr}] if gate is not None else [])
        self.opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0)
        warm, total = args.warmup, args.max_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))))
        self.step = 0
        self.gen = torch.Generator().manual_seed(args.seed)
        self.tracker = Tracker(args.report_to, self.out, "train-drafter", asdict(args))

    def order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.train)))
        random.Random(self.args.seed * 1_000_003 + epoch).shuffle(idx)
        return idx

    def trained_state(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v.detach().contiguous() for name in self.trained
                for k, v in getattr(self.model, name).state_dict().items()}

    def save(self) -> None:
        """state/ (to resume) and hamburger/ (the checkpoint), each written whole beside itself and swapped in
        (`training.atomic`): a kill leaves the last complete ones."""
        state, ship = self.out / "state", self.out / "hamburger"
        settle_dir(state)
        settle_dir(ship)
        new = staging(state)
        new.mkdir(parents=True)
        save_file(self.trained_state(), new / "trained.safetensors")
        torch.save({"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                    "rng": self.gen.get_state(), "torch_rng": torch.get_rng_state()}, new / "optimizer.pt")
        write_text(new / "trainer.json", json.dumps({"step": self.step, "args": asdict(self.args)}))
        replace_dir(state)
        self.model.save_pretrained(staging(ship))
        replace_dir(ship)

    def resume(self) -> bool:
        state = self.out / "state"
        settle_dir(state)  # a kill between a swap's renames: finish it
        settle_dir(self.out / "hamburger")
        if not (state / "trainer.json").is_file():
            return False
        weights = load_file(state / "trained.safetensors")
        for name in self.trained:
            prefix = name + "."
            getattr(self.model, name).load_state_dict({k[len(prefix):]: v for k, v in weights.items()
                                                       if k.startswith(prefix)})
        extra = torch.load(state / "optimizer.pt", weights_only=True)
        self.opt.load_state_dict(extra["optimizer"])
        self.sched.load_state_dict(extra["scheduler"])
        self.gen.set_state(extra["rng"])
        torch.set_rng_state(extra["torch_rng"])
        self.step = json.loads((state / "trainer.json").read_text())["step"]
        return True

    def log(self, row: dict) -> None:
        with (self.out / "log.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)

    def autocast(self):
        return torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16)

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        row = evaluate_drafter(self.model, self.held, self.args.max_len)
        self.model.train()
        return row

    def fit(self) -> dict[str, float]:
        a = self.args
        if self.step == 0:
            first = self.evaluate()
            self.log({"step": 0, "examples_seen": 0, **first})
            self.tracker.log(first, 0, "eval")
        t0, positions, metrics = time.perf_counter(), 0, {}
        self.model.train()
        while self.step < a.max_steps:
            epoch, i = divmod(self.step, len(self.train))
            ex = self.train[self.order(epoch)[i]]
            with self.autocast():
                batch = draft_batch(self.model, ex.input_ids[: a.max_len], ex.prompt_len, a.positions, self.gen)
            self.step += 1
            if batch is not None:
                with self.autocast():
                    loss, parts = draft_loss(self.model, batch, a.stop_weight)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.params, 1.0)
                self.opt.step()
                positions += len(batch.inputs)
                self.sched.step()
            else:  # the schedule counts examples, also one that gave no batch (before any optimizer step, torch
                with warnings.catch_warnings():  # warns that the step came first: the order is meant here)
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step\\(\\)` before")
                    self.sched.step()
            if batch is not None:
                rate = positions / (time.perf_counter() - t0)
                self.tracker.log({**parts, "positions_per_s": rate, "lr": self.sched.get_last_lr()[0]}, self.step,
                                 "train")
            if self.step % 20 == 0 and batch is not None:
                print(f"step {self.step}/{a.max_steps} kl {parts['kl']:.3f} stop {parts['stop_bce']:.3f} "
                      f"lr {self.sched.get_last_lr()[0]:.2e} {rate:.0f} positions/s", flush=True)
            if self.step % a.eval_every == 0 or self.step == a.max_steps:
                metrics = self.evaluate()
                self.log({"step": self.step, "examples_seen": self.step, **metrics})
                self.tracker.log(metrics, self.step, "eval")
            if self.step % a.save_every == 0 or self.step == a.max_steps:
                self.save()
        self.tracker.end()
        return metrics
