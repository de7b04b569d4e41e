"""Incremental detokenization that never splits a UTF-8 character.

Decodes a small window of recent tokens and emits only text that is
complete: a trailing replacement character means a multi-byte character is
still arriving, so it is held back until the next token; at the end, where the tokens' bytes
(a byte-level vocabulary's) show a U+FFFD whole, it is the answer's. Special tokens are
left out, but for those ``kept`` (a family's tool-call markers, such as
Granite's ``<|tool_call|>``, which the markup reads).
"""

from __future__ import annotations

import codecs
from functools import cache
from typing import Any

from tokenizers import decoders

WINDOW = 6


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_tail: list[int] | None = None, kept: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.backend_tokenizer
        self.kept = {i: text for text in kept if (i := vocab.token_to_id(text)) is not None}
        self.byte_level = isinstance(getattr(vocab, "decoder", None), decoders.ByteLevel)  # its tokens say their bytes
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
        text = after[len(before) :]
        cut = self._cut_inside(self.ids[self.prefix :])
        self.read = len(self.ids)
        if not text.endswith("\ufffd") or cut is False:  # a U+FFFD the answer wrote (its three bytes) is text
            return text
        return text[:-1] if cut else text.rstrip("\ufffd")  # a character cut off; unknown: every one

    def _cut_inside(self, ids: list[int]) -> bool | None:
        """Whether the bytes of ``ids`` end inside a character (None where the vocabulary does not say)."""
        if not self.byte_level:
            return None
        try:
            raw = bytes(_byte_alphabet()[c] for i in ids for c in self.tokenizer.backend_tokenizer.id_to_token(i) or "")
        except KeyError:  # a token outside the byte alphabet (an added one)
            return None
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        utf8.decode(raw)
        return bool(utf8.getstate()[0])

    def _decode(self, ids: list[int]) -> str:
        cuts = [i for i, token in enumerate(ids) if token in self.kept]
        if not cuts:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        pieces, start = [], 0
        for at in cuts:
            pieces += [self.tokenizer.decode(ids[start:at], skip_special_tokens=True), self.kept[ids[at]]]
            start = at + 1
        return "".join(pieces) + self.tokenizer.decode(ids[start:], skip_special_tokens=True)


@cache
def _byte_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level vocabulary (GPT-2's alphabet) stands for."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    return {chr(b): b for b in shown} | {chr(256 + n): b for n, b in enumerate(hidden)}
