"""A tier's OpenAI-compatible HTTP endpoint: ``openai_listen`` and
``openai_timeout_s`` in the topology's ``global`` section, a region's entry or a
zone's entry, with the same meaning in each (served by
``common.request.openai_http``; at an inner tier as a client-facing entry of its
own, ``common.tier.client_entry``)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config.node import ConfigError, ConfigNode, Endpoint, parse_endpoint, require_positive

# How long an OpenAI HTTP request may run (its callers send no deadline).
DEFAULT_OPENAI_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class OpenAIEdgeConfig:
    """A tier's OpenAI-compatible HTTP (``common.request.openai_http``)."""

    endpoint: Endpoint
    # A request still running after this is cancelled and answered 504.
    timeout_s: float = DEFAULT_OPENAI_TIMEOUT_S

    @property
    def base_url(self) -> str:
        """What an OpenAI client is given as its base URL (``http://HOST:PORT/v1``)."""
        return f"http://{self.endpoint.address}/v1"


def parse_openai_edge(node: ConfigNode) -> OpenAIEdgeConfig | None:
    """``openai_listen`` (absent: no OpenAI HTTP) and its ``openai_timeout_s``, in the
    tier's entry ``node`` (``global``, ``regions[i]`` or ``regions[i].zones[j]``)."""
    text = node.get("openai_listen", None)
    timeout = node.get("openai_timeout_s", DEFAULT_OPENAI_TIMEOUT_S, kind=float)
    require_positive(node, "openai_timeout_s", timeout)
    if text is None:
        if "openai_timeout_s" in node.raw:
            raise ConfigError(f"{node.key_path('openai_timeout_s')}: set without openai_listen")
        return None
    return OpenAIEdgeConfig(parse_endpoint(text, node.key_path("openai_listen")), timeout)
