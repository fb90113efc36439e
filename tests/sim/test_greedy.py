"""The oracle: late binding over the whole fleet, least true completion time, in simulated time.

Expected figures come from the engine's step formula (``sim.engine.step_cost_s``),
worked out here by hand for each case, not from the oracle's own estimate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from common.basics.geo import GeoPoint
from common.config.gpu import HARDWARE_SPEED, GpuConfig
from common.config.node import Endpoint
from common.request.prefix import BLOCK_TOKENS
from sim.clock import run_simulated
from sim.engine import PREFILL_S_PER_TOKEN, step_cost_s
from sim.gpu_model import SimGpu
from sim.greedy import GreedyClairvoyant, PlacedGpu, completion_s, prefill_s
from sim.greedy_index import HolderIndex, probe_depths
from sim.requests import SIM_MODEL, SimRequest
from tests.cyclic import request_leftovers, unreachable_now

PARIS = GeoPoint(48.86, 2.35)
NEW_YORK = GeoPoint(40.71, -74.01)


class Recorder:
    """The recorder the oracle reports to, keeping each request's one call by id."""

    def __init__(self) -> None:
        self.ok: dict[int, dict[str, Any]] = {}
        self.lost: dict[int, dict[str, Any]] = {}

    def served(self, req: SimRequest, **kw: Any) -> None:
        assert req.id not in self.ok and req.id not in self.lost
        self.ok[req.id] = kw

    def failed(self, req: SimRequest, **kw: Any) -> None:
        assert req.id not in self.ok and req.id not in self.lost
        self.lost[req.id] = kw


def config(name: str, hardware: str = "A100", slots: int = 4, kv: int = 65_536) -> GpuConfig:
    return GpuConfig(
        name=name,
        endpoint=Endpoint("127.0.0.1", 1),
        metrics_endpoint=Endpoint("127.0.0.1", 1),
        hardware=hardware,
        models=(SIM_MODEL,),
        max_concurrency=slots,
        kv_cache_tokens=kv,
    )


def req(
    i: int, at: float, prompt: int = 64, output: int = 16, *, origin: GeoPoint = PARIS,
    blocks: tuple[int, ...] = (),
) -> SimRequest:  # fmt: skip
    return SimRequest(
        i, at, "paris", origin, "t", prompt, output, prefix_blocks=blocks, max_tokens=output
    )


def flat_rtt(ms: float) -> Callable[[GeoPoint, str], float]:
    return lambda origin, region: ms


TEN_MS = flat_rtt(10.0)
Fleet = Callable[[asyncio.AbstractEventLoop], list[PlacedGpu]]


def run(
    fleet: Fleet,
    requests: Sequence[SimRequest],
    rtt: Callable[[GeoPoint, str], float] = TEN_MS,
    events: Callable[[list[PlacedGpu]], None] | None = None,
) -> tuple[Recorder, list[PlacedGpu]]:
    """Serve ``requests`` at their arrival times on a fresh simulated loop."""
    calls = Recorder()
    placed: list[PlacedGpu] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        placed.extend(fleet(loop))
        oracle = GreedyClairvoyant(placed, rtt, calls, lambda origin: "home")
        if events is not None:
            events(placed)

        async def one(r: SimRequest) -> None:
            await asyncio.sleep(r.at_s - loop.time())
            await oracle.serve(r)

        await asyncio.gather(*(one(r) for r in requests))

    run_simulated(main())
    return calls, placed


def gpus(*specs: tuple[str, str, str], slots: int = 4) -> Fleet:
    """(name, hardware, region) per GPU, each in zone '<region>-a'."""

    def build(loop: asyncio.AbstractEventLoop) -> list[PlacedGpu]:
        return [
            PlacedGpu(SimGpu(config(name, hw, slots), loop), region, f"{region}-a")
            for name, hw, region in specs
        ]

    return build


def alone_s(speed: float, batch: int, prompt: int, output: int) -> float:
    """Prefill then decode at a fixed batch on a GPU of ``speed`` (the engine's steps)."""
    return (step_cost_s(batch, prompt) + (output - 1) * step_cost_s(batch, 0)) / speed


def test_both_free_the_faster_gpu_takes_it() -> None:
    calls, _ = run(gpus(("slow", "A100", "eu"), ("fast", "H100", "eu")), [req(0, 0.0)])
    got = calls.ok[0]
    assert got["gpu"] == "fast" and got["region"] == "eu" and got["zone"] == "eu-a"
    speed = HARDWARE_SPEED["H100"]
    assert got["ttft_s"] == pytest.approx(step_cost_s(1, 64) / speed + 0.010, abs=1e-9)
    assert got["e2e_s"] == pytest.approx(alone_s(speed, 1, 64, 16) + 0.010, abs=1e-9)
    assert got["attempts"] == 1 and got["rtt_ms"] == 10.0 and got["home_region"] == "home"


def test_never_queues_on_a_gpu_while_another_admits() -> None:
    # An H100 and two A100s with 2 slots each, six requests at once. Even at batch 6
    # the H100 would finish each sooner than an idle A100 (prefill + 15 steps: ~48 ms
    # against ~80 ms), so a router blind to slots piles them onto it, where four
    # wait in its queue. The oracle gives each GPU two, all admitted at the first step.
    fleet = gpus(("h100", "H100", "eu"), ("a0", "A100", "eu"), ("a1", "A100", "eu"), slots=2)
    calls, _ = run(fleet, [req(i, 0.0) for i in range(6)])
    per_gpu = {g: sum(1 for c in calls.ok.values() if c["gpu"] == g) for g in ("h100", "a0", "a1")}
    assert per_gpu == {"h100": 2, "a0": 2, "a1": 2}
    first_step = step_cost_s(2, 2 * 64)  # two admitted together: one step prefills both
    for c in calls.ok.values():
        speed = HARDWARE_SPEED["H100" if c["gpu"] == "h100" else "A100"]
        assert c["ttft_s"] == pytest.approx(first_step / speed + 0.010, abs=1e-9)


def test_waits_centrally_and_goes_where_a_job_finishes() -> None:
    # One slot each on an H100 and an A100, three requests at once: the third waits
    # in the central queue until the H100's job ends, then runs there alone.
    fleet = gpus(("a100", "A100", "eu"), ("h100", "H100", "eu"), slots=1)
    calls, placed = run(fleet, [req(i, 0.0) for i in range(3)])
    fast = HARDWARE_SPEED["H100"]
    assert [calls.ok[i]["gpu"] for i in range(3)] == ["h100", "a100", "h100"]
    first_done = alone_s(fast, 1, 64, 16)
    assert calls.ok[2]["e2e_s"] == pytest.approx(2 * first_done + 0.010, abs=1e-9)
    assert all(not p.gpu.waiting for p in placed)


def test_rtt_decides_between_equal_gpus_in_two_regions() -> None:
    rtts = {(PARIS, "eu"): 12.0, (PARIS, "us"): 80.0, (NEW_YORK, "eu"): 75.0}
    rtts[(NEW_YORK, "us")] = 9.0
    fleet = gpus(("g-us", "A100", "us"), ("g-eu", "A100", "eu"))
    requests = [req(0, 0.0, origin=PARIS), req(1, 0.0, origin=NEW_YORK)]
    calls, _ = run(fleet, requests, rtt=lambda origin, region: rtts[(origin, region)])
    assert (calls.ok[0]["region"], calls.ok[0]["rtt_ms"]) == ("eu", 12.0)
    assert (calls.ok[1]["region"], calls.ok[1]["rtt_ms"]) == ("us", 9.0)


@pytest.mark.parametrize(("blocks", "output"), [(100, 16), (1, 64)])
def test_a_prefix_holder_wins_when_the_prefill_saved_outweighs_the_batch(
    blocks: int, output: int
) -> None:
    # g0 is warmed with the prefix, then takes a long job; at t=5 the shared request
    # may join g0 (batch 2, prefix cached) or run alone on idle g1 (batch 1, full prefill).
    prompt = blocks * BLOCK_TOKENS
    prefix = tuple(range(1000, 1000 + blocks))
    holder_s = alone_s(1.0, 2, 0, output)
    idle_s = alone_s(1.0, 1, prompt, output)
    expected = "g0" if holder_s < idle_s else "g1"
    requests = [
        req(0, 0.0, prompt, 2, blocks=prefix),  # warms g0 (the tie goes to the first GPU)
        req(1, 2.0, 16, 4000),  # both idle again: g0 again, for 4000 steps
        req(2, 5.0, prompt, output, blocks=prefix),
    ]
    calls, _ = run(gpus(("g0", "A100", "eu"), ("g1", "A100", "eu")), requests)
    assert calls.ok[0]["gpu"] == "g0" and calls.ok[1]["gpu"] == "g0"
    got = calls.ok[2]
    assert got["gpu"] == expected
    assert got["cached_tokens"] == (prompt if expected == "g0" else 0)
    assert {100: "g0", 1: "g1"}[blocks] == expected  # the two cases go opposite ways


def test_a_gpu_dying_before_the_first_token_costs_a_retry_elsewhere() -> None:
    fleet = gpus(("fast", "H100", "eu"), ("slow", "A100", "eu"))

    def kill(placed: list[PlacedGpu]) -> None:
        loop = placed[0].gpu.loop
        loop.call_at(0.001, placed[0].gpu.fail, "power")

    calls, _ = run(fleet, [req(0, 0.0, 2000, 16)], events=kill)
    got = calls.ok[0]
    assert (got["gpu"], got["attempts"]) == ("slow", 2)
    assert got["e2e_s"] == pytest.approx(0.001 + alone_s(1.0, 1, 2000, 16) + 0.010, abs=1e-9)


def test_a_gpu_dying_after_the_first_token_fails_the_request() -> None:
    fleet = gpus(("fast", "H100", "eu"), ("slow", "A100", "eu"))

    def kill(placed: list[PlacedGpu]) -> None:
        placed[0].gpu.loop.call_at(0.5, placed[0].gpu.fail, "power")

    calls, _ = run(fleet, [req(0, 0.0, 64, 1000), req(1, 1.0)], events=kill)
    failed = calls.lost[0]
    assert (failed["code"], failed["home_region"], failed["attempts"]) == (
        "UNAVAILABLE", "home", 1,
    )  # fmt: skip
    assert failed["elapsed_s"] == pytest.approx(0.5 + 0.010, abs=1e-12)
    assert calls.ok[1]["gpu"] == "slow"  # the dead GPU is never chosen again


def test_a_request_failed_by_a_dying_gpu_leaves_nothing_for_the_cyclic_gc() -> None:
    """The failed job's future keeps its error, whose traceback holds the oracle's frame:
    the frame lets go of the job, so no cycle is left for the cyclic GC."""
    fleet = gpus(("fast", "H100", "eu"), ("slow", "A100", "eu"))
    left: list[list[object]] = []

    def kill(placed: list[PlacedGpu]) -> None:
        loop = placed[0].gpu.loop
        loop.call_at(0.001, placed[0].gpu.fail, "power")  # before the first token: retried
        loop.call_at(0.5, placed[1].gpu.fail, "power")  # after it: the request fails
        loop.call_at(0.9, lambda: left.append(unreachable_now()))

    calls, _ = run(fleet, [req(0, 0.0, 64, 1000), req(1, 1.0)], events=kill)  # 1: runs on
    assert calls.lost[0]["attempts"] == 2
    assert request_leftovers(left[0]) == []


def test_a_request_no_gpu_can_hold_fails_at_once() -> None:
    calls, _ = run(gpus(("g0", "A100", "eu")), [req(0, 1.0, 70_000, 16), req(1, 1.0)])
    assert calls.lost[0]["code"] == "INVALID_ARGUMENT"
    assert calls.lost[0]["elapsed_s"] == 0.0
    assert calls.ok[1]["gpu"] == "g0"  # nothing behind it was held up


def test_the_oracle_refuses_an_empty_fleet() -> None:
    with pytest.raises(ValueError, match="the fleet is empty"):
        GreedyClairvoyant([], flat_rtt(1.0), Recorder(), lambda origin: "home")


def test_dispatch_weighs_groups_not_gpus() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        hardware = ["A100", "H100"] * 32
        placed = [
            PlacedGpu(SimGpu(config(f"g{i}", hw), loop), ("eu", "us")[i % 4 // 2], "z")
            for i, hw in enumerate(hardware)
        ]
        oracle = GreedyClairvoyant(placed, flat_rtt(1.0), Recorder(), lambda o: "home")
        return oracle.group_count

    assert run_simulated(main()) == 4  # 64 GPUs: 2 regions x 2 hardware classes


def test_holder_index_probes_powers_of_two_and_the_last_block() -> None:
    assert probe_depths(0) == []
    assert probe_depths(1) == [1]
    assert probe_depths(9) == [1, 2, 4, 8, 9]
    index = HolderIndex(holders_per_block=2)
    index.remember((1, 2, 3), 7)
    index.remember((1, 2, 4, 5, 6), 8)
    index.remember((1, 9), 9)
    # Depth 4 (block 10): nobody; depth 2: 8 then 7 (newest first); depth 1: 9 (7 fell out).
    assert index.holders((1, 2, 3, 10)) == [8, 7, 9]
    assert len(index) == 6  # blocks recorded at depths 1, 2, 4 and each last


def test_a_full_holder_index_forgets_the_least_recently_recorded_block() -> None:
    index = HolderIndex(limit=3)
    index.remember((1,), 1)
    index.remember((2,), 2)
    index.remember((3,), 3)
    index.remember((1,), 4)  # block 1 recorded again: now the newest
    index.remember((5,), 5)  # full: block 2, the oldest, goes
    assert len(index) == 3
    assert [index.holders((b,)) for b in (1, 2, 3, 5)] == [[4, 1], [], [3], [5]]


def test_throttling_mid_run_is_known_at_once() -> None:
    # At t=1 the H100 drops to 0.5x an A100: the request at t=2 goes to the A100.
    fleet = gpus(("h100", "H100", "eu"), ("a100", "A100", "eu"))

    def throttle(placed: list[PlacedGpu]) -> None:
        placed[0].gpu.loop.call_at(1.0, placed[0].gpu.set_speed, 0.5)

    calls, _ = run(fleet, [req(0, 0.0), req(1, 2.0)], events=throttle)
    assert [calls.ok[i]["gpu"] for i in (0, 1)] == ["h100", "a100"]


def test_a_gpu_back_from_failure_is_used_again() -> None:
    fleet = gpus(("h100", "H100", "eu"), ("a100", "A100", "eu"))

    def fail_and_recover(placed: list[PlacedGpu]) -> None:
        loop, h100 = placed[0].gpu.loop, placed[0].gpu
        loop.call_at(0.5, h100.fail, "reboot")
        loop.call_at(2.0, h100.recover)

    requests = [req(0, 1.0), req(1, 2.5)]
    calls, _ = run(fleet, requests, events=fail_and_recover)
    assert [calls.ok[i]["gpu"] for i in (0, 1)] == ["a100", "h100"]


def test_completion_splits_into_decode_steps_and_one_prefill() -> None:
    # What the oracle's per-group arithmetic relies on: prefill adds to a step.
    for batch, uncached, output in ((1, 0, 1), (3, 700, 40), (16, 4096, 250)):
        whole = completion_s(0.5, batch, uncached, output)
        split = 0.5 * (output * step_cost_s(batch, 0) + prefill_s(uncached))
        assert whole == pytest.approx(split, rel=1e-12)
    assert prefill_s(1000) == pytest.approx(1000 * PREFILL_S_PER_TOKEN, rel=1e-12)
