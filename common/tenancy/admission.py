"""What a request must pass before a tier forwards it, and what it leaves behind.

The edge (the global tier, or the OpenAI edge of an inner tier, which clients
call directly: ``common.tier.client_entry``) authenticates the caller, checks
what it asks for, and applies every tenant quota, shared by its replicas
through Redis: the rate limits (``common.tenancy.quota``) and ``max_concurrent``
(``common.tenancy.concurrency``). Inner tiers' V2 ports count no quota: a request the edge
admitted is the tenant's to run wherever it lands, and a quota refused below the
edge would be failed over to another region. The edge also writes exactly one
usage record per finished request. A tier without any of these (auth off, no
limits) admits everything as the ``anonymous`` tenant.

Token quotas are charged an estimate up front and settled on the real count:
when a request ends, the edge charges (or gives back) the difference between
what its GPU reported (``CallRecord.tokens_reported``) and what admission took
(``CallRecord.tokens_charged``), in the background (``common.tenancy.settle``).
Where the GPU reported nothing, the estimate stands, and the usage record says
so (``tokens_reported: False``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import grpc

from common.config.access import ANONYMOUS, AuthConfig, TenantConfig
from common.request.call import CallRecord
from common.request.pick import PickRequest
from common.request.routing import RouteHints
from common.request.streaming import Release, no_release
from common.tenancy.auth import Authenticator, asked_priority
from common.tenancy.concurrency import TenantConcurrency
from common.tenancy.quota import TenantRateLimiter
from common.tenancy.quota_scripts import EDGE_SCRIPTS
from common.tenancy.settle import QuotaSettler
from common.tenancy.shared_redis import QuotaRedis
from common.tenancy.usage import UsageRecord, UsageRecorder


@dataclass
class Admission:
    """Identity, quotas and usage for one tier (everything optional)."""

    auth: AuthConfig
    authenticator: Authenticator | None = None
    limiter: TenantRateLimiter | None = None
    concurrency: TenantConcurrency | None = None
    usage: UsageRecorder | None = None
    # Settles token charges on real counts (set with a limiter, see edge_admission).
    settler: QuotaSettler | None = None
    # The Redis client the limiter and the concurrency caps share (closed here).
    shared: QuotaRedis | None = None
    # The route above this tier ("eu-west" at a local tier's OpenAI edge, whose own
    # route starts at its zone), so a usage record names the region, zone and GPU.
    route_above: str = ""

    async def start(self) -> None:
        if self.shared is not None:
            await self.shared.warm(EDGE_SCRIPTS)
        if self.usage is not None:
            self.usage.start()
        if self.settler is not None:
            self.settler.start()

    async def stop(self) -> None:
        """After the server stopped: flush the usage records, settle what is pending,
        close Redis clients."""
        if self.usage is not None:
            await self.usage.stop()
        if self.settler is not None:
            await self.settler.stop()
        if self.limiter is not None:
            await self.limiter.close()
        if self.concurrency is not None:
            await self.concurrency.close()
        if self.shared is not None:
            await self.shared.close()

    def tenant(self, tenant_id: str) -> TenantConfig:
        return self.auth.tenant(tenant_id) or ANONYMOUS

    def identify(self, metadata: object, hints: RouteHints) -> RouteHints:
        """At the edge: who is calling and what it may ask for (raises RouteError)."""
        if self.authenticator is None:
            return hints
        tenant = self.authenticator.tenant(metadata)
        return self.authenticator.authorise(tenant, hints, asked_priority(metadata))

    async def admit(
        self, hints: RouteHints, pick: PickRequest, call: CallRecord | None = None
    ) -> Release:
        """Apply the tenant's limits; returns the release to call when it finishes
        (exactly once counts: a second call gives nothing back). The tokens charged
        go into ``call.tokens_charged``, for ``call_ended`` to settle.

        The concurrency lease is counted first: a request refused for being one too
        many takes nothing from the rate limits; one refused by a rate limit takes no
        lease. With both, one script in Redis does it all (one round trip)."""
        tenant = self.tenant(hints.tenant)
        if tenant is ANONYMOUS:
            return no_release
        tokens = int(pick.work_tokens)
        rates = self.limiter.check(tenant, tokens) if self.limiter is not None else None
        release = no_release
        if self.concurrency is not None:
            release = await self.concurrency.acquire(tenant, rates)
        elif rates is not None:
            await rates.admit()
        if call is not None and rates is not None and tenant.tokens_per_min is not None:
            call.tokens_charged = tokens
        return release

    # As a CallObserver of the call interceptor (common.request.call): one usage
    # record per finished request (a unary call, or one request of a stream), at
    # the edge only (``usage`` is set there).
    def call_started(self, call: CallRecord) -> None:
        return None

    def call_ended(self, call: CallRecord) -> None:
        if call.hints is None or call.carries_requests:
            # The call failed before its caller was known, or a stream (each of its
            # requests is billed and settled on its own record).
            return
        if self.settler is not None and call.tokens_charged and call.tokens_reported:
            real = call.prompt_tokens + call.completion_tokens
            self.settler.add(self.tenant(call.hints.tenant), real - call.tokens_charged)
        if self.usage is None:  # not the edge
            return
        route = f"{self.route_above}/{call.route}" if self.route_above else call.route
        region, zone, gpu = ([*route.split("/"), "", "", ""])[:3] if route else ("", "", "")
        ok = call.code == grpc.StatusCode.OK
        self.usage.record(
            UsageRecord(
                tenant=call.hints.tenant or ANONYMOUS.id,
                model=call.model,
                region=region,
                zone=zone,
                gpu=gpu,
                prompt_tokens=call.prompt_tokens,
                completion_tokens=call.completion_tokens,
                gpu_seconds=call.elapsed_s if ok else 0.0,
                status=call.code.name,
                trace_id=call.trace_id,
                request_id=uuid.uuid4().hex,
                finished_at_ms=int(time.time() * 1000),
                tokens_reported=call.tokens_reported,
            )
        )


def edge_admission(
    auth: AuthConfig,
    redis_url: str,
    replicas: int = 1,
    usage_replicas_ack: int = 0,
    route_above: str = "",
) -> Admission:
    """The edge's (the global tier's, or an inner tier's OpenAI edge): API keys (when
    enabled), shared rate limits and concurrency caps, usage records (each batch on
    ``usage_replicas_ack`` Redis replicas before it counts as written). ``replicas``:
    how many processes of this edge share the quotas (each one's fallback while Redis
    is down is its 1/replicas share); ``route_above``: see ``Admission``."""
    limited = any(t.requests_per_s or t.tokens_per_min for t in auth.tenants)
    capped = any(t.max_concurrent is not None for t in auth.tenants)
    # One client for both quotas (one script admits a request to both), so Redis is up
    # or down for both at once. 200 ms: a busy event loop must not push a replica onto
    # its fallback share.
    shared = (
        QuotaRedis(
            redis_url,
            what="quota",
            fallback=f"limiting and capping each tenant in process at 1/{replicas} of its limits",
            timeout_s=0.2,
        )
        if limited or capped
        else None
    )
    limiter = TenantRateLimiter(shared, replicas=replicas) if shared and limited else None
    return Admission(
        auth,
        authenticator=Authenticator(auth) if auth.enabled else None,
        limiter=limiter,
        settler=QuotaSettler(limiter) if limiter is not None else None,
        concurrency=TenantConcurrency(shared, replicas=replicas) if shared and capped else None,
        usage=UsageRecorder(redis_url, replicas_ack=usage_replicas_ack),
        shared=shared,
        route_above=route_above,
    )


def inner_admission(auth: AuthConfig) -> Admission:
    """A regional or local tier's: no quota (the edge holds them all for the fleet)."""
    return Admission(auth)
