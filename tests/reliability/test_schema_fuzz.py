"""Schema fuzzing: schemathesis drives every operation of the running server's
``/openapi.json`` with generated requests (valid ones, and invalid ones wherever the document
declares inputs), a few examples per operation and a time budget.

It fails on any 5xx, any request that hangs, any error body not in OpenAI's error shape, any
invalid input that is not refused with a 4xx, any response that does not conform to the
document, and any KV block or request left behind afterwards.

The document is the contract, so the test is as strict as the document is precise, and
grows stricter with it by itself:

* undocumented status codes fail once an operation documents its error responses (any 4xx);
* content types, headers and bodies are checked against every response the document
  declares, except FastAPI's placeholder for an undeclared body (``application/json`` with
  the empty schema ``{}``), which says nothing to check;
* invalid inputs are generated for every operation with declared parameters or a request
  body, so declaring a request body turns on negative fuzzing of it.

Each tolerated gap is reported as a warning naming the operation and status.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import requests
from reliakit import assert_no_leaks
from serverkit import LiveServer

schemathesis = pytest.importorskip("schemathesis", minversion="4.0")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import load_all_checks  # noqa: E402

load_all_checks()
import schemathesis.checks as checks  # noqa: E402

EXAMPLES = int(os.environ.get("KVLOOP_FUZZ_EXAMPLES", "12"))
"""Examples per operation and generation mode (raise it for a deeper local run)."""
BUDGET_S = float(os.environ.get("KVLOOP_FUZZ_BUDGET_S", "30"))
"""Wall-clock bound of the whole fuzzing pass; examples past it are skipped."""
REQUEST_TIMEOUT_S = 60.0
"""A request not answered within this is a hang, and fails the test."""

SEEDS: dict[str, list[dict[str, Any]]] = {
    "POST /v1/completions": [
        {"prompt": "hello world", "max_tokens": 4},
        {"prompt": "hello world", "max_tokens": 4, "stream": True,
         "stream_options": {"include_usage": True}},
        {"prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 2, "stop": ["zz"]},
    ],
    "POST /v1/chat/completions": [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
         "logprobs": True, "top_logprobs": 2},
    ],
}
"""Valid bodies sent first to each operation that declares a request body, so that every
run checks both kinds of success response (JSON and server-sent events) against the
document, whatever the generator happens to produce."""

ALWAYS = [checks.not_a_server_error, checks.negative_data_rejection]
STATUS = [checks.status_code_conformance]
PER_RESPONSE = [checks.content_type_conformance, checks.response_headers_conformance,
                checks.response_schema_conformance]


def _resolve(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while isinstance(node, dict) and "$ref" in node:
        target: Any = doc
        for part in node["$ref"].lstrip("#/").split("/"):
            target = target[part]
        node = target
    return node


def _declared_response(doc: dict[str, Any], op: Any, status: int) -> dict[str, Any] | None:
    responses = op.definition.raw.get("responses", {})
    for key in (str(status), f"{str(status)[0]}XX", f"{str(status)[0]}xx", "default"):
        if key in responses:
            return _resolve(doc, responses[key])
    return None


def _is_placeholder(response: dict[str, Any]) -> bool:
    """FastAPI's default for a route returning a raw ``Response``: JSON of any shape."""
    content = response.get("content")
    return content == {"application/json": {"schema": {}}}


def _documents_errors(op: Any) -> bool:
    return any(str(k).startswith("4") or k == "default"
               for k in op.definition.raw.get("responses", {}))


def _has_inputs(op: Any) -> bool:
    raw = op.definition.raw
    return bool(raw.get("requestBody") or raw.get("parameters"))


def _error_shape_problem(response: Any) -> str | None:
    """OpenAI's error shape for every 4xx of the API: {"error": {message, type, param, code}}
    with ``code`` the status. ``None`` when it conforms."""
    try:
        body = response.json()
    except ValueError:
        return f"{response.status_code} with a body that is not JSON: {response.text[:200]!r}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not {"message", "type", "param", "code"} <= set(err):
        return f"{response.status_code} body not in OpenAI's error shape: {body!r:.300}"
    if err["code"] != response.status_code or not isinstance(err["message"], str):
        return f"{response.status_code} error code/message mismatch: {err!r:.300}"
    return None


def _fuzz(op: Any, mode: GenerationMode, exercise: Callable[[Any, Any], None]) -> None:
    """Run ``exercise(op, case)`` on up to ``EXAMPLES`` generated cases (reproducible)."""

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        exercise(op, case)

    with contextlib.suppress(Unsatisfiable):  # nothing of this mode to generate
        run()


def test_every_operation_survives_fuzzing(server: LiveServer) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.update(base_url=server.url)
    schema.config.output.sanitization.update(enabled=False)  # it hides "max_tokens" values
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions",
                                              "POST /v1/chat/completions"}

    deadline = time.monotonic() + BUDGET_S
    failures: list[str] = []
    tolerated: set[str] = set()
    sent: Counter[str] = Counter()
    session = requests.Session()

    def exercise(op: Any, case: Any) -> None:
        if time.monotonic() > deadline:
            return
        try:
            response = case.call(session=session, timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:  # a hang or a dropped connection
            failures.append(f"{op.label}: no response ({exc!r})\n{case.as_curl_command()}")
            return
        sent[f"{op.label} {response.status_code}"] += 1
        active = list(ALWAYS)
        declared = _declared_response(doc, op, response.status_code)
        if _documents_errors(op):
            active += STATUS
        elif declared is None:
            tolerated.add(f"{op.label} {response.status_code}: status undocumented")
        if declared is not None and not _is_placeholder(declared):
            active += PER_RESPONSE
        elif declared is not None:
            tolerated.add(f"{op.label} {response.status_code}: body left undeclared")
        try:
            case.validate_response(response, checks=active)
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis' FailureGroup
            failures.append(f"{op.label}:\n{exc}")
        if op.path.startswith("/v1/") and 400 <= response.status_code < 500:
            problem = _error_shape_problem(response)
            if problem:
                failures.append(f"{op.label}: {problem}\n{case.as_curl_command()}")

    for op in operations:
        if op.definition.raw.get("requestBody"):
            for body in SEEDS.get(op.label, []):
                exercise(op, op.Case(body=body, media_type="application/json"))
        modes = [GenerationMode.POSITIVE]
        if _has_inputs(op):
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            _fuzz(op, mode, exercise)

    session.close()
    print("statuses by operation:", dict(sorted(sent.items())))  # shown with -s
    assert sent, "no request was sent"
    assert not failures, f"{len(failures)} failures:\n\n" + "\n\n".join(failures[:20])
    assert_no_leaks(server)
    if tolerated:
        warnings.warn("OpenAPI document gaps the fuzzer could not check: "
                      + "; ".join(sorted(tolerated)), stacklevel=1)
