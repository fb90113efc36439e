"""One GPU inference server of a topology: its hardware class, models, limits and TLS.

Hardware classes set a GPU's relative speed and KV-cache size; a model may be
listed with versions (``demo-llm@2``). ``protocol`` says how the local tier talks to
the server: ``v2`` (KServe V2 gRPC, the default) or ``openai`` (OpenAI HTTP, as vLLM,
SGLang, TGI and llama.cpp's server speak it; its metrics on the same port's
``/metrics`` unless ``metrics_listen`` says otherwise). ``parse_gpu`` reads one entry of a
zone's ``gpus`` (``common.config.topology``), every bad value a ``ConfigError``
naming its key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from common.config.access import GpuTls, parse_gpu_tls
from common.config.node import (
    ConfigError,
    ConfigNode,
    Endpoint,
    parse_endpoint,
    require_positive,
)

# Relative speed of each hardware class, A100 = 1.0 (DESIGN.md: H100 ~ 2x A100,
# A100 ~ 1.7x V100).
HARDWARE_SPEED: Mapping[str, float] = {"V100": 0.6, "A100": 1.0, "H100": 2.0, "H200": 2.3}
# KV-cache capacity in tokens of a typical 7-13B model on each class's memory.
HARDWARE_KV_TOKENS: Mapping[str, int] = {
    "V100": 16_384,
    "A100": 65_536,
    "H100": 81_920,
    "H200": 131_072,
}


DEFAULT_VERSIONS = frozenset({"1"})
PROTOCOLS = ("v2", "openai")


@dataclass(frozen=True)
class GpuConfig:
    """One GPU inference server (a V2 endpoint) behind a local tier."""

    name: str
    endpoint: Endpoint
    metrics_endpoint: Endpoint
    hardware: str
    models: tuple[str, ...]
    throttle: float = 1.0
    max_concurrency: int = 16
    kv_cache_tokens: int = 65_536
    # Versions served per model; a model listed without "@version" serves version "1".
    versions: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # The local tier dials it with TLS (None: plaintext, the default).
    tls: GpuTls | None = None
    # The emulated GPU reports its token counts in its responses (false: it
    # reports none, as a server without them would; the edge bills estimates).
    report_tokens: bool = True
    # How the local tier talks to it: "v2" (KServe V2 gRPC) or "openai" (OpenAI HTTP).
    protocol: str = "v2"
    # Of max_concurrency, the slots this local-tier process may fill (None: all of them).
    # Not a topology key: ``meridian local --workers N`` splits each GPU's slots between
    # its N workers (``split_slots``), so together they never exceed max_concurrency.
    held_slots: int | None = None

    @property
    def slots(self) -> int:
        """The slots this process may fill: ``held_slots``, else ``max_concurrency``."""
        return self.max_concurrency if self.held_slots is None else self.held_slots

    def serves(self, model: str, version: str = "") -> bool:
        """True when this GPU serves ``model`` (at ``version``, when one is asked for)."""
        if model not in self.models:
            return False
        return not version or version in self.versions.get(model, DEFAULT_VERSIONS)

    @property
    def speed(self) -> float:
        """Effective speed relative to an A100: hardware class times throttle."""
        return HARDWARE_SPEED[self.hardware] * self.throttle


def parse_gpu(node: ConfigNode) -> GpuConfig:
    """One entry of a zone's ``gpus``."""
    hardware = node.get("hardware", kind=str)
    if hardware not in HARDWARE_SPEED:
        raise ConfigError(
            f"{node.key_path('hardware')}: unknown hardware class {hardware!r}; "
            f"known: {sorted(HARDWARE_SPEED)}"
        )
    entries = node.get("models", kind=list)
    if not entries or not all(isinstance(m, str) and m and not m.startswith("@") for m in entries):
        raise ConfigError(
            f"{node.key_path('models')}: expected a non-empty list of model names "
            "('name' or 'name@version')"
        )
    versions: dict[str, set[str]] = {}
    for entry in entries:
        name, _, version = entry.partition("@")
        versions.setdefault(name, set()).add(version or "1")
    models = list(versions)
    throttle = node.get("throttle", 1.0, kind=float)
    if not 0 < throttle <= 1:
        raise ConfigError(f"{node.key_path('throttle')}: must be in (0, 1], got {throttle}")
    max_concurrency = node.get("max_concurrency", 16, kind=int)
    require_positive(node, "max_concurrency", max_concurrency)
    kv_tokens = node.get("kv_cache_tokens", HARDWARE_KV_TOKENS[hardware], kind=int)
    require_positive(node, "kv_cache_tokens", kv_tokens)
    protocol = parse_protocol(node)
    listen = node.get("listen")
    # vLLM and SGLang serve /metrics on their API port.
    metrics_default = listen if protocol == "openai" else "127.0.0.1:0"
    gpu = GpuConfig(
        name=node.get("name", kind=str),
        endpoint=parse_endpoint(listen, node.key_path("listen")),
        metrics_endpoint=parse_endpoint(
            node.get("metrics_listen", metrics_default), node.key_path("metrics_listen")
        ),
        hardware=hardware,
        models=tuple(models),
        throttle=throttle,
        max_concurrency=max_concurrency,
        kv_cache_tokens=kv_tokens,
        versions={m: frozenset(v) for m, v in versions.items()},
        tls=parse_gpu_tls(node),
        report_tokens=node.get("report_tokens", True, kind=bool),
        protocol=protocol,
    )
    if protocol == "openai" and gpu.tls is not None:
        raise ConfigError(
            f"{node.key_path('tls')}: not supported with protocol 'openai' (the local tier "
            "speaks plain HTTP to OpenAI servers; leave tls out)"
        )
    node.done()
    return gpu


def split_slots(gpu: GpuConfig, workers: int, index: int, key: str) -> GpuConfig:
    """``gpu`` as worker ``index`` of ``workers`` holds it: ``max_concurrency // workers``
    slots, the remainder one each to the first workers. A GPU with fewer slots than
    workers cannot be split without exceeding it: ConfigError naming ``key`` (the GPU's
    ``max_concurrency`` path)."""
    if not 0 <= index < workers:
        raise ValueError(f"worker index {index} is not in 0..{workers - 1}")
    if gpu.max_concurrency < workers:
        raise ConfigError(
            f"{key}: {gpu.max_concurrency} slots cannot be split between {workers} workers "
            f"(--workers); each worker must hold at least one"
        )
    share, extra = divmod(gpu.max_concurrency, workers)
    return replace(gpu, held_slots=share + (1 if index < extra else 0))


def parse_protocol(node: ConfigNode) -> str:
    """A GPU's ``protocol``: ``v2`` (default) or ``openai``."""
    protocol = node.get("protocol", "v2", kind=str)
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"{node.key_path('protocol')}: unknown protocol {protocol!r}; known: {list(PROTOCOLS)}"
        )
    return protocol
