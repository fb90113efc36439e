"""Whether a launched server serves: a V2 server's ServerReady, an OpenAI GPU's /health.

Blocking calls, for the launcher and for tests that start processes, outside any event loop.
"""

from __future__ import annotations

import grpc

from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from sim.openai_server import openai_ready


def tier_ready(
    address: str, credentials: grpc.ChannelCredentials | None = None, timeout_s: float = 0.5
) -> bool:
    """True when the V2 server at ``address`` answers ServerReady with ready=true (an
    ``http://`` address: an OpenAI GPU, when its ``/health`` answers 200)."""
    if address.startswith("http://"):
        return openai_ready(address, timeout_s)
    if credentials is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, credentials)
    with channel:
        try:
            reply = pb_grpc.GRPCInferenceServiceStub(channel).ServerReady(
                pb.ServerReadyRequest(), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        return bool(reply.ready)
