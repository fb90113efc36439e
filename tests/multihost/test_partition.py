"""A real partition between hosts under load, and a region cut from its Redis.

The fleet runs across network namespaces (``tests.multihost.fleet``); a cut detaches a
link's port from its bridge, so every process keeps running and nobody sees an RST or a
FIN (``test_hosts.py``). The global tier's keepalive (1 s ping, 0.75 s timeout) is what finds
the partition; its requests held up on the dead connection fail over, having sent nothing
back, and the region is ramped back over ``failback_window_s`` after the heal.
"""

from __future__ import annotations

import grpc

from tests.multihost.conftest import TEST_FAILBACK_WINDOW_S
from tests.multihost.fleet import MultiHostFleet
from tests.multihost.scenario import GRACE_S, Phases, partition, redis_cut

CUT_REGION = "us-east"  # the client is beside it, so it serves everything until the cut
RATE_PER_S = 60.0


def test_a_partitioned_region_loses_its_traffic_within_2s_and_gets_it_back_gradually(
    multihost_fleet: MultiHostFleet,
) -> None:
    phases = Phases(before_s=2.0, cut_s=5.0, after_s=TEST_FAILBACK_WINDOW_S + 1.0,
                    rate_per_s=RATE_PER_S)  # fmt: skip
    run = partition(multihost_fleet, CUT_REGION, phases)
    figures = run.figures()
    assert run.served_by(CUT_REGION, run.cut - phases.before_s, run.cut) > 0, figures
    # Moved within 2 s: answers (from elsewhere: see below) flow again ...
    assert run.moved_s is not None and run.moved_s <= GRACE_S, figures
    # ... and the requests in flight at the cut were failed over, not failed: the global's
    # keepalive closed the dead connection (<= 1.75 s); a second for the retry on a CPU
    # shared by a dozen processes.
    assert all(s.code == grpc.StatusCode.OK for s in run.caught), figures
    assert run.caught_answered_s <= GRACE_S + 1.0, figures
    # ... none failed once the partition was 2 s old, and the cut region served nothing.
    late_failures = run.failures(run.cut + GRACE_S, run.end)
    assert not late_failures, (late_failures[:3], figures)
    assert run.served_by(CUT_REGION, run.cut + GRACE_S, run.heal) == 0, figures
    others = len(run.started(run.cut + GRACE_S, run.heal))
    expected = RATE_PER_S * (run.heal - run.cut - GRACE_S)
    # (a quarter of the offered rate at least: the machine is shared, and its clients
    # wait for each answer)
    assert others >= 0.25 * expected, (others, expected, figures)
    # Every request the global tier answered has its usage record.
    assert run.usage_records == len(run.samples), figures
    # Back gradually: a small share first, some seconds in between, all of it at the end.
    shares = [share for _, share in run.share_after_heal()]
    assert shares[0] < 0.5, figures
    assert sum(0.05 < share < 0.9 for share in shares) >= 2, figures
    assert shares[-1] >= 0.8, figures


def test_a_region_cut_from_its_redis_keeps_serving(multihost_fleet: MultiHostFleet) -> None:
    run = redis_cut(multihost_fleet, CUT_REGION, Phases(before_s=2.0, cut_s=4.0, after_s=5.0))
    figures = run.figures()
    # The cut is real: the region's tiers wrote no capacity summary while it lasted ...
    assert run.stream_advanced_during_cut == 0, figures
    # ... yet nothing failed and the region kept serving (direct health evidence) ...
    assert figures["failures"] == 0, figures
    assert figures["served_by_region_during_cut"] > 0, figures
    # ... and its summaries came back by themselves once Redis was reachable again.
    assert run.stream_resumed_s is not None, figures
