"""The macro-step: the one definition of how a HAMburger step is decoded.

The decode loop (`scheduler.Scheduler`, which `Engine.generate` and the server both run) decodes trust mode by
`macro_step`, and verify and compress modes draft by it (token 0 given by their check pass, the micro tokens or a
proposer's read as drafts, kept apart from the tokens emitted). A row's limits live in `Limits`, how its tokens
are chosen in `RowPicker`, and what the step made is a `Step`.

One macro-step over n rows: token 0 from the base's LM head at the state the base pass left, then the
micro-step decoder, one token per micro-step, while any row's step goes on. A row's step ends at EOS, at its
token budget, at K tokens, or where the stop head says so (P(continue) <= the row's confidence), unless a
forced step length replaces the stop head's verdict (bench's forced-steps system).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hamburger.inference.kv import KVCache, MicroContext
from hamburger.inference.rows import RowBatch
from hamburger.inference.sampling import continues, greedy_tokens, sample

if TYPE_CHECKING:
    from hamburger.inference.proposers import Proposer
    from hamburger.inference.runner import ModelRunner

# pick(h, active, micro) -> (n,) token ids: `h` (n, d) the states that predict them, `active` (n,) the rows
# whose token is used (samplers draw only for those), `micro` whether h comes from the micro-step decoder.
Pick = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]


def micro_context(runner: ModelRunner, cache: KVCache, used: torch.Tensor | list[int] | int, base_pos: torch.Tensor,
                  valid: torch.Tensor | None = None) -> MicroContext | None:
    """The context of a macro-step, None for a decoder without one. A row's entries in use are its first `used`
    slots ((n,), a list, or one int for every row), less those `valid` (n, >= end) marks False (left padding); the
    decoder sees the latest `micro_context` of them, as in training (`train-drafter --micro-context`)."""
    window = runner.model.micro.context
    if not window or runner.k == 1:
        return None
    used = torch.as_tensor(used, device=base_pos.device).expand(base_pos.shape[0])
    end = int(used.max())
    in_use = torch.arange(end, device=base_pos.device) < used[:, None]
    if valid is not None:
        in_use &= valid[:, :end]
    latest = in_use.long().flip(-1).cumsum(-1).flip(-1) <= window
    return MicroContext(cache, in_use & latest, base_pos)


class MicroRun:
    """The micro-step decoder over one macro-step of n rows.

    Its cache restarts every macro-step with the base's normed features [f_1..f_m]; each call feeds one token
    (t_0 first, then each micro token) and returns the normed state (n, d) that predicts the next one.
    """

    def __init__(self, runner: ModelRunner, feats: list[torch.Tensor], cache: KVCache,
                 context: MicroContext | Callable[[], MicroContext | None] | None = None) -> None:
        self.runner, self.feats, self.cache, self.context, self.fed = runner, feats, cache, context, 0

    def __call__(self, tok: torch.Tensor) -> torch.Tensor:
        micro = self.runner.model.micro
        if callable(self.context):  # made on the first micro-step (none on a step without one)
            self.context = self.context()
        x = self.runner.model.embed(tok)[:, None]
        if self.fed == 0:
            normed = [norm(f) for f, norm in zip(self.feats, micro.feature_norms)]
            x, start = torch.cat([torch.stack(normed, 1), x], 1), 0
        else:
            start = micro.num_features + self.fed
        self.fed += 1
        return self.runner.micro_pass(x, self.cache, start, self.context)


class RowPicker:
    """How each row of the running batch chooses its tokens (a `Pick`): greedy rows by one argmax; sampled rows one
    by one with their own generator (only when active, so a request draws the same random numbers as when it runs
    alone). A checked row's token 0 is the one its last check pass chose (`RowBatch.next_t0`: greedy, the base's
    choice after the kept drafts; sampled, drawn by the acceptance); a sampled checked row's drafts keep the
    distribution they were drawn from for the next acceptance (`RowBatch.keep_distribution`)."""

    def __init__(self, runner: ModelRunner, rows: RowBatch) -> None:
        self.runner, self.rows, self.depth = runner, rows, 0  # depth: which draft of the macro-step a pick makes

    def __call__(self, h: torch.Tensor, active: torch.Tensor, micro: bool) -> torch.Tensor:
        rows, runner, n = self.rows, self.runner, len(h)
        self.depth = self.depth + 1 if micro else 0
        given = rows.next_t0[:n]
        if (not micro and all(r is None or r.mode.checked for r in rows.requests[:n])  # no sync for trust rows
                and bool((given >= 0).logical_or(~active).all())):
            return given.clamp(min=0)  # every decoding row is checked: its check pass chose token 0 already
        shortlist = micro and runner.vocab is not None
        sampled = [(i, r) for i, r in enumerate(rows.requests[:n]) if r is not None and not r.sampling.greedy]
        if not sampled:  # every row greedy: the head's argmax alone (no logits where the native kernels run it)
            return runner.head_argmax(h, shortlist)
        logits = runner.short_logits(h) if shortlist else runner.model.lm_head(h)
        tok = greedy_tokens(logits)
        on, t0 = active.tolist(), given.tolist()
        for i, req in sampled:
            if not on[i]:
                continue
            if req.mode.checked and not micro and t0[i] >= 0:
                tok[i] = t0[i]
            elif req.mode.checked and micro:
                probs = torch.softmax(req.warpers(logits[i : i + 1].float()), -1)
                tok[i] = torch.multinomial(probs, 1, generator=req.rng)[0, 0]
                self._keep_draft_distribution(i, probs[0])
            else:
                tok[i] = sample(logits[i : i + 1], req.sampling, req.rng, req.warpers)[0]
        return runner.vocab[tok] if shortlist else tok

    def _keep_draft_distribution(self, row: int, probs: torch.Tensor) -> None:
        """A micro draft's distribution (over the shortlist, where the runner has one), over the whole vocabulary."""
        vocab = self.runner.vocab
        full = probs if vocab is None else torch.zeros(self.rows.vocab, device=probs.device).index_copy_(
            0, vocab, probs)
        self.rows.keep_distribution(row, self.depth, full)


@dataclass
class Limits:
    """Per-row rules that end a step or a sequence: EOS ids (n, E) (-1 pads; (1, E) for all rows alike), the
    token budget (n,) or one int, and the confidence a step needs to go on, (n,) or one float.

    `drafting` (n,) or one bool: rows whose micro tokens are drafts (verify and compress mode): they emit token 0
    only, and their drafts neither count as generated nor end the request (the base checks them first; an EOS
    draft ends the drafting); room is left for the base's own token after them. Their confidence bounds the
    chance that the whole step so far is right (the product of the stop head's P(go on) over the step), not the
    next token's alone: a draft is worth its micro-step only if every draft before it is kept too. These rows
    read the checkpoint's draft stop head where it has one (`HamburgerModel.stop_logits`)."""

    eos: torch.Tensor
    max_new: torch.Tensor | int
    confidence: torch.Tensor | float
    drafting: torch.Tensor | bool = False
    # (n,): at most this many micro-step tokens per row after token 0 (verify mode's draft policy); None: K-1
    micro_len: torch.Tensor | None = None

    def is_eos(self, tok: torch.Tensor) -> torch.Tensor:
        return (tok[:, None] == self.eos).any(-1)


@dataclass
class Step:
    """What one macro-step made, per row: `tokens` (n, 1 + W): token 0, then a trust row's micro tokens or a
    checked row's drafts; `emitted` (n,): the tokens the row emits now (its step; 1 for a checked row; 0 for a
    row not live); `drafts` (n,): a checked row's drafts after token 0, for the next pass to check; `ended` (n,):
    the rows whose request ended (EOS or its budget); `micro_calls`: the micro-step decoder's calls."""

    tokens: torch.Tensor
    emitted: torch.Tensor
    drafts: torch.Tensor
    ended: torch.Tensor
    micro_calls: int = 0


def macro_step(runner: ModelRunner, states: list[torch.Tensor], live: torch.Tensor, gen_len: torch.Tensor,
               limits: Limits, pick: Pick, cache: KVCache | None, forced_len: torch.Tensor | None = None,
               context: MicroContext | Callable[[], MicroContext | None] | None = None,
               proposer: Proposer | None = None, width: int = 0) -> Step:
    """One macro-step over n rows: token 0 from the base's head, then micro-steps while any live row's step goes on.

    `states`: [final normed state, feature_1..feature_m] of the last base pass, each (n, d). `live` (n,): the
    rows that decode (the others are computed but emit nothing). `gen_len` (n,): tokens generated so far, updated
    in place by the tokens emitted. `cache`: the micro-step decoder's cache for the n rows. `forced_len` (n,):
    where > 0, the step takes that many tokens whatever the stop head says (EOS and the budget still end it).
    `context`: what a micro-step decoder with context reads of the base (`micro_context`). `proposer`: drafting
    rows' drafts from elsewhere (`proposers.py`); a row that gets some takes them in place of micro-steps, up to
    max(K-1, `width`) of them.

    The one host sync per micro-step is `go_on.any()`; nothing per token.
    """
    model, k = runner.model, runner.k
    h0, feats = states[0], states[1:]
    drafting = torch.as_tensor(limits.drafting, device=h0.device).expand(h0.shape[0])
    tok = pick(h0, live, False)
    width = max(k - 1, width if proposer is not None else 0)  # a proposer's drafts may run past K-1
    step_tok = torch.zeros(h0.shape[0], 1 + width, dtype=torch.long, device=h0.device)
    step_tok[:, 0] = tok
    step_len = live.long()  # token 0 and the micro tokens or drafts after it
    gen_len += step_len
    ended = live & (limits.is_eos(tok) | (gen_len >= limits.max_new))
    # after token 0, at most this many micro tokens: the budget's rest (a drafting row's less the base's token)
    room = (torch.as_tensor(limits.max_new, device=h0.device) - gen_len - drafting.long()).clamp(min=0)
    go_on = live & ~ended & (room > 0)
    step = Step(step_tok, step_len, torch.zeros_like(step_len), ended)
    if k == 1:
        return step
    if proposer is not None:
        go_on &= _propose(proposer, tok, go_on & drafting, room.clamp(max=width), step_tok, step_len) == 0
    reach = torch.ones(h0.shape[0], device=h0.device)  # the stop head's P(every token of the step so far is right)
    if limits.micro_len is not None:
        go_on &= limits.micro_len > 0
    if bool(go_on.any()):  # some row runs a micro-step (else no stop head either)
        go_on &= _goes_on(model.stop_logits(h0, limits.drafting), step_len, forced_len, limits, reach)
        run = MicroRun(runner, feats, cache, context)
        for i in range(1, k):
            if not bool(go_on.any()):  # the one host sync per micro-step: does any step go on?
                break
            h = run(tok)
            step.micro_calls += 1
            tok = pick(h, go_on, True)
            step_tok[:, i] = torch.where(go_on, tok, step_tok[:, i])
            step_len += go_on.long()
            gen_len += (go_on & ~drafting).long()
            eos, full = limits.is_eos(tok), step_len - 1 >= room
            ended |= go_on & ~drafting & (eos | full)  # an EOS draft ends the drafting, not the request
            go_on = go_on & ~eos & ~full & (step_len < k)
            if limits.micro_len is not None:
                go_on &= step_len <= limits.micro_len
            go_on &= _goes_on(model.stop_logits(h, limits.drafting), step_len, forced_len, limits, reach)
    step.drafts = torch.where(drafting & live, step_len - 1, 0)
    step.emitted = torch.where(drafting, live.long(), step_len)
    return step


def _propose(proposer: Proposer, tok: torch.Tensor, drafting: torch.Tensor, room: torch.Tensor,
             step_tok: torch.Tensor, step_len: torch.Tensor) -> torch.Tensor:
    """The proposer's drafts after token 0 `tok` for the `drafting` rows, at most `room` each: written into
    `step_tok` after token 0, `step_len` advanced in place. Returns how many each row took (n,)."""
    room = room * drafting
    drafts, n = proposer.propose(tok, drafting, room)
    n = torch.minimum(n, room)
    drafts = drafts[:, : step_tok.shape[1] - 1]
    cols = slice(1, 1 + drafts.shape[1])
    step_tok[:, cols] = torch.where(n[:, None] > torch.arange(drafts.shape[1], device=n.device), drafts,
                                    step_tok[:, cols])
    step_len += n
    return n


def _goes_on(stop_logits: torch.Tensor, step_len: torch.Tensor, forced_len: torch.Tensor | None, limits: Limits,
             reach: torch.Tensor) -> torch.Tensor:
    """The stop head's verdict (on the step's running product `reach`, updated in place, for drafting rows), or
    the forced step length where one is given."""
    p = torch.sigmoid(-stop_logits.float())
    reach.mul_(p)
    drafting = torch.as_tensor(limits.drafting, device=p.device)  # one bool for all rows, or one per row
    says = continues(stop_logits, limits.confidence, torch.where(drafting, reach, p))
    if forced_len is None:
        return says
    return torch.where(forced_len > 0, step_len < forced_len, says)
