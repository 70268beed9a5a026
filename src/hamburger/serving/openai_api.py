"""The OpenAI wire format the server speaks: request bodies, their validation, errors, and response shapes.

Validation happens here, before anything reaches the model, and every problem becomes an `ApiError`
whose body is OpenAI's: {"error": {"message", "type", "param", "code"}}. The request models are also the request
bodies of the OpenAPI schema (`schemas`): what the schema adds beyond their types (the refused fields, a message's
required content, the ranges checked outside pydantic) says what `check` and the service decide, and
tests/serving/test_openapi.py holds the two to the same answers.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"  # where the OpenAPI document keeps the models of this module, by class name


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after: int | None = None) -> None:
        """`retry_after`: seconds, sent as the answer's Retry-After header (a 429), which clients' retries honour."""
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after

    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# The statuses the completion endpoints answer with an error object, and when (the OpenAPI schema documents them).
ERRORS = {
    400: "an invalid request: malformed JSON, a wrong type, a value out of range, a missing field, an unsupported "
         "field, a mode the model cannot run, messages its chat template refuses, or a prompt or max_tokens beyond "
         "the context (code context_length_exceeded)",
    401: "a missing or wrong API key, when the server has one (code invalid_api_key)",
    404: "an unknown model (code model_not_found)",
    429: "too many requests waiting for a batch row (code queue_full); retry after the seconds of its Retry-After "
         "header",
    500: "the model failed on this request's batch, or another fault of the server; see the server log",
}


class _Body(BaseModel):
    # Strict: "5" is not a number here. Unknown fields are kept (extra="allow") only so that `_refuse_unsupported`
    # can see them; the rest (user, metadata, store, ...) are ignored as OpenAI's clients send them.
    model_config = ConfigDict(strict=True, extra="allow")


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer field takes 5.0 too: JSON has one number type, and JSON Schema's "integer" is any number with no
# fractional part (clients that hold every number as a double send 5.0); 5.5 and "5" are still refused.
Integer = Annotated[int, BeforeValidator(_integral)]


# Fields OpenAI's clients (and vLLM's: top_k, min_p, repetition_penalty) may send that this server cannot honour,
# each with the values that ask for nothing. Any other value is a 400: a reply that silently ignored the request
# for more choices, log-probabilities, a JSON format, a penalty or a tool would look like a correct answer.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "top_k": (None, 0, -1), "min_p": (None, 0), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto"), "tool_calls": (None, []),
    "audio": (None,), "modalities": (None, ["text"]), "web_search_options": (None,),
}


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # Booleans apart: in Python False == 0, but completions' logprobs: 0 asks for the chosen tokens' log-probabilities.
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)


def _document_unsupported(schema: dict[str, Any]) -> None:
    """The refused fields in a model's JSON schema too, each with the values `_refuse_unsupported` lets pass (JSON
    schema's equality is `_neutral`'s: false is not 0). A declared field of the same name is left as it is."""
    for name, neutral in UNSUPPORTED.items():
        schema["properties"].setdefault(name, {"enum": list(neutral), "description": "not supported by this server: "
                                               "accepted only as one of these values, which ask for nothing"})


def _refuse_unsupported(fields: dict[str, Any] | None, where: str = "") -> None:
    for name, value in (fields or {}).items():
        if name in UNSUPPORTED and not _neutral(value, neutral := UNSUPPORTED[name]):
            sent = json.dumps(value)
            sent = sent if len(sent) <= 40 else sent[:37] + "..."  # a list of tools can be long
            allowed = " or ".join(json.dumps(n) for n in neutral if n is not None)
            raise ApiError(400, f"{where}{name}={sent} is not supported by this server: leave it out"
                           + (f" or send {allowed}" if allowed else ""), f"{where}{name}")


class StreamOptions(_Body):
    include_usage: bool = False


_AT_LEAST_ONE = {"minimum": 1}  # documented here, checked by `_Sampling.check` in its own words


class _Sampling(_Body):
    model_config = ConfigDict(json_schema_extra=_document_unsupported)

    model: str = Field(description="a name from GET /v1/models (another is a 404)")
    max_tokens: Integer | None = Field(None, json_schema_extra=_AT_LEAST_ONE, description=(
        "new tokens at most; default: the rest of the row; beyond the row's room for this prompt (its KV entries "
        "less the prompt's, in the request's mode) a 400 context_length_exceeded"))
    max_completion_tokens: Integer | None = Field(None, json_schema_extra=_AT_LEAST_ONE,
                                              description="max_tokens under its newer name; wins when both are sent")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0, null or below 1e-5: greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # torch's generators take seeds in this range; past it, a sampled request failed its whole batch
    seed: Annotated[int, Field(ge=-2**63, le=2**64 - 1), BeforeValidator(_integral)] | None = None
    stop: str | list[str] | None = Field(None, description="text that ends the reply (not included in it)")
    stream: bool | None = Field(False, description="server-sent events, one per macro-step, then data: [DONE]")
    stream_options: StreamOptions | None = None
    confidence: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1}, description=(
        "HAMburger's extra: the P(continue) a step needs to take another token; default: the server's (trust) or "
        "the checkpoint's (verify, compress)"))
    mode: Literal["trust", "verify", "compress"] | None = Field(None, description=(
        "HAMburger's extra: trust (steps smashed, drafts kept), verify (drafts checked: the base's exact output) or "
        "compress (drafts checked by a base that reads each past step as one merged KV entry; a 400 when the model "
        "has no KV merger); default: the server's (serve --mode, else the checkpoint's)"))
    ignore_eos: bool = Field(False, description=(
        "vLLM's extra: go on past the end-of-sequence token (to max_tokens, a stop string or the row's KV entries), "
        "as load and capacity benchmarks ask"))

    def check(self) -> None:
        """Nothing asked for that would be silently ignored, and no limit below one (the types cannot say it)."""
        _refuse_unsupported(self.model_extra)
        for name in ("max_tokens", "max_completion_tokens"):
            if (value := getattr(self, name)) is not None and value <= 0:
                raise ApiError(400, f"{name} must be >= 1, got {value}", name)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


def _document_message(schema: dict[str, Any]) -> None:
    """A message's schema as `Message.check` decides: content required, a string or a list of text parts (the
    model takes null and a missing content so that `check` can say what is wrong); the refused fields."""
    text_part = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                 "required": ["type", "text"]}
    schema["required"] = ["role", "content"]
    schema["properties"]["content"] = {"title": "Content", "anyOf": [
        {"type": "string"}, {"type": "array", "items": text_part}]}
    _document_unsupported(schema)


class Message(_Body):
    model_config = ConfigDict(json_schema_extra=_document_message)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None  # None here so that `check` can say what is wrong

    def check(self, where: str) -> None:
        """Content is required (no tool calls here to stand in for it): a string or a list of text parts."""
        if self.content is None:
            got = "null" if "content" in self.model_fields_set else "missing"
            raise ApiError(400, f"{where}.content: a {self.role} message needs content, a string or a list of text "
                           f"parts (it is {got})", f"{where}.content")
        if isinstance(self.content, list) and any(
                part.get("type") != "text" or not isinstance(part.get("text"), str) for part in self.content):
            raise ApiError(400, "only text content parts are supported", f"{where}.content")
        _refuse_unsupported(self.model_extra, f"{where}.")

    def text(self) -> str:
        """Content as text: the string, or its text parts joined (`check` has passed)."""
        return self.content if isinstance(self.content, str) else "".join(part["text"] for part in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)

    def check(self) -> None:
        super().check()
        for i, message in enumerate(self.messages):
            message.check(f"messages.{i}")


# What `prompt_value` and the service take: a non-empty string, one string in a list, or token ids (each below the
# model's vocabulary size).
_PROMPTS = {"anyOf": [{"type": "string", "minLength": 1},
                      {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
                      {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]}


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Integer] = Field(json_schema_extra=_PROMPTS)

    def prompt_value(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        return prompt


def parse(raw: bytes, schema: type[_Sampling]) -> _Sampling:
    """The body as `schema`, or an ApiError naming the first problem."""
    try:
        body = schema.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            raise ApiError(400, f"the request body is not valid JSON: {err['msg']}") from None
        if err["type"] == "model_type":
            raise ApiError(400, "the request body must be a JSON object") from None
        param = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param) from None
    body.check()
    return body


def check_limits(prompt_tokens: int, max_tokens: int | None, context: int, param: str, room: int | None = None,
                 mode: str | None = None) -> int:
    """max_tokens checked against the context (None: all that is left of it); `room`: the most new tokens a row
    holds for this prompt in its `mode` (the scheduler's rows are sized in KV entries: a mode that keeps one entry
    per step holds a longer reply), when it differs from the context's."""
    if prompt_tokens >= context:
        raise ApiError(400, f"the prompt has {prompt_tokens} tokens; this server's context is {context}", "messages"
                       if param == "messages" else "prompt", "context_length_exceeded")
    room = context - prompt_tokens if room is None else room
    if max_tokens is None:
        return room
    if max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
    if max_tokens > room:
        where = f" in {mode} mode" if mode else ""
        raise ApiError(400, f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceed this server's "
                       f"context of {context} KV entries{where}: at most {room} new tokens with this prompt",
                       "max_tokens", "context_length_exceeded")
    return max_tokens


class _Shape(BaseModel):
    """A response shape, for the schema: `Reply` and `ApiError` build the objects, these say what they hold (no
    other keys: tests/serving/test_openapi.py checks every answer against them)."""

    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Shape):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error or server_error")
    param: str | None = Field(description="the field at fault, as a dotted path (messages.0.content)")
    code: str | None


class ErrorResponse(_Shape):
    error: ErrorDetail


class Usage(_Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    macro_steps: int = Field(description="HAMburger's: base forwards after the prefill")
    tokens_per_step: float = Field(description="HAMburger's: completion tokens per macro-step")
    kv_entries: int = Field(description="HAMburger's: KV-cache entries per layer the request held at its end")


Finish = Literal["stop", "length"]


class AssistantMessage(_Shape):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Shape):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: Finish


class StepInfo(_Shape):
    """Non-standard, ignored by OpenAI's clients: the macro-step of a streamed chunk."""

    tokens: int = Field(description="the step's tokens")
    prompt_tokens: int


class _Reply(_Shape):
    """What every answer of the completion endpoints carries, whole or streamed."""

    id: str
    created: int
    model: str


class _Chunk(_Reply):
    """What every server-sent event of a stream carries besides its choices."""

    usage: Usage | None = Field(None, description="in the last chunk only, with stream_options.include_usage")
    hamburger: StepInfo | None = Field(None, description="in each step's chunk")


class ChatCompletion(_Reply):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Shape):
    role: Literal["assistant"] = Field("assistant", description="in the first chunk only")
    content: str


class ChatChunkChoice(_Shape):
    index: int
    delta: Delta
    logprobs: None
    finish_reason: Finish | None = Field(description="null until the last step's chunk")


class ChatCompletionChunk(_Chunk):
    """One server-sent event of a chat stream: a macro-step's text, or with stream_options.include_usage, after the
    last step, empty choices and the usage."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


class TextChoice(_Shape):
    index: int
    text: str
    logprobs: None
    finish_reason: Finish


class TextCompletion(_Reply):
    object: Literal["text_completion"]
    choices: list[TextChoice]
    usage: Usage


class TextChunkChoice(TextChoice):
    finish_reason: Finish | None = Field(description="null until the last step's chunk")


class TextCompletionChunk(_Chunk):
    """One server-sent event of a completions stream, as `ChatCompletionChunk`."""

    object: Literal["text_completion"]
    choices: list[TextChunkChoice]


REQUESTS = (ChatRequest, CompletionRequest)
RESPONSES = (ChatCompletion, ChatCompletionChunk, TextCompletion, TextCompletionChunk, ErrorResponse)


def schemas() -> dict[str, dict]:
    """The JSON schemas of the request and response models and of those they hold, by class name, referring to each
    other at `REF`: OpenAPI's components. The request models' are the very schemas of the models `parse` uses."""
    models = [(m, "validation") for m in REQUESTS] + [(m, "serialization") for m in RESPONSES]
    return models_json_schema(models, ref_template=REF)[1]["$defs"]


class Reply:
    """The response objects of one request: chat.completion(.chunk) or text_completion."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _wrap(self, obj: str, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def chunk(self, text: str, finish_reason: str | None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._wrap("chat.completion.chunk", [choice])
        return self._wrap("text_completion", [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}])

    def usage_chunk(self, usage: dict) -> dict:
        return self._wrap("chat.completion.chunk" if self.chat else "text_completion", [], usage)

    def full(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return self._wrap("chat.completion", [choice], usage)
        return self._wrap("text_completion", [{"index": 0, "text": text, "logprobs": None,
                                               "finish_reason": finish_reason}], usage)


def usage(stats) -> dict:
    """OpenAI's usage plus HAMburger's macro-steps, tokens per step and KV entries (`stats.GenerationStats`)."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens, "macro_steps": stats.macro_steps,
            "tokens_per_step": round(stats.tokens_per_step, 4), "kv_entries": stats.kv_entries}
