"""The OpenAPI schema at /openapi.json: it documents both completion endpoints' request bodies (the very models their
handlers parse with) and answers, and a schema-driven fuzz holds the server to it.

The fuzz draws request bodies from the documented request schemas, then often spoils them (a value of any JSON type,
a huge or odd-unicode string, an extra or refused field, a field removed, the JSON cut short) and sends them in
process to the tiny random model. Each answer must be no 5xx, and either a response that its documented model
accepts or a documented error object; a body the schema rejects must be refused, and one it accepts may only fail
on what a schema cannot know (the context, the chat template, the vocabulary, the model name, a mode the model
lacks). The generator and the checks are in schema_strategies.py, shared with benchmarks/fuzz_server.py (the long
fuzz of `hamburger serve` on the embedded default).
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schema_strategies import ENDPOINTS, answer_problem, cases, checkers, refusal_problem, request_schemas
from test_server import CONFIDENCE, KEY, messages

import hamburger.serving.server as server_module
from conftest import VOCAB, hamburger
from hamburger.serving.openai_api import ERRORS, REF, ChatRequest, ErrorResponse
from hamburger.serving.server import BackgroundServer, Service, create_app

ROOT = Path(__file__).resolve().parents[2]


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
def check(doc) -> dict:
    """A validator per component of the OpenAPI document, by name, its references resolved within the document."""
    return checkers(doc)


def ref(model: type) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def test_openapi_documents_both_request_bodies_and_their_answers(doc):
    components = doc["components"]["schemas"]
    for path, (schema, reply, chunk) in ENDPOINTS.items():
        operation = doc["paths"][path]["post"]
        assert operation["requestBody"] == {"required": True, "content": {"application/json": {"schema": ref(schema)}}}
        ok = operation["responses"]["200"]["content"]
        assert ok["application/json"]["schema"] == ref(reply)
        data = ok["text/event-stream"]["schema"]["properties"]["data"]["anyOf"]
        assert data == [{"const": "[DONE]"}, {"contentMediaType": "application/json",
                                              "contentSchema": {"anyOf": [ref(chunk), ref(ErrorResponse)]}}]
        for status in ERRORS:
            assert operation["responses"][str(status)]["content"]["application/json"]["schema"] == ref(ErrorResponse)
        for model, mode in ((schema, "validation"), (reply, "serialization"), (chunk, "serialization"),
                            (ErrorResponse, "serialization")):
            expected = model.model_json_schema(ref_template=REF, mode=mode)
            for name, definition in expected.pop("$defs", {}).items():
                assert components[name] == definition, name
            if model is schema:  # one of this server's models (another is a 404), a mode its model runs (no merger)
                expected["properties"]["model"]["enum"] = ["tiny", "default"]
                next(o for o in expected["properties"]["mode"]["anyOf"] if "enum" in o)["enum"] = ["trust", "verify"]
                if "prompt" in expected["properties"]:  # token ids below the model's vocabulary
                    ids = next(o for o in expected["properties"]["prompt"]["anyOf"] if o.get("items", {}).get(
                        "type") == "integer")
                    ids["items"]["maximum"] = VOCAB - 1
            assert components[model.__name__] == expected, model.__name__
    props = components["ChatRequest"]["properties"]
    assert props["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0}
    assert props["confidence"]["exclusiveMinimum"] == 0 and props["max_tokens"]["minimum"] == 1
    assert props["n"]["enum"] == [None, 1] and components["Message"]["properties"]["tool_calls"]["enum"] == [None, []]
    assert components["Message"]["required"] == ["role", "content"]


def test_a_wrong_method_is_a_405_with_allow_and_metrics_are_documented_as_text(client, doc):
    """What schemathesis 4.32 flagged: a 405 without the Allow header RFC 9110 asks for, /metrics documented as
    JSON while it answers Prometheus' text format, an empty prompt refused under max_tokens' name."""
    answer = client.request("TRACE", "/health")
    assert answer.status_code == 405 and answer.headers["allow"] == "GET"
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    empty = client.post("/v1/completions", json={"model": "tiny", "prompt": "", "max_tokens": 2})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"  # not max_tokens


def test_integers_sent_as_whole_floats_are_taken_and_an_empty_prompt_in_a_list_is_refused(client):
    """What schemathesis 4.32 flagged next: JSON Schema's integer is any number without a fraction (5.0 is one), so
    max_tokens 5.0 is five tokens and 5.5 is refused; [""] is an empty prompt, refused as "" is."""
    body = {"model": "tiny", "prompt": "w1 w2", "seed": 3.0}
    taken = client.post("/v1/completions", json={**body, "max_tokens": 5.0, "ignore_eos": True})
    assert taken.status_code == 200 and taken.json()["usage"]["completion_tokens"] == 5
    ids = client.post("/v1/completions", json={**body, "prompt": [3.0, 4], "max_tokens": 1})
    assert ids.status_code == 200 and ids.json()["usage"]["prompt_tokens"] == 2
    for wrong, param in (({"max_tokens": 5.5}, "max_tokens"), ({"max_tokens": "5"}, "max_tokens"),
                         ({"prompt": [""], "max_tokens": 2}, "prompt")):
        refused = client.post("/v1/completions", json={**body, **wrong})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


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


def test_fuzz_from_the_schema_no_5xx_and_every_answer_documented(client, doc, check):
    schemas = request_schemas(doc)
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
    assert seen[200] >= 20 and seen[400] >= 20, seen  # both sides of the schema were reached (the mix varies)
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


def test_a_full_queue_answers_429_with_retry_after(monkeypatch):
    """One row, one place in the queue: a third request is refused with 429 queue_full and a Retry-After header (in
    seconds, as the OpenAPI document says), so that clients' retries wait; the first two are served."""
    service = Service(hamburger("llama", k=4), "tiny", max_batch_size=1, max_queue=1, max_len=64,
                      default_confidence=CONFIDENCE)
    step = service.scheduler.step  # 100 ms a step: the first request surely holds its row until the third is refused
    monkeypatch.setattr(service.scheduler, "step", lambda: time.sleep(0.1) or step())
    body = {"model": "tiny", "messages": messages(1), "max_tokens": 30, "stream": True, "ignore_eos": True}
    with BackgroundServer(service) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as running:
            next(running.iter_lines())  # it holds the row
            with client.stream("POST", "/v1/chat/completions", json=body) as waiting:
                assert waiting.status_code == 200 and service.scheduler.waiting == 1
                refused = client.post("/v1/chat/completions", json={**body, "stream": False})
                assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
                assert int(refused.headers["Retry-After"]) >= 1
                assert [line for line in waiting.iter_lines() if line][-1] == "data: [DONE]"
        doc = client.get("/openapi.json").json()
    assert "Retry-After" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]["429"]["headers"]


def test_the_long_fuzz_draws_every_endpoint_with_small_limits(doc):
    """benchmarks/fuzz_server.py (the long fuzz of `hamburger serve`, sharing schema_strategies.py with this file):
    its cases reach every documented path, GETs and wrong methods included, a share of them (a fifth to a third) stream, and no
    body the server could take asks for more than its max_tokens (so thousands of requests decode little)."""
    spec = importlib.util.spec_from_file_location("fuzz_server", ROOT / "benchmarks" / "fuzz_server.py")
    fuzz = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fuzz)
    todo = fuzz.all_cases(doc, 300, 1, 8)
    assert len(todo) == 300 and {path.split("?")[0] for _, path, _, _ in todo} >= set(doc["paths"])
    assert {method for method, *_ in todo} >= {"GET", "POST", "DELETE"}
    bodies = [json.loads(raw) for method, _, raw, _ in todo if method == "POST" and raw.startswith(b"{")
              and raw.endswith(b"}")]
    limits = [b.get(k) for b in bodies if isinstance(b, dict) for k in ("max_tokens", "max_completion_tokens")]
    assert all(not isinstance(n, int) or isinstance(n, bool) or n <= 8 or n >= 1_000_000 for n in limits)
    assert 0.1 < sum(stream for *_, stream in todo) / len(todo) < 0.6  # the draw varies with the code tree
