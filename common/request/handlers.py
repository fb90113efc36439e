"""Wrapping a gRPC method handler's behaviour, whatever kind of method it serves.

A server interceptor that runs something around every call (a parent check, a
connection's slot) gets a ``grpc.RpcMethodHandler`` of one of four kinds and must
hand back one of the same kind, with the same codec, around the new behaviour.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behaviour = Callable[..., Any]


def rewrapped(
    handler: grpc.RpcMethodHandler, wrap: Callable[[Behaviour], Behaviour]
) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by ``wrap(behaviour)``: same kind, same codec."""
    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **codec)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **codec)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **codec)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **codec)
