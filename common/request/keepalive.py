"""gRPC keepalive as channel and server arguments (``common.config.liveness.Keepalive``).

A stopped process (SIGSTOP, a wedged host, a black-holed network) keeps its TCP
connection open and sends no RST, so without keepalive a call to it waits for its
deadline. With these arguments the client PINGs every ``time_s`` and closes the
connection when no answer comes within ``timeout_s``; every call on it then fails
UNAVAILABLE ("ping timeout"), which the forwarding loop fails over, and a new
connection to the stopped process never becomes READY (gRPC waits for the
server's SETTINGS frame).

Three details of grpc-core (measured with grpcio 1.85): the wait for a keepalive
ping's answer is the general ``grpc.http2.ping_timeout_ms`` (1 minute by default)
rather than ``grpc.keepalive_timeout_ms``, so both are set; a client sends at most
``grpc.http2.max_pings_without_data`` (2) pings while it sends no data, which would
leave a long unary call unwatched, so that limit is lifted; and the server's ping
allowance is ``grpc.http2.min_ping_interval_without_data_ms`` (the string of
``GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS``): an unknown name is
silently ignored, and a server left at 5 minutes sends GOAWAY ``too_many_pings``
to a client that pings every second (``tests/common/request/test_keepalive.py``).

A gRPC client sends at most one ping a second whatever its keepalive time, hence
``MIN_KEEPALIVE_TIME_S``. Servers ping their callers the same way (a hung caller's
calls are cancelled and their GPU slots freed) and accept a caller's pings as often
as every ``ACCEPT_PINGS_EVERY_MS``, idle or not; a caller pinging faster still is
sent GOAWAY after ``PING_STRIKES`` such pings, as by gRPC's default policy.
"""

from __future__ import annotations

from common.config.liveness import Keepalive

ACCEPT_PINGS_EVERY_MS = 500
PING_STRIKES = 2


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def keepalive_channel_args(keepalive: Keepalive) -> list[tuple[str, int]]:
    """Channel arguments that make a client find a hung server within
    ``keepalive.detects_hang_s`` of the server's last byte."""
    return [
        ("grpc.keepalive_time_ms", _ms(keepalive.time_s)),
        ("grpc.keepalive_timeout_ms", _ms(keepalive.timeout_s)),
        ("grpc.http2.ping_timeout_ms", _ms(keepalive.timeout_s)),
        ("grpc.keepalive_permit_without_calls", int(keepalive.without_calls)),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def keepalive_server_args(keepalive: Keepalive) -> list[tuple[str, int]]:
    """Server arguments: ping callers as ``keepalive`` says, accept their pings (also
    on a connection with no call: without that, gRPC wants 2 hours between them)."""
    return [
        ("grpc.keepalive_time_ms", _ms(keepalive.time_s)),
        ("grpc.keepalive_timeout_ms", _ms(keepalive.timeout_s)),
        ("grpc.http2.ping_timeout_ms", _ms(keepalive.timeout_s)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", ACCEPT_PINGS_EVERY_MS),
        ("grpc.http2.max_ping_strikes", PING_STRIKES),
        # GOAWAY after this age: the caller reconnects and re-resolves the name it
        # dialled (replicas that came or went); calls in flight finish (no grace limit).
        ("grpc.max_connection_age_ms", _ms(keepalive.max_connection_age_s)),
    ]
