"""Requests are planned at the answers' typical length, not at their clients' caps.

Clients send very different caps for answers of the same lengths: none (the server's
limit, thousands of tokens) beside tight ones. A tier that counted each request at its
cap learned its GPUs' rates in caps too, so after an uncapped answer of a hundred
tokens a GPU looked dozens of times faster than it is, and the per-try limit of the
next tightly capped request, computed from that rate, cancelled it while it ran at
normal speed. Rates are learned from the lengths the GPUs report, and the requests
are planned at ``min(cap, typical answer)``.
"""

from __future__ import annotations

import random

from common.request.output_length import cap_class
from sim.requests import SimRequest
from tests.sim.test_deployment import CITIES, simulate

MODEL = "sim-llm"
UNCAPPED = 8000  # what a client that sends no cap gets: the server's limit


def mixed_caps(n: int, rate: float, seed: int = 5) -> list[SimRequest]:
    """Answers of 10–1000 tokens; half the clients send no cap, half a tight one."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        city, origin = CITIES[i % 2]
        cap = UNCAPPED if i % 2 else rng.choice((256, 1024))
        true = min(cap, rng.randint(10, 1000))
        blocks = tuple(rng.getrandbits(60) for _ in range(rng.randint(1, 20)))
        out.append(
            SimRequest(i, t, city, origin, "t", 16 * len(blocks), true, blocks, max_tokens=cap)
        )
    return out


def test_mixed_caps_cancel_nothing_and_plan_at_the_typical_answer() -> None:
    kept, deployment = simulate(mixed_caps(400, 20.0), gpus_per_zone=1)
    assert not kept.lost and len(kept.ok) == 400
    # No attempt was cut by a per-try limit computed from a rate learned in caps.
    assert [f["id"] for f in kept.ok if f["attempts"] != 1] == []
    # Every tier learned the answers' typical length from what the GPUs reported ...
    outputs = deployment.global_forwarding.outputs
    assert 10 <= outputs.typical[MODEL] <= 1000
    # ... and plans an uncapped request at the typical answer of its cap class, a tight
    # cap at the cap.
    uncapped = outputs.by_cap[(MODEL, cap_class(UNCAPPED))]
    assert 10 <= uncapped <= 1000
    assert outputs.planned(MODEL, UNCAPPED) == round(uncapped)
    assert outputs.planned(MODEL, 5) == 5
    # The local tiers learned their GPUs' rates in the tokens really generated: no GPU
    # looks faster than its hardware class by anything like the caps' inflation.
    for zone in deployment.zones.values():
        for gpu in zone.balancer.view.gpus:
            assert gpu.rate < 20 * gpu.speed * 2000.0, gpu.name
