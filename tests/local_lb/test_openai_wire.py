"""V2 requests as OpenAI requests and OpenAI answers as V2 responses (local_lb.openai_wire)."""

from __future__ import annotations

import json

import grpc
import pytest

from common.basics.errors import RouteError
from common.gen.inference import grpc_service_pb2 as pb
from common.request.tokens import TokenCount
from common.request.v2 import generate_request, response_text
from local_lb.openai_wire import (
    OPENAI_BODY,
    OPENAI_ROUTE,
    BadAnswer,
    Piece,
    answer_piece,
    chunk_piece,
    error_detail,
    grpc_code,
    openai_call,
    parse_json,
    retry_after_ms,
    stream_error,
    v2_response,
)


def with_body(body: object, route: str = "chat.completions") -> pb.ModelInferRequest:
    request = generate_request("m", "user: hi", 8)
    request.parameters[OPENAI_ROUTE].string_param = route
    request.parameters[OPENAI_BODY].string_param = json.dumps(body)
    return request


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (400, grpc.StatusCode.INVALID_ARGUMENT),
        (404, grpc.StatusCode.NOT_FOUND),
        (413, grpc.StatusCode.INVALID_ARGUMENT),
        (422, grpc.StatusCode.INVALID_ARGUMENT),
        (429, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (500, grpc.StatusCode.INTERNAL),
        (401, grpc.StatusCode.INTERNAL),
        (502, grpc.StatusCode.UNAVAILABLE),
        (503, grpc.StatusCode.UNAVAILABLE),
        (504, grpc.StatusCode.DEADLINE_EXCEEDED),
        (501, grpc.StatusCode.UNIMPLEMENTED),
    ],
)
def test_http_status_maps_to_the_grpc_code_of_the_same_meaning(
    status: int, code: grpc.StatusCode
) -> None:
    assert grpc_code(status) == code


def test_retry_after_seconds_become_milliseconds() -> None:
    assert retry_after_ms("2") == 2000
    assert retry_after_ms("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert retry_after_ms(None) is None
    assert retry_after_ms("999999") == 3_600_000


def test_a_v2_request_becomes_a_completions_body() -> None:
    call = openai_call(generate_request("m", "tell me", 7), stream=False)
    assert call.path == "/v1/completions" and not call.chat
    assert call.body == {"model": "m", "prompt": "tell me", "max_tokens": 7, "stream": False}


def test_a_streamed_request_asks_for_usage_in_the_last_chunk() -> None:
    call = openai_call(generate_request("m", "tell me", 7), stream=True)
    assert call.body["stream"] is True
    assert call.body["stream_options"] == {"include_usage": True}


def test_the_callers_body_goes_to_the_route_it_names_as_it_came() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.2,
        "stop": ["\n"],
        "stream_options": {"continuous_usage_stats": True},
    }
    call = openai_call(with_body(body), stream=True)
    assert call.path == "/v1/chat/completions" and call.chat
    assert call.body["messages"] == body["messages"]
    assert call.body["temperature"] == 0.2 and call.body["stop"] == ["\n"]
    assert call.body["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    unary = openai_call(with_body(body), stream=False)
    assert unary.body["stream"] is False and "stream_options" not in unary.body


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        (with_body("not an object"), "must be a JSON object"),
        (with_body({"model": "m"}, route="embeddings"), "openai_route"),
        (with_body({"model": "m", "n": 2}), "'n' must be 1"),
    ],
)
def test_a_body_the_gpu_cannot_take_is_invalid_argument(
    request_: pb.ModelInferRequest, says: str
) -> None:
    with pytest.raises(RouteError) as err:
        openai_call(request_, stream=False)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert says in err.value.message


def test_a_body_that_is_not_json_is_invalid_argument() -> None:
    request = generate_request("m", "x", 1)
    request.parameters[OPENAI_BODY].string_param = "{not json"
    with pytest.raises(RouteError) as err:
        openai_call(request, stream=False)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_an_answer_becomes_a_v2_response_with_the_servers_counts() -> None:
    doc = {
        "choices": [{"index": 0, "text": "hello world", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    request = generate_request("m", "x", 4, request_id="r1")
    response = v2_response(request, answer_piece(doc, chat=False))
    assert response_text(response) == "hello world" and response.id == "r1"
    count = TokenCount()
    count.add(response)
    assert (count.prompt, count.completion) == (3, 2)
    assert response.parameters["finish_reason"].string_param == "stop"


def test_a_chat_answer_and_chunks_read_their_content() -> None:
    answer = {"choices": [{"message": {"role": "assistant", "content": "yes"}}]}
    assert answer_piece(answer, chat=True).text == "yes"
    chunk = {"choices": [{"index": 0, "delta": {"content": " no"}, "finish_reason": None}]}
    assert chunk_piece(chunk, chat=True) == Piece(" no", None, "")
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    assert chunk_piece(role_only, chat=True).text == ""
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 9}}
    assert chunk_piece(usage, chat=True) == Piece("", (1, 9), "")


@pytest.mark.parametrize(
    "raw",
    [
        b"{truncated",
        b"[1, 2]",
        b'{"choices": "nope"}',
        b'{"choices": []}',
        b'{"choices": [{"text": 5}]}',
        b'{"choices": [{"text": "a"}], "usage": {"prompt_tokens": -1, "completion_tokens": 1}}',
    ],
)
def test_a_malformed_answer_is_a_bad_answer(raw: bytes) -> None:
    with pytest.raises(BadAnswer):
        answer_piece(parse_json(raw), chat=False)


def test_a_bare_final_marker_has_no_output() -> None:
    request = generate_request("m", "x", 4)
    marker = v2_response(request, Piece("", (2, 4), ""), final=True, text=False)
    assert not marker.outputs
    assert marker.parameters["triton_final_response"].bool_param
    assert marker.parameters["completion_tokens"].int64_param == 4


def test_error_bodies_say_what_the_server_said() -> None:
    assert error_detail(b'{"error": {"message": "too long", "type": "x"}}') == "too long"
    assert error_detail(b'{"object": "error", "message": "old vllm"}') == "old vllm"
    assert error_detail(b"<html>bad gateway</html>") == "<html>bad gateway</html>"


def test_an_error_event_in_a_stream_names_its_code() -> None:
    assert stream_error({"error": {"message": "oom", "code": 503}}) == (
        grpc.StatusCode.UNAVAILABLE,
        "oom",
    )
    assert stream_error({"error": "boom"})[0] == grpc.StatusCode.INTERNAL  # type: ignore[index]
    assert stream_error({"choices": []}) is None
