"""What ``meridian deploy k8s`` may be told, and the conventions of a rendered fleet.

Every tier instance runs in pods of its own, so a port the topology leaves at 0
("pick one at launch") becomes its kind's conventional port (Triton's: gRPC
8001, HTTP 8000, metrics 8002); a port the topology names is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from cli.k8s.names import check_namespace
from common.config.node import ConfigError

GRPC_PORT = 8001
OPS_PORT = 8002
OPENAI_PORT = 8000
EXT_PROC_PORT = 9002
# Emulated GPUs of a zone: the i-th serves on GPU_PORT_BASE + i, its metrics on
# GPU_METRICS_PORT_BASE + i (loopback inside the local tier's pod).
GPU_PORT_BASE = 9000
GPU_METRICS_PORT_BASE = 9400
REDIS_PORT = 6379

# Where the pod finds its files (read-only mounts).
CONFIG_DIR = "/etc/meridian"
TOPOLOGY_DIR = f"{CONFIG_DIR}/config"
TOPOLOGY_FILE = f"{TOPOLOGY_DIR}/topology.yaml"
AUTH_DIR = f"{CONFIG_DIR}/auth"
AUTH_FILE = f"{AUTH_DIR}/auth.yaml"
TLS_DIR = f"{CONFIG_DIR}/tls"
# The non-root user the image runs as (Dockerfile).
RUN_AS = 10001

# Seconds beyond --grace a pod gets after SIGTERM: the 0.3 s NOT_SERVING notice
# (common.tier.server.DRAIN_NOTICE_S), then flushing usage records to Redis,
# closing channels and exporting the last spans.
SHUTDOWN_MARGIN_S = 5
# The global tier keeps serving this long after its pod is marked terminating and
# before SIGTERM: clients reach it through kube-proxy or a cloud load balancer,
# which take a few seconds to drop a terminating endpoint and watch no health.
EDGE_PRESTOP_S = 5

TLS_MODES = ("cert-manager", "secrets", "none")
SERVICE_TYPES = ("ClusterIP", "LoadBalancer", "NodePort")


@dataclass(frozen=True)
class RenderOptions:
    """How to render: the image, namespace and the choices a topology does not make."""

    image: str = "meridian:0.1.0"
    namespace: str = "meridian"
    # Seconds a tier finishes in-flight calls on SIGTERM (the tiers' --grace).
    grace_s: float = 5.0
    # Run each zone's emulated GPUs (``meridian worker``) beside its local tier.
    emulated_gpus: bool = False
    # cert-manager Certificates, Secrets from the topology's tls files, or plaintext.
    tls: str = "cert-manager"
    global_replicas: int = 2
    regional_replicas: int = 2
    max_replicas: int = 6
    # A Redis per region (``regions[].redis_url``) or the one Redis for everything.
    redis_per_region: bool = True
    global_service_type: str = "ClusterIP"
    log_format: str = "json"

    def __post_init__(self) -> None:
        if self.tls not in TLS_MODES:
            raise ConfigError(f"--tls: must be one of {', '.join(TLS_MODES)}, not {self.tls!r}")
        if self.global_service_type not in SERVICE_TYPES:
            raise ConfigError(f"--global-service-type: must be one of {', '.join(SERVICE_TYPES)}")
        if self.global_replicas < 2:
            raise ConfigError(
                f"--global-replicas: at least 2 (one replica cannot roll or be drained "
                f"without dropping the edge), not {self.global_replicas}"
            )
        if self.regional_replicas < 1:
            raise ConfigError(f"--regional-replicas: at least 1, not {self.regional_replicas}")
        if self.max_replicas < max(self.global_replicas, self.regional_replicas):
            raise ConfigError(
                "--max-replicas: must be at least --global-replicas and --regional-replicas"
            )
        check_namespace(self.namespace)
        if not self.image or any(c.isspace() for c in self.image):
            raise ConfigError(f"--image: not an image reference: {self.image!r}")

    @property
    def termination_grace_s(self) -> int:
        """What the pod gets after SIGTERM: --grace, rounded up, plus the margin."""
        return -int(-self.grace_s // 1) + SHUTDOWN_MARGIN_S
