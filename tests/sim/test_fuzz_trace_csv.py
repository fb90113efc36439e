"""Fuzzing the trace loader (``sim.trace_csv.read_trace``) on generated files.

Whatever the file holds, replaying it either yields requests (ids 0..n-1, times
from 0, finite and in order, token counts in range) or raises ``TraceError`` naming
the file and, past the header, the line to fix; nothing else. Deterministic and
bounded; the worst files found are the seed corpus below.
"""

from __future__ import annotations

import math
import re
import string
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sim.trace_csv import TraceError, read_trace

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow],
)
COLUMNS = ["TIMESTAMP", "ContextTokens", "GeneratedTokens", "session", "tenant"]


def mostly(
    good: st.SearchStrategy[str], bad: st.SearchStrategy[str], one_in: int = 10
) -> st.SearchStrategy[str]:
    """``bad`` once in ``one_in``: enough files replay to check what a replay yields."""
    return st.integers(1, one_in).flatmap(lambda i: bad if i == 1 else good)


HEADERS = mostly(
    st.lists(st.sampled_from(COLUMNS[3:]), unique=True).flatmap(
        lambda extra: st.permutations([*COLUMNS[:3], *extra])
    ),
    st.lists(st.sampled_from([*COLUMNS, "timestamp", " TIMESTAMP ", "x", ""]), max_size=6),
)
TIMES = mostly(
    st.just("next"),  # the previous row's time plus a few seconds
    st.one_of(
        st.floats(-1e308, 1e308).map(repr),
        st.sampled_from(
            [
                "2023-11-16 18:15:46.6805900",
                "2023-11-16T18:15:47",
                "2023-02-30 00:00:00",
                "2023-11-16 99:99:99",
                "nan",
                "inf",
                "-1e308",
                "1e308",
                "",
            ]
        ),
    ),
    one_in=30,
)
TOKENS = mostly(
    st.integers(0, 20_000).map(str),
    st.sampled_from(["-1", "1.5", "", " 7 ", "1_000", "9" * 5000, "\u0663"]),
    one_in=30,
)
FIELDS = {
    "TIMESTAMP": TIMES,
    "ContextTokens": TOKENS,
    "GeneratedTokens": TOKENS,
    "session": st.sampled_from(["", "s1", "s2"]),
    "tenant": st.sampled_from(["", "gold", 'a"b']),
}
ANY_FIELD = st.text(string.printable, max_size=8)


@st.composite
def traces(draw: st.DrawFn) -> str:
    header = draw(HEADERS)
    lines = [",".join(header)]
    now = draw(st.integers(0, 10**6))
    for _ in range(draw(st.integers(0, 6))):
        row = [draw(FIELDS.get(name.strip(), ANY_FIELD)) for name in header]
        if "next" in row:
            now += draw(st.integers(0, 5))
            row = [str(now) if field == "next" else field for field in row]
        if draw(st.integers(0, 19)) == 0:
            row.append("extra")
        lines.append(",".join(row))
    return "\n".join(lines) + draw(st.sampled_from(["\n", "", "\r\n\n"]))


def replay(path: Path) -> None:
    """Read the whole trace; check what came out, or what the error says."""
    where = str(path)
    try:
        requests = list(read_trace(path, seed=1))
    except TraceError as err:
        message = str(err)
        assert message.startswith(where), message
        detail = message[len(where) :]
        assert re.match(r", line \d+: |: (empty file|not UTF-8)", detail), message
        return
    assert [r.id for r in requests] == list(range(len(requests))) and requests
    times = [r.at_s for r in requests]
    assert times[0] == 0.0 and times == sorted(times) and all(map(math.isfinite, times))
    assert all(r.prompt_tokens >= 0 and 1 <= r.output_tokens <= r.max_tokens for r in requests)


@FUZZ
@given(text=traces())
@example(text="TIMESTAMP,ContextTokens,GeneratedTokens\n-1e308,1,1\n1e308,1,1\n")  # found
@example(text='"' + "x" * 200_000 + '",b\n')  # found: a header field over csv's limit
@example(text="TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n" + "4" * 200_000 + ",1,1\n")
@example(text="TIMESTAMP,ContextTokens,GeneratedTokens\n1,\x00,3\n")
@example(text='TIMESTAMP,ContextTokens,GeneratedTokens\n"1,2,3\n')
@example(text="\ufeffTIMESTAMP,ContextTokens,GeneratedTokens\n0,1,1\n")
@example(text="TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n5,1,1\n")
@example(text="TIMESTAMP,ContextTokens,GeneratedTokens\n\u0661\u0662,1,1\n")
@example(text="TIMESTAMP,ContextTokens,GeneratedTokens\n")
@example(text="")
def test_generated_traces_replay_or_name_the_line(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.csv"
        path.write_text(text, encoding="utf-8", newline="")
        replay(path)


@FUZZ
@given(data=st.binary(max_size=60))
@example(data=b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff,1,1\n")
@example(data=b"\xef\xbb\xbf\xef\xbb\xbfTIMESTAMP,ContextTokens,GeneratedTokens\n0,1,1\n")
def test_any_bytes_replay_or_name_the_line(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.csv"
        path.write_bytes(data)
        replay(path)
