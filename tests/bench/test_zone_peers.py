"""bench.zone_peers: the peers' weighted configs, its arguments, and one small real run."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.data_plane_peers import binary
from bench.sim_validation_real import send_shot
from bench.sim_validation_workload import (
    ShapeSpec,
    Shot,
    draw_sessions,
    draw_shapes,
    draw_unshared_sessions,
    make_shots,
    zone_gpus,
    zone_topology,
)
from bench.zone_peers import main, parse_args, peer_files, ratios, run, stem
from common.config.node import Endpoint
from common.gen.inference import grpc_service_pb2 as pb
from common.gen.inference import grpc_service_pb2_grpc as pb_grpc
from common.request.routing import SESSION

HARDWARE = ("H100", "A100@0.5", "V100")


def test_the_peers_weigh_each_gpu_by_its_speed(tmp_path: Path) -> None:
    gpus = zone_gpus(zone_topology("redis://127.0.0.1:1", hardware=HARDWARE, time_scale=1.0))
    listen = Endpoint("127.0.0.1", 9)
    nginx = peer_files("nginx", tmp_path, listen, gpus)["nginx.conf"]
    haproxy = peer_files("haproxy", tmp_path, listen, gpus)["haproxy.cfg"]
    for gpu, weight in zip(gpus, (20, 5, 6), strict=True):
        assert f"server {gpu.endpoint.address} weight={weight};" in nginx
        assert f"{gpu.endpoint.address} proto h2 weight {weight}" in haproxy
    assert "least_conn;" in nginx and "balance leastconn" in haproxy
    # Plaintext HTTP/2 to the client, as the local tier serves it here.
    assert "listen 127.0.0.1:9 http2;" in nginx and "ssl" not in nginx
    assert "bind 127.0.0.1:9 proto h2" in haproxy and "ssl" not in haproxy


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--fronts", "meridian,envoy"], "--fronts"),
        (["--fronts", ","], "--fronts"),
        (["--load", "0"], "--load"),
        (["--requests", "5"], "--requests"),
        (["--rounds", "0"], "--rounds"),
        (["--sim-loads", "half"], "--sim-loads"),
        (["--sim-seeds", "0"], "--sim-seeds"),
        (["--sessions", "shared"], "--sessions"),
    ],
)
def test_bad_arguments_name_the_flag(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


def test_every_front_serves_the_same_requests_on_the_same_gpus() -> None:
    fronts = ["meridian", "completion_time"]
    fronts += [p for p in ("nginx", "haproxy") if binary(p) is not None]
    if len(fronts) == 2:
        pytest.skip("no nginx or haproxy on this machine: `make peers` installs them")
    args = parse_args(
        ["--fronts", ",".join(fronts), "--requests", "30", "--rounds", "1", "--no-write",
         "--hardware", "A100,V100", "--time-scale", "1", "--load", "0.5"]
    )  # fmt: skip
    rate, runs = run(args)
    assert rate > 0
    assert [r.front for r in runs] == fronts
    for r in runs:
        assert r.served == 30 and r.codes == {"OK": 30}, r
        # Both GPUs took requests, and nothing was sent twice.
        assert sum(r.attempts_per_gpu.values()) == 30 and all(r.attempts_per_gpu.values()), r
        assert 0 < r.p50_ms <= r.p90_ms <= r.p99_ms
    for peer in fronts[1:]:
        ratio = ratios(runs, peer)
        mine = next(r for r in runs if r.front == "meridian")
        theirs = next(r for r in runs if r.front == peer)
        assert ratio["p99"] == pytest.approx(theirs.p99_ms / mine.p99_ms)


def test_the_simulated_variant_routes_the_same_requests_for_every_front(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--simulate", "--requests", "60", "--sim-seeds", "2", "--sim-loads", "0.5,0.9",
            "--hardware", "H100,V100", "--no-write"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 50%", "| 90%"))]
    assert len(rows) == 2 * 3  # two loads x meridian, completion_time, nginx (haproxy: none)
    assert sum("| meridian |" in r for r in rows) == 2
    assert all(r.endswith("| 1.00 | 1.00 | 1.00 |") for r in rows if "| meridian |" in r)


def test_a_sessions_turns_extend_its_history_and_arrive_in_order() -> None:
    shapes = draw_sessions(40, ShapeSpec(), random.Random(3), turns=4)
    assert len(shapes) == 40
    by_session: dict[str, list[str]] = {}
    for shape in shapes:
        assert shape.session is not None
        by_session.setdefault(shape.session, []).append(shape.prompt)
    assert len(by_session) == 10 and all(len(p) == 4 for p in by_session.values())
    for prompts in by_session.values():
        for before, after in itertools.pairwise(prompts):
            # The whole last turn, its answer, then the new user text.
            assert after.startswith(before + " ") and len(after.split()) > len(before.split())
    # Every first turn before any second one.
    assert [s.session for s in shapes[:10]] == [f"session-{i}" for i in range(10)]
    shots = make_shots(shapes, 10.0, random.Random(3))
    assert [s.session for s in shots] == [s.session for s in shapes]


def test_unshared_sessions_are_the_independent_requests_with_session_ids() -> None:
    """The prompts ``draw_shapes`` draws for the same seed, none a prefix of another
    turn's, each session's four turns in the order ``draw_sessions`` sends them."""
    shapes = draw_unshared_sessions(40, ShapeSpec(), random.Random(3), turns=4)
    plain = draw_shapes(40, ShapeSpec(), random.Random(3))
    assert [(s.prompt, s.max_tokens, s.shared_words) for s in shapes] == [
        (s.prompt, s.max_tokens, s.shared_words) for s in plain
    ]
    assert [s.session for s in shapes[:10]] == [f"session-{i}" for i in range(10)]
    turns: dict[str | None, list[str]] = {}
    for shape in shapes:
        turns.setdefault(shape.session, []).append(shape.prompt)
    assert len(turns) == 10 and all(len(p) == 4 for p in turns.values())
    for prompts in turns.values():
        for before, after in itertools.pairwise(prompts):
            assert not after.startswith(before)


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        ([], "zone_peers"),
        (["--sessions"], "zone_peers_sessions"),
        (["--sessions", "history"], "zone_peers_sessions"),
        (["--sessions", "unshared"], "zone_peers_sessions_unshared"),
    ],
)
def test_each_workload_writes_results_of_its_own(argv: list[str], name: str) -> None:
    assert stem(parse_args(argv), "zone_peers") == name


def test_sessions_reach_the_local_tier_and_keep_their_history_warm() -> None:
    """The local tier keeps a session's turns where its history is cached (the session
    ring and the prefix index): more prompt tokens come from the GPUs' prefix caches
    than behind weighted least connections, which knows nothing of either."""
    if binary("nginx") is None:
        pytest.skip("no nginx on this machine: `make peers` installs it")
    args = parse_args(
        ["--fronts", "meridian,nginx", "--sessions", "--requests", "48", "--rounds", "1",
         "--no-write", "--hardware", "A100,A100,V100", "--time-scale", "1", "--load", "0.4"]
    )  # fmt: skip
    _, runs = run(args)
    mine, theirs = runs
    assert mine.codes == {"OK": 48} and theirs.codes == {"OK": 48}
    assert mine.prefix_hit_share > theirs.prefix_hit_share + 0.05, (mine, theirs)


class _Recorder(pb_grpc.GRPCInferenceServiceServicer):
    """A V2 server that answers every ModelInfer and keeps each call's metadata."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> Any:
        self.seen.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        return pb.ModelInferResponse(model_name=request.model_name)


async def test_a_shot_of_a_session_carries_the_session_header() -> None:
    recorder, server = _Recorder(), grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            now = asyncio.get_running_loop().time()
            turn = Shot(0, 0.0, "hello there", 2, 1, (), session="session-7")
            alone = dataclasses.replace(turn, id=1, session=None)
            samples = [await send_shot(stub, shot, now, 5.0) for shot in (turn, alone)]
    finally:
        await server.stop(0)
    assert [s.code for s in samples] == ["OK", "OK"]
    assert recorder.seen[0][SESSION] == "session-7"
    assert SESSION not in recorder.seen[1]
