from common.geo import GeoPoint
from regional_lb.picker import ZonePicker
from tests.pickers import child, request, with_summary

ZONE_A = GeoPoint(39.03, -77.47)
ZONE_B = GeoPoint(38.94, -77.45)
HOME = GeoPoint(39.04, -77.49)


def zones():
    return [child("1a", location=ZONE_A), child("1b", location=ZONE_B)]


def names(ranked):
    return [c.name for c in ranked]


def test_request_zone_first() -> None:
    picker = ZonePicker(HOME, 1.5)
    assert names(picker.rank(request(ZONE_B), zones(), 0)) == ["1b", "1a"]
    assert names(picker.rank(request(ZONE_A), zones(), 0)) == ["1a", "1b"]


def test_other_zone_when_own_zone_is_down() -> None:
    zs = zones()
    zs[1].healthy = False
    assert names(ZonePicker(HOME, 1.5).rank(request(ZONE_B), zs, 0)) == ["1a"]


def test_zone_with_no_healthy_gpu_in_fresh_summary_skipped() -> None:
    zs = zones()
    with_summary(zs[0], healthy_gpus=0, received_at=0)
    assert names(ZonePicker(HOME, 1.5).rank(request(ZONE_A), zs, 1.0)) == ["1b"]


def test_equidistant_zones_ordered_by_outstanding_work() -> None:
    zs = [child("x", location=HOME, outstanding_work=50), child("y", location=HOME)]
    assert names(ZonePicker(HOME, 1.5).rank(request(HOME), zs, 0)) == ["y", "x"]
