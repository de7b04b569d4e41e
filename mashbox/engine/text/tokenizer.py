"""A model's tokenizer read with ``tokenizers`` alone: its ``tokenizer.json``, the special tokens and the
chat template of its ``tokenizer_config.json`` (or ``chat_template.jinja``).

transformers reads the same files in over a second (its import, then the vocabulary parsed in Python);
this takes a tenth of that, so a worker is ready sooner. ``Tokenizer.of`` wraps a tokenizer transformers
already made (a GGUF's vocabulary, converted once; a directory with only a slow tokenizer), and
``save`` writes the files ``read`` reads, as transformers' ``save_pretrained`` lays them out.
"""

from __future__ import annotations

import json
import re
import secrets
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers


class Quotes:
    """The special texts a request's words hold, each replaced (``quote``) by a mark of this request's
    own random key, which no client can write, and put back (``unquote``) once the template rendered."""

    def __init__(self, specials: re.Pattern[str]) -> None:
        self.said: list[str] = []
        self._key = secrets.token_hex(8)
        self._specials = specials
        self._mark = re.compile(f"\ue000{self._key}:(\\d+)\ue001")

    def quote(self, text: str) -> str:
        return self._specials.sub(self._marked, text)

    def unquote(self, text: str) -> str:
        return self._mark.sub(lambda found: self.said[int(found[1])], text)

    def _marked(self, found: re.Match[str]) -> str:
        self.said.append(found[0])
        return f"\ue000{self._key}:{len(self.said) - 1}\ue001"


SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CONFIG = "tokenizer_config.json"
_TEMPLATE = "chat_template.jinja"
_TOOL_TEMPLATE = "tool_use.jinja"  # beside it, in additional_chat_templates/


class Tokenizer:
    """Text to token ids and back, the special tokens by name, and the chat template's source."""

    def __init__(self, backend: tokenizers.Tokenizer, specials: dict[str, str],
                 chat_template: str | None, tool_template: str | None = None) -> None:
        self.backend_tokenizer = backend
        self.backend_tokenizer.no_padding()
        self.backend_tokenizer.no_truncation()
        self.special_tokens_map = specials
        self.chat_template = chat_template
        self.tool_template = tool_template  # the template named tool_use, for requests with tools (Hermes')
        self.eos_token_id = self.token_id(specials.get("eos_token"))
        self.bos_token_id = self.token_id(specials.get("bos_token"))

    @classmethod
    def read(cls, folder: Path) -> Tokenizer:
        """The tokenizer saved in ``folder``; FileNotFoundError if it has no ``tokenizer.json``."""
        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = json.loads((folder / _CONFIG).read_text()) if (folder / _CONFIG).is_file() else {}
        specials = {name: text for name in SPECIAL if (text := _content(config.get(name)))}
        template = (folder / _TEMPLATE).read_text() if (folder / _TEMPLATE).is_file() else config.get("chat_template")
        tool_file = folder / "additional_chat_templates" / _TOOL_TEMPLATE
        tools = tool_file.read_text() if tool_file.is_file() else _named(template, "tool_use")
        return cls(backend, specials, _default_template(template), tools)

    @classmethod
    def of(cls, hf: Any) -> Tokenizer:
        """The tokenizer of a transformers fast tokenizer."""
        specials = {name: str(text) for name in SPECIAL if (text := getattr(hf, name, None))}
        template = hf.chat_template
        return cls(hf.backend_tokenizer, specials, _default_template(template), _named(template, "tool_use"))

    def save(self, folder: Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat template) to ``folder``."""
        self.backend_tokenizer.save(str(folder / "tokenizer.json"))
        _merges_as_text(folder / "tokenizer.json")
        config = {**self.special_tokens_map, "tokenizer_class": "PreTrainedTokenizerFast"}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        if self.chat_template and self.tool_template:  # named, as transformers writes several
            config["chat_template"] = [{"name": "default", "template": self.chat_template},
                                       {"name": "tool_use", "template": self.tool_template}]
        (folder / _CONFIG).write_text(json.dumps(config, ensure_ascii=False, indent=2))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _ids(self.backend_tokenizer, text, add_special_tokens)

    def encode_quoting(self, text: str, quotes: Quotes) -> list[int]:
        """Tokens of a rendered prompt ``text`` whose ``quotes`` marks stand for special tokens' texts
        the request's words held, read as the plain text they are (not the turn's end, say); the special
        tokens of ``text`` itself (the chat template's) are read as they are by ``encode``."""
        ids: list[int] = []
        for n, piece in enumerate(self._specials.split(text)):
            if n % 2:
                ids.append(self.backend_tokenizer.token_to_id(piece))
            elif piece:
                ids += _ids(self._literal, quotes.unquote(piece), add_special_tokens=False)
        return ids

    @cached_property
    def quotes(self) -> bool:
        """Whether ``encode_quoting`` reads a prompt as ``encode`` does where nothing is quoted: the text
        between special tokens tokenized piece by piece (not so where each piece would begin with a word
        mark, as some sentencepiece vocabularies have it; there messages are read as ``encode`` reads them)."""
        if not self.special_texts:
            return False
        mark = self.special_texts[-1]
        probe = f"{mark}user\na b{mark} c\n\n{mark}  d"
        return self.encode_quoting(probe, self.new_quotes()) == self.encode(probe, add_special_tokens=False)

    def new_quotes(self) -> Quotes:
        """A request's own quotes of this vocabulary's special texts."""
        return Quotes(self._specials)

    @cached_property
    def special_texts(self) -> tuple[str, ...]:
        """The text of each special token (the longest first): the template's marks, which a message
        may hold as text too."""
        added = self.backend_tokenizer.get_added_tokens_decoder().values()
        return tuple(sorted({t.content for t in added if t.special and t.content}, key=len, reverse=True))

    @cached_property
    def _specials(self) -> re.Pattern[str]:
        return re.compile("(" + "|".join(map(re.escape, self.special_texts)) + ")")

    @cached_property
    def _literal(self) -> tokenizers.Tokenizer:
        """The same vocabulary, its special tokens' texts read as plain text."""
        literal = tokenizers.Tokenizer.from_str(self.backend_tokenizer.to_str())
        literal.encode_special_tokens = True
        return literal

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @cached_property
    def most_chars_per_token(self) -> int:
        """At most how many characters of text one token stands for: its longest vocabulary entry, times 4
        where the tokenizer normalizes text first (NFC/NFKC compose up to 4 code points into one). Worked
        out on first use (a tenth of a second for a large vocabulary)."""
        longest = max(map(len, self.get_vocab()), default=1)
        return longest * (1 if self.backend_tokenizer.normalizer is None else 4)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str | None) -> int | None:
        """The id of the vocabulary's one token for ``token`` (a special token's text), or None."""
        return None if token is None else self.backend_tokenizer.token_to_id(token)


def _ids(backend: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """The tokens of ``text``, read with the interpreter's lock let go: ``encode`` holds it throughout (2M
    characters: 1.6 s in which no other thread ran, the engine's included: every stream stalled), the batch
    form lets it go, and its ``_fast`` form skips the offsets nothing here reads."""
    return backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def _content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: the text, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _default_template(template: Any) -> str | None:
    """The template to use: the one given, or of several named ones the ``default`` (else the first)."""
    if isinstance(template, list):  # [{"name": ..., "template": ...}], as some configs list them
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    elif isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template else None


def _named(template: Any, name: str) -> str | None:
    """The template called ``name`` where the config names several (a list of name and template, or a dict)."""
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    named = template.get(name) if isinstance(template, dict) else None
    return named if isinstance(named, str) and named else None


def _merges_as_text(file: Path) -> None:
    """A BPE's merges as ``"a b"`` strings rather than ``["a", "b"]`` pairs, where no piece holds a space
    (the form a space would make ambiguous): ``tokenizers`` reads them a quarter faster (Gemma 3's
    515k merges: 0.85 -> 0.65 s of every start), and both forms are the same merges."""
    data = json.loads(file.read_text(encoding="utf-8"))
    merges = data.get("model", {}).get("merges") or []
    if not all(isinstance(m, list) and len(m) == 2 and " " not in m[0] + m[1] for m in merges) or not merges:
        return
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    file.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
