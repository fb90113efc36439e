"""The ``meridian`` command line: every subcommand's own --help, --version, errors that
name the flag."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from cli.options import version
from cli.parser import build_parser
from common.observability.logs import LogSettings

ROOT = Path(__file__).resolve().parents[2]
TIER = ("--config", "--log-format", "--log-level")
TLS_WORKER = ("--tls-cert", "--tls-key", "--time-scale")

# subcommand -> options its --help must name, options it must not.
HELP: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "global": ((*TIER, "--redis", "--grace"), ("--region", "--zone", "--policy", *TLS_WORKER)),
    "regional": ((*TIER, "--region", "--redis", "--grace"), ("--zone", "--policy", *TLS_WORKER)),
    "local": ((*TIER, "--region", "--zone", "--policy", "--grace"), TLS_WORKER),
    "worker": ((*TIER, "--region", "--zone", *TLS_WORKER), ("--policy", "--grace", "--redis")),
    "up": (
        ("--config", "--run-dir", "--redis", "--time-scale", "--policy", "--log-format"),
        ("--region", "--zone", "--grace", "--tls-cert", "--target"),
    ),
    "loadgen": (
        ("--target", "--requests", "--concurrency", "--stream-share", "--tls", "--ca"),
        ("--config", "--region", "--policy", "--grace", "--log-format"),
    ),
    "top": (("--ops", "--interval", "--once", "--count", "--no-color"), ("--config", "--target")),
    "keygen": ((), ("--config", "--region", "--target")),
    "admin": (("--target", "--key", "--ca", "--timeout"), ("--config", "--region", "--policy")),
    "usage": (("--redis", "--since", "--until", "--json"), ("--config", "--region", "--target")),
    "sim": (("fleet", "run"), ("--config", "--region", "--target")),
}


def help_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code in (0, None)
    return capsys.readouterr().out


def named(text: str, flag: str) -> bool:
    """``flag`` appears as an option of the help (not inside another, --tls in --tls-cert)."""
    return any(word.strip("[],") == flag for word in text.split())


@pytest.mark.parametrize("command", sorted(HELP))
def test_each_subcommand_helps_with_its_own_options_only(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    text = help_of(capsys, command)
    must, must_not = HELP[command]
    assert text.startswith(f"usage: meridian {command}")
    assert [f for f in must if not named(text, f)] == []
    assert [f for f in must_not if named(text, f)] == []


@pytest.mark.parametrize("command", ["global", "local", "worker", "up", "loadgen", "top"])
def test_every_option_has_help_and_shows_its_default(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[union-attr]
    for action in sub._actions:
        assert action.help, f"meridian {command} {action.option_strings} has no help"
    text = " ".join(sub.format_help().split())  # wrapped where the terminal's width says
    if command in ("global", "local"):
        assert "--grace SECONDS" in text and "(default: 5.0)" in text
    if command == "loadgen":
        assert "(default: 300)" in text and "(default: 127.0.0.1:8001)" in text


def test_the_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(capsys)
    for command in HELP:
        assert named(text, command), command
    assert "--version" in text


def test_version_comes_from_the_package_metadata() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert done.stdout.strip() == f"meridian {version()}"
    assert version()[0].isdigit()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["loadgen", "--requests", "0"], "--requests"),
        (["loadgen", "--requests", "many"], "--requests"),
        (["loadgen", "--stream-share", "1.5"], "--stream-share"),
        (["loadgen", "--concurrency", "-2"], "--concurrency"),
        (["top", "--interval", "0"], "--interval"),
        (["global", "--config", "x.yaml", "--grace", "-1"], "--grace"),
        (["global", "--config", "x.yaml", "--log-level", "loud"], "--log-level"),
        (
            ["local", "--config", "x.yaml", "--region", "r", "--zone", "z", "--policy", "no"],
            "--policy",
        ),
        (["regional", "--config", "x.yaml"], "--region"),
        (
            ["worker", "--config", "x.yaml", "--region", "r", "--zone", "z", "--time-scale", "0"],
            "--time-scale",
        ),
        (["admin", "--timeout", "soon", "list"], "--timeout"),
    ],
)
def test_a_bad_value_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err or f"arguments are required: {flag}" in err, err


def test_a_bad_log_variable_is_refused_naming_it() -> None:
    env = {**os.environ, "MERIDIAN_LOG_LEVEL": "loud"}
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "global", "--config", "x.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2
    assert "MERIDIAN_LOG_LEVEL='loud'" in done.stderr


def test_log_options_default_to_the_environment_and_the_flag_wins() -> None:
    parser = build_parser(LogSettings.from_env({"MERIDIAN_LOG_FORMAT": "json"}))
    args = parser.parse_args(["global", "--config", "x.yaml"])
    assert (args.log_format, args.log_level) == ("json", "info")
    args = parser.parse_args(
        ["global", "--config", "x", "--log-format", "text", "--log-level", "error"]
    )
    assert (args.log_format, args.log_level) == ("text", "error")
