"""``/openapi.json`` declares the request bodies (from the pydantic models) and the error
responses (the OpenAI error shape) of every route, and what it says holds: the documented
ranges are the ones the server enforces, errors match ``ErrorResponse``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serverkit import LiveServer

from kvloop.server.errors import ErrorResponse

POSTS = {"/v1/completions": "CompletionRequest",
         "/v1/chat/completions": "ChatCompletionRequest"}
ERROR_REF = "#/components/schemas/ErrorResponse"


@pytest.fixture(scope="module")
def doc(server: LiveServer) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/openapi.json")
    assert r.status_code == 200
    return r.json()


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_every_reference_resolves(doc: dict[str, Any]) -> None:
    schemas = doc["components"]["schemas"]
    refs = set(_refs(doc))
    assert refs
    for ref in refs:
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.rsplit("/", 1)[1] in schemas, ref
    assert "HTTPValidationError" not in schemas  # no FastAPI 422s: errors are 400s


def test_request_bodies_come_from_the_models(doc: dict[str, Any]) -> None:
    from kvloop.server.protocol import ChatCompletionRequest, CompletionRequest

    schemas = doc["components"]["schemas"]
    for path, name in POSTS.items():
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{name}"}
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert set(schemas["CompletionRequest"]["properties"]) == set(CompletionRequest.model_fields)
    assert set(schemas["ChatCompletionRequest"]["properties"]) == set(
        ChatCompletionRequest.model_fields)
    assert schemas["CompletionRequest"]["additionalProperties"] is False  # unknown: 400


@pytest.mark.parametrize(("path", "method", "statuses"), [
    ("/v1/completions", "post", (400, 401, 404, 413, 429, 500, 503)),
    ("/v1/chat/completions", "post", (400, 401, 404, 413, 429, 500, 503)),
    ("/v1/models", "get", (401, 413)),
    ("/health", "get", (413, 503)),
    ("/version", "get", (413,)),
    ("/metrics", "get", (413,)),
])
def test_error_responses_are_declared(doc: dict[str, Any], path: str, method: str,
                                      statuses: tuple[int, ...]) -> None:
    responses = doc["paths"][path][method]["responses"]
    assert "422" not in responses
    for status in statuses:
        entry = responses[str(status)]
        assert entry["description"]
        assert entry["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}
    if "429" in responses:
        assert "Retry-After" in responses["429"]["headers"]


def test_success_responses(doc: dict[str, Any]) -> None:
    health = doc["paths"]["/health"]["get"]["responses"]["200"]["content"]["application/json"]
    assert health["schema"] == {"$ref": "#/components/schemas/HealthStatus"}
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    for path in POSTS:
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content)


def test_error_bodies_match_the_documented_model(server: LiveServer) -> None:
    for r in (httpx.post(f"{server.base_url}/completions", json={"prompt": ""}),
              httpx.get(f"{server.base_url}/nothing"),
              httpx.put(f"{server.base_url}/completions"),
              httpx.post(f"{server.base_url}/chat/completions", json={"messages": []})):
        assert r.status_code >= 400
        ErrorResponse.model_validate(r.json())


def _bounds(doc: dict[str, Any], model: str) -> Iterator[tuple[str, str, float]]:
    for name, prop in doc["components"]["schemas"][model]["properties"].items():
        for key in ("minimum", "maximum", "exclusiveMinimum"):
            if key in prop:
                yield name, key, prop[key]


def test_documented_ranges_are_enforced(server: LiveServer, doc: dict[str, Any]) -> None:
    """Just outside a documented bound is a 400 naming the field; on an inclusive bound the
    field is accepted."""
    checked = 0
    for model, path, base in (
        ("CompletionRequest", "/completions", {"prompt": "hi"}),
        ("ChatCompletionRequest", "/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}),
    ):
        for field, key, bound in _bounds(doc, model):
            prop = doc["components"]["schemas"][model]["properties"][field]
            is_int = any(t.get("type") == "integer" for t in prop.get("anyOf", [prop]))
            step = 1 if is_int else max(1e-3, abs(bound) / 2)
            outside = bound - step if key != "maximum" else bound + step
            if not is_int and key == "minimum" and bound > 0:
                outside = bound / 2  # NOTE: still positive, so only the bound refuses it
            body = {"max_tokens": 1, **base, field: outside}
            r = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
            if key != "exclusiveMinimum":
                on = {"max_tokens": 1, **base, field: bound}
                r = httpx.post(f"{server.base_url}{path}", json=on, timeout=30)
                if r.status_code != 200:  # e.g. max_tokens needs room: another field's 400
                    assert r.json()["error"]["param"] != field, (field, r.text)
            checked += 1
    assert checked >= 20


def test_api_key_declares_bearer_security(new_server) -> None:
    live = new_server(api_key="k")
    doc = httpx.get(f"{live.url}/openapi.json").json()  # the document needs no key
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearerAuth": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
