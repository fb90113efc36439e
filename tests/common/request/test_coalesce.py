"""The outbox's merge (``common.request.coalesce``) and ``limits.stream_coalesce_ms``."""

from __future__ import annotations

import pytest

from common.config.access import parse_limits
from common.config.node import ConfigError, ConfigNode
from common.gen.inference import grpc_service_pb2 as pb
from common.request.coalesce import Outbox
from common.request.tokens import put_counts
from common.request.v2 import generate_request, response_text, text_response

REQUEST = generate_request("m", "a b c", 8, request_id="r1", stream=True)


def token(text: str, n: int | None, final: bool = False) -> pb.ModelStreamInferResponse:
    response = text_response(REQUEST, text, final=final)
    if n is not None:
        put_counts(response, 3, n)
    return pb.ModelStreamInferResponse(infer_response=response)


def held(*responses: pb.ModelStreamInferResponse) -> tuple[Outbox, list[Outbox]]:
    readied: list[Outbox] = []
    box = Outbox(readied.append)
    box.parts.extend(responses)
    return box, readied


def test_responses_held_go_as_one_with_every_text_and_the_last_counts() -> None:
    box, _ = held(token(" a", 1), token(" b", 2), token(" c", 3, final=True))
    merged = box.take().infer_response
    assert response_text(merged) == " a b c" and merged.id == "r1"
    assert merged.parameters["completion_tokens"].int64_param == 3
    assert merged.parameters["triton_final_response"].bool_param
    assert box.parts == [] and box.responses == 3


def test_one_response_held_goes_unchanged() -> None:
    only = token(" a", 1)
    expected = pb.ModelStreamInferResponse()
    expected.CopyFrom(only)
    box, _ = held(only)
    assert box.take() == expected


def test_an_error_is_never_merged_and_keeps_its_place() -> None:
    error = pb.ModelStreamInferResponse(error_message="UNAVAILABLE: gone (request id 'r1')")
    box, _ = held(token(" a", 1), token(" b", 2), error, token(" c", 3))
    assert response_text(box.take().infer_response) == " a b"
    assert box.take() == error
    assert response_text(box.take().infer_response) == " c"


def test_without_counts_a_merge_says_how_many_tokens_it_stands_for() -> None:
    box, _ = held(token(" a", None), token(" b", None))
    merged = box.take().infer_response
    assert merged.parameters["completion_tokens"].int64_param == 2
    box.parts.append(token(" c", None))
    assert box.take().infer_response.parameters["completion_tokens"].int64_param == 3


async def test_the_first_response_put_readies_the_outbox_once() -> None:
    readied: list[Outbox] = []
    box = Outbox(readied.append)
    await box.put(token(" a", 1))
    await box.put(token(" b", 2))
    assert readied == [box] and len(box.parts) == 2


@pytest.mark.parametrize("value", [-1, 1000.5, float("nan"), "5", True])
def test_a_bad_stream_coalesce_ms_names_the_key(value: object) -> None:
    root = ConfigNode({"limits": {"stream_coalesce_ms": value}}, "")
    with pytest.raises(ConfigError, match=r"limits\.stream_coalesce_ms"):
        parse_limits(root)


def test_stream_coalesce_ms_defaults_to_zero_and_takes_a_window() -> None:
    assert parse_limits(ConfigNode({}, "")).stream_coalesce_ms == 0
    root = ConfigNode({"limits": {"stream_coalesce_ms": 20}}, "")
    assert parse_limits(root).stream_coalesce_ms == 20.0
