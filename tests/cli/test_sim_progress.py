"""``meridian sim run``'s progress: requests fed over every run, from worker processes too."""

from __future__ import annotations

import io
from dataclasses import replace

from cli.sim_progress import RunProgress, run_key, simulate
from common.config.topology import topology_from_mapping
from sim.fleet_gen import fleet_mapping
from sim.run import RunSpec
from sim.scenarios import SCENARIOS
from sim.workload import WorkloadSpec

A, B = ("steady-90", "meridian"), ("steady-90", "greedy_clairvoyant")


def test_off_a_terminal_a_line_every_few_seconds_and_one_per_finished_run() -> None:
    out, now = io.StringIO(), [0.0]
    bar = RunProgress(2, 1000, out, every_s=10.0, clock=lambda: now[0])
    bar.fed_so_far(A, 100)
    now[0] = 4.0
    bar.fed_so_far(B, 300)  # within every_s of the start: no line
    assert out.getvalue() == ""
    now[0] = 10.0
    bar.fed_so_far(A, 500)
    assert out.getvalue().splitlines() == [
        "[############..................] 0/2 runs, 800/2,000 requests, 10s 80 req/s"
    ]
    bar.fed_so_far(A, 400)  # a late report never moves a run back
    assert bar.fed[A] == 500
    now[0] = 12.0
    bar.run_ended(A, "steady-90 / meridian")
    assert out.getvalue().splitlines()[-1] == (
        "[###################...........] 1/2 runs, 1,300/2,000 requests, 12s 108 req/s "
        "steady-90 / meridian"
    )
    assert "\r" not in out.getvalue()


def test_worker_processes_report_what_they_fed() -> None:
    topology = topology_from_mapping(fleet_mapping(gpus=24, regions=2, seed=3))
    base = RunSpec(
        topology=topology,
        workload=WorkloadSpec(seed=3),
        scenario=next(s for s in SCENARIOS if s.name == "steady-50"),
        policy="round_robin",
        requests=2000,
    )
    specs = [base, replace(base, policy="random")]
    out = io.StringIO()
    results = simulate(specs, 2, out)
    assert set(results) == {run_key(s) for s in specs}
    offered = {results[run_key(s)][0].offered for s in specs}  # after the warm-up
    # Each result says what simulating it took: every arrival fed, and its wall time.
    assert all(results[run_key(s)][0].sim_requests == 2000 for s in specs)
    assert all(0 < (results[run_key(s)][0].sim_wall_s or 0) < 60 for s in specs)
    assert len(offered) == 1 and 0 < offered.pop() <= 2000  # the same arrivals
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("[##############################] 2/2 runs, 4,000/4,000 requests")
