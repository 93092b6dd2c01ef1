"""Token ids in, text out, one token at a time: what a streamed completion shows as it is produced.

`TextStream` decodes incrementally without ever splitting a UTF-8 character (a byte-level token may
hold part of one: its text is held until the character completes), cuts the text at the first stop
string (which the caller's text never includes, as OpenAI defines `stop`), and holds back any tail
that could still become a stop string. The non-streamed text of a sequence is its stream run to the
end, so the two are equal by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]
REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence yields


class TextStream:
    def __init__(self, decode: Decode, stops: Sequence[str] = ()) -> None:
        self._decode = decode
        self.stops = tuple(s for s in stops if s)
        self.tokens: list[int] = []
        self._prefix = 0  # tokens before this are decoded and only give context for the next ones
        self._read = 0  # tokens before this are in `_text`
        self._text = ""  # complete characters decoded so far (before stop-string cutting)
        self._sent = 0  # characters of `_text` handed out
        self.stopped = False  # a stop string was found: the text ends before it
        self.stop_string: str | None = None  # which one (the earliest in the text)
        self.finished = False

    @property
    def text(self) -> str:
        """All text handed out so far."""
        return self._text[: self._sent]

    def push(self, token: int) -> str:
        """Add one token; return the text it makes visible (often "", never part of a character)."""
        if self.stopped or self.finished:
            return ""
        self.tokens.append(token)
        seen = self._decode(self.tokens[self._prefix : self._read])
        now = self._decode(self.tokens[self._prefix :])
        if len(now) > len(seen) and not now.endswith(REPLACEMENT):
            self._text += now[len(seen) :]
            self._prefix, self._read = self._read, len(self.tokens)
        return self._release(final=False)

    def finish(self) -> str:
        """The sequence ended: hand out whatever is left (a dangling partial character included)."""
        if self.finished:
            return ""
        self.finished = True
        if not self.stopped and self._read < len(self.tokens):
            seen = self._decode(self.tokens[self._prefix : self._read])
            self._text += self._decode(self.tokens[self._prefix :])[len(seen) :]
            self._read = len(self.tokens)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stops and not self.stopped:
            # A stop string cannot begin in text already handed out: its start would have been held back.
            hits = [(i, s) for s in self.stops if (i := self._text.find(s, self._sent)) >= 0]
            if hits:
                at, self.stop_string = min(hits)
                self._text = self._text[:at]
                self.stopped = True
        end = len(self._text)
        if not (final or self.stopped):
            end -= self._held(self._text[self._sent :])
        out = self._text[self._sent : end]
        self._sent = end
        return out

    def _held(self, pending: str) -> int:
        """Length of the longest tail of `pending` that is the start of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(pending)), best, -1):
                if pending.endswith(s[:n]):
                    best = n
                    break
        return best
