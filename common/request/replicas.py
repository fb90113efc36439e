"""Dialling a tier by name: every replica behind the name gets calls.

A tier's child (a regional or local tier) is dialled at its ``address``
(``common.config.addresses``), which may be a DNS name standing for several
replicas. The channel's target is ``<dns>host:port`` (``dns:///`` or
``dns://NAME-SERVER/``), so gRPC's DNS resolver turns the name into every address
it has; the ``round_robin`` policy keeps a subchannel to each and sends each call
to the next one that is READY. What this relies on, from gRPC's client:

* round_robin skips subchannels that are not READY: a replica that died (refused
  connection, or keepalive found it hung) is left out within one reconnect attempt
  or ``keepalive.detects_hang_s``, and is asked for the name again (re-resolution)
  when one of its subchannels fails;
* client-side health checking (``healthCheckConfig``): each subchannel follows
  grpc.health.v1 Watch of ``REPLICA_HEALTH`` on its own replica and is used only
  while that says SERVING. A stopping tier says NOT_SERVING there first
  (``common.tier.server``), so its parent stops sending to that replica before
  its connection closes. Only stopping changes it: a replica whose own children
  are all down stays in rotation (its answers carry a capacity hint, so the
  forwarding loop fails over without marking the name down), and the Admin API
  still reaches it;
* servers close connections at ``keepalive.max_connection_age_s`` (GOAWAY, calls
  in flight finish), so every client re-resolves at least that often and finds
  replicas that came since; a new resolution is allowed every
  ``MIN_RERESOLVE_MS``.

A tier's own health verdict on the child (the name as a whole) stays with
``common.request.health``: it watches over the same channel, so one replica's
stream; a break or a NOT_SERVING from it is confirmed over the channel before it
counts (another replica may still serve).
"""

from __future__ import annotations

import json

from common.config.node import Endpoint

# The grpc.health.v1 service name a tier reports for "this replica takes calls":
# SERVING from start until it begins to stop.
REPLICA_HEALTH = "meridian.replica"
# How soon after one resolution gRPC may resolve the name again (default 30 s).
MIN_RERESOLVE_MS = 1000

_SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": REPLICA_HEALTH},
    }
)


def replica_target(address: Endpoint, dns: str) -> str:
    """The channel target for ``address`` resolved by ``dns`` (``dns:///``, or
    ``dns://HOST:PORT/`` for a given name server)."""
    return f"{dns}{address.address}"


def replica_channel_options() -> list[tuple[str, str | int]]:
    """Channel arguments that spread calls over every replica behind a name."""
    return [
        ("grpc.service_config", _SERVICE_CONFIG),
        ("grpc.dns_min_time_between_resolutions_ms", MIN_RERESOLVE_MS),
    ]
