"""A greedy clairvoyant reference: one central queue over the whole fleet, perfect knowledge.

Not a bound, and no claim that a router cannot do better: it sees every GPU's
true state and speed and every answer's true length the instant they change
(knowledge no router has), keeps every request in one central FIFO, and binds
a request to a GPU only when that GPU admits it at once (a free concurrency
slot and room for its KV reservation, ``prompt + output``) — late binding, so
no request ever waits in a GPU's own queue while another GPU could take it.
Among the GPUs that admit it, it takes the one where the request's *own*
completion time is least:

    rtt(origin, region) + prefill of the part the GPU's own prefix cache lacks
                        + output decode steps at the batch it joins

(``completion_s``; the engine's step formula at the GPU's effective speed).
Greedy per request, it leaves out what its choice costs the others: the
prefill it adds to the step time of every request already batched on that GPU
(most of a step's cost under load in this engine), so it fills the fastest
GPUs to their slot limit and leaves slow ones idle, and its tail can be far
worse than a router's. The wait until the GPU's next step boundary (at most
one step, a few ms) is left out. When nothing admits the head of the queue,
it waits there until a job finishes somewhere (``job.done`` callbacks), then
goes at once. The lower bound every policy is measured against is
``sim.bound``.

Cost per request is O(groups), not O(GPUs): GPUs alike but for load and cache
form a group whose least-loaded GPU is its heap's top (``sim.greedy_fleet``).
Prefix holders are found in a small index of where prompts were sent
(``sim.greedy_index``); the GPU's real cache then says exactly how much it
holds (``PrefixCache.peek``, which touches nothing). A group's best GPU is
asked too when its cache could still change the answer.

Failures: a GPU that dies before a request's first token costs a retry
elsewhere (no byte reached the client; it never sends to a dead GPU);
after the first token the request has failed as the client sees it. GPUs that
come back or change speed are regrouped at once when ``refresh()`` is called,
and in any case within ``REFRESH_S`` of simulated time.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import grpc

from common.basics.geo import GeoPoint
from common.request.prefix import BLOCK_TOKENS
from sim.engine import step_cost_s
from sim.gpu_model import GpuFailed, SimJob
from sim.greedy_fleet import FleetBook, GpuGroup, PlacedGpu, TrackedGpu
from sim.greedy_index import HolderIndex
from sim.requests import SimRequest

REFRESH_S = 0.1


class GreedyRecorder(Protocol):
    """What the greedy reference reports (``sim.measure`` implements it); ``code`` is a gRPC
    status name ("UNAVAILABLE"), as the deployment's flow reports it."""

    def served(
        self, req: SimRequest, *, region: str, zone: str, gpu: str, home_region: str,
        rtt_ms: float, ttft_s: float, e2e_s: float, cached_tokens: int, attempts: int,
    ) -> None: ...  # fmt: skip

    def failed(
        self, req: SimRequest, *, code: str, home_region: str, elapsed_s: float, attempts: int
    ) -> None: ...  # fmt: skip


_Waiter = tuple[SimRequest, "asyncio.Future[tuple[TrackedGpu, SimJob] | None]"]


def prefill_s(tokens: int) -> float:
    """The prefill part of one engine step on an A100 (a step = decode part + this)."""
    return step_cost_s(0, tokens) - step_cost_s(0, 0)


def _first(item: tuple[float, object]) -> float:
    return item[0]


def completion_s(scale: float, batch: int, uncached_tokens: int, max_tokens: int) -> float:
    """Admission to last token at a fixed batch: the first step prefills, then decode.
    ``scale`` is the GPU's ``time_scale / speed``."""
    steps = max(1, max_tokens)
    return scale * (step_cost_s(batch, uncached_tokens) + (steps - 1) * step_cost_s(batch, 0))


class GreedyClairvoyant:
    """Serves requests on ``gpus`` as the best possible router would (module docstring)."""

    def __init__(
        self,
        gpus: Sequence[PlacedGpu],
        rtt_ms: Callable[[GeoPoint, str], float],
        recorder: GreedyRecorder,
        home_region: Callable[[GeoPoint], str],
    ) -> None:
        if not gpus:
            raise ValueError("the greedy reference needs at least one GPU; the fleet is empty")
        self._loop = gpus[0].gpu.loop
        self._rtt_ms = rtt_ms
        self._home_region = home_region
        self.recorder = recorder
        self.fleet = FleetBook(gpus)
        self._queue: deque[_Waiter] = deque()
        self._index = HolderIndex()
        self._rtts: dict[GeoPoint, list[float]] = {}
        self._orders: dict[GeoPoint, list[tuple[float, GpuGroup]]] = {}
        self._homes: dict[GeoPoint, str] = {}
        # The decode part of a step at each batch size (the batch a request joins).
        largest = max(p.gpu.cfg.max_concurrency for p in gpus)
        self._decode = [step_cost_s(b, 0) for b in range(largest + 2)]
        self._refreshed_at = -math.inf
        self.refresh()

    @property
    def group_count(self) -> int:
        """Groups a request is weighed against (what one dispatch costs)."""
        return sum(1 for g in self.fleet.groups.values() if g.members)

    # ------------------------------------------------------------------ fleet state

    def refresh(self) -> None:
        """Re-read every GPU now (up or down, speed): call it after changing GPUs."""
        self._refreshed_at = self._loop.time()
        self.fleet.sync_all()
        self._drain()

    def _tick(self) -> None:
        if self._loop.time() - self._refreshed_at >= REFRESH_S:
            self.refresh()

    # ------------------------------------------------------------------ choosing

    def _rtt_row(self, origin: GeoPoint) -> list[float]:
        """RTT in ms from ``origin`` to each region (by index), cached per origin."""
        row = self._rtts.get(origin)
        if row is None:
            if len(self._rtts) >= 100_000:
                self._rtts.clear()
                self._orders.clear()
            row = [self._rtt_ms(origin, r) for r in self.fleet.regions]
            self._rtts[origin] = row
        return row

    def _by_distance(self, origin: GeoPoint) -> list[tuple[float, GpuGroup]]:
        """Every group with its RTT in seconds from ``origin``, nearest first (cached
        per origin until a new group appears): near groups set a low bar early."""
        groups = self.fleet.groups
        order = self._orders.get(origin)
        if order is None or len(order) != len(groups):
            row = self._rtt_row(origin)
            order = sorted(((row[g.region] / 1000.0, g) for g in groups.values()), key=_first)
            self._orders[origin] = order
        return order

    def _cached(self, g: TrackedGpu, req: SimRequest) -> int:
        """Tokens of the prompt the GPU's own cache holds (exact, touches nothing)."""
        blocks = g.placed.gpu.prefix_cache.peek(req.prefix_blocks)
        return min(req.prompt_tokens, blocks * BLOCK_TOKENS)

    def choose(self, req: SimRequest) -> TrackedGpu | None:
        """The admitting GPU where ``req`` completes soonest; None when none admits it.

        Time = RTT + scale × (steps × decode step at the batch joined + prefill of
        the uncached prompt), ``completion_s`` taken apart so that a group costs
        one multiply-add. Prefix holders first (exact), then each group's
        least-loaded GPU with no cache; then, lowest bound first, the groups whose
        best could still win if its cache held the prompt, looked up exactly.
        """
        reservation = req.prompt_tokens + req.output_tokens
        rtts = self._rtt_row(req.origin)
        steps = max(1, req.output_tokens)
        decode = self._decode
        blocks = req.prefix_blocks
        fleet = self.fleet
        known_groups = len(fleet.groups)
        best, best_t = None, math.inf
        for i in self._index.holders(blocks) if blocks else ():
            g = fleet.gpus[i]
            group = fleet.current(g)
            if group is None or not g.admits(reservation):
                continue
            uncached = req.prompt_tokens - self._cached(g, req)
            t = rtts[group.region] / 1000.0 + group.scale * (
                steps * decode[g.active + 1] + prefill_s(uncached)
            )
            if t < best_t:
                best, best_t = g, t
        full = prefill_s(req.prompt_tokens)
        floor = steps * decode[1]  # nothing runs faster than alone
        bounds: list[tuple[float, TrackedGpu]] = []
        for rtt_s, group in self._by_distance(req.origin):
            if not group.members or rtt_s + group.scale * floor >= best_t:
                continue
            top = fleet.best_of(group, reservation)
            if top is None:
                continue
            bound = rtt_s + group.scale * steps * decode[top.active + 1]
            t = bound + group.scale * full
            if t < best_t:
                best, best_t = top, t
            if blocks and bound < best_t:
                bounds.append((bound, top))
        bounds.sort(key=_first)
        for bound, top in bounds:  # if its cache held the whole prompt, it would take bound
            if bound >= best_t:
                break
            cached = self._cached(top, req)
            scale = top.group.scale if top.group is not None else math.inf
            t = bound + scale * prefill_s(req.prompt_tokens - cached)
            if cached and t < best_t:
                best, best_t = top, t
        if len(fleet.groups) != known_groups:  # a GPU changed speed: weigh its new group too
            return self.choose(req)
        return best

    # ------------------------------------------------------------------ serving

    async def serve(self, req: SimRequest) -> None:
        """Serve ``req`` from now (its arrival) to its last token, and record it."""
        self._tick()
        home = self._home(req.origin)
        attempts = 0
        while True:
            placed = await self._place(req, retry=attempts > 0)
            if placed is None:
                code = self._refusal(req).name
                self.recorder.failed(
                    req, code=code, home_region=home, elapsed_s=self._loop.time() - req.at_s,
                    attempts=attempts,
                )  # fmt: skip
                return
            g, job = placed
            attempts += 1
            rtt = self._rtt_row(req.origin)[self.fleet.regions.index(g.placed.region)]
            try:
                await job.done
            except GpuFailed:
                first_token_at = job.first_token_at
                # The failed future keeps its error, whose traceback holds this frame:
                # letting go of the job here leaves no cycle for the cyclic GC.
                del placed, job
                now = self._loop.time()
                if not first_token_at <= now:
                    continue  # nothing reached the client yet: place it again
                self.recorder.failed(
                    req, code=grpc.StatusCode.UNAVAILABLE.name, home_region=home,
                    elapsed_s=now - req.at_s + rtt / 1000.0, attempts=attempts,
                )  # fmt: skip
                return
            self.recorder.served(
                req, region=g.placed.region, zone=g.placed.zone, gpu=g.placed.gpu.name,
                home_region=home, rtt_ms=rtt,
                ttft_s=job.first_token_at - req.at_s + rtt / 1000.0,
                e2e_s=job.finished_at - req.at_s + rtt / 1000.0,
                cached_tokens=job.cached_tokens, attempts=attempts,
            )  # fmt: skip
            return

    def _home(self, origin: GeoPoint) -> str:
        home = self._homes.get(origin)
        if home is None:
            if len(self._homes) >= 100_000:
                self._homes.clear()
            home = self._homes[origin] = self._home_region(origin)
        return home

    def _refusal(self, req: SimRequest) -> grpc.StatusCode:
        """Why nothing can ever take ``req``: too large for every GPU, or no GPU up."""
        if req.prompt_tokens + req.max_tokens > self.fleet.largest_kv:
            return grpc.StatusCode.INVALID_ARGUMENT
        return grpc.StatusCode.UNAVAILABLE

    async def _place(self, req: SimRequest, *, retry: bool) -> tuple[TrackedGpu, SimJob] | None:
        """Bind ``req`` to a GPU now, or wait in the central FIFO (a retry waits at its head);
        None when no GPU that is up could ever take it."""
        if retry or not self._queue:
            g = self.choose(req)
            if g is not None:
                return self._submit(g, req)
        if not self.fleet.servable(req.prompt_tokens + req.max_tokens):
            return None
        waiter: _Waiter = (req, self._loop.create_future())
        if retry:
            self._queue.appendleft(waiter)
        else:
            self._queue.append(waiter)
        return await waiter[1]

    def _submit(self, g: TrackedGpu, req: SimRequest) -> tuple[TrackedGpu, SimJob]:
        job = g.placed.gpu.submit(
            req.prompt_tokens, req.max_tokens, req.prefix_blocks, req.output_tokens
        )
        reservation = job.reservation
        self.fleet.load_changed(g, 1, reservation)
        if req.prefix_blocks:
            self._index.remember(req.prefix_blocks, g.index)
        job.done.add_done_callback(lambda _: self._finished(g, reservation))
        return g, job

    def _finished(self, g: TrackedGpu, reservation: int) -> None:
        self.fleet.load_changed(g, -1, -reservation)
        self._tick()
        self._drain()

    def _drain(self) -> None:
        """Bind waiting requests, oldest first, while the head finds a GPU."""
        queue = self._queue
        while queue:
            req, future = queue[0]
            if future.done():  # its caller was cancelled
                queue.popleft()
                continue
            g = self.choose(req)
            if g is None:
                if self.fleet.servable(req.prompt_tokens + req.max_tokens):
                    return
                queue.popleft()
                future.set_result(None)
                continue
            queue.popleft()
            future.set_result(self._submit(g, req))
