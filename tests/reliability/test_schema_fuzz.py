"""Schema fuzzing: schemathesis drives every operation of the running server's
``/openapi.json`` with generated requests (valid ones, and invalid ones wherever the document
declares inputs), a few examples per operation and a time budget, under every scheduling
policy; then every numeric field of the request bodies gets extreme numbers (beyond 64 bits,
at and past the 64-bit limits, the largest and tiniest floats, infinities, NaN).

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
"""Wall-clock bound of one policy's fuzzing pass; examples past it are skipped."""
POLICIES = {"fcfs": {}, "priority": {}, "slo": {"slo_ttft": 1.0}, "fair": {}}
"""Scheduling policies the server is fuzzed under, with the settings each needs."""
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


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_operation_survives_fuzzing(new_server: Callable[..., LiveServer],
                                          policy: str) -> None:
    server = new_server(scheduling_policy=policy, **POLICIES[policy])
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


EXTREMES: list[Any] = [10**400, -(10**400), 2**64, 2**63, 2**63 - 1, -(2**63), -(2**63) - 1,
                       1e308, -1e308, 5e-324, 1e-45, 1e-39, 1e-38, -0.0, -1, 0, 1,
                       float("inf"), float("-inf"), float("nan")]
"""Numbers at and past what 64-bit integers and doubles hold (JSON written by Python's
``json``, which spells the last three ``Infinity``, ``-Infinity`` and ``NaN``)."""
NUMERIC_FIELDS = {
    "/v1/completions": ["max_tokens", "temperature", "top_p", "n", "min_tokens", "seed",
                        "presence_penalty", "frequency_penalty", "top_k", "min_p",
                        "repetition_penalty", "priority", "slo_ttft", "slo_tpot", "logprobs",
                        "best_of", "stop_token_ids", "logit_bias", "prompt"],
    "/v1/chat/completions": ["max_completion_tokens", "top_logprobs", "temperature",
                             "priority", "seed"],
}
"""Fields that take numbers (``stop_token_ids``, ``logit_bias`` and ``prompt`` inside a list or
an object)."""


@pytest.mark.parametrize("policy", list(POLICIES))
def test_extreme_numbers_in_every_numeric_field(new_server: Callable[..., LiveServer],
                                                policy: str) -> None:
    """No number in any field is a 5xx; each is answered (200, or a 4xx in OpenAI's shape),
    and nothing is left behind."""
    import json

    server = new_server(scheduling_policy=policy, **POLICIES[policy])
    bases = {"/v1/completions": {"prompt": "hello world", "max_tokens": 2},
             "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2, "logprobs": True}}
    failures, statuses = [], Counter()
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as http:
        for path, fields in NUMERIC_FIELDS.items():
            for field in fields:
                for value in EXTREMES:
                    shaped = ([value] if field in ("stop_token_ids", "prompt") else
                              {"5": value} if field == "logit_bias" else value)
                    body = json.dumps({**bases[path], field: shaped})
                    r = http.post(f"{server.url}{path}", content=body,
                                  headers={"content-type": "application/json"})
                    statuses[r.status_code] += 1
                    if r.status_code >= 500 or (r.status_code >= 400
                                                and _error_shape_problem(r)):
                        failures.append(f"{path} {field}={value!r:.30}: {r.status_code} "
                                        f"{r.text[:200]}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
    assert statuses[200] and statuses[400], statuses  # both kinds of answer were reached
    assert_no_leaks(server)
