"""Incremental detokenization that never splits a UTF-8 character.

Decodes a small window of recent tokens and emits only text that is
complete: a trailing replacement character means a multi-byte character is
still arriving, so it is held back until the next token. Special tokens are
left out, but for those ``kept`` (a family's tool-call markers, such as
Granite's ``<|tool_call|>``, which the markup reads).
"""

from __future__ import annotations

from typing import Any

WINDOW = 6


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_tail: list[int] | None = None, kept: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.backend_tokenizer
        self.kept = {i: text for text in kept if (i := vocab.token_to_id(text)) is not None}
        self.ids: list[int] = list(prompt_tail or [])
        self.prefix = self.read = len(self.ids)

    def push(self, token: int) -> str:
        """Add one token; return the new complete text (maybe empty)."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix = max(self.prefix, self.read - WINDOW)
        self.read = len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is held back, at the end of the stream."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.read = len(self.ids)
        return after[len(before) :].rstrip("\ufffd")

    def _decode(self, ids: list[int]) -> str:
        cuts = [i for i, token in enumerate(ids) if token in self.kept]
        if not cuts:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        pieces, start = [], 0
        for at in cuts:
            pieces += [self.tokenizer.decode(ids[start:at], skip_special_tokens=True), self.kept[ids[at]]]
            start = at + 1
        return "".join(pieces) + self.tokenizer.decode(ids[start:], skip_special_tokens=True)
