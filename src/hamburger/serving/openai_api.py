"""The OpenAI wire format the server speaks: request bodies, their validation, errors, and response shapes.

Validation happens here, before anything reaches the model, and every problem becomes an `ApiError`
whose body is OpenAI's: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    # Strict: "5" is not a number here. Unknown fields are kept (extra="allow") only so that `_refuse_unsupported`
    # can see them; the rest (user, metadata, store, ...) are ignored as OpenAI's clients send them.
    model_config = ConfigDict(strict=True, extra="allow")


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


class _Sampling(_Body):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    confidence: float | None = None  # HAMburger's extra: P(continue) a step needs to take another token
    # HAMburger's extra: "trust" (steps smashed, drafts kept), "verify" (drafts checked: the base's exact output) or
    # "compress" (drafts checked by a base that reads each past step as one merged KV entry; a 400 when the model
    # has no KV merger); None: the model's default mode
    mode: Literal["trust", "verify", "compress"] | None = None
    # vLLM's extra: go on past the end-of-sequence token (to max_tokens, a stop string or the row's KV entries), as
    # load and capacity benchmarks ask
    ignore_eos: bool = False

    def check(self) -> None:
        """Nothing asked for that would be silently ignored (the schema cannot say it)."""
        _refuse_unsupported(self.model_extra)

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class Message(_Body):
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


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]

    def prompt_value(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", "prompt")
            return self.prompt[0]
        if not self.prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        return self.prompt


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
