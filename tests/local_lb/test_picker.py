"""CompletionTimePicker: shares, prefix affinity, sessions, stale reports, O(1) candidates."""

import random

from common.config.node import Endpoint
from common.request.pick import PickRequest
from common.request.prefix import prompt_block_hashes
from local_lb.load_book import LoadSample
from local_lb.picker import CompletionTimePicker
from local_lb.state import GpuChild, LocalView
from sim.fleetsim import simulate

M = "m"


def gpu(name: str, *, speed: float = 1.0, work: float = 0.0, requests: int = 0) -> GpuChild:
    g = GpuChild(
        name=name,
        endpoint=Endpoint("127.0.0.1", 1),
        models=frozenset({M}),
        speed=speed,
        rate=speed * 2000.0,
    )
    g.outstanding_work = work
    g.outstanding_requests = requests
    return g


def request(
    prompt_tokens: int = 0,
    max_tokens: int = 50,
    *,
    blocks: tuple[int, ...] = (),
    session: str | None = None,
) -> PickRequest:
    return PickRequest(
        M, "", None, session, "standard", prompt_tokens, max_tokens, prefix_blocks=blocks
    )


def picker(view: LocalView, sample_size: int = 8) -> CompletionTimePicker:
    return CompletionTimePicker(view, sample_size=sample_size, rng=random.Random(5))


def reporting(*gpus: GpuChild) -> LocalView:
    """A view whose GPUs each reported (fresh, at t=0) just what this tier has in flight."""
    view = LocalView(gpus)
    for g in gpus:
        view.load.update(
            g.name, LoadSample(g.outstanding_requests, 0, None, taken_at=0.0, source="trailer")
        )
    return view


def names(ranked: list) -> list[str]:
    return [g.name for g in ranked]


def test_least_expected_completion_first() -> None:
    """A request shares the batch it joins: the GPU with the fewest in flight first."""
    view = reporting(gpu("busy", requests=6), gpu("idle"), gpu("some", requests=2))
    assert names(picker(view).rank(request(), view.free[M], 0)) == ["idle", "some", "busy"]


def test_the_work_ahead_does_not_count_only_the_batch() -> None:
    """Under continuous batching a request runs beside long generations, not after them:
    one long request in flight costs less than three short ones."""
    view = reporting(
        gpu("one-long", requests=1, work=5000), gpu("three-short", requests=3, work=90)
    )
    assert names(picker(view).rank(request(), view.free[M], 0))[0] == "one-long"


def test_fast_gpu_preferred_at_an_equal_batch() -> None:
    view = reporting(gpu("a100", requests=2), gpu("h100", speed=2.0, requests=2))
    assert names(picker(view).rank(request(), view.free[M], 0))[0] == "h100"
    # Twice as fast holds twice the batch at the same cost; one more tips it.
    view = reporting(gpu("a100", requests=2), gpu("h100", speed=2.0, requests=6))
    assert names(picker(view).rank(request(), view.free[M], 0))[0] == "a100"


def test_h100_takes_a_larger_share_than_an_a100_by_its_hardware_speed() -> None:
    # Every GPU starts with the same seed rate; the hardware class (speed) decides.
    result = simulate([2.0, 1.0, 1.0, 1.0], load=0.75, requests=4000, seed=11)
    ratio = result.share("gpu0") / (sum(result.share(f"gpu{i}") for i in (1, 2, 3)) / 3)
    assert 1.6 <= ratio <= 3.5, ratio


def test_throttled_gpu_gets_less() -> None:
    result = simulate([1.0, 0.8, 1.0], load=0.75, requests=3000, seed=4)
    assert result.share("gpu1") < min(result.share("gpu0"), result.share("gpu2"))


def test_default_beats_round_robin_on_tail_latency_under_heterogeneity() -> None:
    speeds = [2.0, 1.0, 1.0, 0.6]
    ours = simulate(speeds, policy="default", load=0.75, requests=3000, seed=2)
    rr = simulate(speeds, policy="round_robin", load=0.75, requests=3000, seed=2)
    assert ours.p(0.99) < rr.p(0.99)


def test_prefix_holder_wins_while_the_saving_outweighs_its_queue() -> None:
    prompt = " ".join(f"w{i}" for i in range(1024))
    blocks = tuple(prompt_block_hashes(prompt, model=M, limit=64))
    # Cached: 10 work beside one other (x2) against 10 + 0.05 x 1024 alone.
    warm, cold = gpu("warm", requests=1), gpu("cold")
    view = reporting(warm, cold)
    view.prefix.record(blocks, "warm")
    ranked = picker(view).rank(request(1024, 10, blocks=blocks), view.free[M], 0)
    assert names(ranked)[0] == "warm"


def test_prefix_holder_loses_when_its_queue_is_too_long() -> None:
    prompt = " ".join(f"w{i}" for i in range(1024))
    blocks = tuple(prompt_block_hashes(prompt, model=M, limit=64))
    warm, cold = gpu("warm", requests=10), gpu("cold")  # 10 x 11 > 61.2 x 1
    view = reporting(warm, cold)
    view.prefix.record(blocks, "warm")
    ranked = picker(view).rank(request(1024, 10, blocks=blocks), view.free[M], 0)
    assert names(ranked)[0] == "cold"


def test_stale_report_is_not_read_as_idle() -> None:
    fresh, stale = gpu("fresh"), gpu("stale")
    view = LocalView((fresh, stale), report_max_age_s=2.0)
    view.load.update("fresh", LoadSample(1, 0, 0.1, taken_at=10.0, source="metrics"))
    view.load.update("stale", LoadSample(0, 0, 0.0, taken_at=0.0, source="metrics"))
    # At t=10 the stale GPU's "idle" report is 10 s old: it must not look idle.
    assert names(picker(view).rank(request(), view.free[M], 10.0))[0] == "fresh"


def test_a_gpu_that_never_reports_load_is_routed_by_our_own_in_flight() -> None:
    """A stock server (MLServer: no load trailer, no metric this tier reads) beside GPUs
    that report: it is no stale report, so no penalty, only what this tier sent it."""
    silent, busy = gpu("silent"), gpu("busy", requests=1)
    view = LocalView((silent, busy), report_max_age_s=2.0)
    view.load.update("busy", LoadSample(1, 0, 0.1, taken_at=10.0, source="trailer"))
    assert names(picker(view).rank(request(), view.free[M], 10.0))[0] == "silent"
    silent.outstanding_requests = 2  # ours: now it is the busier one
    assert names(picker(view).rank(request(), view.free[M], 10.0))[0] == "busy"


def test_foreign_load_reported_by_the_gpu_counts() -> None:
    ours_only, shared = gpu("ours"), gpu("shared")
    view = LocalView((ours_only, shared))
    view.load.update("ours", LoadSample(0, 0, None, taken_at=5.0, source="trailer"))
    view.load.update("shared", LoadSample(6, 4, None, taken_at=5.0, source="trailer"))
    assert names(picker(view).rank(request(), view.free[M], 5.0))[0] == "ours"


def test_session_sticks_to_one_gpu_while_costs_are_equal() -> None:
    view = LocalView(tuple(gpu(f"g{i}") for i in range(8)))
    p = picker(view, sample_size=2)
    first = names(p.rank(request(session="conv-1"), view.free[M], 0))[0]
    for _ in range(20):
        assert names(p.rank(request(session="conv-1"), view.free[M], 0))[0] == first


def test_a_busier_session_gpu_loses_to_a_cheaper_one() -> None:
    """The session's GPU is a candidate ranked by cost, not first whenever it has a
    slot: without its prefix cached there, joining its batch costs what it costs."""
    gpus = tuple(gpu(f"g{i}") for i in range(2))
    view = reporting(*gpus)
    p = picker(view)
    home = names(p.rank(request(session="conv-3"), view.free[M], 0))[0]
    busy = view.by_name[home]
    busy.outstanding_requests = 3
    view.refresh(busy)
    ranked = names(p.rank(request(session="conv-3"), view.free[M], 0))
    assert ranked[0] != home and home in ranked
    # With the session's prefix cached there, the saved prefill outweighs the batch.
    prompt = " ".join(f"w{i}" for i in range(1024))
    blocks = tuple(prompt_block_hashes(prompt, model=M, limit=64))
    view.prefix.record(blocks, home)  # 10 work beside 3 others (x4) against 61.2 alone
    cached = request(1024, 10, blocks=blocks, session="conv-3")
    assert names(p.rank(cached, view.free[M], 0))[0] == home


def test_session_moves_when_its_gpu_is_full() -> None:
    gpus = tuple(gpu(f"g{i}") for i in range(4))
    view = LocalView(gpus)
    p = picker(view)
    home = names(p.rank(request(session="conv-9"), view.free[M], 0))[0]
    full = view.by_name[home]
    full.outstanding_requests = full.slots
    view.refresh(full)
    assert names(p.rank(request(session="conv-9"), view.free[M], 0))[0] != home


def test_candidates_are_sampled_not_the_whole_fleet() -> None:
    view = LocalView(tuple(gpu(f"g{i}") for i in range(1000)))
    ranked = picker(view, sample_size=4).rank(request(), view.free[M], 0)
    assert 1 <= len(ranked) <= 4


def test_empty_pool_ranks_nothing() -> None:
    g = gpu("only")
    g.outstanding_requests = g.slots
    view = LocalView((g,))
    assert picker(view).rank(request(), view.free[M], 0) == []


def test_a_long_request_prefers_the_fast_gpu_a_typical_one_leaves_it() -> None:
    """Both times scale with a request's work, so by completion time alone a long and
    a typical request would choose alike; the long one pays for a slow GPU's slowness
    (local_lb.cost.long_request_weight), and it is long ones on slow GPUs that make
    the tail (bench.zone_peers)."""
    fast, slow = gpu("h100", speed=2.0, requests=3), gpu("v100", speed=0.6)
    view = reporting(fast, slow)
    view.took(50.0)  # the typical request
    # Typical: 50 x (3 + 1) / 2.0 = 100 on the H100, 50 x 1 / 0.6 = 83 on the idle V100.
    assert names(picker(view).rank(request(0, 50), view.free[M], 0))[0] == "v100"
    # Four times as long: its weight on the V100 is 0.6 ** -1 (sqrt(4) - 1 = 1).
    assert names(picker(view).rank(request(0, 200), view.free[M], 0))[0] == "h100"
    # With the bias off it ranks by completion time alone, as a typical request does.
    plain = CompletionTimePicker(view, sample_size=8, rng=random.Random(5), length_bias=0.0)
    assert names(plain.rank(request(0, 200), view.free[M], 0))[0] == "v100"


def test_the_typical_work_follows_what_is_leased() -> None:
    view = LocalView((gpu("a"),))
    assert view.typical_work == 0.0  # nothing yet: no request counts as long
    view.took(100.0)
    assert view.typical_work == 100.0
    for _ in range(500):
        view.took(20.0)
    assert 20.0 < view.typical_work < 21.0
