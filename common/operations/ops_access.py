"""Who may read a tier's ops HTTP.

With ``auth.enabled`` off the whole ops port is open (a trusted private
deployment), as the rest of the fleet is. With it on:

* ``/metrics``, ``/healthz``, ``/readyz`` and the dashboard page itself (``/``,
  ``/dashboard``: static HTML with no data in it) stay open to anyone, so that
  Prometheus, Kubernetes probes and a browser need no key;
* everything else (``/api/*``: state, series, traces, the fleet view — they name
  tenants, routes and GPUs) needs ``Authorization: Bearer <operator key>``, a key
  whose SHA-256 is in ``auth.operator_key_sha256``. A route a tier adds later is
  closed unless listed here as open: the default is closed.

Answers: 401 with ``WWW-Authenticate: Bearer realm="meridian-ops"`` and a JSON
``error`` when no key is presented (or the header is not ``Bearer <key>``); 403
with a JSON ``error`` when a key is presented that is not an operator key (a
tenant's API key included). With auth on and no operator key configured, every
key is refused (403): the data stays closed rather than open.

A presented key is hashed and compared with every configured digest in constant
time (``hmac.compare_digest``, no early exit), so the answer's timing does not
tell how much of a digest matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from common.config.access import AuthConfig

# Open to anyone even with auth on: scrapes, probes, and the page that asks for a key.
OPEN_PATHS = frozenset({"/metrics", "/healthz", "/readyz", "/", "/dashboard"})
REALM = 'Bearer realm="meridian-ops"'
# A longer header is refused unread (no key is anywhere near this long).
MAX_AUTHORIZATION_CHARS = 512

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class OpsAccess:
    """The ops port's rule: open (``enabled`` False) or operator keys only."""

    enabled: bool = False
    # SHA-256 hex digests (lower case) of the operator keys.
    operator_keys: frozenset[str] = frozenset()

    @classmethod
    def of(cls, auth: AuthConfig) -> OpsAccess:
        return cls(enabled=auth.enabled, operator_keys=auth.operator_key_hashes)

    def is_operator(self, key: str) -> bool:
        digest = hashlib.sha256(key.encode()).hexdigest()
        found = False
        for known in self.operator_keys:  # every digest compared: no early exit
            found |= hmac.compare_digest(known, digest)
        return found

    def refusal(self, authorization: str | None) -> web.Response | None:
        """Why a call with this ``Authorization`` header may not read operator data, as
        the answer to give; None when it may."""
        if authorization is None:
            return _unauthorized("missing 'Authorization: Bearer <operator key>' header")
        if not authorization.startswith("Bearer ") or len(authorization) > MAX_AUTHORIZATION_CHARS:
            return _unauthorized("header 'Authorization' must be 'Bearer <operator key>'")
        if not self.is_operator(authorization[len("Bearer ") :].strip()):
            return web.json_response(
                {"error": "not an operator key (auth.operator_key_sha256)"}, status=403
            )
        return None

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not self.enabled or request.path in OPEN_PATHS:
            return await handler(request)
        refused = self.refusal(request.headers.get("Authorization"))
        if refused is not None:
            return refused
        return await handler(request)


# Anyone may read everything: the ops port of a fleet with authentication off.
OPEN = OpsAccess()


def _unauthorized(why: str) -> web.Response:
    return web.json_response({"error": why}, status=401, headers={"WWW-Authenticate": REALM})
