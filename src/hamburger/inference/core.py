"""The macro-step: the one definition of how a HAMburger step is decoded.

The decode loop (`scheduler.Scheduler`, which `Engine.generate` and the server both run) decodes trust mode by
`macro_step`, and verify and compress modes draft by it (token 0 given, the micro tokens read as drafts). A row's
limits live in `Limits` and how a token is chosen in `pick`.

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
from hamburger.inference.sampling import continues

if TYPE_CHECKING:
    from hamburger.inference.runner import ModelRunner

# pick(h, active, micro) -> (n,) token ids: `h` (n, d) the states that predict them, `active` (n,) the rows
# whose token is used (samplers draw only for those), `micro` whether h comes from the micro-step decoder.
Pick = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]
# lookup(tok, rows, room) -> (drafts (n, K-1), counts (n,)): after token 0 `tok` (n,), drafts from elsewhere than the
# micro-step decoder (`lookup.py`) for the rows that may draft (`rows` (n,)), at most `room` (n,) each (0: none).
LookupFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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


@dataclass
class Limits:
    """Per-row rules that end a step or a sequence: EOS ids (n, E) (-1 pads; (1, E) for all rows alike), the
    token budget (n,) or one int, and the confidence a step needs to go on, (n,) or one float.

    `path` (n,) or one bool: rows whose confidence bounds the chance that the whole step so far is right (the
    product of the stop head's P(go on) over the step), not the next token's alone. Verify and compress mode
    draft this way: a draft is worth its micro-step only if every draft before it is kept too. These rows read
    the checkpoint's draft stop head where it has one (`HamburgerModel.stop_logits`)."""

    eos: torch.Tensor
    max_new: torch.Tensor | int
    confidence: torch.Tensor | float
    path: torch.Tensor | bool = False
    # (n,): at most this many micro-step tokens per row after token 0 (verify mode's draft policy); None: K-1
    micro_len: torch.Tensor | None = None

    def ends(self, tok: torch.Tensor, gen_len: torch.Tensor) -> torch.Tensor:
        """Rows whose sequence ends with `tok` (EOS) or has reached its budget (`gen_len` counts `tok`)."""
        return (tok[:, None] == self.eos).any(-1) | (gen_len >= self.max_new)


def macro_step(runner: ModelRunner, states: list[torch.Tensor], live: torch.Tensor, gen_len: torch.Tensor, limits: Limits,
               pick: Pick, cache: KVCache | None, forced_len: torch.Tensor | None = None,
               context: MicroContext | Callable[[], MicroContext | None] | None = None, lookup: LookupFn | None = None, lookup_width: int = 0):
    """One macro-step over n rows: token 0 from the base's head, then micro-steps while any live row's step goes on.

    `states`: [final normed state, feature_1..feature_m] of the last base pass, each (n, d). `live` (n,): the
    rows that decode (the others are computed but emit nothing). `gen_len` (n,): tokens generated so far, updated
    in place. `cache`: the micro-step decoder's cache for the n rows. `forced_len` (n,): where > 0, the step
    takes that many tokens whatever the stop head says (EOS and the budget still end it). `context`: what a
    micro-step decoder with context reads of the base (`micro_context`). `lookup`: verify and compress rows'
    lookup drafts; a row that gets some takes them as its micro tokens and runs no micro-step, up to
    max(K-1, `lookup_width`) of them.

    Returns the step's tokens (n, 1 + max(K-1, lookup_width)), their number (n,) (0 on rows not live) and the
    rows that ended.
    The one host sync per micro-step is `go_on.any()`; nothing per token.
    """
    model, k = runner.model, runner.k
    h0, feats = states[0], states[1:]
    tok = pick(h0, live, False)
    width = max(k - 1, lookup_width if lookup is not None else 0)  # lookup drafts may run past K-1
    step_tok = torch.zeros(h0.shape[0], 1 + width, dtype=torch.long, device=h0.device)
    step_tok[:, 0] = tok
    step_len = live.long()
    gen_len += step_len
    ended = live & limits.ends(tok, gen_len)
    go_on = live & ~ended
    if k == 1:
        return step_tok, step_len, ended
    if lookup is not None:
        go_on &= _take_lookup(lookup, tok, go_on, gen_len, limits, step_tok, step_len, width) == 0
    reach = torch.ones(h0.shape[0], device=h0.device)  # the stop head's P(every token of the step so far is right)
    if limits.micro_len is not None:
        go_on &= limits.micro_len > 0
    if not bool(go_on.any()):  # no row runs a micro-step (lookup drafts only, or none): no stop head either
        return step_tok, step_len, ended
    go_on &= _goes_on(model.stop_logits(h0, limits.path), step_len, forced_len, limits, reach)
    run = MicroRun(runner, feats, cache, context)
    for i in range(1, k):
        if not bool(go_on.any()):  # the one host sync per micro-step: does any step go on?
            break
        h = run(tok)
        tok = pick(h, go_on, True)
        step_tok[:, i] = torch.where(go_on, tok, step_tok[:, i])
        step_len += go_on.long()
        gen_len += go_on.long()
        now_ends = go_on & limits.ends(tok, gen_len)
        ended |= now_ends
        go_on = go_on & ~now_ends & (step_len < k)
        if limits.micro_len is not None:
            go_on &= step_len <= limits.micro_len
        go_on &= _goes_on(model.stop_logits(h, limits.path), step_len, forced_len, limits, reach)
    return step_tok, step_len, ended


def _take_lookup(lookup: LookupFn, tok: torch.Tensor, go_on: torch.Tensor, gen_len: torch.Tensor, limits: Limits,
                 step_tok: torch.Tensor, step_len: torch.Tensor, width: int) -> torch.Tensor:
    """The rows' drafts from `lookup` after token 0 `tok`, within each row's budget: written into `step_tok` as its
    micro tokens, `step_len` and `gen_len` advanced in place. Returns how many each row took (n,)."""
    room = (torch.as_tensor(limits.max_new, device=gen_len.device) - gen_len).clamp(0, width) * go_on
    drafts, n = lookup(tok, go_on, room)
    n = torch.minimum(n, room)
    drafts = drafts[:, :width]
    cols = slice(1, 1 + drafts.shape[1])
    step_tok[:, cols] = torch.where(n[:, None] > torch.arange(drafts.shape[1], device=n.device), drafts,
                                    step_tok[:, cols])
    step_len += n
    gen_len += n
    return n


def _goes_on(stop_logits: torch.Tensor, step_len: torch.Tensor, forced_len: torch.Tensor | None, limits: Limits,
             reach: torch.Tensor) -> torch.Tensor:
    """The stop head's verdict (on the step's running product `reach`, updated in place, for `path` rows), or
    the forced step length where one is given."""
    p = torch.sigmoid(-stop_logits.float())
    reach.mul_(p)
    path = torch.as_tensor(limits.path, device=p.device)  # one bool for all rows, or one per row
    says = continues(stop_logits, limits.confidence, torch.where(path, reach, p))
    if forced_len is None:
        return says
    return torch.where(forced_len > 0, step_len < forced_len, says)
