"""``meridian local --ext-proc-listen``: turns the endpoint picker on, or moves it."""

from pathlib import Path

import yaml

from cli.main import _topology
from cli.parser import build_parser
from common.config.node import Endpoint
from sim.topology import one_zone_mapping


def _zone_ext_proc(tmp_path: Path, section: dict | None, *flag: str):  # type: ignore[no-untyped-def]
    mapping = one_zone_mapping("redis://127.0.0.1:1/0")
    if section is not None:
        mapping["regions"][0]["zones"][0]["ext_proc"] = section
    config = tmp_path / "topology.yaml"
    config.write_text(yaml.safe_dump(mapping))
    args = build_parser().parse_args(
        ["local", "--config", str(config), "--region", "r", "--zone", "r-1a", *flag]
    )
    return _topology(args).zone("r", "r-1a").ext_proc


def test_flag_turns_the_mode_on_with_defaults(tmp_path: Path) -> None:
    config = _zone_ext_proc(tmp_path, None, "--ext-proc-listen", "127.0.0.1:9002")
    assert config.listen == Endpoint("127.0.0.1", 9002) and config.fallbacks == 2


def test_flag_moves_the_listen_address_and_keeps_the_rest(tmp_path: Path) -> None:
    section = {"listen": "127.0.0.1:1", "fallbacks": 0, "max_wait_s": 2}
    config = _zone_ext_proc(tmp_path, section, "--ext-proc-listen", "127.0.0.1:9003")
    assert (config.listen.port, config.fallbacks, config.max_wait_s) == (9003, 0, 2.0)


def test_without_the_flag_the_file_decides(tmp_path: Path) -> None:
    assert _zone_ext_proc(tmp_path, None) is None
