"""`meridian top` frames from canned /api/fleet and /api/series answers."""

from __future__ import annotations

from typing import Any

from common.top import Paint, bar, render, sparkline, visible

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
