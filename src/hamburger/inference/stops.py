"""Stop strings: incremental detokenisation that ends a reply at the first stop string, shared by the server's
`stop` field and `hamburger generate --stop`, so both cut a reply at the same place."""

from __future__ import annotations


class TextStream:
    """Incremental detokenisation with stop strings: `feed` returns text that is safe to send.

    Text that might be the start of a stop string, or an incomplete UTF-8 character, is held back.
    """

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False

    def feed(self, tokens: list[int], final: bool = False) -> str:
        self.tokens += tokens
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.text = True, self.text[: min(hits)]
            return self._send(len(self.text))
        if final:
            return self._send(len(self.text))
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        if self.text.endswith("\ufffd"):
            hold = max(hold, 1)
        return self._send(len(self.text) - hold)

    def _send(self, upto: int) -> str:
        out = self.text[self.sent : upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out
