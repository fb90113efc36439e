"""A synthetic workload for the fleet simulator: who asks what, from where, when.

``WorkloadSpec`` holds it all; ``generate(spec)`` yields ``SimRequest`` lazily in
arrival order, ids 0..n-1, until ``duration_s`` or ``max_requests``.

- Shapes (``sim.shapes``): prompt and output token counts fitted to the Azure
  2023 traces' mean, median and P99 (``CODE``, ``CONVERSATION``); every request
  draws both, so the stream has the published distributions whatever else is on.
- Arrivals (``sim.arrivals``): a renewal process with the shape's inter-arrival
  CV at ``rate_rps``; each arrival's city by weight × the diurnal curve of its
  local time, its tenant by weight; ``Boost`` windows multiply some cities' or a
  tenant's rate (flash crowd, tenant flood).
- Caps (``sim.caps``): each request's ``max_tokens`` drawn from the clients' mix
  (``caps``), from a generator of its own; the true length is cut at the cap.
- Prefix sharing (``sim.sessions``): tenants' shared system prompts, and
  multi-turn sessions whose turns extend the previous turn's blocks.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from common.basics.vocabulary import Priority
from common.request.prefix import BLOCK_TOKENS
from sim.arrivals import Arrivals, Boost, Mixer
from sim.caps import DEFAULT_CAPS, CapDraw, ClientCaps
from sim.geography import CITIES, City
from sim.requests import SIM_MODEL, SimRequest
from sim.sessions import MIN_MESSAGE_TOKENS, BlockIds, Session, SessionBook, SystemPrompts
from sim.shapes import CODE, CONVERSATION, KV_CAP_TOKENS, SHAPES, RequestShape
from sim.stats import cumulative_shares

__all__ = [
    "CODE",
    "CONVERSATION",
    "KV_CAP_TOKENS",
    "SHAPES",
    "Boost",
    "RequestShape",
    "TenantMix",
    "WorkloadSpec",
    "generate",
    "mean_request_shape",
]

# mean_request_shape estimates the shared-prefix fraction on this many requests.
SHARED_FRACTION_SAMPLE = 50_000
ARRIVAL_CHUNK = 256


@dataclass(frozen=True)
class TenantMix:
    """A tenant of the workload: its share of requests and the priority it sends."""

    id: str
    weight: float
    priority: Priority = Priority.STANDARD


DEFAULT_TENANTS = (
    TenantMix("enterprise", 0.45),
    TenantMix("team", 0.30),
    TenantMix("batch", 0.15, Priority.SHEDDABLE),
    TenantMix("free-tier", 0.10, Priority.SHEDDABLE),
)


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything ``generate`` needs; every field is checked (``ValueError`` naming it).

    ``session_fraction`` is the share of requests meant to belong to multi-turn
    sessions of ``mean_turns`` turns on average (at least 2), spaced by an
    exponential think time of mean ``think_time_s``. A session ends early when its
    context outgrows the prompts the shape draws, so the realised share is lower
    (about 0.27 for the default 0.3 on conversation shapes).
    ``start_utc_hour`` is the UTC hour at time 0; ``day_length_s`` compresses a
    day so that a short run spans one (86 400 = real time).
    """

    shape: RequestShape = CONVERSATION
    rate_rps: float = 100.0
    duration_s: float | None = 60.0
    max_requests: int | None = None
    seed: int = 0
    cities: tuple[City, ...] = CITIES
    diurnal: bool = True
    start_utc_hour: float = 12.0
    day_length_s: float = 86_400.0
    tenants: tuple[TenantMix, ...] = DEFAULT_TENANTS
    system_prompts_per_tenant: int = 4
    system_prompt_tokens: tuple[int, int] = (256, 1024)
    session_fraction: float = 0.3
    mean_turns: float = 4.0
    think_time_s: float = 30.0
    boosts: tuple[Boost, ...] = ()
    # None: the shape's own (1.1 for conversation, 13 for code).
    interarrival_cv: float | None = None
    model: str = SIM_MODEL
    # The models requests ask for, by weight (empty: ``model`` alone).
    models: tuple[tuple[str, float], ...] = ()
    # How clients set max_tokens (sim.caps); the true length is the shape's draw.
    caps: ClientCaps = DEFAULT_CAPS

    def __post_init__(self) -> None:
        _check_bounds(self)
        _check_people(self)
        _check_prefixes(self)
        for i, boost in enumerate(self.boosts):
            _check_boost(self, i, boost)

    def mixer(self) -> Mixer:
        """Who sends each arrival (``sim.arrivals.Mixer``): cities by weight × the diurnal
        curve, tenants by weight, this spec's boosts."""
        return Mixer(
            self.cities,
            [(t.id, t.weight) for t in self.tenants],
            boosts=self.boosts,
            diurnal=self.diurnal,
            start_utc_hour=self.start_utc_hour,
            day_length_s=self.day_length_s,
        )

    def mean_tokens(self) -> tuple[float, float]:
        """Mean prompt and mean output tokens as the GPUs see them (the output's true
        lengths cut at the clients' caps): what capacity is counted in. Only the means:
        the shared-prefix fraction (``mean_request_shape``) plays no part in capacity."""
        return self.shape.prompt.mean, self.caps.mean_output(self.shape.output.table)

    @property
    def cv(self) -> float:
        return self.shape.interarrival_cv if self.interarrival_cv is None else self.interarrival_cv


def _fail(name: str, what: str) -> None:
    raise ValueError(f"WorkloadSpec.{name} {what}")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        _fail(name, f"must be a number > 0, got {value!r}")


def _check_bounds(spec: WorkloadSpec) -> None:
    _positive("rate_rps", spec.rate_rps)
    if spec.duration_s is None and spec.max_requests is None:
        _fail("duration_s", "and max_requests are both None: set one (a workload must end)")
    if spec.duration_s is not None:
        _positive("duration_s", spec.duration_s)
    if spec.max_requests is not None and (
        not isinstance(spec.max_requests, int) or spec.max_requests < 1
    ):
        _fail("max_requests", f"must be an integer >= 1, got {spec.max_requests!r}")
    _positive("day_length_s", spec.day_length_s)
    if not 0 <= spec.start_utc_hour < 24:
        _fail("start_utc_hour", f"must be in [0, 24), got {spec.start_utc_hour!r}")
    if spec.interarrival_cv is not None:
        _positive("interarrival_cv", spec.interarrival_cv)
    if not spec.model:
        _fail("model", "must be a model name, got ''")
    for i, (name, weight) in enumerate(spec.models):
        if not name or not (
            isinstance(weight, int | float) and math.isfinite(weight) and weight > 0
        ):
            _fail(f"models[{i}]", f"must be (a model name, a weight > 0), got {(name, weight)!r}")


def _check_people(spec: WorkloadSpec) -> None:
    if not spec.cities:
        _fail("cities", "must list at least one city")
    names = [c.name for c in spec.cities]
    if len(set(names)) != len(names):
        _fail("cities", f"has duplicate names: {sorted({n for n in names if names.count(n) > 1})}")
    for city in spec.cities:
        if not city.weight > 0:
            _fail("cities", f"weight of {city.name!r} must be > 0, got {city.weight!r}")
    if not spec.tenants:
        _fail("tenants", "must list at least one tenant")
    ids = [t.id for t in spec.tenants]
    if len(set(ids)) != len(ids) or not all(ids):
        _fail("tenants", f"ids must be non-empty and distinct, got {ids}")
    for tenant in spec.tenants:
        if not tenant.weight > 0:
            _fail("tenants", f"weight of {tenant.id!r} must be > 0, got {tenant.weight!r}")


def _check_prefixes(spec: WorkloadSpec) -> None:
    if spec.system_prompts_per_tenant < 0:
        _fail("system_prompts_per_tenant", f"must be >= 0, got {spec.system_prompts_per_tenant}")
    lo, hi = spec.system_prompt_tokens
    if not BLOCK_TOKENS <= lo <= hi:
        _fail(
            "system_prompt_tokens",
            f"must be (low, high) with {BLOCK_TOKENS} <= low <= high, "
            f"got {spec.system_prompt_tokens}",
        )
    if not 0 <= spec.session_fraction < 1:
        _fail("session_fraction", f"must be in [0, 1), got {spec.session_fraction!r}")
    if not spec.mean_turns >= 2:
        _fail(
            "mean_turns",
            f"must be >= 2 (a session has at least two turns), got {spec.mean_turns!r}",
        )
    _positive("think_time_s", spec.think_time_s)


def _check_boost(spec: WorkloadSpec, i: int, boost: Boost) -> None:
    name = f"boosts[{i}]"
    if not 0 <= boost.start_s < boost.end_s:
        _fail(name, f"needs 0 <= start_s < end_s, got {boost.start_s} and {boost.end_s}")
    _positive(f"{name}.factor", boost.factor)
    if boost.cities is not None:
        unknown = sorted(boost.cities - {c.name for c in spec.cities})
        if unknown or not boost.cities:
            _fail(
                f"{name}.cities",
                f"must name known cities, got unknown {unknown}; "
                f"known: {', '.join(c.name for c in spec.cities)}",
            )
    if boost.tenant is not None and boost.tenant not in {t.id for t in spec.tenants}:
        _fail(
            f"{name}.tenant",
            f"must name a tenant of the workload, got {boost.tenant!r}; "
            f"known: {', '.join(t.id for t in spec.tenants)}",
        )


class _Stream:
    """One pass over a spec: draws every request and counts shared prefix tokens.

    Arrivals draw from their own generator (seeded from ``seed``), so changing the
    prefix or session settings leaves the arrival times and origins as they were."""

    def __init__(self, spec: WorkloadSpec) -> None:
        self.spec = spec
        self.rng = rng = random.Random(f"content:{spec.seed}")
        mixer = spec.mixer()
        self.arrivals = Arrivals(
            mixer, rate_rps=spec.rate_rps, cv=spec.cv, rng=random.Random(f"arrivals:{spec.seed}")
        )
        self.caps = CapDraw(spec.caps, random.Random(f"caps:{spec.seed}"))
        self.models_rng = random.Random(f"models:{spec.seed}")
        self.ids = BlockIds(rng)
        self.system = SystemPrompts(
            len(spec.tenants),
            spec.system_prompts_per_tenant,
            spec.system_prompt_tokens,
            self.ids,
            rng,
        )
        self.book = SessionBook(spec.think_time_s, int(spec.shape.prompt.ceiling), rng)
        # Share of fresh requests that open a session so that the share of requests in
        # sessions is session_fraction: phi = sT / (1 + s(T - 1)) solved for s.
        phi, turns = spec.session_fraction, spec.mean_turns
        self.open_p = phi / (turns - phi * (turns - 1))
        extra = turns - 2.0  # turns beyond the second: geometric with this mean
        self.log_q = math.log(extra / (1.0 + extra)) if extra > 0 else 0.0
        self.sessions = 0
        self.prompt_tokens = 0
        self.shared_tokens = 0

    def _turns(self) -> int:
        if not self.log_q:
            return 2
        return 2 + int(math.log(1.0 - self.rng.random()) / self.log_q)

    def _open(self, key: int, prompt: int, output: int, blocks: tuple[int, ...], at: float) -> str:
        self.sessions += 1
        session = Session(f"s{self.sessions}", key, self._turns() - 1, prompt, output, blocks)
        self.book.after_turn(session, at)
        return session.id

    def _arrivals(self) -> Iterator[list[tuple[float, int]]]:
        """Chunks of (time, pair index) until the spec's end (the last one cut there)."""
        spec = self.spec
        left = spec.max_requests if spec.max_requests is not None else math.inf
        end = spec.duration_s if spec.duration_s is not None else math.inf
        while left > 0:
            chunk = self.arrivals.chunk(int(min(left, ARRIVAL_CHUNK)))
            left -= len(chunk)
            if chunk[-1][0] > end:
                yield [a for a in chunk if a[0] <= end]
                return
            yield chunk

    def __iter__(self) -> Iterator[SimRequest]:
        spec, uniform, block = self.spec, self.rng.random, BLOCK_TOKENS
        cities, tenants = spec.cities, spec.tenants
        senders = [(c.name, c.location, t.id, t.priority) for c in cities for t in tenants]
        n_tenants, model, open_p = len(spec.tenants), spec.model, self.open_p
        cap = self.caps.draw
        models = cumulative_shares(spec.models)
        if len(models) == 1:  # one model: nothing to draw
            model, models = models[0][1], []
        model_draw = self.models_rng.random
        prompts, outputs = spec.shape.prompt.table, spec.shape.output.table
        n_prompts, n_outputs = len(prompts), len(outputs)
        book, extend, system = self.book, self.ids.extend, self.system.choose
        waiting, after_turn = book.waiting, book.after_turn
        arrivals = (a for chunk in self._arrivals() for a in chunk)
        for n, (t, pair) in enumerate(arrivals):
            output = outputs[int(uniform() * n_outputs)]
            prompt = prompts[int(uniform() * n_prompts)]
            if t >= book.next_ready:
                book.wake(t)
            pool = waiting.get(pair)
            turn = book.take(pool, prompt) if pool and pool[0].required <= prompt else None
            if turn is not None:
                shared = turn.blocks
                blocks = extend(shared, prompt)
                turn.next_turn(prompt, output, blocks)
                after_turn(turn, t)
                session_id: str | None = turn.id
            else:
                size, shared = system(pair % n_tenants, uniform())
                if size + MIN_MESSAGE_TOKENS > prompt:
                    shared = ()
                blocks = extend(shared, prompt)
                session_id = None
                if uniform() < open_p:
                    session_id = self._open(pair, prompt, output, blocks, t)
            self.prompt_tokens += prompt
            self.shared_tokens += len(shared) * block
            city, origin, tenant, priority = senders[pair]
            max_tokens, output = cap(prompt, output)
            if models:
                u = model_draw()
                model = next(m for share, m in models if u < share)
            yield SimRequest(
                n,
                t,
                city,
                origin,
                tenant,
                prompt,
                output,
                blocks,
                session_id,
                priority,
                model,
                max_tokens=max_tokens,
                shared_blocks=len(shared),
            )


def generate(spec: WorkloadSpec) -> Iterator[SimRequest]:
    """The spec's requests, lazily, in arrival order with ids 0..n-1."""
    return iter(_Stream(spec))


def mean_request_shape(spec: WorkloadSpec) -> tuple[float, float, float]:
    """(mean prompt tokens, mean output tokens, expected fraction of prompt tokens that
    are a shared prefix: a system prompt's or an earlier turn's blocks).

    The means are the fitted distributions' (every request draws from them); the
    shared fraction is measured on the spec's first ``SHARED_FRACTION_SAMPLE``
    requests (same seed, whatever its duration), which is what a run of it sees.
    """
    sample = dataclasses.replace(spec, duration_s=None, max_requests=SHARED_FRACTION_SAMPLE)
    stream = _Stream(sample)
    for _ in stream:
        pass
    shared = stream.shared_tokens / stream.prompt_tokens if stream.prompt_tokens else 0.0
    return spec.shape.prompt.mean, spec.shape.output.mean, shared
