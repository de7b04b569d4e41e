"""``Runtime``: one model running on this machine, continuously batched: ``EngineRequest`` in,
engine events out (``stream`` / ``astream``). The protocols sit above it: ``mashbox.Engine``
(``mashbox/facade.py``) answers them over a Runtime, and nothing here imports them.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import fields, replace
from functools import cache
from pathlib import Path, PurePath
from typing import Any, NamedTuple, Self

import torch

from mashbox.engine.config import EngineConfig
from mashbox.engine.core import EngineCore, ThinkBudget
from mashbox.engine.events import Event, Finish, Queued, Started, TextDelta
from mashbox.engine.info import ModelInfo
from mashbox.engine.load.catalog import cache_dir, readable, stamps
from mashbox.engine.load.loader import LoadedModel, load, pick_device
from mashbox.engine.load.progress import loading
from mashbox.engine.model import native
from mashbox.engine.model.form import Form, decide
from mashbox.engine.model.memory import check_fits, kv_bytes_per_token, room
from mashbox.engine.model.packed import Packer
from mashbox.engine.model.runner import ModelRunner
from mashbox.engine.model.weights import Weights
from mashbox.engine.request import EngineRequest, Message, SamplingParams
from mashbox.engine.sched.disk_cache import PageStore
from mashbox.engine.sched.draft import Drafts
from mashbox.engine.sched.scheduler import Scheduler
from mashbox.engine.sched.sequence import Sequence
from mashbox.engine.stats import EngineStats
from mashbox.engine.text.grammar import CallGuard, Grammars
from mashbox.engine.text.markup import (LOOP_NOTE, THINK_CLOSE, THINK_OPEN, Markup, call_format, json_value,
                                        looping_call)
from mashbox.engine.text.template import ChatTemplate, part_at, turn_ends, unreadable
from mashbox.engine.text.tokenizer import Quotes, Tokenizer
from mashbox.errors import ConfigError, ContextLengthError, EngineClosedError, InvalidRequestError

log = logging.getLogger("mashbox")


class Job(NamedTuple):
    """A request ready for the engine thread: its sequence and text machines."""

    seq: Sequence
    markup: Markup
    budget: ThinkBudget | None
    guard: CallGuard | None = None


class Relay:
    """One request's events from the engine thread, as its caller sees them: where its answer is written again
    (``Runtime._again``), read on from the new job's channel, with one ``Started`` and one ``Finish`` for both."""

    def __init__(self, runtime: Runtime, job: Job, request: EngineRequest) -> None:
        self.runtime, self.job, self.request = runtime, job, request
        self.channel = runtime._core.submit(*job)
        self.first: Finish | None = None  # the end of the answer given up, where it was written again
        self.finished = False

    def take(self, event: Event) -> list[Event]:
        """What ``event`` from the channel gives the caller."""
        if (again := self.runtime._again(self.job, self.request, event)) is not None:
            given_up, self.job, self.first = self.job.seq, again, event
            self.channel = self.runtime._core.submit(*again, replaces=given_up)
            return []
        events = self.runtime._relayed(event, self.job, self.request, self.first)
        self.finished = any(isinstance(e, Finish) for e in events)
        return events

    def close(self) -> None:
        """Stop the request where the caller left before its end."""
        if not self.finished:
            self.runtime._core.abort(self.job.seq.id)


class Runtime:
    """One model, answering many requests at once.

    >>> with Engine() as engine:
    ...     engine.chat(messages=[{"role": "user", "content": "Hi"}]).choices[0].message.content
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **options: Any) -> None:
        config = _configured(model, config, options)
        with loading(PurePath(config.model).name, config.quiet) as step:
            self._build(config, step)

    def _build(self, config: EngineConfig, step: Callable[[str], None]) -> None:
        device = pick_device(config.device)
        form = decide(device, config.dtype, config.batch_invariant, config.kv_dtype)
        loaded = load(config.model, device=device, dtype=form.dtype, step=step)
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.ctx = _context(config, loaded)
        per_token = kv_bytes_per_token(loaded.checkpoint.spec, form)
        graphs = config.cuda_graphs and device.type == "cuda"
        free, where = room(device)
        layers = loaded.checkpoint.spec.num_layers if device.type == "cuda" else None
        check_fits(self.ctx, config.slots + graphs, per_token, free, where, layers)
        host_cap = config.cache_ram_mib * 2**20
        left = None if free is None else free - self.ctx * config.slots * per_token  # beside the KV cache
        if device.type == "cpu" and left is not None and left < host_cap:
            host_cap = max(left, 0)  # the host cache lives there too
            log.info("the host prefix cache holds at most %d MiB (of %d asked): the memory the KV cache leaves",
                     host_cap >> 20, config.cache_ram_mib)
        self.eos_ids = _eos_ids(loaded)
        self._templates: dict[bool, ChatTemplate] = {}
        templates = (self.tokenizer.chat_template, self.tokenizer.tool_template)
        if broken := unreadable(t for t in templates if t):  # said at load, not only at the first chat request
            log.warning("the model's chat template does not read (%s): chat requests will be refused; plain "
                        "prompts (complete) work", broken)
        self.calls = call_format("".join(t for t in templates if t), self._has_token)
        self.grammars = Grammars(self.tokenizer, self.eos_ids, self.calls)
        step(f"preparing the weights and the KV cache ({config.slots} x {self.ctx} tokens, {form.kv_name})")
        packer = Packer.kept(form.lib, cache_dir() / "packed", Path(loaded.weights), form.mode) if form.lib else None
        runner = ModelRunner(loaded.checkpoint, config.slots, self.ctx, form, graphs, packer)
        self.info = _info(loaded, self.ctx, config.slots, form, runner.weights)
        scheduler = Scheduler(config.slots, self.ctx, config.chunk_tokens, host_cap,
                              runner.kv.bytes_per_token, config.step_tokens, config.busy_tokens,
                              _page_store(config, self.info, runner), runner.cut_anywhere)
        self._speculate = config.speculation and runner.cut_anywhere  # a row's bits never depend on its batch
        self._core = EngineCore(scheduler, runner, self.tokenizer)
        self._pid = os.getpid()  # its thread runs in this process only: a forked child waited forever
        _one_thread_after_fork()
        self._release = weakref.finalize(self, _release, self._core)  # also where the Engine is dropped unclosed

    def __reduce__(self) -> Any:
        """Refused plainly: a process pool's pickling of an Engine failed on whatever inner part came first
        ("Can't pickle local object 'CDLL.__init__.<locals>._FuncPtr'")."""
        raise TypeError(f"an {type(self).__name__} cannot be sent to another process (its model and thread live in "
                        f"this one): make one in the child, with the same arguments")

    def __repr__(self) -> str:
        i, state = self.info, "closed" if self._core.closed else "open"
        return (f"<{type(self).__name__} {i.id} ({i.weights}, {i.weights_mode}) on {i.device}: {i.slots} slots "
                f"x {i.ctx} tokens, {state}>")

    def _has_token(self, text: str) -> bool:
        return self.tokenizer.token_id(text) is not None

    @property
    def model_id(self) -> str:
        return self.info.id

    @property
    def template(self) -> ChatTemplate:
        """The model's chat template."""
        return self._template_for(tools=False)

    def _template_for(self, tools: bool) -> ChatTemplate:
        """The chat template for a request with ``tools`` or without: the one named tool_use where the model
        has one (Hermes 2 Pro and 3), else its own."""
        tools = tools and self.tokenizer.tool_template is not None
        if tools not in self._templates:
            source = Tokenizer(self.tokenizer.backend_tokenizer, self.tokenizer.special_tokens_map,
                               self.tokenizer.tool_template) if tools else self.tokenizer
            self._templates[tools] = ChatTemplate(source, self.config.verbatim_template, self.calls)
        return self._templates[tools]

    # -- the core: canonical requests in, engine events out ---------------

    def encode(self, request: EngineRequest) -> list[int]:
        """The prompt tokens ``request`` runs on (after the chat template).

        A prompt of more than ``COUNTED_CHARS`` characters that cannot fit the context whatever its
        tokens is refused first, from a cheap lower bound, so that a huge request costs no rendering or
        tokenizing; a shorter one is counted (an agent reads the count to know how much to cut). The note a
        model in a loop reads (``_out_of_loop``) is counted as read."""
        return self._prompt(self._out_of_loop(self._checked(request)))

    def _checked(self, request: EngineRequest) -> EngineRequest:
        """``request``, where the engine is open and it is an EngineRequest; else raise."""
        self._check_open()
        if not isinstance(request, EngineRequest):
            raise InvalidRequestError("request", f"must be an EngineRequest (got {type(request).__name__}); "
                                                 "a dict is a request of chat(), complete(), respond() or message()")
        return request

    def _prompt(self, request: EngineRequest) -> list[int]:
        """The prompt tokens of ``request`` as it stands (``encode``)."""
        words, tools = _fewest_tokens(request, self.tokenizer.most_chars_per_token)
        if (floor := words + tools) > self.ctx and floor * self.tokenizer.most_chars_per_token > COUNTED_CHARS:
            field = "prompt" if request.prompt is not None else "tools" if tools > self.ctx else "messages"
            raise ContextLengthError.of(field, floor, self.ctx, bound="counted from its characters")
        if request.prompt is not None:  # a plain prompt is the client's own: its special tokens are meant
            return self.tokenizer.encode(request.prompt, add_special_tokens=True)
        for tool in request.tools:  # a call must write its name: one with a special token's text ends it empty
            if said := next((s for s in self.tokenizer.special_texts if s in tool.name), None):
                raise InvalidRequestError("tools", f"the tool {tool.name!r}: its name holds {said!r}, a special "
                                                   "token of this model, which no call can write")
        if self.tokenizer.quotes and (quoted := _quoted(request, self.tokenizer.new_quotes())):
            return self.tokenizer.encode_quoting(self._rendered(quoted[0]), quoted[1])  # a file an agent read holds
            # "<|im_end|>": text to the model, not the end of its turn
        return self.tokenizer.encode(self._rendered(request), add_special_tokens=False)

    def _rendered(self, request: EngineRequest) -> str:
        """A chat request's prompt text, after the chat template."""
        tools = request.tools if request.tool_choice != "none" else ()
        template = self._template_for(bool(tools))
        return template.render(request.messages, tools, request.enable_thinking, request.continue_final)

    def _overflowing(self, request: EngineRequest, field: str, tokens: int) -> str:
        """The field a prompt of ``tokens`` too long for the context is named by: ``tools`` where the
        conversation alone would fit and the tools take the most of it (a client sending thousands of
        tools), else ``field`` (a history that grew past the context beside an agent's tools)."""
        if field != "messages" or not request.tools or request.tool_choice == "none":
            return field
        alone = len(self.tokenizer.encode(self._rendered(replace(request, tools=(), tool_choice="auto")),
                                          add_special_tokens=False))
        return "tools" if alone < self.ctx and tokens - alone > alone else field

    def stream(self, request: EngineRequest) -> Iterator[Event]:
        """Submit ``request``; iterate its events: ``Queued`` at once, ``Started`` once it has a slot,
        then its text, reasoning and tool-call events, ending with one ``Finish``.

        Errors in the request raise here, before any work. Closing the
        iterator early aborts the request and frees its slot.
        """
        return self._events(self._job(request), request)

    def astream(self, request: EngineRequest) -> AsyncIterator[Event]:
        return self._aevents(self._job(request), request)

    def abort(self, request_id: str) -> None:
        """Stop the request of this id where it runs or waits (from any thread): its events go on to
        a ``Finish`` of reason ``abort`` with what it used. An id not running is ignored."""
        self._core.abort(request_id)

    def _job(self, request: EngineRequest, first: Job | None = None, spent: int = 0) -> Job:
        """``request`` ready for the engine; after ``first``, whose answer began with a call to a tool the request
        lacks (``Markup.invented``), that answer written again as a call to one of its tools (as ``tool_choice:
        required``), on the same prompt, in what the ``spent`` tokens left of ``max_tokens``."""
        told = self._out_of_loop(self._checked(request))
        ids = list(first.seq.prompt_ids) if first else self._prompt(told)
        looped, request = told is not request, replace(told, tool_choice="required") if first else told
        self._core.check_new(request.id)  # here, at the call; submit checks it again under its lock
        field = "prompt" if request.prompt is not None else "messages"
        if not ids:
            raise InvalidRequestError(field, "is empty: there is no token to continue from")
        if request.sampling.logit_bias and (most := max(request.sampling.logit_bias)[0]) >= len(self.tokenizer):
            raise InvalidRequestError("logit_bias", f"token id {most} is not in the model's vocabulary (ids 0 to "
                                                    f"{len(self.tokenizer) - 1})")
        room = self.ctx - len(ids)
        if room < 1:
            raise ContextLengthError.of(self._overflowing(request, field, len(ids)), len(ids), self.ctx)
        max_new = min(request.sampling.max_tokens or room, room) - spent
        seq = Sequence(request.id, ids, request.sampling, max_new, self.eos_ids, cache_salt=request.cache_salt,
                       session=request.session)
        if self._speculate:  # indexed here, not on the engine's thread
            text = (request.prediction or "")[: PREDICTED_CHARS * max_new]  # no more than the answer can use
            predicted = self.tokenizer.encode(text, add_special_tokens=False) if text else []
            seq.drafts = Drafts([*ids, *predicted])  # the latest occurrence wins: a prediction over the prompt
        if request.messages is None:
            return Job(seq, Markup(calls=None), None)
        seq.constraint = self.grammars.for_tools(request.tools, request.tool_choice, request.parallel_tool_calls)
        seq.constraint = seq.constraint or self.grammars.for_schema(request.response_schema)
        guard = None
        if request.tools and request.tool_choice == "auto" and seq.constraint is None and self.config.constrain_calls:
            guard = self.grammars.guard(request.tools)
        ends_invented = guard is not None and not looped  # a model told of its loop answers in words
        return Job(seq, self._markup(request, ids, seq.constraint is not None, ends_invented), self._budget(request),
                   guard)

    def _out_of_loop(self, request: EngineRequest) -> EngineRequest:
        """``request``, where its model made the same call ``LOOP_TURNS`` turns in a row and got the same result:
        told so after the results (a late system turn where the template keeps one in place, else the user's), and
        kept from opening a call with its tag in this answer (a small model otherwise reads one file again and
        again, its loop is cut, and the agent's task ends with no answer); else as it is."""
        results = request.messages and request.messages[-1].role == "tool"  # not a user's words after them: a
        # new ask may need the call (a prefill's text goes on where it stops)
        steered = results and request.tools and request.tool_choice == "auto" and self.config.constrain_calls
        if not (steered and looping_call(request.messages)):
            return request
        role = "system" if self._template_for(True).system_in_place else "user"
        sampling = request.sampling
        if (opener := self.tokenizer.token_id(self.calls.open)) is not None:
            bias = dict(sampling.logit_bias) | {opener: -100.0}
            sampling = replace(sampling, logit_bias=tuple(sorted(bias.items())))
        return replace(request, messages=(*request.messages, Message(role, LOOP_NOTE)), sampling=sampling)

    def _markup(self, request: EngineRequest, ids: list[int], constrained: bool, ends_invented: bool) -> Markup:
        calls = self.calls if request.tools and request.tool_choice != "none" else None
        think = self.template.knows_thinking and request.enable_thinking is not False
        # a grammar that writes the answer from its first token leaves no thinking, whatever the prompt opened
        in_think = self.template.knows_thinking and not constrained and self._opens_thinking(request, ids)
        names = frozenset(t.name for t in request.tools) if calls else frozenset()
        forced = calls is not None and request.tool_choice != "auto"  # the grammar writes only calls
        loop = looping_call(request.messages) if calls and request.tool_choice == "auto" else None
        made = frozenset([loop] if loop else [])
        return Markup(calls=calls, think=think, in_think=in_think, names=names, cut_calls_are_text=not forced,
                      made=made, one_call=not request.parallel_tool_calls, ends_invented=ends_invented)

    def _opens_thinking(self, request: EngineRequest, ids: list[int]) -> bool:
        """Whether the answer begins inside thinking: the prompt ends with ``<think>`` (a template that opens it
        whatever the request asks, as DeepSeek-R1's and QwQ's do), or the text it continues (a prefill) opened
        thinking and did not close it."""
        if request.continue_final:  # opened at its start (a later mention of the tag is text)
            text = request.messages[-1].content
            return text.lstrip().startswith(THINK_OPEN) and THINK_CLOSE not in text
        return self.tokenizer.decode(ids[-4:]).rstrip().endswith(THINK_OPEN)

    def _budget(self, request: EngineRequest) -> ThinkBudget | None:
        if request.thinking_budget is None:
            return None
        closes = {THINK_CLOSE[:i]: tuple(self.tokenizer.encode(THINK_CLOSE[i:] + "\n\n", add_special_tokens=False))
                  for i in range(len(THINK_CLOSE))}
        return ThinkBudget(request.thinking_budget, closes)

    def _located(self, event: Event, request: EngineRequest, ids: list[int]) -> Event:
        """``event``, and where a ``Started`` one's prompt left a longer cached prefix: the part of
        the conversation that token lies in."""
        if not isinstance(event, Started) or event.differs is None or request.messages is None:
            return event
        at = len(self.tokenizer.decode(ids[: event.differs]))
        rendered = self._rendered(request)
        tools = None  # where the tools' block begins: where the prompt rendered without them first differs
        if request.tools and request.tool_choice != "none":
            tools = len(os.path.commonprefix([rendered, self._rendered(replace(request, tools=(), tool_choice="auto"))]))
        return replace(event, part=part_at(rendered, at, request.messages, tools))

    def _events(self, job: Job, request: EngineRequest) -> Iterator[Event]:
        relay = Relay(self, job, request)
        try:
            yield Queued(len(job.seq.prompt_ids))
            while not relay.finished:
                yield from relay.take(relay.channel.get())
        finally:
            relay.close()

    async def _aevents(self, job: Job, request: EngineRequest) -> AsyncIterator[Event]:
        relay = Relay(self, job, request)
        try:
            yield Queued(len(job.seq.prompt_ids))
            while not relay.finished:
                for event in relay.take(await relay.channel.aget()):
                    yield event
        finally:
            relay.close()

    def _again(self, job: Job, request: EngineRequest, event: Event) -> Job | None:
        """The answer to write again, where ``event`` ends one that began with a call, by its keys, to a tool the
        request lacks (none of it given: ``Markup.invented``), now a call to one of its tools; else None."""
        if not (isinstance(event, Finish) and job.markup.invented):
            return None
        if event.usage.completion_tokens >= job.seq.max_new_tokens:  # nothing left of max_tokens
            return None
        try:
            return self._job(request, job, event.usage.completion_tokens)
        except InvalidRequestError:  # a tool llguidance cannot hold to its schema: the answer stays as written
            return None

    def _relayed(self, event: Event, job: Job, request: EngineRequest, first: Finish | None) -> list[Event]:
        """``event`` as the caller sees it: where the answer was written again after ``first``, no second
        ``Started``, and one ``Finish`` for both (``_joined``); an answer held back and not written again given
        before its ``Finish``."""
        if first and isinstance(event, Started):
            return []
        if first and isinstance(event, Finish):
            event = _joined(first, event)
        held = [TextDelta(job.markup.invented)] if isinstance(event, Finish) and job.markup.invented else []
        return [*held, self._located(event, request, job.seq.prompt_ids)]

    def stats(self) -> EngineStats:
        """Requests running and waiting, KV use and token counters, as of the engine's last step."""
        return self._core.stats()

    # -- lifetime -----------------------------------------------------------

    def _check_open(self) -> None:
        if os.getpid() != self._pid:
            raise EngineClosedError(f"this Engine was made in process {self._pid}, and its thread runs there: a "
                                    "forked child cannot use it; make one in the child, or start children with "
                                    "multiprocessing's spawn method")
        if self._core.closed:
            raise EngineClosedError(self._core.why_closed)

    def close(self) -> None:
        """Stop the engine thread and release the model and its KV cache."""
        self._release()

    def __enter__(self) -> Self:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release(core: EngineCore) -> None:
    """Stop an engine's thread and let its model and KV cache go: at ``close()``, or once the Engine is
    dropped without it (a notebook cell that makes one, run again), which would otherwise keep them."""
    core.close()
    core.runner = None  # type: ignore[assignment]


REQUEST_FIELDS = frozenset(f.name for f in fields(SamplingParams)) | {"max_completion_tokens", "tools", "messages"}
PREDICTED_CHARS = 16  # characters of a prediction read per token the answer may have: its tokens hold fewer
COUNTED_CHARS = 1 << 21  # a prompt too long for the context is counted up to about this many characters (a
# tenth of a second or so); a longer one is refused from its lower bound


def _configured(model: Any, config: Any, options: dict[str, Any]) -> EngineConfig:
    """The engine's config: ``config`` (or the defaults) with ``options`` and ``model`` over it; a
    mistake in them (a misspelt option, a model that is no name) raises ``ConfigError``."""
    if config is not None and not isinstance(config, EngineConfig):
        raise ConfigError(f"config: must be an EngineConfig (got {type(config).__name__}), or its fields as options")
    if model is not None and not isinstance(model, str | PurePath):
        raise ConfigError(f"model: must be a catalog id or a path (got {model!r})")
    known = [f.name for f in fields(EngineConfig)]
    for name in options:
        if name in REQUEST_FIELDS:  # "did you mean `step_tokens`?" misled where a request's field was meant
            raise ConfigError(f"{name}: is a request's field, not an Engine option: give it to each call, e.g. "
                              f"engine.chat(messages=..., {name}=...)")
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"the options are: {', '.join(known)}"
            raise ConfigError(f"{name}: is not an Engine option; {hint}")
    return replace(config or EngineConfig(), **options, **({"model": str(model)} if model is not None else {}))


@cache
def _one_thread_after_fork() -> None:
    """Once per process that ran a model: a child forked from it computes on one thread, as PyTorch's
    DataLoader workers do. The OpenMP pool of the parent's threads does not survive a fork (GNU
    OpenMP), and the child's first parallel region waited for them for good: an ``Engine`` made in a
    multiprocessing child (the fork start method) hung while it loaded."""
    os.register_at_fork(after_in_child=lambda: torch.set_num_threads(1))


def _rotary(runner: ModelRunner) -> list[list[float]]:
    """The rotary tables' row for position 1, one for each kind the layers use: what of ``ctx`` a page
    depends on (LongRoPE's long table past the model's original context; any other ``ctx`` computes
    the same keys, so a server started with another ``--ctx`` reads the same pages)."""
    rows = {tuple(layer.cos[1].float().tolist()) + tuple(layer.sin[1].float().tolist())
            for layer in runner.weights.layers}
    return [list(row) for row in sorted(rows)]


def _page_store(config: EngineConfig, info: ModelInfo, runner: ModelRunner) -> PageStore | None:
    """The disk tier of the prefix cache (pages of 8 chunks), or None when it has no bytes."""
    if config.cache_disk_gib <= 0:
        return None
    parts = [info.id, info.source, _rotary(runner), info.dtype,  # source: the weights' path and files' stamps
             info.weights_mode, str(runner.kv.keys.dtype), config.chunk_tokens, torch.__version__,
             native.source_hash()]  # pages computed by other kernels would differ in their last bits
    namespace = hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    folder = Path(config.cache_dir) if config.cache_dir else cache_dir() / "prefixes"
    page = 8 * config.chunk_tokens
    form = tuple(((t.shape[0], page, *t.shape[2:]), t.dtype) for t in runner.kv.save(0, 1))  # as a page holds them
    try:
        return PageStore(folder, int(config.cache_disk_gib * 2**30), namespace, page, form)
    except OSError as err:
        raise ConfigError(f"cache_dir: {folder} cannot be a folder here ({err.strerror or err})") from None


def _quoted(request: EngineRequest, quotes: Quotes) -> tuple[EngineRequest, Quotes] | None:
    """``request`` with each special token's text in its words (the messages' text, reasoning and call
    arguments, decoded; the tools' descriptions and schemas) replaced by a mark of ``quotes``; None
    where there is none."""
    def quoted_json(value: Any) -> Any:
        if isinstance(value, str):
            return quotes.quote(value)
        if isinstance(value, dict):
            return {quotes.quote(k): quoted_json(v) for k, v in value.items()}
        return [quoted_json(v) for v in value] if isinstance(value, list) else value

    def arguments(text: str) -> str:  # decoded first: "\u003c|im_end|\u003e" is the same text
        try:
            return json.dumps(quoted_json(json_value(text)), ensure_ascii=False)
        except (ValueError, RecursionError):
            return quotes.quote(text)

    messages = tuple(replace(m, content=quotes.quote(m.content), reasoning=m.reasoning and quotes.quote(m.reasoning),
                             tool_calls=tuple(replace(c, arguments=arguments(c.arguments)) for c in m.tool_calls))
                     for m in request.messages)
    tools = tuple(replace(t, description=quotes.quote(t.description), parameters=quoted_json(t.parameters))
                  for t in request.tools)
    return (replace(request, messages=messages, tools=tools), quotes) if quotes.said else None


def _fewest_tokens(request: EngineRequest, chars_per_token: int) -> tuple[int, int]:
    """Lower bounds on the prompt's tokens of its messages and of its tools, from lengths alone: every
    chat template writes at least one token per message, its text (trimmed, maybe), its calls' arguments
    (half their JSON at least, in any layout), and each shown tool's name, description and the strings of
    its schema (whatever the form); no token holds more than ``chars_per_token`` characters."""
    if request.prompt is not None:
        return -(-len(request.prompt) // chars_per_token), 0
    chars = sum(len(m.content.strip()) + sum(len(c.arguments) for c in m.tool_calls) // 2 for m in request.messages)
    shown = request.tools if request.tool_choice != "none" else ()
    described = sum(len(t.name) + len(t.description) + _string_chars(t.parameters) for t in shown)
    return max(len(request.messages), -(-chars // chars_per_token)), described // chars_per_token


def _string_chars(node: Any) -> int:
    """The characters of the strings within a JSON value."""
    if isinstance(node, str):
        return len(node)
    if isinstance(node, dict):
        return sum(_string_chars(v) for v in node.values())
    return sum(_string_chars(v) for v in node) if isinstance(node, list) else 0


def _context(config: EngineConfig, loaded: LoadedModel) -> int:
    """The context of each slot: the one asked for, refused past the model's training unless allowed."""
    trained = loaded.checkpoint.trained_ctx
    if config.ctx is None:
        return loaded.ctx_default
    if trained and config.ctx > trained and loaded.checkpoint.dynamic_rope:  # allowed or not
        raise ConfigError(f"ctx: {config.ctx} is more than the {trained} tokens {loaded.id} was trained on, past "
                          "which its rotary scaling (rope_type dynamic) grows with the prompt, which mashbox does "
                          f"not do: its answers there would not be the model's; ctx {trained} at most")
    if trained and config.ctx > trained and not config.allow_long_context:
        raise ConfigError(f"ctx: {config.ctx} is more than the {trained} tokens {loaded.id} was trained on; "
                          "lower it, or ask for it with allow_long_context=True (--allow-long-context "
                          "on the command line), knowing that answers degrade past that length")
    return config.ctx


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    ids = {loaded.tokenizer.eos_token_id, *turn_ends(loaded.tokenizer)}
    ids.update(loaded.checkpoint.eos_ids)
    return frozenset(i for i in ids if i is not None)


def _info(loaded: LoadedModel, ctx: int, slots: int, form: Form, weights: Weights) -> ModelInfo:
    what, mode = form.describe(weights)
    source = json.dumps([str(loaded.weights), stamps(Path(loaded.weights))])
    return ModelInfo(loaded.id, ctx, slots, readable(PurePath(loaded.weights).name), loaded.bpw, weights.nbytes / 1e9,
                     str(loaded.device), what, mode, form.kv_name, hashlib.sha256(source.encode()).hexdigest()[:16])


def _joined(first: Finish, last: Finish) -> Finish:
    """The end of an answer written twice (``Runtime._again``): its prompt as the first read it (the second's came
    from the cache the first filled), the tokens of both."""
    a, b, t, u = first.usage, last.usage, first.timings, last.timings
    usage = replace(a, completion_tokens=a.completion_tokens + b.completion_tokens,
                    reasoning_tokens=a.reasoning_tokens + b.reasoning_tokens,
                    accepted_tokens=a.accepted_tokens + b.accepted_tokens,
                    rejected_tokens=a.rejected_tokens + b.rejected_tokens)
    timings = replace(t, predicted_n=t.predicted_n + u.predicted_n,
                      predicted_ms=t.predicted_ms + u.prompt_ms + u.predicted_ms)
    return replace(last, usage=usage, timings=timings)
