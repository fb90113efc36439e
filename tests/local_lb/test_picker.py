from local_lb.picker import LeastWorkPicker, estimated_drain_tokens
from tests.pickers import child, request


def names(ranked):
    return [c.name for c in ranked]


def test_least_outstanding_work_first() -> None:
    gpus = [child("busy", outstanding_work=300), child("idle"), child("some", outstanding_work=40)]
    assert names(LeastWorkPicker().rank(request(), gpus, 0)) == ["idle", "some", "busy"]


def test_work_is_normalised_by_speed() -> None:
    # Same outstanding work: the H100 (speed 2) drains it in half the time.
    gpus = [
        child("a100", speed=1.0, outstanding_work=100),
        child("h100", speed=2.0, outstanding_work=100),
    ]
    assert names(LeastWorkPicker().rank(request(), gpus, 0))[0] == "h100"
    assert estimated_drain_tokens(gpus[1], 20) == 60


def test_unhealthy_and_wrong_model_gpus_excluded() -> None:
    gpus = [child("down", healthy=False), child("other", models=("x",)), child("ok")]
    assert names(LeastWorkPicker().rank(request(), gpus, 0)) == ["ok"]
