"""What the four protocol modules share: the extra-field policy, parsing, sampling fields.

Extra fields are accepted and reported, never silently dropped: ``ignored_fields()`` lists them
(the server logs them and sets ``x-mashbox-ignored-fields``). ``parse`` turns a pydantic
``ValidationError`` into ``InvalidRequestError`` whose ``param`` is the dotted path of the field.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
)

from mashbox.engine.request import MAX_STOP_CHARS, MAX_STOPS, EngineRequest, SamplingParams
from mashbox.engine.text.markup import SURROGATE, json_value
from mashbox.errors import InvalidRequestError

NO_LOGPROBS = "log probabilities are not supported"
TEXT_ONLY = "is not supported: this server runs a text-only model; send text parts only"
STRUCTURED = "structured output is not supported; only {'type': 'text'} is accepted"

MAX_ITEMS = 100_000  # items an array of a request may hold (no context fits more)
TURNS = frozenset({"messages", "input", "history_messages"})  # a conversation: one longer than the context is the
# route's to refuse, as too long
MAX_VALUES = 200_000  # JSON values in a whole body (a 32k context holds ~60k of a conversation): as many bad ones
# take ~0.6 s to validate and name one, on the loop that streams every answer
MAX_DEPTH = 128  # levels a request's JSON may nest: each reader after the decoder recurses (pickling to the
# worker, pydantic's dumps, the chat template), and none of them takes a thousand as the decoder does
M = TypeVar("M", bound=BaseModel)


class Part(BaseModel):
    """A nested object of a request: unknown keys are kept, not reported. Types are strict, as OpenAI's and
    Anthropic's APIs are: ``"5"`` is not a number, nor ``1`` a boolean (a client's bug, named, not guessed)."""

    model_config = ConfigDict(extra="allow", strict=True)

    def left_out(self) -> bool:
        """Whether the request's translation leaves this part out whole (a tool that runs on the provider's side),
        reported by its own name: its keys are not."""
        return False


class StreamOptions(Part):
    """OpenAI's ``stream_options`` (Chat and Completions): ``include_usage`` adds a last object with the usage
    and no choices."""

    include_usage: bool | None = None


def unread_stream_options(stream: bool, options: StreamOptions | None) -> list[str]:
    """``stream_options`` on an answer not streamed, which reads none of it (OpenAI refuses it with a 400; it is
    reported here, as any field not acted on)."""
    return ["stream_options"] if options is not None and not stream else []


class RequestModel(Part):
    """A whole request body. Unknown keys, its parts' too, are reported by ``ignored_fields``."""

    accepted_ignored: ClassVar[tuple[str, ...]] = ()
    echoed: ClassVar[frozenset[str]] = frozenset()  # unknown keys that the protocol's own answers carry, sent back
    # in the next turn (an output item's id and status): no news to the client, not reported

    def ignored_fields(self) -> list[str]:
        names = set(self.model_extra or {}) | unread(self) - self.echoed
        names.update(n for n in self.accepted_ignored if getattr(self, n, None) is not None)
        names.update(self._more_ignored())
        return sorted(names)

    def _more_ignored(self) -> list[str]:
        return []


class OutModel(BaseModel):
    """A response object. ``None`` fields are left out unless named in ``keep_none``."""

    model_config = ConfigDict(extra="forbid")
    keep_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        # No return annotation: with one, pydantic would replace the JSON schema by ``dict``.
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k in self.keep_none}

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def at_a_glance(text: str, finish: str | None, prompt_tokens: int | None, output_tokens: int | None) -> str:
    """How Jupyter shows a whole answer (``_repr_markdown_``): its text, then its finish reason
    and token counts, instead of a one-line model dump."""
    counts = "" if prompt_tokens is None else f" · {prompt_tokens} prompt + {output_tokens} new tokens"
    return f"{text.strip() or '*(no text)*'}\n\n---\n*finish: {finish}{counts}*"


class UnsupportedPart(Part):
    """Image, audio and file parts: recognised so that the 400 names them clearly."""

    type: str

    @field_validator("type")
    @classmethod
    def _refuse(cls, value: str) -> str:
        raise ValueError(f"content part type {value!r} {TEXT_ONLY}")


Temperature = Annotated[float, Field(ge=0, le=4, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
MaxTokens = Annotated[int, Field(ge=1)]
# null: not streamed, as OpenAI's
Stream = Annotated[bool, BeforeValidator(lambda v: False if v is None else v, json_schema_input_type=bool | None)]


class SamplingFields(BaseModel):
    """The sampling table every generating route shares (server-api.md)."""

    model_config = ConfigDict(strict=True)

    temperature: Temperature | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    seed: Annotated[int, Field(ge=-2**63, lt=2**63)] | None = None  # 64 bits, as OpenAI's: no two draw alike
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    stop: str | list[str] | None = None
    stop_sequences: list[str] | None = None
    n: int | None = None

    @field_validator("n")
    @classmethod
    def _n_is_one(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("must be 1: one answer per request")
        return value

    @field_validator("stop", "stop_sequences")
    @classmethod
    def _stops_few_and_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        values = [value] if isinstance(value, str) else value or []
        if len(values) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings (got {len(values)})")
        if not all(values):
            raise ValueError("stop strings must not be empty")
        if (longest := max(map(len, values), default=0)) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters (one has {longest})")
        return value

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def stop_strings(self) -> tuple[str, ...]:
        stop = self.stop if self.stop is not None else self.stop_sequences
        return (stop,) if isinstance(stop, str) else tuple(stop or ())

    def sampling(self) -> SamplingParams:
        given = {
            name: getattr(self, name)
            for name in (
                "temperature", "top_p", "top_k", "min_p", "seed",
                "repetition_penalty", "frequency_penalty", "presence_penalty",
            )
            if getattr(self, name) is not None
        }
        return SamplingParams(**given, max_tokens=self.max_new_tokens(), stop=self.stop_strings())


class LogitBias(BaseModel):
    """OpenAI's ``logit_bias`` (Chat and Completions): token ids, as strings, each with a bias from -100 (never
    drawn) to 100 (always) added to its logit. Listed before ``SamplingFields`` among a request's bases."""

    model_config = ConfigDict(strict=True)

    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if (bad := next((key for key in value or {} if not (key.isascii() and key.isdigit())), None)) is not None:
            raise ValueError(f"keys are token ids (such as \"50256\"), not {bad!r}")
        if (long := next((key for key in value or {} if len(key.lstrip("0")) > 18), None)) is not None:
            raise ValueError(f"token id {long[:20]}... ({len(long)} digits) is in no model's vocabulary")  # nor
            # read as a number: Python refuses past 4,300 digits (a 500)
        return value

    def sampling(self) -> SamplingParams:
        biased = {int(key.lstrip("0") or "0"): bias for key, bias in (self.logit_bias or {}).items()}  # SamplingParams
        # sorts them; Python reads no number of over 4,300 digits, leading zeros counted
        return dataclasses.replace(super().sampling(), logit_bias=biased)  # type: ignore[misc]


class ErrorBody(OutModel):
    """The ``error`` a Chat or Completions stream ends with when it fails after starting;
    ``request_id`` is the id of the response the client already holds part of."""

    message: str
    type: str = "server_error"
    request_id: str | None = None


def plain(body: Any, turns: int = MAX_ITEMS) -> Any:
    """``body``, where no string holds a lone surrogate (half of a UTF-16 pair, no text: the tokenizer cannot
    read it), nothing nests more than ``MAX_DEPTH`` levels, no array but a conversation holds more than
    ``MAX_ITEMS`` and the whole holds at most ``MAX_VALUES``; else raise, naming where. A conversation of more
    than ``turns`` items (the server's context) is not read here: the route refuses it as too long for the
    context, the error agents read to compact it. Runs on the event loop that streams every answer: no path is
    built until a fault is found, and what validation costs is bounded (a 10 MB body of 4.9 million bad items
    was walked, then each one's error named, for over a minute)."""
    try:
        _Walk(turns).visit(body, 1)
    except _Fault as fault:
        where = ".".join(map(str, fault.path[:6] if fault.deep else fault.path))  # deep: where it begins to
        raise InvalidRequestError(where + "..." * fault.deep, fault.message) from None
    return body


class _Fault(Exception):
    def __init__(self, message: str, deep: bool = False) -> None:
        self.message, self.deep, self.path = message, deep, []


class _Walk:
    def __init__(self, turns: int) -> None:
        self.values, self.turns = 0, turns

    def visit(self, body: Any, depth: int) -> None:
        self.values += 1
        if isinstance(body, str):
            if SURROGATE.search(body):
                raise _Fault("holds a lone surrogate (a half of a UTF-16 pair), which is not text")
            return
        items = body.items() if isinstance(body, Mapping) else enumerate(body) if isinstance(body, list | tuple) else ()
        for key, value in items:
            try:
                if depth >= MAX_DEPTH and isinstance(value, Mapping | list | tuple):
                    raise _Fault(f"nests more than {MAX_DEPTH} levels deep", deep=True)
                if depth == 1 and key in TURNS and isinstance(value, list) and len(value) > self.turns \
                        and turns_in(value) > self.turns:  # counted only where it may be past the context
                    continue  # refused unread by the route: too long for the context
                if isinstance(value, list | tuple) and len(value) > MAX_ITEMS:
                    raise _Fault(f"holds {len(value)} items: more than any request can use (at most {MAX_ITEMS})")
                if self.values >= MAX_VALUES:  # named where the count ran out
                    raise _Fault(f"is past the {MAX_VALUES}th JSON value of the body: more than any request can use")
                self.visit(value, depth + 1)
            except _Fault as fault:
                fault.path.insert(0, key)
                raise


def turns_in(conversation: list[Any]) -> int:
    """A conversation's items that take at least a token each: all but reasoning items (which may take none)."""
    return sum(not (isinstance(item, dict) and item.get("type") == "reasoning") for item in conversation)


def json_object(text: str) -> dict[str, Any]:
    """Tool-call arguments as an object; ``{}`` when they are not a JSON object."""
    try:
        value = json_value(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def unread(value: Any, where: str = "") -> set[str]:
    """The path of each key with a value that ``value`` (a request, or a part of one) has and none of its fields
    reads, its parts' too, at any depth (``messages[].content[].cache_control``: ``[]`` is any item of a list;
    an assistant message's ``audio``, Codex's ``text.verbosity``)."""
    if isinstance(value, (list, tuple)):
        where = f"{where}[]"
        return set().union(*(unread(item, where) for item in value if isinstance(item, (BaseModel, list, tuple))))
    if not isinstance(value, BaseModel) or isinstance(value, Part) and value.left_out():
        return set()
    path = lambda key: f"{where}.{key}" if where else key
    names = {path(k) for k, v in (value.model_extra or {}).items() if v not in (None, "", [], {})}
    for name, field in vars(value).items():  # the declared fields' values (the extras are apart)
        if isinstance(field, (BaseModel, list, tuple)):
            names |= unread(field, path(name))
    return names


def parameters_of(schema: dict[str, Any] | None) -> dict[str, Any]:
    """A function tool's parameters; omitted, none at all (OpenAI: an empty parameter list), where an
    empty schema would let the call's grammar write any object."""
    return {"type": "object", "properties": {}} if schema is None else schema


def refuse_logprobs(value: Any) -> Any:
    if value is not None and value is not False:
        raise ValueError(NO_LOGPROBS)
    return value


def engine_request(**fields: Any) -> EngineRequest:
    """Build an EngineRequest; its own checks become 400s naming the field."""
    try:
        return EngineRequest(**fields)
    except ValueError as exc:
        param, _, message = str(exc).partition(": ")
        raise InvalidRequestError(param, message or str(exc)) from None


def type_of(value: Any, default: str = "") -> str:
    """The ``type`` of a raw or parsed object: what callable discriminators look at."""
    found = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return found if isinstance(found, str) else default


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def prefixed(prefix: str, base: str) -> str:
    return base if base.startswith(prefix) else prefix + base


def now() -> int:
    return int(time.time())


def parse(model_cls: type[M], data: dict[str, Any] | BaseModel) -> M:
    """Validate a request body; errors become InvalidRequestError naming the field."""
    if isinstance(data, model_cls):
        return data
    if isinstance(data, BaseModel):
        data = data.model_dump(by_alias=True, exclude_unset=True)
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc, data) from None


ERRORS_READ = 64  # of a body's validation errors, the most read for the one named (one per bad item of an array)


OBJECT_TYPES = frozenset({"model_type", "dict_type", "model_attributes_type"})  # pydantic's "not an object"
KINDS = {"string_type": "a string", "list_type": "an array", "int_type": "an integer", "float_type": "a number",
         "bool_type": "a boolean", **dict.fromkeys(OBJECT_TYPES, "a JSON object")}  # what a type error asked for


def _invalid(exc: ValidationError, data: Any) -> InvalidRequestError:
    errors = exc.errors(include_url=False)[:ERRORS_READ]
    paths = [_path(err, data) for err in errors]
    best = max(range(len(errors)), key=lambda i: len(paths[i]))
    err, path = errors[best], paths[best]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequestError):
        return InvalidRequestError(".".join([*path, cause.param] if cause.param else path), cause.message,
                                   code=cause.code)
    message = err["msg"].removeprefix("Value error, ")
    kinds = list(dict.fromkeys(KINDS[e["type"]] for e, p in zip(errors, paths) if p == path and e["type"] in KINDS))
    if len(kinds) > 1:  # a union's branches, each of another type: all of them, not the first one's words
        message = f"Input should be {' or '.join(kinds)}, not {_json_type(err['input'])}"
    elif err["type"] in OBJECT_TYPES:  # pydantic's words name its class ("... or instance of TemplateKwargs")
        message = f"Input should be a JSON object, not {_json_type(err['input'])}"
    elif err["type"] == "union_tag_invalid":
        message = f"unknown type {err['ctx']['tag']!r}; expected one of {err['ctx']['expected_tags']}"
    return InvalidRequestError(".".join(path), message)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
             dict: "a JSON object"}
    return names.get(type(value), type(value).__name__)


def _path(err: Any, data: Any) -> list[str]:
    """The error's location, keeping only the keys that are really in the body."""
    loc = err["loc"]
    if err["type"] == "missing" and loc:  # to where the key lacks: a union's tag that is also a key of the body
        # (a Chat tool's "function" sent to Responses) is no step of the path
        found = _walk(loc[:-1], data, loc[-1])
        if found is None:
            found = _walk(loc[:-1], data) or []
        return [*found, str(loc[-1])]
    parts = _walk(loc, data) or []
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        name = str(err["ctx"]["discriminator"]).strip("'")
        parts.append("type" if name.endswith("()") else name)
    return parts


def _walk(loc: tuple[Any, ...], node: Any, lacking: Any = None) -> list[str] | None:
    """Longest path of body keys along ``loc``; pydantic's union tags are skipped. With ``lacking``, only a
    path to an object without that key (else None)."""
    if not loc:
        return None if lacking is not None and _holds(node, lacking) else []
    skip = _walk(loc[1:], node, lacking)
    rest = _walk(loc[1:], node[loc[0]], lacking) if _holds(node, loc[0]) else None
    if rest is not None and (skip is None or len(rest) + 1 > len(skip)):
        return [str(loc[0]), *rest]
    return skip


def _holds(node: Any, key: Any) -> bool:
    if isinstance(node, dict):
        return key in node
    return isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node)
