"""One greedy request decoding alone: the verify step (check, then the macro-step) on host integers.

At batch 1 a decode step's own work is one base pass over a few positions, the LM head's argmax and, now and then,
a few micro-step passes. The batched step (`verify.check`, `core.macro_step`) wraps that work in a few hundred small
PyTorch operators on one-row tensors (masks, `where`s, gathers, per-row limits), each costing several times its
usual time right after a pass has streamed the weights (`benchmarks/step_time.py` counts and times them). When the
scheduler runs one request, greedy, in verify mode, or the plain base (trust mode with one token a step), it steps
it here instead: the same passes and the same decisions (acceptance and rollback, lookup, the draft policy, the
stop head, EOS and the budget), with the row's lengths and tokens as Python integers, read from row 0 of the
`RowBatch` and written back to it through numpy views of the same memory (`RowBatch.host`), so the batched step
takes over at any step (another request arrives) with nothing to convert.

tests/inference/test_solo.py holds this to the batched step: the same events, stats and row state at every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hamburger.inference import verify
from hamburger.inference.admission import Request, RequestEvent
from hamburger.inference.core import MicroRun, micro_context
from hamburger.inference.lookup import find
from hamburger.inference.proposers import drafts_wanted
from hamburger.inference.rows import RowBatch
from hamburger.inference.sampling import continues

if TYPE_CHECKING:
    from hamburger.inference.runner import ModelRunner

# The scheduler steps a lone greedy verify (or plain base) row here unless told not to (`Scheduler(alone=False)`).
ON_BY_DEFAULT = True


def takes(runner: ModelRunner, b: RowBatch, custom_drafter: bool) -> bool:
    """Whether row 0's request, running alone, can be stepped here: on a CPU (the row's numpy views), greedy, not
    forced, and verify mode (compress merges its steps: the batched step) or a model of one token a step (the plain
    base); no custom drafter."""
    req = b.requests[0]
    if b.host is None or req is None or custom_drafter or req.forced is not None or not req.sampling.greedy:
        return False
    return (req.mode.checked and not req.mode.merged) or (not req.mode.checked and runner.k == 1)


def check(runner: ModelRunner, b: RowBatch) -> int:
    """`verify.check` for row 0 alone: one base pass over [t0, d1..dn] at the row's next slots, the drafts the base
    agrees with kept, the cache length advanced past them, the base's own token after them as the next token 0.
    A plain base's row (trust mode, one token a step) feeds its token the same way and keeps nothing more.
    Returns the pass's width."""
    req, h = b.requests[0], b.host
    drafted, slot = int(h.n_drafts[0]), int(h.cache_len[0])
    width, pos = 1 + drafted, max(0, int(h.prompt_len[0]) + int(h.gen_len[0]) - 1)
    *states, choice = verify.check_pass(runner, runner.model.embed(b.step_tok[:1, :width]), pos, slot, b.first_cache,
                                        argmax=True)
    kept, new, choice = 0, [], choice[0].tolist()  # the base's greedy token after t0, d1, ..
    if req.mode.checked:
        drafts = h.step_tok[0, 1:width].tolist()
        (kept,), (h.next_t0[0],) = verify.accept_greedy([drafts], [drafted], [choice])
        new = verify.record_row(runner, b, 1, 0, drafts, kept)
        if b.ended_early[0]:
            h.live[0] = False
    else:  # the plain base's token, for `macro_step` (which puts back the batched step's -1)
        h.next_t0[0] = choice[0]
    b.states[0] = torch.cat(states).select(1, kept)  # the states at the last kept position
    h.cache_len[0] = slot + 1 + kept
    h.gen_len[0] += len(new)
    h.n_drafts[0] = 0
    return width


def macro_step(runner: ModelRunner, b: RowBatch, max_len: int) -> tuple[list[RequestEvent], int]:
    """`core.macro_step` for row 0 alone, and its report: token 0 (the check's choice; the head's after a prefill
    and for a plain base), then lookup drafts or micro-step drafts while the draft policy, the budget and the stop
    head allow. Returns the events and the micro-step decoder's calls."""
    req, k, h = b.requests[0], runner.k, b.host
    look, most = drafts_wanted(runner, b, 1)[0]  # once a step: the draft policy counts its waits down
    lookup = k > 1 and look > 0 and req.index is not None
    tokens = [0] * (1 + max(k - 1, b.drafts if lookup else 0))
    if not h.live[0]:  # a kept draft was EOS: the row reports its pending tokens and ends
        tokens[0] = max(0, int(h.next_t0[0]))
        return _report(b, tokens, 0, False, 0), 0
    gen, max_new, t0 = int(h.gen_len[0]) + 1, int(h.max_new[0]), int(h.next_t0[0])
    if not req.mode.checked:
        h.next_t0[0] = -1
    if t0 < 0:  # after a prefill
        t0 = int(runner.head_argmax(b.states[:1, 0])[0])
    tokens[0] = t0
    ended = t0 in req.eos or gen >= max_new
    drafts = calls = 0
    if req.mode.checked and not ended and k > 1:
        room = min(max_new - gen - 1, len(tokens) - 1)  # a drafting row leaves room for the base's own token
        if lookup and room > 0:
            found = find(req.index, runner.store, min(room, b.drafts, look), (t0,))
            if found:
                req.looked = drafts = len(found)
                tokens[1 : 1 + drafts] = found
        if not drafts and room > 0 and most > 0:
            drafts = calls = _micro_drafts(runner, b, req, tokens, min(room, most))
    ended = ended or int(h.cache_len[0]) >= max_len  # the row's entries have run out
    h.gen_len[0] = gen
    return _report(b, tokens, 1, ended, drafts), calls


def _micro_drafts(runner: ModelRunner, b: RowBatch, req: Request, tokens: list[int], most: int) -> int:
    """Micro-step drafts after token 0 into `tokens[1:]` while the stop head's product of P(go on) over the step
    beats the row's confidence: at most `most`, up to K tokens in all, through the first EOS. Returns how many
    (the micro-step decoder's calls)."""
    model, k = runner.model, runner.k
    confidence, reach = b.confidence[:1], torch.ones(1)  # the product of P(go on) over the step, as `core._goes_on`

    def goes_on(state: torch.Tensor) -> bool:
        logits = model.stop_logits(state, True)
        reach.mul_(torch.sigmoid(-logits.float()))
        return bool(continues(logits, confidence, reach))

    if not goes_on(b.states[:1, 0]):
        return 0
    h = b.host
    slot, pos = int(h.cache_len[0]), int(h.prompt_len[0]) + int(h.gen_len[0]) - 1
    run = MicroRun(runner, list(b.states[:1, 1:].unbind(1)), b.first_micro_cache,
                   lambda: micro_context(runner, b.first_cache, [slot], torch.tensor([pos])))
    calls, tok, shortlist = 0, tokens[0], runner.vocab is not None
    while True:
        state = run(torch.tensor([tok]))
        calls += 1
        tokens[calls] = tok = int(runner.head_argmax(state, shortlist)[0])
        if tok in req.eos or calls >= most or calls + 1 >= k or not goes_on(state):
            return calls


def _report(b: RowBatch, tokens: list[int], emitted: int, ended: bool, drafts: int) -> list[RequestEvent]:
    """The step's tokens into row 0 (for the next check, or the batched step), then `RowBatch.report`."""
    h = b.host
    h.step_tok[0, : len(tokens)] = tokens
    h.step_len[0], h.n_drafts[0] = emitted, drafts
    return b.report([tokens], [emitted], [ended], [drafts])
