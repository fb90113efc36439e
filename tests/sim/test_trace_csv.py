"""Replaying a trace CSV in the Azure format: tokens and relative times as written,
cities as the workload draws them, sessions' prefixes, and every malformed case."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.basics.vocabulary import Priority
from common.request.prefix import BLOCK_TOKENS
from sim.geography import CITIES
from sim.trace_csv import TraceError, read_trace


def write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.7805900,396,109
2023-11-16 18:16:01.0000001,879,0
2023-11-17 00:00:00.5000000,20000,100
"""


def test_an_azure_trace_replays_with_its_tokens_and_times_from_zero(tmp_path: Path) -> None:
    requests = list(read_trace(write(tmp_path, AZURE)))
    assert [r.id for r in requests] == [0, 1, 2, 3]
    assert [r.at_s for r in requests] == pytest.approx(
        [0.0, 4.1, 14.3194101, 5 * 3600 + 44 * 60 + 13.81941], abs=1e-6
    )
    # 0 generated tokens replays as 1; 20000 + 100 is capped to the 16384 KV cache.
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [
        (374, 44),
        (396, 109),
        (879, 1),
        (16384 - 100, 100),
    ]
    for r in requests:
        assert len(r.prefix_blocks) == r.prompt_tokens // BLOCK_TOKENS
        assert r.tenant == "trace" and r.session is None and r.priority is Priority.STANDARD
    # Without sessions nothing is shared.
    blocks = [b for r in requests for b in r.prefix_blocks]
    assert len(blocks) == len(set(blocks))


def test_plain_seconds_columns_in_any_order_with_sessions_and_tenants(tmp_path: Path) -> None:
    text = (
        "tenant,GeneratedTokens,session,TIMESTAMP,ContextTokens\n"
        "acme,10,s1,100.5,320\n"
        "beta,20,,101.0,100\n"
        "acme,30,s1,102.25,400\n"  # the session's context grew: extends turn 1
        ",5,s1,110,64\n"  # it shrank (history cut): shares nothing
    )
    requests = list(read_trace(write(tmp_path, text), priorities={"acme": Priority.CRITICAL}))
    assert [r.at_s for r in requests] == [0.0, 0.5, 1.75, 9.5]
    assert [(r.prompt_tokens, r.output_tokens) for r in requests] == [
        (320, 10),
        (100, 20),
        (400, 30),
        (64, 5),
    ]
    assert [r.tenant for r in requests] == ["acme", "beta", "acme", "trace"]
    assert [r.session for r in requests] == ["s1", None, "s1", "s1"]
    assert [r.priority for r in requests] == [
        Priority.CRITICAL,
        Priority.STANDARD,
        Priority.CRITICAL,
        Priority.STANDARD,
    ]
    first, _, second, third = requests
    assert second.prefix_blocks[: len(first.prefix_blocks)] == first.prefix_blocks
    assert len(second.prefix_blocks) == 400 // BLOCK_TOKENS
    assert not set(third.prefix_blocks) & set(second.prefix_blocks)
    assert first.city == second.city == third.city  # a session stays where it began


def test_cities_are_drawn_by_weight_and_local_time_and_seeded(tmp_path: Path) -> None:
    rows = "".join(f"{i * 0.01:.2f},100,10\n" for i in range(20_000))
    path = write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows)
    flat = [r.city for r in read_trace(path, diurnal=False)]
    total = sum(c.weight for c in CITIES)
    for city in ("Tokyo", "New York", "Sydney"):
        weight = next(c.weight for c in CITIES if c.name == city)
        assert flat.count(city) / len(flat) == pytest.approx(weight / total, abs=0.01)
    # At 12:00 UTC it is 21:00 in Tokyo and 07:00 in New York; at 00:00 UTC the reverse.
    noon = [r.city for r in read_trace(path, start_utc_hour=12.0)]
    midnight = [r.city for r in read_trace(path, start_utc_hour=0.0)]
    assert noon.count("Tokyo") > 1.5 * midnight.count("Tokyo")
    assert midnight.count("New York") > 1.5 * noon.count("New York")
    assert noon == [r.city for r in read_trace(path, start_utc_hour=12.0)]
    assert noon != [r.city for r in read_trace(path, start_utc_hour=12.0, seed=1)]


def test_a_dated_trace_takes_its_hour_of_day_from_its_first_timestamp(tmp_path: Path) -> None:
    def at(hour: int) -> Path:
        rows = "".join(
            f"2023-11-16 {hour:02d}:{i // 60:02d}:{i % 60:02d},10,1\n" for i in range(3000)
        )
        return write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows, f"{hour}.csv")

    assert [r.city for r in read_trace(at(12))] == [
        r.city for r in read_trace(at(12), start_utc_hour=12.0)
    ]
    assert [r.city for r in read_trace(at(12))] != [r.city for r in read_trace(at(0))]


def test_a_row_slightly_out_of_order_is_replayed_at_its_predecessors_time(tmp_path: Path) -> None:
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n10.0,1,1\n12.0,1,1\n11.5,1,1\n13,1,1\n"
    assert [r.at_s for r in read_trace(write(tmp_path, text))] == [0.0, 2.0, 2.0, 3.0]


HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
MALFORMED = [
    ("", "trace.csv: empty file; expected a header TIMESTAMP,ContextTokens,GeneratedTokens"),
    (HEADER, "trace.csv: empty file: no requests after the header"),
    (
        "TIMESTAMP,ContextTokens\n1,2\n",
        "trace.csv, line 1: missing column 'GeneratedTokens'; the header must name "
        "TIMESTAMP,ContextTokens,GeneratedTokens",
    ),
    (
        "TIMESTAMP,ContextTokens,GeneratedTokens,Session\n1,2,3,a\n",
        "trace.csv, line 1: unknown column 'Session'; known: TIMESTAMP, ContextTokens, "
        "GeneratedTokens, session, tenant (names are case-sensitive)",
    ),
    (
        "TIMESTAMP,ContextTokens,ContextTokens,GeneratedTokens\n",
        "trace.csv, line 1: column 'ContextTokens' appears twice",
    ),
    (
        HEADER + "1,2,3\n2,12.5,3\n",
        "trace.csv, line 3: ContextTokens must be a whole number of tokens, got '12.5'",
    ),
    (HEADER + "1,2,-3\n", "trace.csv, line 2: GeneratedTokens must be >= 0, got -3"),
    (HEADER + "1,2,x\n", "trace.csv, line 2: GeneratedTokens must be a whole number of tokens"),
    (
        HEADER + "yesterday,2,3\n",
        "trace.csv, line 2: TIMESTAMP 'yesterday' is neither a date-time like "
        "'2023-11-16 18:15:46.6805900' nor a number of seconds",
    ),
    (
        HEADER + "2023-11-16 18:15:46.6805900,2,3\n1700000000,2,3\n",
        "trace.csv, line 3: TIMESTAMP '1700000000' is not a date-time like "
        "'2023-11-16 18:15:46.6805900' (the form the first row uses)",
    ),
    (HEADER + "2023-02-30 10:00:00,2,3\n", "trace.csv, line 2: no such date '2023-02-30'"),
    (HEADER + "nan,2,3\n", "trace.csv, line 2: TIMESTAMP 'nan' is neither a date-time"),
    (
        HEADER + "10,2,3\n\n20,2,3\n15.5,2,3\n",
        "trace.csv, line 5: TIMESTAMP goes back 4.500 s from line 4; rows must be in time "
        "order (within 1 s)",
    ),
    (HEADER + "1,2,3\n2,3\n", "trace.csv, line 3: expected 3 fields (TIMESTAMP,ContextTokens,"),
]


@pytest.mark.parametrize(("text", "message"), MALFORMED, ids=[m for _, m in MALFORMED])
def test_a_malformed_trace_names_the_file_the_line_and_what_is_wrong(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(TraceError) as info:
        list(read_trace(path))
    assert str(info.value).startswith(str(tmp_path))
    assert message in str(info.value)


def test_an_empty_or_headless_file_fails_at_once_a_bad_row_when_reached(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="empty file"):
        read_trace(write(tmp_path, ""))
    replay = read_trace(write(tmp_path, HEADER + "1,2,3\n2,2,-1\n", "late.csv"))
    assert next(replay).prompt_tokens == 2
    with pytest.raises(TraceError, match="line 3: GeneratedTokens must be >= 0"):
        next(replay)


def test_a_missing_or_binary_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.csv: cannot read it"):
        read_trace(tmp_path / "nope.csv")
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match=r"bin\.csv: not UTF-8 text"):
        list(read_trace(binary))
