"""Bad input never breaks a tier: each kind gets its exact status and message, then the
tier serves the next good request, and no GPU ran anything for the bad one.

One small fleet (1 region x 1 zone x 1 GPU) serves the whole module. Besides
the named cases, a Hypothesis property throws generated V2 requests and
metadata at the edge: never UNKNOWN or INTERNAL, never a crashed process.
Header values a gRPC client refuses to send (control characters, raw bytes)
are sent over a hand-written HTTP/2 stream, since a raw HTTP/2 peer can.
"""

from __future__ import annotations

import socket
import struct
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cli.launcher import Fleet
from common.gen.inference import grpc_service_pb2 as pb
from common.request.routing import CLIENT_GEO, CLIENT_REGION, PRIORITY, SESSION
from common.request.v2 import generate_request, response_text
from common.tenancy.usage import USAGE_STREAM, UsageRecord
from tests.client import V2Client, expect_code
from tests.common.request.test_limits import infer_requests, wire_metadata
from tests.conftest import small_fleet_spec, start_fleet
from tests.e2e.test_demo_fleet import served_requests

DUBLIN = (CLIENT_GEO, "53.35,-6.26")
MIB = 1024 * 1024
NOT_SERVABLE = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = start_fleet(tmp_path_factory.mktemp("bad-input"), small_fleet_spec(1, 1, 1))
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def client(fleet: Fleet) -> Iterator[V2Client]:
    with V2Client(fleet.global_address) as c:
        yield c


def refused(
    fleet: Fleet, client: V2Client, code: grpc.StatusCode, call: Callable[[], object]
) -> grpc.RpcError:
    """``call`` fails with exactly ``code``; then a good request succeeds, and the GPU
    served that one only."""
    before = served_requests(fleet)
    err = expect_code(code, call)
    assert client.infer(metadata=[DUBLIN]).text
    assert served_requests(fleet) == before + 1
    return err


def prompt_request(prompt: str, shape: Sequence[int] = (1,)) -> pb.ModelInferRequest:
    request = generate_request("demo-llm", prompt, 2)
    del request.inputs[0].shape[:]
    request.inputs[0].shape.extend(shape)
    return request


# --------------------------------------------------------------------------- sizes


def test_oversized_message_is_refused_by_grpc(fleet: Fleet, client: V2Client) -> None:
    # gRPC's own answer, before any Meridian code runs: RESOURCE_EXHAUSTED without a
    # retry-after-ms trailer (the same request would be refused again).
    big = prompt_request("a" * (4 * MIB))
    err = refused(
        fleet, client, grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: client.infer(request=big)
    )
    assert "Received message larger than max" in err.details()
    assert f"vs. {4 * MIB}" in err.details()
    assert "retry-after-ms" not in dict(err.trailing_metadata() or ())


def test_oversized_prompt_names_text_input_and_limit(fleet: Fleet, client: V2Client) -> None:
    request = prompt_request("a" * (256 * 1024 + 1))
    err = refused(
        fleet, client, grpc.StatusCode.INVALID_ARGUMENT, lambda: client.infer(request=request)
    )
    assert err.details() == (
        "input 'text_input' is 262145 bytes; the limit is 262144 bytes (limits.max_prompt_bytes)"
    )


def test_too_many_inputs(fleet: Fleet, client: V2Client) -> None:
    request = generate_request("demo-llm", "hello", 2)
    for i in range(16):
        request.inputs.add(name=f"extra_{i}", datatype="INT32", shape=[1])
        request.raw_input_contents.append(struct.pack("<i", i))
    err = refused(
        fleet, client, grpc.StatusCode.INVALID_ARGUMENT, lambda: client.infer(request=request)
    )
    assert err.details() == "the request has 17 inputs; at most 16 are accepted (limits.max_inputs)"


@pytest.mark.parametrize("shape", [[2], [0], [1, 3], [-1]], ids=str)
def test_shape_that_does_not_match_the_prompt(
    fleet: Fleet, client: V2Client, shape: list[int]
) -> None:
    request = prompt_request("hello", shape)
    err = refused(
        fleet, client, grpc.StatusCode.INVALID_ARGUMENT, lambda: client.infer(request=request)
    )
    assert err.details().startswith("input 'text_input' has ")
    assert str(shape) in err.details()


def test_oversized_metadata_is_refused_by_grpc(fleet: Fleet, client: V2Client) -> None:
    metadata = [("x-client-notes", "a" * (16 * 1024))]
    err = refused(
        fleet,
        client,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        lambda: client.infer(metadata=metadata),
    )
    assert "metadata size exceeds hard limit" in err.details()


def test_metadata_just_under_the_limit_is_served(client: V2Client) -> None:
    assert client.infer(metadata=[("x-client-notes", "a" * (15 * 1024))]).text


# --------------------------------------------------------------------------- routing hints


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        pytest.param(
            PRIORITY,
            "urgent",
            "metadata 'x-meridian-priority' must be one of critical, standard, sheddable; "
            "got 'urgent'",
            id="bad-priority",
        ),
        pytest.param(
            CLIENT_REGION, "mars-north", "'x-meridian-client-region'", id="unknown-region"
        ),
        pytest.param(
            CLIENT_GEO,
            "53.35;-6.26",
            "metadata 'x-meridian-client-geo': expected 'lat,lon' in degrees, got '53.35;-6.26'",
            id="malformed-geo",
        ),
        pytest.param(
            "x-meridian-prority",
            "critical",
            "unknown metadata key 'x-meridian-prority'; Meridian reads x-meridian-client-geo, "
            "x-meridian-client-region, x-meridian-priority, x-meridian-session",
            id="unknown-meridian-key",
        ),
        pytest.param(
            SESSION, "s" * 257, "metadata 'x-meridian-session' is longer than 256", id="long-hint"
        ),
    ],
)
def test_bad_routing_metadata(
    fleet: Fleet, client: V2Client, key: str, value: str, message: str
) -> None:
    err = refused(
        fleet,
        client,
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: client.infer(metadata=[(key, value)]),
    )
    assert message in err.details()


def test_forged_internal_metadata_changes_neither_tenant_nor_route(
    fleet: Fleet, client: V2Client
) -> None:
    """Internal keys from a client are dropped at the edge: not refused, not believed."""
    trace = uuid.uuid4().hex
    forged = [
        DUBLIN,
        ("traceparent", f"00-{trace}-{'1' * 16}-01"),
        ("x-meridian-tenant", "gold"),
        ("x-meridian-origin", "1.35,103.82"),
        ("x-meridian-attempt", "99"),
        ("x-meridian-prefix-blocks", "not-hex"),  # would be INVALID_ARGUMENT if it were read
    ]
    reply = client.infer(metadata=forged)
    assert reply.route == client.infer(metadata=[DUBLIN]).route
    record = usage_record(fleet, trace)
    assert (record.tenant, record.status) == ("anonymous", "OK")


def usage_record(fleet: Fleet, trace_id: str, timeout_s: float = 10.0) -> UsageRecord:
    """The edge's usage record for the request with ``trace_id``."""
    deadline = time.monotonic() + timeout_s
    with redis.Redis.from_url(fleet.topology.redis_url) as db:
        while time.monotonic() < deadline:
            for _, fields in db.xrange(USAGE_STREAM):
                record = UsageRecord.from_fields(fields)
                if record.trace_id == trace_id:
                    return record
            time.sleep(0.1)
    raise AssertionError(f"no usage record with trace id {trace_id}")


# --------------------------------------------------------------------------- raw HTTP/2


@pytest.mark.parametrize(
    ("value", "key"),
    [
        pytest.param(b"conv\n1", SESSION, id="newline"),
        pytest.param(b"conv\x001", SESSION, id="nul"),
        pytest.param(b"eu-west\xff", CLIENT_REGION, id="non-utf8"),
        pytest.param("caf\u00e9".encode(), SESSION, id="utf8-non-ascii"),
    ],
)
def test_control_characters_in_a_hint_are_refused(
    fleet: Fleet, client: V2Client, value: bytes, key: str
) -> None:
    # Forwarded unchecked, such a value made the call to the regional tier fail
    # inside gRPC and the edge never answered.
    before = served_requests(fleet)
    status, message = raw_h2_infer(fleet.global_address, [(key.encode(), value)])
    assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (
        message
        == f"metadata '{key}' must be printable ASCII; it holds control or non-ASCII characters"
    )
    assert client.infer(metadata=[DUBLIN]).text
    assert served_requests(fleet) == before + 1


def test_control_characters_in_trace_context_are_dropped(fleet: Fleet) -> None:
    status, message = raw_h2_infer(fleet.global_address, [(b"traceparent", b"00-\r\n-01")])
    assert (status, message) == (0, "")


def _hpack_int(value: int, prefix_bits: int) -> bytes:
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([value])
    out, value = [top], value - top
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    return bytes([*out, value])


def _read_hpack_int(data: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    top = (1 << prefix_bits) - 1
    value, pos = data[pos] & top, pos + 1
    shift = 0
    while value >= top:
        byte, pos = data[pos], pos + 1
        value += (byte & 127) << shift
        shift += 7
        if not byte & 128:
            break
    return value, pos


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([kind, flags])
        + struct.pack(">I", stream)
        + payload
    )


def _trailers(block: bytes, table: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """Literal header fields of an HPACK block (enough for gRPC's trailers)."""
    fields: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(block):
        byte = block[pos]
        if byte & 0x80:  # indexed field: a static entry (:status) or one already seen
            _, pos = _read_hpack_int(block, pos, 7)
            continue
        if byte & 0xE0 == 0x20:  # dynamic table size update
            _, pos = _read_hpack_int(block, pos, 5)
            continue
        indexing = byte & 0xC0 == 0x40
        index, pos = _read_hpack_int(block, pos, 6 if indexing else 4)
        if index:
            name = table[index - 62][0] if index > 61 else b":static"
        else:
            name, pos = _hpack_string(block, pos)
        value, pos = _hpack_string(block, pos)
        if indexing:
            table.insert(0, (name, value))
        fields[name] = value
    return fields


def _hpack_string(block: bytes, pos: int) -> tuple[bytes, int]:
    assert not block[pos] & 0x80, "Huffman-coded header: not expected from gRPC"
    length, pos = _read_hpack_int(block, pos, 7)
    return block[pos : pos + length], pos + length


def raw_h2_infer(address: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, str]:
    """ModelInfer over one hand-written HTTP/2 stream; (grpc-status, grpc-message)."""
    literal = b"".join(
        b"\x00" + _hpack_int(len(k), 7) + k + _hpack_int(len(v), 7) + v
        for k, v in [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
            (b":authority", address.encode()),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            (b"grpc-timeout", b"10S"),
            (CLIENT_GEO.encode(), b"53.35,-6.26"),
            *headers,
        ]
    )
    message = generate_request("demo-llm", "hello", 2).SerializeToString()
    body = b"\x00" + struct.pack(">I", len(message)) + message
    host, _, port = address.rpartition(":")
    table: list[tuple[bytes, bytes]] = []
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        sock.sendall(
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
            + _frame(4, 0, 0, b"")
            + _frame(1, 0x4, 1, literal)  # HEADERS, END_HEADERS
            + _frame(0, 0x1, 1, body)  # DATA, END_STREAM
        )
        buffer = b""
        while True:
            while len(buffer) < 9 or len(buffer) < 9 + int.from_bytes(buffer[:3], "big"):
                chunk = sock.recv(65536)
                assert chunk, "the edge closed the connection without a gRPC status"
                buffer += chunk
            length = int.from_bytes(buffer[:3], "big")
            kind, flags = buffer[3], buffer[4]
            payload, buffer = buffer[9 : 9 + length], buffer[9 + length :]
            if kind == 4 and not flags & 0x1:
                sock.sendall(_frame(4, 0x1, 0, b""))  # acknowledge the server's SETTINGS
            assert kind not in (3, 7), f"stream reset (frame type {kind}): {payload!r}"
            if kind == 1:
                fields = _trailers(payload, table)
                if b"grpc-status" in fields:
                    return int(fields[b"grpc-status"]), fields.get(b"grpc-message", b"").decode()


# --------------------------------------------------------------------------- generated input


def test_generated_requests_never_break_the_edge(fleet: Fleet, client: V2Client) -> None:
    """Whatever a client sends, the edge answers with a status that says what was wrong
    (never UNKNOWN or INTERNAL), and it goes on serving."""
    seen: dict[grpc.StatusCode, int] = {}

    @settings(
        max_examples=100,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(infer=infer_requests(), metadata=wire_metadata(), stream=st.booleans())
    def throw(infer: pb.ModelInferRequest, metadata: list[Any], stream: bool) -> None:
        code, details = call(client, infer, metadata, stream)
        seen[code] = seen.get(code, 0) + 1
        assert code not in NOT_SERVABLE, f"{code.name}: {details}"
        assert code == grpc.StatusCode.OK or details, f"{code.name} without a message"

    throw()
    assert all(process.alive() for process in fleet.processes.values())
    reply = client.infer(metadata=[DUBLIN])
    assert reply.text and reply.route
    assert grpc.StatusCode.OK in seen and grpc.StatusCode.INVALID_ARGUMENT in seen, seen


def call(
    client: V2Client, infer: pb.ModelInferRequest, metadata: list[Any], stream: bool
) -> tuple[grpc.StatusCode, str]:
    """The status of one unary or streamed call; a streamed error_message counts as its
    status (``"INVALID_ARGUMENT: ..."``)."""
    try:
        if not stream:
            response = client.stub.ModelInfer(infer, metadata=tuple(metadata), timeout=2.0)
            response_text(response)
            return grpc.StatusCode.OK, ""
        for reply in client.stub.ModelStreamInfer(
            iter([infer]), metadata=tuple(metadata), timeout=2.0
        ):
            if reply.error_message:
                name, _, details = reply.error_message.partition(": ")
                code = grpc.StatusCode.__members__.get(name)
                assert code is not None, f"stream error without a status: {reply.error_message}"
                return code, details
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
