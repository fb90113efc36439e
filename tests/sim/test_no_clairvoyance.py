"""No tier sees an answer's true length: only the client's max_tokens reaches the pickers.

Two bursts of the same requests, alike in everything but their true output lengths
(every max_tokens the same), arrive at one instant, before any GPU has finished
a step: no completion can have told any tier anything yet, so every decision
must be the same in both. A picker, cost or summary that read the true length
would rank GPUs differently (the local tier's cost weighs a request's work).
"""

from __future__ import annotations

import random

from sim.requests import SimRequest
from tests.sim.test_deployment import CITIES, simulate


def burst(lengths: random.Random) -> list[SimRequest]:
    shape = random.Random(11)  # the same prompts, caps and origins in both bursts
    out = []
    for i in range(60):  # under the fleet's 128 slots: nothing waits for a completion
        city, origin = CITIES[i % 2]
        cap = shape.choice((64, 256, 1024))
        blocks = tuple(shape.getrandbits(60) for _ in range(shape.randint(2, 40)))
        true = lengths.randint(1, cap)
        out.append(
            SimRequest(i, 0.0, city, origin, "t", 16 * len(blocks), true, blocks, max_tokens=cap)
        )
    return out


def test_true_lengths_change_no_decision_while_every_max_tokens_stays() -> None:
    short, _ = simulate(burst(random.Random(1)))
    long, _ = simulate(burst(random.Random(2)))
    assert len(short.ok) == len(long.ok) == 60 and not short.lost and not long.lost
    where_short = {f["id"]: (f["region"], f["zone"], f["gpu"]) for f in short.ok}
    where_long = {f["id"]: (f["region"], f["zone"], f["gpu"]) for f in long.ok}
    assert where_short == where_long
    # The lengths did differ, and the GPUs did run them as long as they were.
    e2e_short = {f["id"]: f["e2e_s"] for f in short.ok}
    e2e_long = {f["id"]: f["e2e_s"] for f in long.ok}
    assert e2e_short != e2e_long
    assert len({f["gpu"] for f in short.ok}) > 4
