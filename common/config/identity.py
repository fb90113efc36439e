"""Who a tier instance is: a SPIFFE-style URI its certificate carries, and its parent.

Every tier instance of a fleet has one identity, named by where it sits in the
topology; its certificate carries it as a URI subjectAltName:

- the global tier: ``spiffe://meridian/global``;
- the regional tier of region R: ``spiffe://meridian/regional/R``;
- the local tier of zone Z in region R: ``spiffe://meridian/local/R/Z``;
- the emulated GPU servers of zone Z (only when a GPU there serves TLS with a
  certificate of the fleet's CA): ``spiffe://meridian/gpu/R/Z``.

The parent is the only caller an inner tier serves (``common.request.peers``):
regional R serves only the global tier, local R/Z only regional R. The same
path names the directory holding the instance's certificate and key under
``tls.certs`` (``common.config.access.TlsConfig``), so a file can never be
taken for another instance's. Names become URI path segments, so a fleet on
TLS may name regions and zones only with letters, digits, ``.``, ``-`` and
``_`` (``check_segment``; SPIFFE's rule).
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from dataclasses import dataclass

from common.config.node import ConfigError

TRUST_DOMAIN = "meridian"
SCHEME = f"spiffe://{TRUST_DOMAIN}/"
KINDS = ("global", "regional", "local", "gpu")
_SEGMENT_CHARS = frozenset(string.ascii_letters + string.digits + ".-_")


@dataclass(frozen=True)
class Identity:
    """A tier instance's place in the fleet: ``("regional", "eu-west")`` and so on."""

    path: tuple[str, ...]

    @property
    def uri(self) -> str:
        """The URI SAN its certificate carries (``spiffe://meridian/regional/eu-west``)."""
        return SCHEME + "/".join(self.path)

    @property
    def kind(self) -> str:
        return self.path[0]

    @property
    def parent(self) -> Identity | None:
        """The only identity this instance serves: global for a regional tier, the
        region's regional tier for a local tier; None for the global tier and GPUs
        (the edge serves clients, a GPU server whoever reaches it)."""
        if self.kind == "regional":
            return GLOBAL
        if self.kind == "local":
            return regional(self.path[1])
        return None

    @property
    def label(self) -> str:
        """How messages name it: ``the regional tier of eu-west``."""
        if self.kind == "global":
            return "the global tier"
        where = "/".join(self.path[1:])
        return f"the {self.kind} tier of {where}" if self.kind != "gpu" else f"the GPUs of {where}"

    def __str__(self) -> str:
        return self.uri


GLOBAL = Identity(("global",))


def regional(region: str) -> Identity:
    return Identity(("regional", region))


def local(region: str, zone: str) -> Identity:
    return Identity(("local", region, zone))


def gpu_servers(region: str, zone: str) -> Identity:
    return Identity(("gpu", region, zone))


def parse_identity(uri: str) -> Identity | None:
    """The identity a URI names, or None when it is not one of this fleet's."""
    if not uri.startswith(SCHEME):
        return None
    path = tuple(uri[len(SCHEME) :].split("/"))
    arity = {"global": 1, "regional": 2, "local": 3, "gpu": 3}.get(path[0])
    if arity != len(path) or not all(_valid_segment(s) for s in path):
        return None
    return Identity(path)


def _valid_segment(segment: str) -> bool:
    return bool(segment) and segment not in (".", "..") and set(segment) <= _SEGMENT_CHARS


def check_segment(name: str, key_path: str) -> None:
    """A region or zone name that must fit in a URI path segment; ConfigError naming
    ``key_path`` otherwise."""
    if not _valid_segment(name):
        raise ConfigError(
            f"{key_path}: {name!r} cannot name a TLS identity ({SCHEME}...): use only "
            "letters, digits, '.', '-' and '_'"
        )


def check_fleet_names(regions: Iterable[tuple[str, Iterable[str]]]) -> None:
    """Every (region, its zones) name of a fleet on TLS fits in an identity URI."""
    for i, (region, zones) in enumerate(regions):
        check_segment(region, f"regions[{i}].name")
        for j, zone in enumerate(zones):
            check_segment(zone, f"regions[{i}].zones[{j}].name")
