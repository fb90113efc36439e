"""The validation bench's zone and workload: one topology and one list of requests for both sides.

``zone_topology`` is one region with one zone of mixed hardware (an H100, two
A100s, a V100 by default) on loopback ports, at the bench's ``time_scale``, with
slow start off (both sides start with every GPU at full weight) and the client's
location at the region's, so the simulator adds no RTT. ``make_shots`` draws the
requests: a few shared system prompts, each request one of them followed by its
own user text of varied length, and varied ``max_tokens``; Poisson arrival times
at a given rate. Each ``Shot`` carries the real prompt text (what the real side
sends) and what the simulator is given instead: the prompt's token count as the
engine counts it (whitespace words) and its chained block hashes as
``common.request.prefix.prompt_block_hashes`` computes them, so the GPU model's
prefix cache sees exactly what the engine's does.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from common.basics.geo import GeoPoint
from common.basics.redis_embed import free_port
from common.config.gpu import GpuConfig
from common.config.topology import Topology, topology_from_mapping
from common.request.prefix import BLOCK_TOKENS, prompt_block_hashes
from sim.capacity import fleet_capacity_rps
from sim.requests import SIM_MODEL, SimRequest

REGION, ZONE = "val", "val-1a"
# Where the region, its zone and the client are: one point, so the RTT is 0.
SITE = GeoPoint(50.1, 8.7)
DEFAULT_HARDWARE = ("H100", "A100", "A100", "V100")
# The tenant the real local tier sees for a call without tenant metadata.
NO_TENANT = ""


@dataclass(frozen=True)
class ShapeSpec:
    """How requests are drawn: system prompts shared by all, then per-request parts.

    User text and ``max_tokens`` are log-uniform between their bounds (many short,
    a tail of long ones), as in published LLM traces.
    """

    system_prompt_words: tuple[int, ...] = (48, 96, 160, 256)
    user_words: tuple[int, int] = (8, 400)
    max_tokens: tuple[int, int] = (8, 256)


@dataclass(frozen=True, slots=True)
class Shot:
    """One request as both sides see it."""

    id: int
    at_s: float  # arrival, seconds after the run's start
    prompt: str
    prompt_tokens: int  # whitespace words, as the engine and the tiers count them
    max_tokens: int
    blocks: tuple[int, ...]  # the engine's block hashes of the whole prompt
    session: str | None = None  # sent as x-meridian-session

    def sim_request(self, offset_s: float = 0.0) -> SimRequest:
        return SimRequest(
            id=self.id,
            at_s=offset_s + self.at_s,
            city="site",
            origin=SITE,
            tenant=NO_TENANT,
            prompt_tokens=self.prompt_tokens,
            # The emulated engine decodes exactly max_tokens: its true length.
            output_tokens=self.max_tokens,
            max_tokens=self.max_tokens,
            prefix_blocks=self.blocks,
            session=self.session,
        )


def zone_topology(
    redis_url: str,
    *,
    hardware: Sequence[str] = DEFAULT_HARDWARE,
    time_scale: float,
    max_concurrency: int = 16,
    health_interval_s: float = 0.5,
) -> Topology:
    """One zone of ``hardware`` GPUs serving ``SIM_MODEL``, every listener on a free port.
    ``A100@0.5`` is an A100 throttled to half its speed."""
    where = {"lat": SITE.lat, "lon": SITE.lon}
    gpus = []
    for i, spec in enumerate(hardware):
        hw, _, throttle = spec.partition("@")
        gpu = {
            "name": f"g{i}-{hw.lower()}",
            "hardware": hw,
            "models": [SIM_MODEL],
            "max_concurrency": max_concurrency,
            "listen": f"127.0.0.1:{free_port()}",
            "metrics_listen": f"127.0.0.1:{free_port()}",
        }
        if throttle:
            gpu["throttle"] = float(throttle)
        gpus.append(gpu)
    zone: dict[str, Any] = {
        "name": ZONE,
        "location": where,
        "listen": f"127.0.0.1:{free_port()}",
        "gpus": gpus,
    }
    return topology_from_mapping(
        {
            "redis_url": redis_url,
            "time_scale": time_scale,
            "slow_start_window_s": 0,
            "health_interval_s": health_interval_s,
            # No tenants, no keys: the client calls the local tier as its regional tier would.
            "auth": {"enabled": False, "tenants": []},
            # The upper tiers never listen in this bench; the simulator builds them.
            "global": {"listen": "127.0.0.1:1", "location": where},
            "regions": [
                {"name": REGION, "location": where, "listen": "127.0.0.1:2", "zones": [zone]}
            ],
        }
    )


def zone_gpus(topology: Topology) -> tuple[GpuConfig, ...]:
    return topology.zone(REGION, ZONE).gpus


def _words(rng: random.Random, n: int, tag: str) -> list[str]:
    # Distinct spellings per tag: a user's text never continues a system prompt by chance.
    return [f"{tag}{rng.randrange(5000)}" for _ in range(n)]


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


@dataclass(frozen=True)
class Shape:
    prompt: str
    max_tokens: int
    # Prompt words a warm prefix cache serves: the whole blocks of the shared system
    # prompt, or of a session's history (the last turn and its answer).
    shared_words: int
    session: str | None = None


def draw_shapes(n: int, spec: ShapeSpec, rng: random.Random) -> list[Shape]:
    """``n`` prompts and their ``max_tokens`` (system prompts drawn once, shared)."""
    systems = [" ".join(_words(rng, w, f"s{i}w")) for i, w in enumerate(spec.system_prompt_words)]
    shapes = []
    for i in range(n):
        system = systems[rng.randrange(len(systems))]
        user = " ".join(_words(rng, _log_uniform(rng, *spec.user_words), f"u{i}w"))
        shared = len(system.split()) // BLOCK_TOKENS * BLOCK_TOKENS
        shapes.append(Shape(f"{system} {user}", _log_uniform(rng, *spec.max_tokens), shared))
    return shapes


def draw_sessions(n: int, spec: ShapeSpec, rng: random.Random, turns: int = 4) -> list[Shape]:
    """``n`` requests of multi-turn sessions: each turn's prompt is the previous one, the
    previous answer (words standing for its ``max_tokens``) and a new user text, so a
    turn shares its whole history as a prefix with the last. Every session's first turn
    comes first, then every second turn, and so on: a session's turns arrive in order,
    a few hundred requests apart (the user reading and typing)."""
    systems = [" ".join(_words(rng, w, f"s{i}w")) for i, w in enumerate(spec.system_prompt_words)]
    sessions = max(1, n // turns)
    history = [systems[rng.randrange(len(systems))] for _ in range(sessions)]
    shapes: list[Shape] = []
    for turn in range(turns):
        for s in range(sessions):
            if len(shapes) == n:
                return shapes
            user = " ".join(_words(rng, _log_uniform(rng, *spec.user_words), f"u{s}t{turn}w"))
            prompt = f"{history[s]} {user}"
            max_tokens = _log_uniform(rng, *spec.max_tokens)
            shared = len(history[s].split()) // BLOCK_TOKENS * BLOCK_TOKENS
            shapes.append(Shape(prompt, max_tokens, shared, session=f"session-{s}"))
            answer = " ".join(_words(rng, max_tokens, f"a{s}t{turn}w"))
            history[s] = f"{prompt} {answer}"
    return shapes


def draw_unshared_sessions(
    n: int, spec: ShapeSpec, rng: random.Random, turns: int = 4
) -> list[Shape]:
    """``n`` requests of multi-turn sessions whose turns share no history: each turn is
    an independent prompt (a shared system prompt and its own user text, as
    ``draw_shapes``) sent with its session's id, in ``draw_sessions``' order. The
    session header then carries no cache benefit: what sticking to a session's GPU
    costs shows alone."""
    sessions = max(1, n // turns)
    return [
        replace(shape, session=f"session-{i % sessions}")
        for i, shape in enumerate(draw_shapes(n, spec, rng))
    ]


@dataclass(frozen=True)
class MeanShape:
    prompt: float  # tokens (whitespace words)
    uncached_prompt: float  # what is left to prefill once the system prompts are cached
    output: float


def mean_shape(shapes: Sequence[Shape]) -> MeanShape:
    n = len(shapes)
    prompt = sum(len(s.prompt.split()) for s in shapes) / n
    shared = sum(s.shared_words for s in shapes) / n
    return MeanShape(prompt, prompt - shared, sum(s.max_tokens for s in shapes) / n)


def zone_capacity_rps(topology: Topology, shapes: Sequence[Shape], *, warm: bool = True) -> float:
    """The zone's capacity for these shapes in requests per *real* second.

    ``sim.capacity`` assumes no prefix-cache hits; with ``warm`` it is given the
    mean prompt a warm cache leaves to prefill (every system prompt's whole
    blocks cached on every GPU, which this workload reaches after its first few
    requests), so that 85 % load is 85 % of what the zone can really do. It
    also assumes time scale 1: a slower emulated clock divides it by the scale.
    """
    mean = mean_shape(shapes)
    prompt = mean.uncached_prompt if warm else mean.prompt
    return fleet_capacity_rps(zone_gpus(topology), prompt, mean.output) / topology.time_scale


def make_shots(shapes: Sequence[Shape], rate_rps: float, rng: random.Random) -> list[Shot]:
    """Poisson arrivals at ``rate_rps`` for ``shapes``, in order; the first at t = 0."""
    if rate_rps <= 0:
        raise ValueError(f"the arrival rate must be > 0 requests/s, got {rate_rps}")
    shots, t = [], 0.0
    for i, shape in enumerate(shapes):
        if i:
            t += rng.expovariate(rate_rps)
        prompt = shape.prompt
        blocks = tuple(prompt_block_hashes(prompt, model=SIM_MODEL))
        words = len(prompt.split())
        shots.append(Shot(i, t, prompt, words, shape.max_tokens, blocks, shape.session))
    return shots
