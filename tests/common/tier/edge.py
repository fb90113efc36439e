"""A global tier (the edge, tenants on) over one region child that answers in process."""

from __future__ import annotations

from common.config.access import AuthConfig
from common.config.node import Endpoint
from common.observability.tracing import Telemetry
from common.request.balancer import RankingBalancer
from common.request.children import Child, ChildSet
from common.request.forwarding import ForwardingPolicy
from common.request.proxy import TierSpec
from common.request.server import V2Server
from common.tenancy.admission import edge_admission
from common.tier.server import TierServer
from tests.common.request.front import InOrder
from tests.common.request.test_forwarding_loop import MODEL


def edge_tier(
    child: V2Server, auth: AuthConfig, redis_url: str, telemetry: Telemetry | None = None
) -> TierServer:
    """The edge over ``child`` (started), its tenants from ``auth`` and their limits in Redis."""
    children = ChildSet(
        [Child("us-east", Endpoint("127.0.0.1", child.port), frozenset({MODEL}))],
        probe_interval_s=1,
        summary_ttl_s=1,
        probe=False,
    )
    return TierServer(
        TierSpec(tier="global", trust_internal=False, resolve_origin=lambda hints: None),
        ForwardingPolicy(kind="region"),
        children,
        RankingBalancer(InOrder(), children),
        Endpoint("127.0.0.1", 0),
        admission=edge_admission(auth, redis_url),
        tenants=auth.tenant_ids,
        telemetry=telemetry,
    )
