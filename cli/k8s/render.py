"""From a topology mapping to the files of ``deploy/k8s/``, the same bytes every time.

``render`` returns file name -> text: ``00-namespace.yaml``, ``10-config.yaml``
(the ConfigMap with the cluster's topology, the Secret with the key digests),
``20-tls.yaml`` (certificates), ``30-global.yaml``, ``40-regional-R.yaml`` and
``50-local-Z.yaml`` per instance, ``60-gpus.yaml`` (real GPU servers). The
numbers order ``kubectl apply -f DIR``: the namespace first. Each file starts
with the command that renders it; ``write`` replaces the files of an earlier
rendering and leaves any other file alone.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from cli.k8s import names
from cli.k8s.certificates import cert_manager, file_secrets
from cli.k8s.cluster_topology import cluster_topology
from cli.k8s.gpus import gpu_manifests
from cli.k8s.keys import Keys, resolve_directives
from cli.k8s.options import RenderOptions
from cli.k8s.plan import Plan, build_plan
from cli.k8s.pods import AUTH_SECRET, CONFIG_MAP, serves_tls
from cli.k8s.tiers import tier_manifests

HEADER = "# Rendered by: meridian deploy k8s"
_FLAGS = {
    "image": "--image",
    "namespace": "--namespace",
    "grace_s": "--grace",
    "emulated_gpus": "--with-emulated-gpus",
    "tls": "--tls",
    "global_replicas": "--global-replicas",
    "regional_replicas": "--regional-replicas",
    "max_replicas": "--max-replicas",
    "redis_per_region": "--shared-redis",
    "global_service_type": "--global-service-type",
    "log_format": "--pod-log-format",
}


@dataclass
class Rendered:
    files: dict[str, str]
    keys: Keys
    plan: Plan
    topology: dict[str, Any]  # the ConfigMap's topology, as data


def command_line(config: str, options: RenderOptions) -> str:
    """The ``meridian deploy k8s`` call that renders this (options at their defaults left out)."""
    parts = ["meridian deploy k8s --config", config]
    default = RenderOptions()
    for f in fields(RenderOptions):
        value = getattr(options, f.name)
        if value == getattr(default, f.name):
            continue
        flag = _FLAGS[f.name]
        if isinstance(value, bool):
            parts.append(flag)
        elif isinstance(value, float):
            parts.append(f"{flag} {value:g}")
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


class _Dumper(yaml.SafeDumper):
    """Plain YAML a reader can follow: no anchors, multi-line text as a literal block."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def _dump(docs: Iterable[dict[str, Any]], header: str) -> str:
    body = "---\n".join(yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=100) for d in docs)
    return f"{header}---\n{body}"


def render(
    raw: dict[str, Any], options: RenderOptions, *, config: str, generate_keys: bool = False
) -> Rendered:
    """The manifests of the fleet ``raw`` describes (``raw`` is not changed)."""
    raw = copy.deepcopy(raw)
    keys = resolve_directives(raw, generate=generate_keys)
    plan = build_plan(raw, options)
    topology = cluster_topology(raw, plan, options)
    topology_text = yaml.safe_dump(topology, sort_keys=False, width=100)
    digest = hashlib.sha256(topology_text.encode()).hexdigest()
    header = (
        f"# Rendered by: {command_line(config, options)}\n"
        "# Do not edit: change the topology and render again (tests/deploy compares).\n"
    )
    ns = options.namespace
    files: dict[str, list[dict[str, Any]]] = {
        "00-namespace.yaml": [
            {
                "apiVersion": "v1",
                "kind": "Namespace",
                "metadata": {"name": ns, "labels": {names.PART_OF: names.APP}},
            }
        ],
        "10-config.yaml": _config(topology_text, raw, keys, options),
    }
    if options.tls != "none":
        files["20-tls.yaml"] = (
            cert_manager(plan, options)
            if options.tls == "cert-manager"
            else file_secrets(plan, options)
        )
    client_facing = bool((raw.get("tls") or {}).get("client_facing", False))
    with_auth = isinstance(raw.get("auth"), dict)
    for instance in plan.instances:
        prefix = {"global": "30", "regional": "40", "local": "50"}[instance.kind]
        name = prefix + "-" + instance.name.removeprefix(f"{names.PREFIX}-") + ".yaml"
        files[name] = tier_manifests(
            instance,
            options,
            # The tenants' keys go to every tier that authenticates clients: the global,
            # and an inner tier with an OpenAI edge (common.tier.client_entry).
            with_auth=with_auth and (instance.kind == "global" or instance.openai_port is not None),
            tls=serves_tls(instance, options, client_facing),
            config_digest=digest,
        )
    if plan.external_gpus:
        files["60-gpus.yaml"] = [m for g in plan.external_gpus for m in gpu_manifests(g, options)]
    text = {name: _dump(docs, header) for name, docs in sorted(files.items())}
    return Rendered(text, keys, plan, topology)


def _config(
    topology_text: str, raw: dict[str, Any], keys: Keys, options: RenderOptions
) -> list[dict[str, Any]]:
    meta = {
        "namespace": options.namespace,
        "labels": {names.NAME: names.APP, names.PART_OF: names.APP},
    }
    out: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": CONFIG_MAP, **meta},
            "data": {"topology.yaml": topology_text},
        }
    ]
    if isinstance(raw.get("auth"), dict):
        note = ""
        if keys.pending:
            note = (
                f"# No key yet for {', '.join(keys.pending)} (the topology says `generate`): "
                "add digests from `meridian keygen`\n# (auth.tenants[].api_key_sha256, "
                "auth.admin_keys), or render with --generate-keys.\n"
            )
        text = note + yaml.safe_dump({"auth": raw["auth"]}, sort_keys=False, width=100)
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": AUTH_SECRET, **meta},
                "type": "Opaque",
                "stringData": {"auth.yaml": text},
            }
        )
    return out


def write(rendered: Rendered, out: Path) -> list[Path]:
    """Write the files into ``out``; remove files an earlier rendering wrote there."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.yaml"):
        if old.name not in rendered.files and old.read_text().startswith(HEADER):
            old.unlink()
    written = []
    for name, text in rendered.files.items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
