from common.geo import GeoPoint
from global_lb.picker import RegionPicker
from tests.pickers import child, request, with_summary

US = GeoPoint(39.04, -77.49)
EU = GeoPoint(53.35, -6.26)
AP = GeoPoint(1.29, 103.85)
HOME = GeoPoint(40.71, -74.01)
TTL = 1.5


def regions():
    return [
        child("us-east", location=US),
        child("eu-west", location=EU),
        child("ap-southeast", location=AP),
    ]


def names(ranked):
    return [c.name for c in ranked]


def test_client_in_europe_goes_to_eu_west_first() -> None:
    ranked = RegionPicker(HOME, TTL).rank(request(GeoPoint(51.5, -0.1)), regions(), now=10)
    assert names(ranked) == ["eu-west", "us-east", "ap-southeast"]


def test_client_in_singapore_goes_to_ap_southeast_first() -> None:
    ranked = RegionPicker(HOME, TTL).rank(request(GeoPoint(1.35, 103.82)), regions(), now=10)
    assert names(ranked)[0] == "ap-southeast"


def test_no_origin_uses_the_global_tiers_own_location() -> None:
    ranked = RegionPicker(HOME, TTL).rank(request(None), regions(), now=10)
    assert names(ranked)[0] == "us-east"


def test_down_region_is_skipped_for_next_nearest() -> None:
    rs = regions()
    rs[1].healthy = False
    ranked = RegionPicker(HOME, TTL).rank(request(EU), rs, now=10)
    assert names(ranked) == ["us-east", "ap-southeast"]


def test_fresh_summary_without_healthy_gpus_skips_region() -> None:
    rs = regions()
    with_summary(rs[1], healthy_gpus=0, received_at=9.5)
    assert names(RegionPicker(HOME, TTL).rank(request(EU), rs, now=10))[0] == "us-east"


def test_stale_summary_is_unknown_and_health_evidence_decides() -> None:
    rs = regions()
    with_summary(rs[1], healthy_gpus=0, received_at=1.0)  # 9 s old, TTL 1.5 s
    assert names(RegionPicker(HOME, TTL).rank(request(EU), rs, now=10))[0] == "eu-west"


def test_region_without_the_model_is_skipped() -> None:
    rs = regions()
    rs[1] = child("eu-west", location=EU, models=("other-model",))
    assert "eu-west" not in names(RegionPicker(HOME, TTL).rank(request(EU), rs, now=10))


def test_summary_with_unknown_zones_does_not_rule_region_out() -> None:
    rs = regions()
    with_summary(rs[1], healthy_gpus=0, received_at=9.5)
    rs[1].summary.models[0].unknown_children = 1
    assert names(RegionPicker(HOME, TTL).rank(request(EU), rs, now=10))[0] == "eu-west"


def test_summary_without_the_model_is_unknown_not_zero() -> None:
    rs = regions()
    with_summary(rs[1], healthy_gpus=3, received_at=9.5, model="other")
    assert names(RegionPicker(HOME, TTL).rank(request(EU), rs, now=10))[0] == "eu-west"
