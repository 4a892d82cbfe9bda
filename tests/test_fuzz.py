"""Fuzzing the gateway's edge, against a standalone mocker server (`dynctl mocker`: the real gateway over a
mocker worker in one process, at 1000x so generations take no time):

- schemathesis (an OpenAPI fuzzer) generates requests from the gateway's own `/openapi.json`, valid and
  invalid, for both completion routes: no answer may be a 5xx, and every answer must be one the document
  publishes (status code, content type, JSON body schema); an invalid request must be refused (4xx).
  The document is the served one with the model pinned to the served model and `max_tokens`, `n` and the
  prompts bounded, so a valid request generates a few tokens, not a context's worth.
- Hypothesis throws raw bytes at the HTTP server (random bytes, and valid requests cut, spliced and
  corrupted), and after each a normal request on a fresh connection must still be answered.
"""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import FUZZ_SEED, banner_port, needs, stop_by_sigint, wait_for_line
from hypothesis import given, seed
from hypothesis import strategies as st

MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152
REPO = Path(__file__).resolve().parents[1]
# The thorough profile's budget (`--fuzz-profile thorough`): 260 x 2 routes x 2 modes (valid, invalid), over
# 1,000 requests, and 150 raw byte strings; `make test` runs a share of it (`fuzz_budget`), seeded by the commit.
EXAMPLES_PER_MODE = 260
RAW_EXAMPLES = 150


@pytest.fixture(scope="module")
@needs('fleet')
def server() -> Iterator[str]:
    """A standalone mocker server on a free port; its base URL. Its stderr must show no traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "DYN_WORKER_METRICS": "false", "DYN_MAX_QUEUE": "64"}
    process = subprocess.Popen([sys.executable, "-m", "dynserve.cli.mocker", "--profile", "cpu", "--speedup", "1000",
                                "--http-port", "0", "--log-level", "ERROR"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        banner = wait_for_line(process, "is serving", 120)
        yield f"http://127.0.0.1:{banner_port(banner)}"
    finally:
        code, rest = stop_by_sigint(process)
    assert code == 0 and "Traceback" not in rest, rest


# fields the schema declares (OpenAI defines them) whose non-default values dynserve answers 400, naming them
_UNSUPPORTED = ["logit_bias", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
                "response_format", "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
                "verbosity", "no_stop_trim", "skip_special_tokens", "return_hidden_states", "stream_options"]
# output constraints (vLLM's extensions): a value drawn at random is almost always a malformed one (a 400)
_CONSTRAINTS = ["structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"]
_REFUSED = {"ChatCompletionRequest": [*_UNSUPPORTED, *_CONSTRAINTS, "continue_final_message"],
            "CompletionRequest": [*_UNSUPPORTED, *_CONSTRAINTS, "echo", "suffix", "best_of"]}


def _pinned(document: dict[str, Any], *, bounded: bool) -> dict[str, Any]:
    """The served document with the completion routes only and the served model's limits (its name, its
    vocabulary); `bounded`, also the work a request asks bounded and refused fields left out. (Invalid requests
    come from the document without those bounds, which the server does not enforce.)"""
    document = copy.deepcopy(document)
    document["paths"] = {path: document["paths"][path] for path in ("/v1/chat/completions", "/v1/completions")}
    schemas = document["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    for variant in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        for ids in (variant.get("items", {}), variant.get("items", {}).get("items", {})):
            if ids.get("type") == "integer":
                ids["maximum"] = VOCAB_SIZE - 1
    if not bounded:
        return document
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        properties = schemas[name]["properties"]
        properties["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 8}
        properties["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
        schemas[name]["required"] = sorted({*schemas[name]["required"], "max_tokens"})
    for name, fields in _REFUSED.items():  # valid by the schema, refused by name: kept out of valid requests
        for field in fields:
            schemas[name]["properties"].pop(field)
    schemas["ChatCompletionRequest"]["properties"]["max_completion_tokens"] = {"type": "integer", "minimum": 1,
                                                                               "maximum": 8}
    schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] = 4
    # a content part of another type (an image, audio) is valid by the schema and refused by name: the valid
    # requests send text parts (else about half of them drew some other type, and the majority check below
    # failed on the draw)
    schemas["TextPart"]["properties"] = {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}
    schemas["TextPart"]["required"] = ["text", "type"]
    for variant in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        if variant.get("type") == "array":
            variant["maxItems"] = 4
    return document


@pytest.fixture(scope="module")
def schemas(server: str) -> dict[str, Any]:
    """The schemas valid (positive) and invalid (negative) requests are generated from."""
    import schemathesis

    document = httpx.get(f"{server}/openapi.json", timeout=10).json()
    return {mode: schemathesis.openapi.from_dict(_pinned(document, bounded=mode == "positive"))
            for mode in ("positive", "negative")}


def _checks() -> list[Any]:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    return [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
            negative_data_rejection]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_server_error_and_no_answer_off_the_schema(server: str, schemas: dict[str, Any],
                                                                          fuzz_budget: Any,
                                                                          path: str, mode: str) -> None:
    import requests
    from schemathesis import GenerationMode

    operation = schemas[mode][path]["POST"]
    checks = _checks()
    session = requests.Session()
    statuses: list[int] = []
    refusals: list[str] = []

    budget = fuzz_budget(EXAMPLES_PER_MODE)

    @seed(FUZZ_SEED)
    @budget
    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    def fuzz(case: Any) -> None:
        response = case.call_and_validate(base_url=server, session=session, checks=checks, timeout=30)
        statuses.append(response.status_code)
        if response.status_code == 400 and mode == "positive":
            refusals.append(response.json()["error"]["message"])

    try:
        fuzz()
    finally:
        session.close()  # (a failed run must not leave its socket to another test's warnings)
    assert len(statuses) >= budget.max_examples
    if mode == "positive":  # most valid requests are served (the rest are refused by the preprocessing)
        assert sum(s == 200 for s in statuses) > len(statuses) // 2, refusals
    else:
        assert all(400 <= s < 500 for s in statuses), sorted(set(statuses))


# ---- raw bytes -----------------------------------------------------------------------------------------------

_VALID = [
    b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n",
    b"HEAD /v1/models HTTP/1.1\r\nhost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 71\r\n\r\n"
    b'{"model": "SmolLM2-135M-Instruct", "prompt": "Hi there", "max_tokens": 2}',
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    b'4e\r\n{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"Hi"}],"max_tokens":2}\r\n0\r\n\r\n',
]


@st.composite
def _raw_requests(draw: st.DrawFn) -> bytes:
    """Random bytes, or valid requests cut, spliced, repeated (pipelined) and with bytes flipped."""
    if draw(st.booleans()):
        return draw(st.binary(min_size=1, max_size=2048))
    data = bytearray(b"".join(draw(st.lists(st.sampled_from(_VALID), min_size=1, max_size=3))))
    for _ in range(draw(st.integers(0, 4))):
        if not data:  # deleted whole: a connection that sends nothing is a case too
            break
        at = draw(st.integers(0, len(data) - 1))
        operation = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if operation == "flip":
            data[at] = draw(st.integers(0, 255))
        elif operation == "insert":
            data[at:at] = draw(st.sampled_from([b"\r\n", b"\x00", b":", b" ", b"0" * 20, b"\xff\xfe", b"-1"]))
        elif operation == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        elif len(data) > 1:
            del data[max(1, at):]
    return bytes(data)


def _send_raw(address: tuple[str, int], data: bytes) -> None:
    """Send `data` and read what comes back until the server closes or goes quiet for 0.2 s."""
    with socket.create_connection(address, timeout=5) as sock:
        sock.settimeout(0.2)
        try:
            sock.sendall(data)
            while sock.recv(65536):
                pass
        except (TimeoutError, ConnectionError):
            pass


def test_raw_bytes_never_break_the_server(server: str, fuzz_budget: Any) -> None:
    host, port = server.removeprefix("http://").split(":")
    address = (host, int(port))
    with httpx.Client(base_url=server, timeout=10) as client:

        @seed(FUZZ_SEED)
        @fuzz_budget(RAW_EXAMPLES)
        @given(data=_raw_requests())
        def throw(data: bytes) -> None:
            _send_raw(address, data)
            answer = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2

        throw()
