"""Who may call an inner tier: its parent, proven by the identity in its TLS certificate.

A fleet on mutual TLS gives every tier instance its own identity
(``common.config.identity``). The regional tier of region R serves only the
global tier; the local tier of R/Z only regional R. ``ParentOnly`` is a server
interceptor that refuses, with PERMISSION_DENIED naming both identities, every
call from any other caller — a sibling zone, another region, a GPU server's
certificate — before the handler runs. So internal metadata
(``x-meridian-tenant``, the origin, prefix hashes, the attempt; see
``common.request.routing``) is only ever read from the parent, and a forged
tenant never passes silently: whoever holds one tier's key can no longer speak
for another tier, nor use an inner tier as an unmetered way in.

Open to any caller that passed the handshake: grpc.health.v1 (the parent
watches it, an operator's probe may too) and server reflection. Everything else
on the port — the V2 service and the Admin API — is the parent's.

Cost: the identity comes from the connection's verified certificate, parsed by
gRPC once per handshake (``auth_context()['peer_uri']``, the URI SANs); a call
compares one string, about 3 µs in all. Nothing is cached by peer address: a
closed connection's address may come back with another certificate.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from common.config.identity import Identity
from common.request.handlers import rewrapped

PEER_URI = "peer_uri"
# Services any authenticated caller may use (the parent's health watch, reflection).
OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


def caller_uris(context: grpc.aio.ServicerContext) -> list[str]:
    """The URI SANs of the caller's verified certificate (empty without one)."""
    return [u.decode() for u in context.auth_context().get(PEER_URI, ())]


class ParentOnly(grpc.aio.ServerInterceptor):
    """Serves only ``parent``: any other caller gets PERMISSION_DENIED (see the module
    docstring); health and reflection stay open. Install it last among a server's
    interceptors: it keeps the handler it built for each method."""

    def __init__(self, me: Identity, parent: Identity) -> None:
        self.me = me
        self.parent = parent
        self._parent_uri = [parent.uri.encode()]
        # One guarded handler per method, built at its first call, not at every call:
        # safe because this is the last interceptor (below it, only the method lookup).
        self._guarded_by_method: dict[str, grpc.RpcMethodHandler] = {}

    def refusal(self, context: grpc.aio.ServicerContext) -> str | None:
        """None when the caller is the parent, else why it is refused."""
        if context.auth_context().get(PEER_URI) == self._parent_uri:
            return None
        uris = caller_uris(context)
        caller = ", ".join(uris) if uris else "a certificate that names no Meridian identity"
        return (
            f"{self.me.label} serves only its parent, {self.parent.label} ({self.parent.uri}), "
            f"and believes internal metadata such as x-meridian-tenant only from it; "
            f"the caller is {caller}"
        )

    async def _refuse_unless_parent(self, context: grpc.aio.ServicerContext) -> None:
        message = self.refusal(context)
        if message is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        guarded = self._guarded_by_method.get(method)
        if guarded is not None:
            return guarded
        handler = await continuation(handler_call_details)
        service = method.lstrip("/").partition("/")[0]
        if handler is None or service in OPEN_SERVICES:
            return handler
        guarded = self._guarded_by_method[method] = self._guarded(handler)
        return guarded

    def _guarded(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` with the parent check before its behaviour, whatever its kind."""
        return rewrapped(handler, self._wrap)

    def _wrap(self, behaviour: Callable[..., Any]) -> Callable[..., Any]:
        """Check first, then run ``behaviour``: a coroutine or an async generator
        (a streaming handler that yields its responses) alike."""
        if inspect.isasyncgenfunction(behaviour):

            async def streamed(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                await self._refuse_unless_parent(context)
                async for response in behaviour(request, context):
                    yield response

            return streamed

        async def called(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await self._refuse_unless_parent(context)
            result = behaviour(request, context)
            return await result if inspect.isawaitable(result) else result

        return called


def parent_only(identity: Identity | None) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors that keep a tier to its parent: none for the edge, for GPUs
    and for a plaintext fleet (``identity`` None, where there is no identity to check)."""
    parent = None if identity is None else identity.parent
    return [] if identity is None or parent is None else [ParentOnly(identity, parent)]
