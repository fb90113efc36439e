"""What every ``meridian`` parser shares: the help layout and value checks that name the flag.

``HelpFormatter`` keeps descriptions as written (they hold usage examples) and
shows each option's default after its help, as argparse's
``ArgumentDefaultsHelpFormatter`` does, but not for an option without a default
(None, a flag that is off) or whose help already says it. The ``type=`` checks
raise ``argparse.ArgumentTypeError``, so argparse's error names the flag:
``meridian loadgen: error: argument --requests: must be a whole number > 0, not '0'``.
"""

from __future__ import annotations

import argparse
from importlib import metadata

DISTRIBUTION = "meridian-lb"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Raw descriptions; ``(default: X)`` after an option's help when it has a default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or "%(default)" in text
            or "default" in text
        ):
            return action.help
        return f"{text} (default: %(default)s)"


def version() -> str:
    """The installed distribution's version (``meridian --version``)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "unknown (not installed)"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a whole number > 0, not {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, not {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, not {text!r}")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, not {text!r}")
    return value
