"""Gray-failure settings: keepalive, the per-try timeout, the panic threshold and
what makes slow health probes count as a GPU down — their types, defaults, and how
the topology file's ``keepalive`` (with ``max_connection_age_s``), ``gpu_keepalive``,
``per_try_timeout``, ``panic_threshold`` and ``slow_probes_before_down`` keys are read.

A hung peer (stopped, not dead: no RST ever arrives) is found by gRPC keepalive
(an HTTP/2 PING every ``time_s``; no answer within ``timeout_s`` closes the
connection and fails its calls UNAVAILABLE). Between tiers both ends are Meridian,
so pings go every second. Towards GPU servers the default is what any stock gRPC
server accepts: Triton, like gRPC's own servers, answers a client that pings more
often than every 5 minutes (every 2 hours while it has no call) with GOAWAY
``too_many_pings`` after the third such ping, which fails the calls on that
connection. Meridian's emulated GPU accepts pings every 500 ms, so the demo fleet
pings it every second.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.config.node import ConfigError, ConfigNode

# A gRPC client sends at most one ping a second, whatever its keepalive time.
MIN_KEEPALIVE_TIME_S = 1.0
# A server closes (GOAWAY, calls in flight finish) a connection this old, so its
# clients re-resolve a replicated tier's name and find replicas that came since.
DEFAULT_MAX_CONNECTION_AGE_S = 300.0
# Below a second, connections would churn faster than a client re-resolves.
MIN_CONNECTION_AGE_S = 1.0


@dataclass(frozen=True)
class Keepalive:
    """gRPC keepalive on a connection: a PING every ``time_s`` (also while no call is
    open, when ``without_calls``); no answer within ``timeout_s`` closes it. A server
    closes a caller's connection at ``max_connection_age_s`` (gRPC adds ±10 % jitter),
    gracefully: calls in flight finish (only the ``keepalive`` key sets it)."""

    time_s: float = 1.0
    # 0.75 s, not 1: a hung peer is then found within 1.75 s, so a request held up on it
    # is answered elsewhere within the 2 s a partition may take to move traffic (at 1 s
    # the worst case was 2 s before the retry). A cross-region round trip (~0.3 s at
    # most) fits; a lossy long link may want more (the topology's keepalive key).
    timeout_s: float = 0.75
    without_calls: bool = True
    max_connection_age_s: float = DEFAULT_MAX_CONNECTION_AGE_S

    @property
    def detects_hang_s(self) -> float:
        """At most how long a hung peer goes unnoticed on a busy connection."""
        return self.time_s + self.timeout_s


# Safe towards any gRPC server left at its defaults (Triton's included): one ping
# per 5 minutes, only while a call is open, and gRPC's own 20 s timeout.
STOCK_SERVER_KEEPALIVE = Keepalive(time_s=300.0, timeout_s=20.0, without_calls=False)


@dataclass(frozen=True)
class PerTryTimeout:
    """Envoy's per-try timeout, from the expected service time of each attempt.

    An attempt that has sent nothing back to the caller after
    ``floor_s + multiple × expected`` seconds is cancelled and the request moves to
    another child. ``expected`` is the local tier's own estimate for the GPU
    (``local_lb.cost.attempt_expected_s``); upper tiers have none of their own and
    use ``upper_s_per_token`` × the request's work tokens (0: no per-try timeout at
    the regional and global tiers, whose hung children keepalive finds).
    """

    enabled: bool = True
    multiple: float = 4.0
    floor_s: float = 1.0
    upper_s_per_token: float = 0.0

    def limit_s(self, expected_s: float | None, work: float) -> float | None:
        """The attempt's time limit (None: none), from its expected service time
        (None: this tier has no estimate of its own) and its work in tokens."""
        if not self.enabled:
            return None
        if expected_s is None:
            if self.upper_s_per_token <= 0:
                return None
            expected_s = self.upper_s_per_token * work
        return self.floor_s + self.multiple * expected_s


@dataclass(frozen=True)
class Liveness:
    """Every gray-failure setting of a topology (see the module docstring)."""

    keepalive: Keepalive = field(default_factory=Keepalive)
    gpu_keepalive: Keepalive = STOCK_SERVER_KEEPALIVE
    per_try_timeout: PerTryTimeout = field(default_factory=PerTryTimeout)
    # Below this fraction of a zone's GPUs ready, route over every GPU up by direct
    # evidence (Envoy's healthy_panic_threshold, 50 %); 0 turns panic off.
    panic_threshold: float = 0.5
    # Health probes of a GPU that time out in a row, with no request succeeding on it
    # meanwhile, before it counts as down: one slow probe is slowness, not death.
    slow_probes_before_down: int = 3


def _keepalive(root: ConfigNode, key: str, default: Keepalive) -> Keepalive:
    if key not in root.raw:
        root.seen.add(key)
        return default
    node = root.child(key)
    time_s = node.get("time_s", default.time_s, kind=float)
    timeout_s = node.get("timeout_s", default.timeout_s, kind=float)
    without_calls = node.get("without_calls", default.without_calls, kind=bool)
    age = default.max_connection_age_s
    if key == "keepalive":  # GPU servers are not Meridian's: their server settings are theirs
        age = node.get("max_connection_age_s", age, kind=float)
    node.done()
    if age < MIN_CONNECTION_AGE_S:
        raise ConfigError(
            f"{node.key_path('max_connection_age_s')}: must be >= {MIN_CONNECTION_AGE_S}, got {age}"
        )
    if time_s < MIN_KEEPALIVE_TIME_S:
        raise ConfigError(
            f"{node.key_path('time_s')}: must be >= {MIN_KEEPALIVE_TIME_S} "
            f"(gRPC clients ping at most once a second), got {time_s}"
        )
    if timeout_s <= 0:
        raise ConfigError(f"{node.key_path('timeout_s')}: must be > 0, got {timeout_s}")
    return Keepalive(time_s, timeout_s, without_calls, age)


def _per_try(root: ConfigNode) -> PerTryTimeout:
    default = PerTryTimeout()
    if "per_try_timeout" not in root.raw:
        root.seen.add("per_try_timeout")
        return default
    node = root.child("per_try_timeout")
    enabled = node.get("enabled", default.enabled, kind=bool)
    multiple = node.get("multiple", default.multiple, kind=float)
    floor_s = node.get("floor_s", default.floor_s, kind=float)
    per_token = node.get("upper_s_per_token", default.upper_s_per_token, kind=float)
    node.done()
    # A limit below the expected time would cancel attempts going at normal speed.
    if multiple < 1:
        raise ConfigError(f"{node.key_path('multiple')}: must be >= 1, got {multiple}")
    if floor_s <= 0:
        raise ConfigError(f"{node.key_path('floor_s')}: must be > 0, got {floor_s}")
    if per_token < 0:
        raise ConfigError(f"{node.key_path('upper_s_per_token')}: must be >= 0, got {per_token}")
    return PerTryTimeout(enabled, multiple, floor_s, per_token)


def parse_liveness(root: ConfigNode) -> Liveness:
    """The gray-failure keys of a topology's root, each validated, defaults filled in."""
    default = Liveness()
    keepalive = _keepalive(root, "keepalive", default.keepalive)
    gpu_keepalive = _keepalive(root, "gpu_keepalive", default.gpu_keepalive)
    per_try = _per_try(root)
    panic = root.get("panic_threshold", default.panic_threshold, kind=float)
    if not 0.0 <= panic <= 1.0:
        raise ConfigError(f"panic_threshold: must be between 0 and 1, got {panic}")
    slow = root.get("slow_probes_before_down", default.slow_probes_before_down, kind=int)
    if slow < 1:
        raise ConfigError(f"slow_probes_before_down: must be >= 1, got {slow}")
    return Liveness(keepalive, gpu_keepalive, per_try, panic, slow)
