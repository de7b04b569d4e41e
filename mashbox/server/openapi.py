"""GET /openapi.json: the OpenAPI 3.1 description of this server, naming the model it runs.

The bodies come from the same pydantic models the handlers validate and answer with; a test
checks that every route the app serves is described here.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple, get_args

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from mashbox.api import anthropic_messages, anthropic_output, chat_output, openai_chat, openai_completions
from mashbox.api import openai_responses, responses_output, task_events, task_items
from mashbox.server.models import AnthropicModel, AnthropicModelList, Model, ModelList

REF = "#/components/schemas/{model}"
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
_INT, _NULL_INT, _NULL_STR = {"type": "integer"}, {"type": ["integer", "null"]}, {"type": ["string", "null"]}
HEALTH = {"type": "object", "required": ["status"], "additionalProperties": True, "properties": {
    "status": {"type": "string", "enum": ["ok", "loading", "failed"]},
    "live_rows": _NULL_INT, "waiting": _INT, "cache_bytes": _INT, "host_cache_bytes": _INT, "snapshot_bytes": _INT,
    "host_cache_cap_bytes": _INT, "host_cache_evictions": _INT, "cache_namespace": _NULL_STR,
    "deployment_id": _NULL_STR, "component_set_sha": _NULL_STR, "certification": {"type": "string"},
    "compiles_after_ready": _NULL_INT, "routed_experts": {"type": ["object", "null"]},
    "worker_pid": _INT, "worker_restarts": _INT}}
OPENAI_ERRORS = {"400": "Bad request.", "404": "A model id other than the one this server serves (model_not_found).",
                 "429": "Too many requests are waiting for a slot.",
                 "500": "The request failed on the device.", "503": "The model is still loading."}
ANTHROPIC_ERRORS = {"400": "Bad request.", "429": "Too many requests of yours are waiting for a slot.",
                    "500": "The request failed on the device.",
                    "529": "The model is still loading, or the server's queue is full."}


GUARDS = {
    "401": "An API key is missing or wrong (only when the server has keys).",
    "403": "A request from a web page of another origin, or naming a host this server does not answer to.",
    "415": "The body is not Content-Type: application/json.",
}


class Route(NamedTuple):
    method: str
    path: str
    summary: str
    answer: type[BaseModel] | dict[str, Any] | None = None
    request: type[BaseModel] | None = None
    event: type[BaseModel] | tuple[str, Any] | None = None  # a stream's event: a model, or a named union of them
    errors: dict[str, str] = {}
    anthropic: type[BaseModel] | None = None  # the answer to a client that sends ``anthropic-version``


TASK_ERROR = {"type": "object", "required": ["jsonrpc", "error"], "properties": {
    "jsonrpc": {"const": "2.0"}, "id": {"type": ["string", "integer", "null"]}, "error": {
        "type": "object", "required": ["code", "message"], "properties": {
            "code": {"type": "integer"}, "message": {"type": "string"}, "data": {"type": "object"}}}}}
TASK_ERRORS = {"400": "Bad request (error.data.param names the field).", "404": "No such task (of this tenant).",
               "409": "The task is not in a state that allows this.", "429": OPENAI_ERRORS["429"],
               "503": OPENAI_ERRORS["503"]}


def _task_routes() -> list[Route]:
    one, envelope = "/v1/tasks/{task_id}", task_events.TaskEnvelope
    acts = [Route("post", f"{one}/{verb}", f"{verb.capitalize()} an agent task (the task's fields beside the "
                                           "envelope's)", {"$ref": REF.format(model="TaskAction")}, errors=TASK_ERRORS)
            for verb in ("cancel", "pause", "resume")]
    return [
        Route("post", "/v1/tasks", "Create an agent task (also POST /tasks)", envelope, task_items.CreateTask,
              task_events.TaskEventEnvelope, TASK_ERRORS),
        Route("get", "/v1/tasks", "List agent tasks, newest first (limit, starting_after, ending_before, status, "
                                  "session_id, user_id)", task_events.TaskListEnvelope, errors=TASK_ERRORS),
        Route("get", one, "Retrieve an agent task", envelope, errors=TASK_ERRORS),
        Route("delete", one, "Delete an agent task (a running one is canceled first)", envelope, errors=TASK_ERRORS),
        *acts,
    ]


HEALTH_ROUTE = {"200": "OK", "503": "The model is still loading."}
ROUTES = [
    Route("get", "/v1/health", "Health", HEALTH, errors=HEALTH_ROUTE),
    Route("get", "/health", "Health (short path)", HEALTH, errors=HEALTH_ROUTE),
    Route("get", "/", "Health, or the chat page with --ui", HEALTH, errors=HEALTH_ROUTE),
    Route("head", "/v1/health", "Ready check without a body (every path answers HEAD the same way)",
          errors={"503": "Loading."}),
    Route("get", "/v1/models", "List models", ModelList, errors={"503": OPENAI_ERRORS["503"]},
          anthropic=AnthropicModelList),
    Route("get", "/v1/models/{model}", "Get a model", Model, errors={"404": OPENAI_ERRORS["404"],
                                                                     "503": OPENAI_ERRORS["503"]},
          anthropic=AnthropicModel),
    Route("post", "/v1/chat/completions", "Chat completion", chat_output.ChatCompletion,
          openai_chat.ChatRequest, chat_output.ChatCompletionChunk, OPENAI_ERRORS),
    Route("post", "/v1/completions", "Text completion", openai_completions.Completion,
          openai_completions.CompletionRequest, openai_completions.Completion, OPENAI_ERRORS),
    Route("post", "/v1/messages", "Messages (Anthropic)", anthropic_output.AnthropicMessage,
          anthropic_messages.MessagesRequest, ("MessageStreamEvent", anthropic_output.StreamEvent), ANTHROPIC_ERRORS),
    Route("post", "/v1/messages/count_tokens", "Count tokens", anthropic_output.TokenCount,
          anthropic_messages.CountTokensRequest, errors={"400": "Bad request.", "529": ANTHROPIC_ERRORS["529"]}),
    Route("post", "/v1/responses", "Responses (OpenAI)", responses_output.Response,
          openai_responses.ResponsesRequest, ("ResponseStreamEvent", responses_output.StreamEvent), OPENAI_ERRORS),
    Route("get", "/metrics", "Metrics (Prometheus text)"),
    Route("get", "/openapi.json", "This description", {"type": "object"}),
    *_task_routes(),
]


def document(model_id: str, version: str) -> dict[str, Any]:
    """The whole OpenAPI 3.1 document."""
    schemas, refs = _schemas()
    schemas.update(Error=ERROR, AnthropicError=ANTHROPIC_ERROR, Health=HEALTH, TaskError=TASK_ERROR,
                   TaskAction=_beside(schemas["TaskObject"], schemas["TaskEnvelope"]))
    for name, union in (r.event for r in ROUTES if isinstance(r.event, tuple)):  # one event of the stream
        schemas[name] = {"oneOf": [refs[m, "serialization"] for m in _members(union)],
                         "discriminator": {"propertyName": "type"}}
    schemas["Model"]["properties"]["id"]["examples"] = [model_id]
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method] = _operation(route, refs)
    info = {"title": "mashbox", "version": version, "x-model": model_id,
            "description": f"A local LLM server running the model {model_id}: OpenAI Chat Completions, "
                           "Completions and Responses, and Anthropic Messages."}
    return {"openapi": "3.1.0", "info": info, "paths": paths, "components": {"schemas": schemas}}


def _operation(route: Route, refs: dict[Any, Any]) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": route.summary, "operationId": _operation_id(route)}
    if names := re.findall(r"{(\w+)}", route.path):
        operation["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                   for n in names]
    if route.request is not None:
        body = {"application/json": {"schema": refs[route.request, "validation"]}}
        operation["requestBody"] = {"required": True, "content": body}
    errors = route.errors | _guards(route)
    operation["responses"] = {"200": {"description": "OK", **_content(route, refs)}} | {
        code: {"description": text, **_errors(route, code)} for code, text in sorted(errors.items()) if code != "200"
    }
    return operation


def _guards(route: Route) -> dict[str, str]:
    """The refusals that come before any route: 403 anywhere, 401 where keys apply, 415 on POST."""
    keyed = route.path in ("/metrics", "/openapi.json") or (route.path.startswith("/v1/") and route.path != "/v1/health")
    codes = ["403"] + (["401"] if keyed else []) + (["415"] if route.method == "post" else [])
    return {code: GUARDS[code] for code in codes}


def _content(route: Route, refs: dict[Any, Any]) -> dict[str, Any]:
    if route.path == "/metrics":
        return {"content": {"text/plain": {"schema": {"type": "string"}}}}
    if route.answer is None:
        return {}
    schema = _named(route.answer) if isinstance(route.answer, dict) else refs[route.answer, "serialization"]
    if route.anthropic is not None:
        schema = {"oneOf": [schema, refs[route.anthropic, "serialization"]]}
    content = {"application/json": {"schema": schema}}
    if isinstance(route.event, tuple):
        content["text/event-stream"] = {"schema": {"$ref": f"#/components/schemas/{route.event[0]}"}}
    elif route.event is not None:
        content["text/event-stream"] = {"schema": refs[route.event, "serialization"]}
    return {"content": content}


def _errors(route: Route, code: str) -> dict[str, Any]:
    if route.method == "head":
        return {}
    shape = "Health" if route.answer is HEALTH and code == "503" else (
        "AnthropicError" if route.path.startswith("/v1/messages") else
        "TaskError" if route.path.startswith("/v1/tasks") else "Error")
    return {"content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}}


def _named(schema: dict[str, Any]) -> dict[str, Any]:
    return {"$ref": "#/components/schemas/Health"} if schema is HEALTH else schema


def _beside(*parts: dict[str, Any]) -> dict[str, Any]:
    """One object holding the fields of each of ``parts`` (a later part's field wins)."""
    properties = {name: field for part in parts for name, field in part["properties"].items()}
    required = sorted({name for part in parts for name in part.get("required", ())})
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _operation_id(route: Route) -> str:
    words = route.path.strip("/").replace("{", "").replace("}", "").replace(".", "_").replace("/", "_")
    return f"{route.method}_{words or 'root'}"


def _members(union: Any) -> tuple[type[BaseModel], ...]:
    """The models of an ``Annotated[A | B | ..., Field(discriminator=...)]``."""
    return get_args(get_args(union)[0])


def _schemas() -> tuple[dict[str, Any], dict[Any, Any]]:
    wanted = {(r.request, "validation") for r in ROUTES if r.request is not None}
    wanted |= {(m, "serialization") for r in ROUTES for m in (r.answer, r.event, r.anthropic) if isinstance(m, type)}
    wanted |= {(m, "serialization") for r in ROUTES if isinstance(r.event, tuple) for m in _members(r.event[1])}
    refs, top = models_json_schema(sorted(wanted, key=lambda w: (w[0].__name__, w[1])), ref_template=REF)
    return top.get("$defs", {}), refs
