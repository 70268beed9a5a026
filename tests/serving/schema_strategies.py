"""Requests drawn from the server's own OpenAPI schema, and the checks of its answers against that schema.

Shared by the in-suite fuzz (tests/serving/test_openapi.py, in process on the tiny random model) and the long one
(benchmarks/fuzz_server.py, `hamburger serve` on the embedded default, which puts this folder on sys.path): one
generator and one verdict, so that the two fuzzes cannot drift apart. It imports nothing from the test suite.

`from_schema` draws bodies that a documented request schema allows; `cases` then often spoils them (a value of any
JSON type, a huge or odd-unicode string, an extra or refused field, a field removed, the JSON cut short).
`answer_problem` and `refusal_problem` say what is wrong with an answer: a 5xx, an undocumented status or body, a
body the schema rejects that was served, or one it accepts refused for a reason a schema could know.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st
from jsonschema import Draft202012Validator, validators
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from hamburger.serving.openai_api import (
    UNSUPPORTED,
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    CompletionRequest,
    TextCompletion,
    TextCompletionChunk,
)

# path: (the model its handler parses the body with, its answer, its stream's events)
ENDPOINTS = {"/v1/chat/completions": (ChatRequest, ChatCompletion, ChatCompletionChunk),
             "/v1/completions": (CompletionRequest, TextCompletion, TextCompletionChunk)}
# What a body the schema accepts may still be refused for (the field named by the error's param): the context, the
# chat template, the vocabulary (messages, prompt, max_tokens), an unknown model, compress without a KV merger.
BEYOND_THE_SCHEMA = {"messages", "prompt", "max_tokens", "model", "mode"}
# The checker's "integer" is a JSON integer: strict, the server refuses 5.0 where JSON Schema would take it.
_Checker = validators.extend(Draft202012Validator, type_checker=Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool)))


def checkers(doc: dict) -> dict[str, Draft202012Validator]:
    """A validator per component of the OpenAPI document `doc`, by name, its references resolved within it."""
    registry = Registry().with_resource("urn:openapi", Resource(contents=doc, specification=DRAFT202012))
    return {name: _Checker({"$ref": f"urn:openapi#/components/schemas/{name}"}, registry=registry)
            for name in doc["components"]["schemas"]}


def first_error(validator: Draft202012Validator, value) -> str | None:
    return next((error.message[:300] for error in validator.iter_errors(value)), None)


def answer_problem(doc: dict, check: dict, path: str, resp, stream: bool) -> str | None:
    """What is wrong with an answer (an httpx or TestClient response): a 5xx, an undocumented status or body, a
    stream that is not chunks then [DONE]; None when nothing is."""
    _, reply, chunk = ENDPOINTS[path]
    if resp.status_code >= 500 or str(resp.status_code) not in doc["paths"][path]["post"]["responses"]:
        return f"status {resp.status_code}: {resp.text[:300]}"
    if resp.status_code != 200:
        return first_error(check["ErrorResponse"], resp.json())
    if not stream:
        reply.model_validate(resp.json())
        return first_error(check[reply.__name__], resp.json())
    events = [e.removeprefix("data: ") for e in resp.text.split("\n\n") if e]
    if events[-1] != "[DONE]":
        return f"the stream ends with {events[-1][:200]}"
    for event in events[:-1]:
        chunk.model_validate_json(event)  # an error object mid-stream fails here: the stream's 5xx
        if error := first_error(check[chunk.__name__], json.loads(event)):
            return f"event {event[:200]}: {error}"
    return None


def refusal_problem(check: dict, path: str, raw: bytes, resp) -> str | None:
    """What is wrong with the status given the schema's verdict on the body; None when nothing is."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return None if resp.status_code == 400 else f"a body that is no JSON object got {resp.status_code}"
    refused = first_error(check[ENDPOINTS[path][0].__name__], body)
    if refused is not None and resp.status_code not in (400, 404):
        return f"the schema refuses it ({refused}) but the server answered {resp.status_code}"
    if refused is None and resp.status_code != 200 and resp.json()["error"]["param"] not in BEYOND_THE_SCHEMA:
        return f"the schema accepts it but the server refused it: {resp.text[:300]}"
    return None


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
ODD = st.text(st.characters(codec="utf-8"), min_size=1, max_size=30) | st.sampled_from(
    ["\u202e\u0000\ufeff", "w1\u0301\u200d w2", "\U0001f354" * 50, "<|im_start|>user\nw1<|im_end|>", "\\u0000"])
HUGE = st.sampled_from(["w3 ", "x", "\U0001f600", "é "]).map(lambda s: s * 30_000)


def from_schema(schema: dict, components: dict) -> st.SearchStrategy:
    """Values that `schema` allows, for the keywords the documented schemas use; `components` resolves references.
    (hypothesis-jsonschema does this in full, but no longer runs with current hypothesis.)"""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components))
    if "anyOf" in schema:  # the keywords beside anyOf (a minimum, say) hold for each of its schemas
        outer = {k: v for k, v in schema.items() if k != "anyOf"}
        return st.one_of([from_schema({**outer, **arm}, components) for arm in schema["anyOf"]])
    if "enum" in schema or "const" in schema:
        return st.sampled_from(schema["enum"]) if "enum" in schema else st.just(schema["const"])
    kind = schema["type"]
    if kind in ("null", "boolean", "string"):
        return {"null": st.none(), "boolean": st.booleans(),
                "string": st.text(min_size=schema.get("minLength", 0), max_size=12)}[kind]
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low = schema.get("exclusiveMinimum", schema.get("minimum"))
        return st.floats(low, schema.get("maximum"), exclude_min="exclusiveMinimum" in schema, allow_nan=False,
                         allow_infinity=False)
    if kind == "array":
        return st.lists(from_schema(schema["items"], components), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 3), 3))
    return _object(schema, components)


def _object(schema: dict, components: dict) -> st.SearchStrategy:
    """Its required properties, some of the others, and perhaps an unknown one where the schema allows those."""
    props = {name: from_schema(sub, components) for name, sub in schema.get("properties", {}).items()}
    required = set(schema.get("required", ()))
    known = st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                  optional={k: v for k, v in props.items() if k not in required})
    if schema.get("additionalProperties") is not True:
        return known
    unknown = st.dictionaries(st.text(max_size=8).filter(lambda k: k not in props), JSON, max_size=1)
    return st.tuples(known, unknown).map(lambda pair: {**pair[1], **pair[0]})


def request_schemas(doc: dict) -> dict[str, st.SearchStrategy]:
    """Per completion path, the bodies its documented request schema allows."""
    components = doc["components"]["schemas"]
    return {path: from_schema({"$ref": f"#/components/schemas/{schema.__name__}"}, components)
            for path, (schema, _, _) in ENDPOINTS.items()}


STRINGS = {"/v1/chat/completions": ["model", "stop", "mode"], "/v1/completions": ["model", "stop", "prompt"],
           "message": ["content", "role", "name"]}  # where a huge or odd string goes


@st.composite
def spoilt(draw, body: dict, path: str) -> dict:
    """`body` as drawn, or with one thing changed: a value of any type, a huge or odd string, an extra or refused
    field, a field removed; in a message, or in the body."""
    in_message = "messages" in body and draw(st.booleans())
    target = body["messages"][0] if in_message else body
    how = draw(st.sampled_from(["none", "none", "value", "huge", "odd", "extra", "refused", "remove"]))
    if how == "value":
        target[draw(st.sampled_from(sorted(target)))] = draw(JSON)
    elif how in ("huge", "odd"):
        key = draw(st.sampled_from(STRINGS["message" if in_message else path]))
        target[key] = draw(HUGE if how == "huge" else ODD)
    elif how == "extra":
        target[draw(st.text(min_size=1, max_size=12))] = draw(JSON)
    elif how == "refused":
        target[draw(st.sampled_from(sorted(UNSUPPORTED)))] = draw(JSON)
    elif how == "remove":
        target.pop(draw(st.sampled_from(sorted(target))))
    return body


LIMITS = ("max_tokens", "max_completion_tokens")


def _capped(body: dict, max_tokens: int) -> dict:
    """A spoilt body's limits brought back to at most `max_tokens` where they are integers a context could hold
    (larger ones stay: the server refuses them), and one limit if the spoiling removed both: a real model's
    context is long, and a fuzz of thousands of requests should not decode thousands of tokens for some."""
    for limit in LIMITS:
        value = body.get(limit)
        if isinstance(value, int) and not isinstance(value, bool) and max_tokens < value < 1_000_000:
            body[limit] = value % max_tokens + 1
    if not any(body.get(limit) is not None for limit in LIMITS):
        body["max_completion_tokens"] = max_tokens
    return body


@st.composite
def cases(draw, schemas: dict, served: str = "tiny", max_tokens: int = 6, capped: bool = False,
          streams: bool = False) -> tuple[str, bytes, bool]:
    """(path, raw body, stream): a body the schema allows, its model mostly `served` and its max_tokens at most
    `max_tokens`, then perhaps spoilt (`capped`: its limits kept small even then, `_capped`); sometimes cut short,
    or a JSON value that is no object. `streams`: about half the bodies ask for a stream (among ~30 optional
    fields, hypothesis rarely draws stream: true)."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    body = draw(schemas[path])
    if streams and draw(st.booleans()):
        body["stream"] = True
    body["model"] = draw(st.sampled_from([served, served, served, "default", body["model"]]))
    for limit in LIMITS:
        if limit in body and (body[limit] is None or body[limit] > max_tokens):
            body[limit] = draw(st.integers(1, max_tokens))
    body.setdefault("max_tokens", draw(st.integers(1, max_tokens)))
    body = draw(spoilt(body, path))
    if capped:
        body = _capped(body, max_tokens)
    raw = json.dumps(body, ensure_ascii=draw(st.booleans())).encode()
    shape = draw(st.sampled_from(["object"] * 18 + ["cut short", "no object"]))
    if shape == "cut short":
        return path, raw[: draw(st.integers(0, len(raw) - 1))], False
    if shape == "no object":
        return path, json.dumps(draw(JSON.filter(lambda v: not isinstance(v, dict)))).encode(), False
    return path, raw, body.get("stream") is True
