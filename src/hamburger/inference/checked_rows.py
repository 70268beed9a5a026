"""The checked rows of the continuous batch: verify and compress requests, whose micro tokens are drafts.

`Scheduler` runs these methods on its own state (they are its methods, kept here to keep each file about one
concern): the base pass that checks a step's drafts and keeps the longest prefix the base agrees with
(`_feed_verify`), the draft distributions a sampled request's acceptance needs, and its lookup drafts. The
engine's verify loop (`verify.run_verify`) is the same rule over a fixed batch; tests hold the two equal.
"""

from __future__ import annotations

import torch

from hamburger.inference.kv import CacheView
from hamburger.inference.lookup import Lookup, NgramIndex
from hamburger.inference.verify import Window, accept_greedy, accept_sampled, check_pass, settle


class CheckedRows:
    """`Scheduler`'s verify and compress side (a mixin: the rows, caches and per-row tensors are the scheduler's)."""

    def _feed_verify(self, n: int) -> None:
        """A pass of 1 + most drafts positions per row, each row at its own slots (`RowSlots`). Trust rows use
        position 0 (their smashed step); a verify row feeds [t0, d1..dn] and keeps the longest prefix of drafts
        that the base's argmax agrees with (`accept_greedy`): those are reported with this step, the next
        token is the base's own (this step's macro-step picks it greedily from the state after them), and the
        entries of rejected drafts lie past the row's cache length, where the next pass overwrites them. A
        compress row is checked the same way, under the merger's bias on its merged entries; then its decided
        step [t0, kept drafts] becomes one entry at the step's first slot (`verify.merge_step`)."""
        dev, live, verify = self.states.device, self.live[:n], self.verify[:n] & self.live[:n]
        width = 1 + int(self.n_drafts[:n].max())
        step_len = self.step_len[:n]
        embeds = self.model.embed(self.step_tok[:n, :width])
        smashed = self.model.smash(self.step_tok[:n, : self.k], step_len.clamp(min=1))
        embeds[:, 0] = torch.where(verify[:, None], embeds[:, 0], smashed)
        positions = (self.prompt_len[:n] + self.gen_len[:n] - 1).clamp(min=0)
        compress = self.compress[:n] & live
        merged = torch.zeros(n, width, dtype=torch.bool, device=dev)
        merged[:, 0] = ~verify & (step_len > 1)
        states = check_pass(self.engine, embeds, positions, torch.where(live, self.cache_len[:n], 0),
                            CacheView(self.cache, slice(0, n)), merged,
                            merged_len=self.merged_len[:n] if bool(compress.any()) else None)
        at = torch.zeros(n, dtype=torch.long, device=dev)
        rows = verify.nonzero().squeeze(1)
        logits = self.model.lm_head(states[0][rows])  # (rows, width, V): the base's choice after t0, d1, ..
        at[rows] = accept_greedy(self.step_tok[rows, 1:width], self.n_drafts[rows], logits)[0]
        for j, i in enumerate(rows.tolist()):  # sampled rows: speculative-sampling acceptance, each its own draws
            req = self.rows[i]
            if req.sampling.greedy:
                continue
            # Only the row's own drafts: the random numbers it draws must not depend on its neighbours' drafts.
            nd = int(self.n_drafts[i])
            probs = torch.softmax(req.warpers(None, logits[j, : nd + 1].float()), -1)[None]  # (1, nd + 1, V)
            q = self.q[i : i + 1, :nd] if self.q is not None else probs.new_zeros(1, nd, probs.shape[-1])
            kept_i, t0 = accept_sampled(self.step_tok[i : i + 1, 1 : 1 + nd], self.n_drafts[i : i + 1], q, probs,
                                        req.rng)
            at[i], self.next_t0[i] = kept_i[0], t0[0]
        window = None
        if self.model.config.merge_window > 1 and bool(compress.any()):
            window = Window(self.model.config.merge_window, n)
            window.steps = [r.window_steps if r is not None else [] for r in self.rows[:n]]  # the requests' own lists
            window.first_pos = positions
        self.states[:n] = torch.stack(settle(self.model.merger, states, at, self.cache, self.cache_len[:n], live,
                                             compress, self.merged_len, window), 1)
        if window is not None:
            for req in self.rows[:n]:
                if req is not None and req.mode == "compress":
                    req.stats.window_entries = sum(m - 1 for _, m, _ in req.window_steps)
        kept, tokens, rows_l = at.tolist(), self.step_tok[:n].tolist(), rows.tolist()
        added = [0] * n
        costs, drafted = self.engine.step_costs(n), self.n_drafts[:n].tolist()
        for i in rows_l:
            req = self.rows[i]
            if req.mode == "verify" and drafted[i]:  # the draft policy learns what this row's drafts keep
                req.drafting.observe(drafted[i], kept[i], req.looked > 0, costs, self.drafts)
            if req.looked:
                req.stats.lookup_drafts += req.looked
                req.stats.lookup_kept += kept[i]
                req.looked = 0
            new = tokens[i][1 : 1 + kept[i]]
            new = new[: next((j + 1 for j, t in enumerate(new) if t in req.eos), len(new))]  # cut after EOS
            self.pending[i], added[i] = new, len(new)
            if req.index is not None:  # before this step's lookup, which follows them
                req.index.extend(new)
            if new and new[-1] in req.eos:
                self.ended_early[i] = True
        self.gen_len[:n] += torch.tensor(added, device=dev)
        self.live[:n] &= ~torch.tensor(self.ended_early[:n], device=dev)
        self.n_drafts[:n] = 0

    def _keep_draft_distribution(self, row: int, probs: torch.Tensor) -> None:
        """A micro draft's distribution (over the shortlist, where the engine has one)."""
        vocab = self.model.base.config.vocab_size
        full = probs if self.engine.vocab is None else torch.zeros(vocab, device=probs.device).index_copy_(
            0, self.engine.vocab, probs)
        self._keep_full_distribution(row, full)

    def _keep_full_distribution(self, row: int, full: torch.Tensor) -> None:
        if self.q is None:
            vocab = self.model.base.config.vocab_size
            self.q = torch.zeros(len(self.rows), max(self.drafts, 1), vocab, device=full.device)
        self.q[row, self._depth - 1] = full

    def _lookup(self, indexes: list[NgramIndex | None], caps: list[int]):
        """`macro_step`'s lookup over the running rows, at most `caps` drafts each; a sampled row's lookup drafts
        are draws from point masses (kept as its draft distributions for the next acceptance)."""
        find = Lookup(indexes, self.drafts, indexed_token0=False, caps=caps, store=self.engine.store)
        compress = self.compress[: len(indexes)]

        def fn(tok: torch.Tensor, rows: torch.Tensor, room: torch.Tensor):
            # compress rows: at most K-1 drafts (the merger's steps have at most K tokens)
            drafts, counts = find(tok, rows, torch.where(compress, room.clamp(max=self.k - 1), room))
            vocab = self.model.base.config.vocab_size
            for i, (c, d) in enumerate(zip(counts.tolist(), drafts.tolist())):
                req = self.rows[i]
                if c:
                    req.looked = c
                if c and not req.sampling.greedy:
                    for j in range(c):
                        self._depth = j + 1
                        self._keep_full_distribution(i, torch.nn.functional.one_hot(drafts[i, j], vocab).float())
            self._depth = 0
            return drafts, counts

        return fn
