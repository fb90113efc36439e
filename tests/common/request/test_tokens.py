"""common.request.tokens: the GPU server's own token counts, read from its responses."""

from __future__ import annotations

import struct
import time

import pytest

from common.gen.inference import grpc_service_pb2 as pb
from common.request.call import CallRecord
from common.request.tokens import MAX_COUNT, TokenCount, put_counts
from common.request.v2 import generate_request, text_response


def response(text: str = "hi") -> pb.ModelInferResponse:
    return text_response(generate_request("m", "a prompt"), text)


def with_output(name: str, datatype: str, value: int, *, raw: bool = True) -> pb.ModelInferResponse:
    """A response with a one-element integer output ``name`` beside ``text_output``."""
    r = response()
    out = r.outputs.add(name=name, datatype=datatype, shape=[1])
    if raw:
        fmt = {"UINT32": "<I", "INT32": "<i", "UINT64": "<Q", "INT64": "<q"}[datatype]
        r.raw_output_contents.append(struct.pack(fmt, value))
    else:
        out.contents.uint_contents.append(value)
        del r.raw_output_contents[:]  # typed contents for every output
        r.outputs[0].contents.bytes_contents.append(b"hi")
    return r


def counted(*responses: pb.ModelInferResponse) -> tuple[int | None, int | None]:
    count = TokenCount()
    for r in responses:
        count.add(r)
    return count.prompt, count.completion


def test_meridian_parameters_are_read() -> None:
    r = response()
    put_counts(r, 4, 10)
    assert counted(r) == (4, 10)


def test_parameters_as_uint64_or_decimal_strings_are_read() -> None:
    r = response()
    r.parameters["prompt_tokens"].uint64_param = 7
    r.parameters["completion_tokens"].string_param = " 12 "
    assert counted(r) == (7, 12)


def test_a_stream_keeps_the_last_responses_totals() -> None:
    parts = []
    for i in range(1, 4):
        r = response()
        put_counts(r, 4, i)
        parts.append(r)
    assert counted(*parts) == (4, 3)


def test_openai_usage_json_is_read() -> None:
    r = response()
    r.parameters[
        "usage"
    ].string_param = '{"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}'
    assert counted(r) == (5, 9)


def test_triton_outputs_are_read_raw_or_typed() -> None:
    r = with_output("num_output_tokens", "UINT32", 6)
    assert counted(r) == (None, 6)
    assert counted(with_output("num_input_tokens", "UINT32", 3, raw=False)) == (3, None)


def test_triton_output_tokens_of_a_stream_add_up() -> None:
    parts = [with_output("num_output_tokens", "UINT32", n) for n in (1, 2, 3)]
    assert counted(*parts) == (None, 6)


@pytest.mark.parametrize(
    "bad",
    [
        ("prompt_tokens", "int64_param", -1),
        ("prompt_tokens", "int64_param", MAX_COUNT + 1),
        ("prompt_tokens", "string_param", "four"),
        ("prompt_tokens", "bool_param", True),
        ("prompt_tokens", "double_param", 4.0),
        ("usage", "string_param", "not json"),
        ("usage", "string_param", '["prompt_tokens", 4]'),
        ("usage", "string_param", '{"prompt_tokens": "4", "completion_tokens": 1.5}'),
        ("usage", "string_param", '{"prompt_tokens": true}'),
    ],
)
def test_what_is_not_a_count_is_not_reported(bad: tuple[str, str, object]) -> None:
    name, kind, value = bad
    r = response()
    setattr(r.parameters[name], kind, value)
    assert counted(r) == (None, None)


def test_a_triton_output_of_the_wrong_type_or_size_is_not_reported() -> None:
    r = with_output("num_output_tokens", "UINT32", 6)
    r.raw_output_contents[1] = b"\x01\x00"  # two bytes for a UINT32
    assert counted(r) == (None, None)
    r = with_output("num_output_tokens", "UINT32", 6)
    r.outputs[1].datatype = "FP32"
    assert counted(r) == (None, None)


def test_a_response_without_counts_reports_nothing() -> None:
    count = TokenCount()
    count.add(response())
    assert not count.reported and (count.prompt, count.completion) == (None, None)


def record() -> CallRecord:
    call = CallRecord("ModelInfer", (), time.monotonic())
    call.prompt_tokens = 4  # the estimate, set at admission
    return call


def test_fill_replaces_the_estimates_with_reported_counts() -> None:
    call = record()
    count = TokenCount(prompt=6, completion=10)
    count.fill(call, completion_estimate=1000)
    assert (call.prompt_tokens, call.completion_tokens, call.tokens_reported) == (6, 10, True)


def test_fill_without_counts_leaves_the_estimates() -> None:
    call = record()
    TokenCount().fill(call, completion_estimate=1000)
    assert (call.prompt_tokens, call.completion_tokens, call.tokens_reported) == (4, 1000, False)


def test_fill_with_only_the_completion_reported_is_not_reported() -> None:
    call = record()
    TokenCount(completion=10).fill(call, completion_estimate=1000)
    assert (call.prompt_tokens, call.completion_tokens, call.tokens_reported) == (4, 10, False)
