"""Incremental detokenization with stop strings: text deltas safe to show while tokens arrive."""

from __future__ import annotations

import re

from typing import Sequence


class TextAssembler:
    """Accumulates generated token ids and releases text that can no longer change.

    Text is held back while it ends in an incomplete UTF-8 sequence (decoded as U+FFFD) or in a prefix
    of a stop string. When a stop string appears, the text is cut before it and ``stopped`` is set.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False
        self.stop_token_count: int | None = None  # tokens kept when a stop string ended the text
        # incremental decoding: the text of ids[:_read] is _stable; ids[_prefix:_read] are decoded again as context
        # for the next tokens (a token's text can depend on its neighbour: spaces, multi-byte characters)
        self._prefix = self._read = 0
        self._stable = ""

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self) -> str:
        """The text of all tokens so far. Decodes only the tokens since the last complete character plus a few of
        context, so a step costs the same at token 10 and at token 10,000 (decoding everything each step grew with
        the length); where the window's text does not extend its context's, falls back to decoding everything."""
        context = self.decode(self.ids[self._prefix : self._read])
        window = self.decode(self.ids[self._prefix :])
        if not window.startswith(context):
            self._prefix = self._read = 0
            self._stable = ""
            return self.decode(self.ids)
        text = self._stable + window[len(context) :]
        if len(window) > len(context) and not window.endswith("\ufffd"):  # complete: the next window starts here
            self._stable, self._prefix, self._read = text, self._read, len(self.ids)
        return text

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens; return the newly released text."""
        start = len(self.ids)
        self.ids.extend(new_ids)
        text = self.text()
        cut = self._find_stop(text)
        if cut is not None:
            self.stopped = True
            self.stop_token_count = self._tokens_to_reach(text[:cut], start)
            return self._release(text[:cut])
        safe = len(text)
        if text.endswith("\ufffd"):
            safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # hold back a tail that may grow into a stop string
            for n in range(min(len(s) - 1, safe), 0, -1):
                if text[safe - n : safe] == s[:n]:
                    safe -= n
                    break
        return self._release(text[:safe])

    def finish(self) -> str:
        """Release whatever is held back (the generation ended without completing a stop string)."""
        if self.stopped:
            return ""
        return self._release(self.text().rstrip("\ufffd"))

    def _release(self, text: str) -> str:
        if not text.startswith(self.emitted):  # decoding changed earlier text; never retract what was shown
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s, max(0, len(self.emitted) - len(s))) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _tokens_to_reach(self, kept_text: str, start: int) -> int:
        # fewest tokens whose text covers what is kept before the stop string
        for n in range(start, len(self.ids) + 1):
            if len(self.decode(self.ids[:n])) > len(kept_text):
                return n
        return len(self.ids)


# whitespace as JSON Schema's (ECMA-262) \s counts it: the API's schema and its validation must agree, and
# Python's str.isspace() also counts \x1c-\x1f and \x85
NOT_SPACE = "[^\t\n\v\f\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]"
_NOT_SPACE = re.compile(NOT_SPACE)


def has_text(value: str) -> bool:
    """Whether ``value`` has a character that is not whitespace (in JSON Schema's sense)."""
    return _NOT_SPACE.search(value) is not None
