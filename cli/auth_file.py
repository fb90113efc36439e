"""``meridian global --auth-file FILE``: the topology's ``auth`` section from a file of its own.

In a cluster the topology is a ConfigMap, readable by whoever may read the
namespace's configuration, while the tenants' key digests and the Admin API's
belong in a Secret (``cli.k8s``). The file holds one top-level key, ``auth``,
which replaces the topology's ``auth`` section; the result is validated as one
topology, every error naming its key as usual.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from common.config.node import ConfigError
from common.config.topology import Topology, topology_from_mapping


def _yaml(path: str | Path) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def load_with_auth(config: str | Path, auth_file: str | Path) -> Topology:
    """The topology ``config`` with its ``auth`` section taken from ``auth_file``."""
    raw = _yaml(config)
    if not isinstance(raw, dict):
        raise ConfigError(f"{config}: expected a mapping, got {type(raw).__name__}")
    auth = _yaml(auth_file)
    if not isinstance(auth, dict) or set(auth) != {"auth"}:
        keys = sorted(auth) if isinstance(auth, dict) else type(auth).__name__
        raise ConfigError(f"{auth_file}: expected exactly one key, auth; got {keys}")
    return topology_from_mapping({**raw, "auth": auth["auth"]})
