"""``meridian deploy k8s``: render the manifests of a topology into a directory.

Its parser is added to ``meridian``'s by ``add_parser``; ``deploy_main`` runs it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from cli.k8s.options import SERVICE_TYPES, TLS_MODES, RenderOptions
from cli.k8s.render import render, write
from cli.options import HelpFormatter, non_negative_float, positive_int
from common.config.node import ConfigError

DEFAULT_OUT = "deploy/k8s"


def add_parser(sub: Any) -> None:
    what = "render deployment manifests from a topology"
    deploy = sub.add_parser("deploy", help=what, description=what, formatter_class=HelpFormatter)
    targets = deploy.add_subparsers(dest="target", required=True, metavar="TARGET")
    what = "Kubernetes manifests: ConfigMap, Secrets, a Deployment and Service per tier instance"
    p = targets.add_parser("k8s", help=what, description=what, formatter_class=HelpFormatter)
    _k8s_options(p)


def _k8s_options(p: argparse.ArgumentParser) -> None:
    default = RenderOptions()
    p.add_argument("--config", required=True, metavar="FILE", help="topology YAML")
    p.add_argument("--image", default=default.image, help="container image of every pod")
    p.add_argument("--namespace", default=default.namespace, help="namespace of every resource")
    p.add_argument("--out", metavar="DIR", default=DEFAULT_OUT, help="directory to write into")
    p.add_argument(
        "--grace",
        metavar="SECONDS",
        type=non_negative_float,
        default=default.grace_s,
        help="the tiers' --grace (terminationGracePeriodSeconds follows)",
    )
    p.add_argument(
        "--with-emulated-gpus",
        action="store_true",
        help="run each zone's emulated GPUs (meridian worker) beside its local tier",
    )
    p.add_argument(
        "--tls",
        choices=TLS_MODES,
        default=default.tls,
        help="certificates by cert-manager, Secrets from the topology's tls files, or plaintext",
    )
    p.add_argument(
        "--generate-keys",
        action="store_true",
        help="make fresh keys for `api_key: generate` (printed once), "
        "else such tenants are rendered without a key",
    )
    _scale_options(p, default)


def _scale_options(p: argparse.ArgumentParser, default: RenderOptions) -> None:
    p.add_argument(
        "--global-replicas",
        metavar="N",
        type=positive_int,
        default=default.global_replicas,
        help="least replicas of the global tier",
    )
    p.add_argument(
        "--regional-replicas",
        metavar="N",
        type=positive_int,
        default=default.regional_replicas,
        help="least replicas of each regional tier",
    )
    p.add_argument(
        "--max-replicas",
        metavar="N",
        type=positive_int,
        default=default.max_replicas,
        help="most replicas the autoscalers may run",
    )
    p.add_argument(
        "--shared-redis",
        action="store_true",
        help="every region on the one Redis (default: a Redis Service per region)",
    )
    p.add_argument(
        "--global-service-type",
        choices=SERVICE_TYPES,
        default=default.global_service_type,
        help="the global tier's Service type",
    )
    p.add_argument(
        "--pod-log-format",
        choices=("text", "json"),
        default=default.log_format,
        help="the tiers' --log-format",
    )


def _read(path: str) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not a YAML topology: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top, got {type(raw).__name__}")
    return raw


def deploy_main(args: argparse.Namespace) -> int:
    options = RenderOptions(
        image=args.image,
        namespace=args.namespace,
        grace_s=args.grace,
        emulated_gpus=args.with_emulated_gpus,
        tls=args.tls,
        global_replicas=args.global_replicas,
        regional_replicas=args.regional_replicas,
        max_replicas=args.max_replicas,
        redis_per_region=not args.shared_redis,
        global_service_type=args.global_service_type,
        log_format=args.pod_log_format,
    )
    rendered = render(
        _read(args.config), options, config=args.config, generate_keys=args.generate_keys
    )
    for path in write(rendered, Path(args.out)):
        print(f"wrote {path}")
    keys = rendered.keys
    for tenant_id, key in keys.fresh.items():
        print(f"tenant {tenant_id} key {key}")
    if keys.admin_key is not None:
        print(f"admin key {keys.admin_key}")
    if keys.operator_key is not None:
        print(f"operator key {keys.operator_key}")
    if keys.pending:
        print(
            f"note: no key for {', '.join(keys.pending)}: add digests to the meridian-auth Secret "
            "(meridian keygen) or render with --generate-keys",
            file=sys.stderr,
        )
    if options.tls == "secrets":
        print(
            f"note: {args.out}/20-tls.yaml holds private keys: keep it out of version control",
            file=sys.stderr,
        )
    return 0
