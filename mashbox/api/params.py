"""The keyword parameters of ``Engine.chat``, ``complete``, ``respond``, ``message`` and
``count_tokens``, as TypedDicts, so that an editor completes them and a type checker checks them.

Each mirrors its protocol's request model key for key (``tests/test_typing.py`` checks that they
agree, required keys included, so neither can drift), less ``stream``: that is each method's own
keyword, since it decides what the method returns. Nested objects (messages, tools, ...) are the
mappings the protocols send; the request models validate them at run time.
"""

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Required, TypedDict

Object = Mapping[str, Any]
ToolChoiceName = Literal["auto", "none", "required"]


class SamplingKeywords(TypedDict, total=False):
    """The sampling table every generating request shares (``base.SamplingFields``)."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    repetition_penalty: float | None
    frequency_penalty: float | None
    presence_penalty: float | None
    max_tokens: int | None
    max_completion_tokens: int | None
    stop: str | list[str] | None
    stop_sequences: list[str] | None
    n: int | None


class ChatParams(SamplingKeywords, total=False):
    """``openai_chat.ChatRequest``."""

    model: str | None
    messages: Required[Sequence[Object]]
    tools: Sequence[Object] | None
    tool_choice: ToolChoiceName | Object | None
    parallel_tool_calls: bool | None
    stream_options: Object | None
    chat_template_kwargs: dict[str, Any] | None
    enable_thinking: bool | None
    merge: bool | None
    prompt_cache_key: str | None
    store: bool | None
    logprobs: bool | None
    top_logprobs: int | None
    response_format: dict[str, Any] | None
    prediction: Object | None
    continue_final_message: bool | None
    logit_bias: Mapping[str, float] | None


class CompletionParams(SamplingKeywords, total=False):
    """``openai_completions.CompletionRequest``."""

    model: str | None
    prompt: Required[str | list[str]]
    stream_options: Object | None
    merge: bool | None
    prompt_cache_key: str | None
    logprobs: int | None
    logit_bias: Mapping[str, float] | None


class ResponsesParams(SamplingKeywords, total=False):
    """``openai_responses.ResponsesRequest``."""

    model: str | None
    input: Required[str | Sequence[Object]]
    instructions: str | None
    tools: Sequence[Object] | None
    tool_choice: ToolChoiceName | Object | None
    parallel_tool_calls: bool | None
    reasoning: Object | None
    prompt_cache_key: str | None
    store: bool | None
    client_metadata: dict[str, Any] | None
    metadata: dict[str, Any] | None
    include: list[str] | None
    top_logprobs: int | None
    text: Object | None
    max_output_tokens: int | None
    previous_response_id: str | None  # refused unless null: this server keeps no responses


class CountTokensParams(TypedDict, total=False):
    """``anthropic_messages.CountTokensRequest``."""

    model: str | None
    messages: Required[Sequence[Object]]
    system: str | Sequence[Object] | None
    tools: Sequence[Object] | None
    tool_choice: Object | None
    thinking: Object | None


class MessagesParams(CountTokensParams, SamplingKeywords, total=False):
    """``anthropic_messages.MessagesRequest``."""

    prompt_cache_key: str | None
    metadata: dict[str, Any] | None
    output_config: Object | None
    output_format: Object | None
