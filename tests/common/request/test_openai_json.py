"""OpenAI's JSON from V2 answers: the error table, Retry-After, chunks, what a call reads."""

from __future__ import annotations

import json

import grpc
import pytest

from common.request.openai_call import HttpCallContext, call_metadata
from common.request.openai_json import Answer, Usage, grpc_error
from common.request.openai_v2 import ROUTE_CHAT, ROUTE_COMPLETIONS, parse_openai


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error"),
        (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (grpc.StatusCode.INTERNAL, 500, "server_error"),
    ],
)
def test_each_grpc_code_has_its_http_status(code: grpc.StatusCode, status: int, kind: str) -> None:
    err = grpc_error(code, "why")
    assert err.status == status
    assert err.body() == {
        "error": {"message": "why", "type": kind, "param": None, "code": code.name.lower()}
    }


@pytest.mark.parametrize(("ms", "seconds"), [("250", "1"), ("1000", "1"), ("1001", "2")])
def test_429_says_when_to_retry_in_both_units(ms: str, seconds: str) -> None:
    err = grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down", [("retry-after-ms", ms)])
    assert dict(err.headers) == {"Retry-After": seconds, "retry-after-ms": ms}


def test_429_without_a_hint_says_one_second() -> None:
    err = grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "shed")
    assert dict(err.headers) == {"Retry-After": "1", "retry-after-ms": "1000"}


def test_a_completion_and_its_chunks() -> None:
    request = parse_openai(
        ROUTE_COMPLETIONS,
        {"model": "m", "prompt": "p", "max_tokens": 3, "stream_options": {"include_usage": True}},
    )
    answer = Answer(request, "cmpl-1", 7)
    whole = answer.whole("a b", Usage(1, 2))
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    chunk = json.loads(answer.chunk("a").removeprefix(b"data: "))
    assert chunk["choices"][0]["text"] == "a" and chunk["usage"] is None
    last = json.loads(answer.usage_chunk(Usage(1, 3)).removeprefix(b"data: "))
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 4


def test_a_chat_chunk_names_the_role_first_then_only_content() -> None:
    request = parse_openai(
        ROUTE_CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    answer = Answer(request, "chatcmpl-1", 7)
    first = json.loads(answer.chunk("a", first=True).removeprefix(b"data: "))
    then = json.loads(answer.chunk("b").removeprefix(b"data: "))
    end = json.loads(answer.chunk("", "length").removeprefix(b"data: "))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert then["choices"][0]["delta"] == {"content": "b"}
    assert end["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "length",
    }
    assert "usage" not in then  # include_usage not asked


def test_a_call_reads_only_the_headers_the_proxy_reads() -> None:
    headers = {
        "Authorization": "Bearer k",
        "X-Meridian-Session": "s",
        "traceparent": "00-ab-cd-01",
        "Content-Type": "application/json",
        "Host": "h",
    }
    assert call_metadata(headers) == (
        ("authorization", "Bearer k"),
        ("x-meridian-session", "s"),
        ("traceparent", "00-ab-cd-01"),
    )


def test_a_call_counts_its_deadline_down() -> None:
    now = [100.0]
    ctx = HttpCallContext((), 5.0, clock=lambda: now[0])
    assert ctx.time_remaining() == 5.0
    now[0] = 106.0
    assert ctx.time_remaining() == 0.0
    assert HttpCallContext((), None).time_remaining() is None
