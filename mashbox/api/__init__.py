"""The four protocols as pydantic models plus pure translators.

Each protocol module has a request model, ``to_engine(request) -> EngineRequest`` and a
``Translator(request, model)`` with ``start``/``feed``/``response``/``error``:

- ``openai_chat``: ChatRequest (Chat Completions)
- ``openai_completions``: CompletionRequest
- ``openai_responses``: ResponsesRequest
- ``anthropic_messages``: MessagesRequest, CountTokensRequest, TokenCount

``base.parse(model_cls, body)`` validates a body and raises InvalidRequestError naming the field.
"""
