"""The OpenAPI schema at /openapi.json: it documents both completion endpoints' request bodies (the very models their
handlers parse with) and answers, and a schema-driven fuzz holds the server to it.

The fuzz draws request bodies from the documented request schemas (`from_schema`), then often spoils them
(a value of any JSON type, a huge or odd-unicode string, an extra or refused field, a field removed, the JSON cut
short) and sends them in process to the tiny random model. Each answer must be no 5xx, and either a response that
its documented model accepts or a documented error object; a body the schema rejects must be refused, and one it
accepts may only fail on what a schema cannot know (the context, the chat template, the vocabulary, the model
name, a mode the model lacks).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator, validators
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012
from test_server import CONFIDENCE, KEY, messages

import hamburger.serving.server as server_module
from conftest import hamburger
from hamburger.serving.openai_api import (
    ERRORS,
    REF,
    UNSUPPORTED,
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    CompletionRequest,
    ErrorResponse,
    TextCompletion,
    TextCompletionChunk,
)
from hamburger.serving.server import Service, create_app

# path: (the model its handler parses the body with, its answer, its stream's events)
ENDPOINTS = {"/v1/chat/completions": (ChatRequest, ChatCompletion, ChatCompletionChunk),
             "/v1/completions": (CompletionRequest, TextCompletion, TextCompletionChunk)}
# What a body the schema accepts may still be refused for (the field named by the error's param): the context, the
# chat template, the vocabulary (messages, prompt, max_tokens), an unknown model, compress without a KV merger.
BEYOND_THE_SCHEMA = {"messages", "prompt", "max_tokens", "model", "mode"}
# The checker's "integer" is a JSON integer: strict, the server refuses 5.0 where JSON Schema would take it.
_Checker = validators.extend(Draft202012Validator, type_checker=Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool)))


@pytest.fixture(scope="module")
def client():
    service = Service(hamburger("llama", k=4), "tiny", max_batch_size=4, max_len=128,
                      default_confidence=CONFIDENCE, api_key=KEY)
    with TestClient(create_app(service), headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def doc(client) -> dict:
    return client.get("/openapi.json").json()


@pytest.fixture(scope="module")
def check(doc) -> dict[str, Draft202012Validator]:
    """A validator per component of the OpenAPI document, by name, its references resolved within the document."""
    registry = Registry().with_resource("urn:openapi", Resource(contents=doc, specification=DRAFT202012))
    return {name: _Checker({"$ref": f"urn:openapi#/components/schemas/{name}"}, registry=registry)
            for name in doc["components"]["schemas"]}


def ref(model: type) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def test_openapi_documents_both_request_bodies_and_their_answers(doc):
    components = doc["components"]["schemas"]
    for path, (schema, reply, chunk) in ENDPOINTS.items():
        operation = doc["paths"][path]["post"]
        assert operation["requestBody"] == {"required": True, "content": {"application/json": {"schema": ref(schema)}}}
        ok = operation["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == ref(reply)
        assert ok["text/event-stream"]["schema"]["x-event-data"] == ref(chunk)
        for status in ERRORS:
            assert operation["responses"][str(status)]["content"]["application/json"]["schema"] == ref(ErrorResponse)
        for model, mode in ((schema, "validation"), (reply, "serialization"), (chunk, "serialization"),
                            (ErrorResponse, "serialization")):
            expected = model.model_json_schema(ref_template=REF, mode=mode)
            for name, definition in expected.pop("$defs", {}).items():
                assert components[name] == definition, name
            assert components[model.__name__] == expected, model.__name__
    props = components["ChatRequest"]["properties"]
    assert props["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0}
    assert props["confidence"]["exclusiveMinimum"] == 0 and props["max_tokens"]["minimum"] == 1
    assert props["n"]["enum"] == [None, 1] and components["Message"]["properties"]["tool_calls"]["enum"] == [None, []]
    assert components["Message"]["required"] == ["role", "content"]


def test_the_handlers_parse_with_the_documented_models(client, doc, monkeypatch):
    parsed = []
    parse = server_module.parse
    monkeypatch.setattr(server_module, "parse", lambda raw, schema: parsed.append(schema) or parse(raw, schema))
    for path, (schema, _, _) in ENDPOINTS.items():
        body = {"model": "tiny", "max_tokens": 2, **({"messages": messages(1)} if schema is ChatRequest
                                                       else {"prompt": "w1 w2"})}
        assert client.post(path, json=body).status_code == 200
        documented = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert parsed.pop() is schema and documented == REF.format(model=schema.__name__)


def first_error(validator: Draft202012Validator, value) -> str | None:
    return next((error.message[:300] for error in validator.iter_errors(value)), None)


def answer_problem(doc: dict, check: dict, path: str, resp, stream: bool) -> str | None:
    """What is wrong with an answer: a 5xx, an undocumented status or body, a stream that is not chunks then
    [DONE]; None when nothing is."""
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


@st.composite
def cases(draw, schemas: dict) -> tuple[str, bytes, bool]:
    """(path, raw body, stream): a body the schema allows, its model mostly the served one and its max_tokens
    small, then perhaps spoilt; sometimes cut short, or a JSON value that is no object."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    body = draw(schemas[path])
    body["model"] = draw(st.sampled_from(["tiny", "tiny", "tiny", "default", body["model"]]))
    for limit in ("max_tokens", "max_completion_tokens"):
        if limit in body and (body[limit] is None or body[limit] > 6):
            body[limit] = draw(st.integers(1, 6))
    body.setdefault("max_tokens", draw(st.integers(1, 6)))
    body = draw(spoilt(body, path))
    raw = json.dumps(body, ensure_ascii=draw(st.booleans())).encode()
    shape = draw(st.sampled_from(["object"] * 18 + ["cut short", "no object"]))
    if shape == "cut short":
        return path, raw[: draw(st.integers(0, len(raw) - 1))], False
    if shape == "no object":
        return path, json.dumps(draw(JSON.filter(lambda v: not isinstance(v, dict)))).encode(), False
    return path, raw, body.get("stream") is True


def test_fuzz_from_the_schema_no_5xx_and_every_answer_documented(client, doc, check):
    components = doc["components"]["schemas"]
    schemas = {path: from_schema(ref(schema), components) for path, (schema, _, _) in ENDPOINTS.items()}
    seen = Counter()

    @settings(max_examples=300, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=cases(schemas))
    def one(case):
        path, raw, stream = case
        resp = client.post(path, content=raw, headers={"Content-Type": "application/json"})
        seen[resp.status_code] += 1
        problem = answer_problem(doc, check, path, resp, stream) or refusal_problem(check, path, raw, resp)
        assert problem is None, f"{path} {raw[:500]!r}: {problem}"

    one()
    assert seen[200] >= 50 and seen[400] >= 50, seen  # both sides of the schema were reached
    body = {"model": "tiny", "messages": messages(2), "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=body).json()["usage"]["completion_tokens"] >= 1
    assert client.get("/health").json()["running"] == 0


def test_errors_of_each_kind_are_documented_error_objects(client, check):
    body = {"model": "tiny", "messages": messages(1), "max_tokens": 2}
    answers = [client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}),
               client.post("/v1/chat/completions", json={**body, "model": "nope"}),
               client.post("/v1/chat/completions", json={**body, "n": 2}),
               client.post("/v1/completions", content=b"{", headers={"Content-Type": "application/json"})]
    assert [a.status_code for a in answers] == [401, 404, 400, 400]
    for answer in answers:
        assert check["ErrorResponse"].is_valid(answer.json()), answer.text
