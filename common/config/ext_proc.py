"""A zone's endpoint-picker mode: the ``ext_proc`` section of a zone in the topology.

With it the zone's local tier also serves Envoy's external processing API
(``envoy.service.ext_proc.v3.ExternalProcessor``) on ``listen``, answering Envoy
with the GPU to send each request to (``local_lb.ext_proc``):

```yaml
zones:
- name: eu-west-1a
  listen: 10.0.0.5:9001
  ext_proc:
    listen: 10.0.0.5:9002   # Envoy's ext_proc filter dials this
    fallbacks: 2            # GPUs named after the chosen one, for Envoy's retries
    max_wait_s: 5           # longest wait for a free slot (below Envoy's message_timeout)
```
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config.node import ConfigError, ConfigNode, Endpoint, parse_endpoint, require_positive

DEFAULT_FALLBACKS = 2
# Envoy's ext_proc filter waits message_timeout for each answer (the example
# configuration in deploy/envoy sets 10 s): the picker's queue wait stays below it.
DEFAULT_MAX_WAIT_S = 5.0
MAX_FALLBACKS = 8


@dataclass(frozen=True)
class ExtProcConfig:
    """Where the picker listens and how it answers."""

    listen: Endpoint
    # Endpoints after the chosen one in the answer (a data plane that walks the list on
    # retries, as Envoy's override_host policy does); 0 for an ORIGINAL_DST cluster,
    # which reads exactly one address from the header.
    fallbacks: int = DEFAULT_FALLBACKS
    # A request that finds every GPU full waits at most this long in the central queue
    # (or its own grpc-timeout, if shorter); then 504, or 429 at once when it could not
    # be served in time anyway.
    max_wait_s: float = DEFAULT_MAX_WAIT_S


def parse_ext_proc(zone: ConfigNode) -> ExtProcConfig | None:
    """The zone's optional ``ext_proc`` section (absent: the mode is off)."""
    if "ext_proc" not in zone.raw:
        zone.seen.add("ext_proc")
        return None
    node = zone.child("ext_proc")
    fallbacks = node.get("fallbacks", DEFAULT_FALLBACKS, kind=int)
    if not 0 <= fallbacks <= MAX_FALLBACKS:
        raise ConfigError(
            f"{node.key_path('fallbacks')}: must be between 0 and {MAX_FALLBACKS}, got {fallbacks}"
        )
    max_wait = node.get("max_wait_s", DEFAULT_MAX_WAIT_S, kind=float)
    require_positive(node, "max_wait_s", max_wait)
    config = ExtProcConfig(
        listen=parse_endpoint(node.get("listen"), node.key_path("listen")),
        fallbacks=fallbacks,
        max_wait_s=max_wait,
    )
    node.done()
    return config
