"""`meridian top` frames from canned /api/fleet and /api/series answers, and from
addresses that answer something else."""

from __future__ import annotations

import contextlib
import copy
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.top import Paint, bar, clean, fit, frame, render, sparkline, visible

ROOT = Path(__file__).resolve().parents[2]

FLEET: dict[str, Any] = {
    "totals": {
        "gpus": 2,
        "gpus_ok": 1,
        "slots": 32,
        "outstanding": 12,
        "queued": 3,
        "utilisation": 0.375,
    },
    "regions": [
        {
            "name": "eu",
            "reachable": True,
            "healthy": True,
            "utilisation": 0.375,
            "outstanding": 12,
            "zones": [
                {
                    "name": "eu-1a",
                    "reachable": True,
                    "healthy": True,
                    "utilisation": 0.375,
                    "outstanding": 12,
                    "tier_queued": 3,
                    "gpus": [
                        {
                            "name": "eu-1a-gpu0",
                            "hardware": "H100",
                            "slots": 16,
                            "state": "ok",
                            "outstanding": 12,
                            "utilisation": 0.75,
                            "running": 12,
                            "waiting": 2,
                            "kv_cache_usage": 0.5,
                            "weight": 2.0,
                        },
                        {
                            "name": "eu-1a-gpu1",
                            "hardware": "A100",
                            "state": "unknown",
                            "weight": 1.0,
                        },
                    ],
                },
                {"name": "eu-1b", "reachable": False, "error": "ClientConnectorError", "gpus": []},
            ],
        }
    ],
}
SERIES = {
    "points": [
        {
            "t": i,
            "rps": float(i),
            "errors_per_s": 0.0,
            "p50_ms": 20.0,
            "p90_ms": 30.0,
            "p99_ms": 50.0,
        }
        for i in range(10)
    ]
}


def lines_of(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}


def test_a_frame_lists_every_region_zone_and_gpu() -> None:
    text = render(FLEET, SERIES, source="http://x", paint=Paint(False))
    rows = lines_of(text)
    assert rows["eu-1a-gpu0"][:3] == ["eu-1a-gpu0", "H100", "ok"]
    assert "12/16" in rows["eu-1a-gpu0"] and "50%" in rows["eu-1a-gpu0"]
    assert rows["eu-1a-gpu1"][:3] == ["eu-1a-gpu1", "A100", "unknown"]
    assert rows["eu-1a-gpu0"][-2:] == ["weight", "2.0"]
    assert "weight" not in rows["eu-1a-gpu1"]  # the default weight is not worth a note
    assert rows["eu-1b"][1] == "unreachable" and "ClientConnectorError" in rows["eu-1b"]
    assert "tier queue 3" in text
    assert "requests/s 7.0" in text and "p99 50 ms" in text and "GPUs 1/2 serving" in text
    assert "\x1b[" not in text


def test_colour_does_not_shift_the_columns() -> None:
    plain = render(FLEET, SERIES, source="http://x", paint=Paint(False))
    coloured = render(FLEET, SERIES, source="http://x", paint=Paint(True))
    assert "\x1b[" in coloured
    # Same text on screen, line by line, once the escapes are gone.
    assert [visible(line) for line in coloured.splitlines()[1:]] == plain.splitlines()[1:]


def test_no_answer_says_why() -> None:
    text = render(None, None, source="http://x", paint=Paint(False), error="refused")
    assert "no answer: refused" in text


def test_bar_and_sparkline() -> None:
    assert visible(bar(0.5, Paint(True))).startswith("█████░░░░░  50%")
    assert bar(None, Paint(False)).strip() == ""
    assert sparkline([0, 1, 2]) == "▁▄█"
    assert sparkline([]) == ""


def test_reported_text_is_printed_without_control_characters() -> None:
    fleet = copy.deepcopy(FLEET)
    zone = fleet["regions"][0]["zones"][0]
    zone["gpus"][1]["last_error"] = "oom\x1b[2J\x1b]0;owned\x07\r\nkilled\x7f\x9b31m"
    fleet["regions"][0]["zones"][1]["error"] = "refused\x1b[31m"
    text = render(fleet, SERIES, source="http://x", paint=Paint(False))
    assert not any(ch in text for ch in "\x1b\x07\r\x7f\x9b")
    rows = lines_of(text)
    assert rows["eu-1a-gpu1"][-1] == "oom[2J]0;ownedkilled31m"
    assert rows["eu-1b"][-1] == "refused[31m"


def test_clean_keeps_printable_text() -> None:
    assert clean("a\tb\x00c — ü") == "abc — ü"


@pytest.fixture
def answer() -> Iterator[tuple[str, list[bytes]]]:
    """A loopback TCP server that answers one connection with the bytes the test puts
    in the list, then hangs up: ``(base URL, that list)``."""
    reply: list[bytes] = []
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)

    def serve_one() -> None:
        with server, contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"".join(reply))

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", reply
    thread.join(timeout=10)
    assert not thread.is_alive()


# What a gRPC port sends first: an HTTP/2 SETTINGS frame, binary, no status line.
HTTP2_SETTINGS = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64"


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        pytest.param(HTTP2_SETTINGS, "BadStatusLine", id="grpc-port"),
        pytest.param(b"garbage\x1b[2J\r\n\r\n", "BadStatusLine", id="not-http"),
        pytest.param(
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{", "IncompleteRead", id="cut-off"
        ),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n[1]\n", "ValueError", id="list"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n{x}", "JSONDecode", id="json"),
        pytest.param(b"", "RemoteDisconnected", id="hang-up"),
    ],
)
def test_an_address_that_is_not_the_ops_http_is_no_answer(
    answer: tuple[str, list[bytes]], reply: bytes, why: str
) -> None:
    base, replies = answer
    replies.append(reply)
    text, answered = frame(base, Paint(False), timeout_s=5)
    assert not answered
    (line,) = [line for line in text.splitlines() if line.startswith("no answer: ")]
    assert why in line
    assert all(ch.isprintable() for ch in text.replace("\n", "")), text


@pytest.fixture
def ops_http() -> Iterator[str]:
    """A loopback HTTP server answering /api/fleet and /api/series with the canned
    answers above, as a global tier's ops HTTP would; stopped at the end."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(FLEET if self.path.startswith("/api/fleet") else SERIES).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def run_top(base: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cli.main", "top", "--ops", base, "--count", "2"]
    clean_env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "NO_COLOR")}
    return subprocess.run(
        [*argv, "--interval", "0.1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean_env, **env},
    )


def test_top_piped_writes_plain_frames_cut_to_columns(ops_http: str) -> None:
    done = run_top(ops_http, {"COLUMNS": "50"})
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout  # no clearing, no cursor moves, no colour
    assert done.stdout.count("Meridian top — ") == 2  # two frames, one after the other
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) == 50
    assert any(line.startswith("    eu-1a-gpu0") for line in lines)


def test_top_piped_without_columns_keeps_whole_lines(ops_http: str) -> None:
    done = run_top(ops_http, {})
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout
    assert any("ClientConnectorError" in line for line in done.stdout.splitlines())


def test_fit_cuts_visible_characters_and_keeps_colours_closed() -> None:
    painted = Paint(True)("abcdef", "\x1b[31m") + "ghij"
    cut = fit(painted, 4)
    assert visible(cut) == "abcd" and cut.endswith("\x1b[0m")
    assert fit("ab\ncdef", 3) == "ab\ncde"
    assert fit("whole", None) == "whole"
