"""What the endpoint picker reads of a request: one named case per rule."""

from __future__ import annotations

import grpc
import pytest

from common.basics.errors import RouteError
from common.config.access import Limits
from common.request.v2 import generate_request
from local_lb.ext_proc_reply import status_of
from local_lb.ext_proc_request import read_head, read_openai, read_v2

LIMITS = Limits()
V2 = [(":method", "POST"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
      ("content-type", "application/grpc")]  # fmt: skip


def _frame(message: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + len(message).to_bytes(4, "big") + message


def _code(call, *args) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(RouteError) as err:
        call(*args)
    return err.value.code


def test_v2_model_infer_is_read_from_its_one_frame() -> None:
    gen = read_v2(_frame(generate_request("m", "a b c", 7).SerializeToString()), LIMITS)
    assert (gen.model, gen.prompt, gen.max_tokens) == ("m", "a b c", 7)


def test_v2_compressed_or_extra_frames_are_invalid() -> None:
    message = generate_request("m", "x", 1).SerializeToString()
    assert _code(read_v2, _frame(message, flag=1), LIMITS) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(read_v2, _frame(message) * 2, LIMITS) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(read_v2, b"\x00\x00", LIMITS) == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_timeout_is_read() -> None:
    assert read_head([*V2, ("grpc-timeout", "250m")]).timeout_s == pytest.approx(0.25)
    assert _code(read_head, [*V2, ("grpc-timeout", "soon")]) == grpc.StatusCode.INVALID_ARGUMENT


def test_stream_infer_and_other_methods_are_unimplemented() -> None:
    stream = [*V2[:1], (":path", "/inference.GRPCInferenceService/ModelStreamInfer"), V2[2]]
    assert _code(read_head, stream) == grpc.StatusCode.UNIMPLEMENTED
    other = [*V2[:1], (":path", "/other.Service/Call"), V2[2]]
    assert _code(read_head, other) == grpc.StatusCode.UNIMPLEMENTED


def test_unknown_meridian_header_is_invalid_naming_it() -> None:
    with pytest.raises(RouteError) as err:
        read_head([*V2, ("x-meridian-prority", "critical")])
    assert "x-meridian-prority" in err.value.message


def test_openai_completions_prompt_list_and_defaults() -> None:
    gen = read_openai("/v1/completions", b'{"model": "m", "prompt": ["a b"]}', LIMITS)
    assert (gen.model, gen.prompt, gen.max_tokens) == ("m", "a b", 16)


def test_openai_chat_messages_text_and_parts() -> None:
    parts = b'[{"type": "text", "text": "yo"}]'
    body = (
        b'{"model": "m", "max_completion_tokens": 9, "messages": [{"role": "user", '
        b'"content": "hi"}, {"role": "user", "content": ' + parts + b"}]}"
    )
    gen = read_openai("/v1/chat/completions", body, LIMITS)
    # The edge's chat template, so prefix blocks hash as the edge's would.
    assert (gen.prompt, gen.max_tokens) == ("<|user|>\nhi\n<|user|>\nyo\n<|assistant|>\n", 9)


@pytest.mark.parametrize(
    "body",
    [b"[1]", b'{"model": ""}', b'{"model": "m", "max_tokens": true}',
     b'{"model": "m", "max_tokens": 0}', b'{"model": "m", "prompt": 5}', b"\xff"],
    ids=["not-object", "empty-model", "bool-tokens", "zero-tokens", "prompt-type", "not-utf8"],
)  # fmt: skip
def test_openai_bad_bodies_are_invalid(body: bytes) -> None:
    assert _code(read_openai, "/v1/completions", body, LIMITS) == grpc.StatusCode.INVALID_ARGUMENT


def test_response_status_from_grpc_status_or_http_status() -> None:
    assert status_of([("grpc-status", "14")], grpc_call=True)[0] == grpc.StatusCode.UNAVAILABLE  # type: ignore[index]
    assert status_of([(":status", "200")], grpc_call=True) is None  # the status is in trailers
    assert status_of([(":status", "200")], grpc_call=False)[0] == grpc.StatusCode.OK  # type: ignore[index]
    assert status_of([(":status", "503")], grpc_call=False)[0] == grpc.StatusCode.UNAVAILABLE  # type: ignore[index]
