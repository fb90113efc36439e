"""The launcher's lifecycle: ``meridian up`` warns once when a tier dies, and a SIGKILLed
``meridian up`` leaves nothing behind — its embedded redis-server included.
``ExitWatch`` on its own, over real child processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cli.launcher import LAYERS, Fleet
from cli.processes import START_GATE_ENV, ExitWatch, TierProcess
from tests.common.basics.test_redis_embed import answers
from tests.conftest import small_fleet_spec

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sleepers(tmp_path: Path) -> Iterator[dict[str, TierProcess]]:
    procs = {n: TierProcess(n, SLEEPER, tmp_path / f"{n}.log") for n in ("local-a", "worker-a")}
    for proc in procs.values():
        proc.start()
    try:
        yield procs
    finally:
        for proc in procs.values():
            proc.stop(signal.SIGKILL)


def kill(proc: TierProcess) -> None:
    assert proc.process is not None
    proc.process.kill()
    proc.process.wait()


def test_a_death_is_reported_once_and_a_restart_once(sleepers: dict[str, TierProcess]) -> None:
    clock = Clock()
    watch = ExitWatch(sleepers, answers=lambda name: False, clock=clock)
    assert watch.poll() == []
    kill(sleepers["local-a"])
    lines = []
    for _ in range(20):  # ten seconds of `meridian up` polling
        lines += watch.poll()
        clock.now += 0.5
    assert lines == [f"warning: local-a exited (code -9); see {sleepers['local-a'].log_path}"]
    sleepers["local-a"].start()
    assert watch.poll() == ["local-a is running again"]
    assert watch.poll() == []


def test_a_tier_started_by_hand_is_reported_back_and_gone_again(
    sleepers: dict[str, TierProcess],
) -> None:
    clock = Clock()
    answering = {"worker-a": False}
    probed: list[str] = []

    def answers(name: str) -> bool:
        probed.append(name)
        return answering.get(name, False)

    watch = ExitWatch(sleepers, answers=answers, probe_interval_s=2.0, clock=clock)
    kill(sleepers["worker-a"])
    assert watch.poll() == [
        f"warning: worker-a exited (code -9); see {sleepers['worker-a'].log_path}"
    ]
    clock.now += 1.0
    assert (watch.poll(), probed) == ([], [])  # not probed before probe_interval_s
    answering["worker-a"] = True  # someone started it from the run directory's topology
    clock.now += 1.0
    assert watch.poll() == ["worker-a answers again (a process this launcher did not start)"]
    clock.now += 2.0
    assert watch.poll() == []
    answering["worker-a"] = False
    clock.now += 2.0
    log = sleepers["worker-a"].log_path
    assert watch.poll() == [f"warning: worker-a stopped answering; see {log}"]
    assert probed == ["worker-a"] * 3


def processes_with(*needles: str) -> dict[int, str]:
    """Every process on the machine whose command line contains one of ``needles``."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry.name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # dead, waiting for its parent to reap it
        except OSError:
            continue
        if any(n in cmdline for n in needles):
            found[int(entry.name)] = cmdline.strip()
    return found


def wait_for(path: Path, text: str, up: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while text not in (out := path.read_text()):
        assert up.poll() is None, f"meridian up exited:\n{out}"
        assert time.monotonic() < deadline, f"no {text!r} from meridian up:\n{out}"
        time.sleep(0.1)
    return out


def test_sigkilled_up_leaves_no_process_and_a_dead_tier_is_warned_of_once(
    tmp_path: Path,
) -> None:
    config, run, out_path = tmp_path / "fleet.yaml", tmp_path / "run", tmp_path / "up.out"
    config.write_text(yaml.safe_dump(small_fleet_spec(regions=1, zones=1, gpus=1)))
    argv = [sys.executable, "-m", "cli.main", "up", "--config", str(config), "--run-dir", str(run)]
    with out_path.open("wb") as out:
        # Its own process group: what it starts is killed with it if the test fails.
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(out_path, "ready;", up, timeout_s=90)
        redis_url = yaml.safe_load((run / "topology.yaml").read_text())["redis_url"]
        redis_port = redis_url.rsplit(":", 1)[1].split("/")[0]
        # redis-server retitles itself "redis-server 127.0.0.1:<port>"
        mine = (str(run), f"127.0.0.1:{redis_port}")
        launched = {p: c for p, c in processes_with(*mine).items() if p != up.pid}
        assert len(launched) == 5, launched  # worker, local, regional, global, redis-server
        workers = [pid for pid, cmd in launched.items() if "cli.main worker" in cmd]
        os.kill(workers[0], signal.SIGKILL)
        wait_for(out_path, "warning: worker-", up, timeout_s=10)
        time.sleep(2.0)  # four more rounds of the launcher's watch
        warnings = [ln for ln in out_path.read_text().splitlines() if ln.startswith("warning")]
        assert len(warnings) == 1 and " exited (code -9); see " in warnings[0], warnings
        up.kill()  # SIGKILL: no handler runs, only the kernel's death signals
        up.wait(10)
        deadline = time.monotonic() + 10
        while left := {p: c for p, c in processes_with(*mine).items() if p in launched}:
            assert time.monotonic() < deadline, f"left behind by a killed meridian up: {left}"
            time.sleep(0.1)
        assert not answers(int(redis_port))
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group this test started
            os.killpg(up.pid, signal.SIGKILL)
        up.wait(10)


# Says when SIGTERM came and, after a drain, when it exits (as a tier does: DRAIN_NOTICE_S).
DRAINER = """
import signal, sys, time
name, events = sys.argv[1], sys.argv[2]
def drain(*_):
    with open(events, "a") as f:
        f.write(f"{name} signalled {time.monotonic()}\\n")
    time.sleep(0.3)
    with open(events, "a") as f:
        f.write(f"{name} exits {time.monotonic()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
time.sleep(60)
"""


def test_a_fleet_stops_top_down_a_layer_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(small_fleet_spec(regions=2, zones=1, gpus=1)))
    fleet = Fleet(path, tmp_path / "run", tls=False)  # not started: its processes drain
    events = tmp_path / "events"
    fleet.processes = {
        name: TierProcess(
            name, [sys.executable, "-c", DRAINER, name, str(events)], tmp_path / f"{name}.log"
        )
        for name in fleet.processes
    }
    try:
        for proc in fleet.processes.values():
            proc.start()
        time.sleep(1.0)  # every handler installed
    finally:
        fleet.stop()
    seen: dict[tuple[str, str], float] = {}
    for line in events.read_text().splitlines():
        name, what, at = line.split()
        seen[name, what] = float(at)
    layers = [[n for n in fleet.processes if n.startswith(layer)] for layer in LAYERS]
    assert sorted(n for layer in layers for n in layer) == sorted(fleet.processes)
    assert all(len(layer) == 2 for layer in layers[:3])  # two zones, two regions
    for upper, lower in zip(layers[::-1], layers[::-1][1:], strict=False):
        # The layer below is signalled only once every process above has exited...
        assert max(seen[n, "exits"] for n in upper) <= min(seen[n, "signalled"] for n in lower)
    for layer in layers:
        # ...and a layer's processes drain together, not one after the other.
        assert max(seen[n, "signalled"] for n in layer) < min(seen[n, "exits"] for n in layer)


GATED = """
import os, sys
from cli.main import _through_start_gate
_through_start_gate("local")
print("local_lb.server" in sys.modules, os.environ.get("MERIDIAN_START_GATE"), flush=True)
"""


def test_a_gated_process_loads_its_tier_then_waits_for_the_gate_to_open() -> None:
    read, write = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", GATED],
        env={**os.environ, START_GATE_ENV: str(read), "PYTHONPATH": str(ROOT)},
        pass_fds=(read,),
        stdout=subprocess.PIPE,
        text=True,
    )
    os.close(read)
    try:
        deadline = time.monotonic() + 30
        # Until it blocks in read(2) on the gate (/proc/PID/syscall: number 0, then the fd).
        while True:
            assert child.poll() is None, "it went through a closed gate"
            if Path(f"/proc/{child.pid}/syscall").read_text().startswith(f"0 {read:#x} "):
                break
            assert time.monotonic() < deadline, "it never waited at the gate"
            time.sleep(0.02)
        os.close(write)
        write = -1
        out, _ = child.communicate(timeout=30)
    finally:
        if write >= 0:
            os.close(write)
        if child.poll() is None:
            child.kill()
            child.wait()
    # Its tier's code loaded; the gate not passed on to what it starts.
    assert out.split() == ["True", "None"]
