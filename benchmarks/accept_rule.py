"""Which signal should decide whether a step goes on: the stop head, or the drafted token's own probability?

Today the decision to emit micro token j is read from the stop head at the state that produced token j-1,
before token j exists. The alternative reads it from the state that produces token j: the micro-step
decoder's own probability of its choice (max softmax over the head it drafts from), at the cost of one
micro-step computed and thrown away where the rule stops. A third rule reads the stop head as today but
on the step's path: draft j goes on while the product of P(go on) over drafts 1..j exceeds c, the chance
that every draft so far is kept (verify and compress mode's rule since it was measured here).

On the held-out split of `hamburger train` (unmerged text, as verify mode checks drafts), at every response
position s the base's state gives token 0; the micro-step decoder drafts tokens 1..K-1 teacher-forced on the
data (= the base's greedy output). A draft is right when it is the base's greedy token. For each rule and
threshold c the chain goes on while the rule's signal > c; printed per position: micro-steps computed,
drafts emitted, drafts kept by a verifying base (the leading right ones), and tokens per base forward
(1 + kept), and tokens per unit of time under a cost model (`--costs`: a base forward over one more
position, the first micro-step and each later one, in base forwards; measure them on your machine).
AUC: how well each signal separates right from wrong drafts (all positions, depth >= 1).

    python benchmarks/accept_rule.py default runs/drafter-kd/export
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hamburger.errors import HamburgerError
from hamburger.model.hamburger_model import load_model
from hamburger.training.drafter import draft_batch, draft_forward, drafted
from hamburger.training.examples import read_examples, split_eval

THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.8, 0.9)


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Probability that a random right draft scores above a random wrong one (ties count half)."""
    pos, neg = score[label], score[~label]
    if not len(pos) or not len(neg):
        return float("nan")
    ranks = torch.cat([pos, neg]).argsort().argsort().double() + 1
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def chain(signal: torch.Tensor, ok: torch.Tensor, c: float, after: bool, path: bool = False,
          costs: tuple[float, float, float] = (0.057, 0.209, 0.170)) -> tuple[float, float, float, float]:
    """signal, ok (N, D). Rule "before" (the stop head): draft j is computed and emitted while signal_j > c;
    with `path`, while the product signal_1 * .. * signal_j > c (the chance that every draft so far is kept).
    Rule "after" (the token's probability): draft j is computed while the chain is alive and emitted if
    signal_j > c; a computed draft that fails is thrown away and ends the chain.
    Returns the means per position of (micro-steps computed, drafts emitted, drafts kept), and the tokens per
    unit of time in base forwards under the cost model `costs` = (one more position in the base forward, the
    first micro-step, each later one), each in base forwards: sum(1 + kept) / sum(cost)."""
    go = ((signal.cumprod(1) if path else signal) > c).long().cumprod(1)  # (N, D): 1 while every test so far passed
    emitted = go.sum(1)
    computed = torch.clamp(emitted + 1, max=signal.shape[1]) if after else emitted
    kept = (go * ok.long()).cumprod(1).sum(1)
    position, first, later = costs
    cost = 1 + position * emitted + (computed > 0) * (first + later * (computed - 1).clamp(min=0))
    speed = float((1 + kept).double().sum() / cost.double().sum())
    return computed.double().mean().item(), emitted.double().mean().item(), kept.double().mean().item(), speed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="checkpoints (or `default`)")
    p.add_argument("--data", default="data/segmented/train-k4-a0.2-r0.5.jsonl")
    p.add_argument("--eval-fraction", type=float, default=0.04, help="the training run's held-out fraction")
    p.add_argument("--examples", type=int, default=60, help="held-out examples read (the first ones)")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--costs", type=float, nargs=3, default=(0.057, 0.209, 0.170), metavar=("POSITION", "FIRST", "LATER"),
                   help="the cost model, in base forwards: one more position in a base forward, the first micro-step "
                        "(the features and token 0), each later micro-step (default: benchmarks/verify_costs.py on "
                        "runs/ctx-gate16-2400, fp16, batch 1, the 2-core development CPU; measure yours)")
    args = p.parse_args()
    try:
        _, held = split_eval(read_examples(Path(args.data)), args.eval_fraction)
        held = [ex for _, ex in held][: args.examples]
        if not held:
            raise HamburgerError(f"no held-out examples at --eval-fraction {args.eval_fraction}")
        print(f"{len(held)} held-out examples of {args.data}; thresholds {THRESHOLDS}")
        print("| checkpoint | rule | AUC | c | micro-steps / position | drafts emitted | drafts kept | "
              "tokens / base forward | kept / micro-step | tokens / cost |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name in args.models:
            model, _ = load_model(name)
            model.eval()
            stops, probs, oks = [], [], []
            with torch.no_grad():
                for ex in held:
                    b = draft_batch(model, ex.input_ids[: args.max_len], ex.prompt_len, None)
                    if b is None:
                        continue
                    logits, stop_logits = draft_forward(model, b)
                    oks.append(drafted(model, logits) == b.greedy)
                    stops.append(torch.sigmoid(-stop_logits))  # P(continue) from the state before each draft
                    probs.append(torch.softmax(logits, -1).amax(-1))  # the draft's own probability
            ok = torch.cat(oks)
            for rule, signal, after, path in (("stop head (before)", torch.cat(stops), False, False),
                                              ("stop head, path (before)", torch.cat(stops), False, True),
                                              ("token prob (after)", torch.cat(probs), True, False)):
                area = auc(signal.flatten(), ok.flatten())
                for c in THRESHOLDS:
                    computed, emitted, kept, speed = chain(signal, ok, c, after, path, tuple(args.costs))
                    per = kept / computed if computed else float("nan")
                    print(f"| {name} | {rule} | {area:.3f} | {c:g} | {computed:.2f} | {emitted:.2f} | {kept:.2f} | "
                          f"{1 + kept:.2f} | {per:.2f} | {speed:.2f} |", flush=True)
    except HamburgerError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
