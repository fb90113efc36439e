"""Renderings the Kubernetes tests share: the committed demo fleet and variants."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import yaml

from cli.k8s.options import RenderOptions
from cli.k8s.render import Rendered, render

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "deploy" / "demo-fleet.yaml"
COMMITTED = ROOT / "deploy" / "k8s"
DEMO_CONFIG = "deploy/demo-fleet.yaml"
# How the committed deploy/k8s/ is rendered (its files' first line says the same).
DEMO_OPTIONS = RenderOptions(emulated_gpus=True)
# The Kubernetes version the manifests are checked against (kubernetes-validate's schemas).
KUBERNETES = "1.31.0"


def demo_raw() -> dict[str, Any]:
    raw: dict[str, Any] = yaml.safe_load(DEMO.read_text())
    return raw


def render_demo(options: RenderOptions = DEMO_OPTIONS, *, generate_keys: bool = False) -> Rendered:
    """A rendering of the demo fleet (the same object for the same options: read only)."""
    if generate_keys:
        return render(demo_raw(), options, config=DEMO_CONFIG, generate_keys=True)
    return _cached(options)


@functools.cache
def _cached(options: RenderOptions) -> Rendered:
    return render(demo_raw(), options, config=DEMO_CONFIG)


def real_gpu_raw() -> dict[str, Any]:
    """One region, two zones of real GPU servers: at IPv4 and IPv6 addresses, at a DNS
    name, one with metrics on another host, one dialled with TLS."""
    raw = demo_raw()
    raw["regions"] = copy.deepcopy(raw["regions"][:1])
    zone_a, zone_b = raw["regions"][0]["zones"]
    zone_a["gpus"] = [
        {
            "name": "a-gpu0",
            "hardware": "H100",
            "models": ["demo-llm"],
            "listen": "10.1.0.5:8001",
            "metrics_listen": "10.1.0.5:8002",
        },
        {
            "name": "a-gpu1",
            "hardware": "A100",
            "models": ["demo-llm"],
            "listen": "[fd00::7]:8001",
            "metrics_listen": "10.1.0.9:9400",
        },
    ]
    zone_b["gpus"] = [
        {
            "name": "b-gpu0",
            "hardware": "H100",
            "models": ["demo-llm"],
            "listen": "gpu7.dc.example.com:8000",
            "protocol": "openai",
        },
        {
            "name": "b-gpu1",
            "hardware": "A100",
            "models": ["demo-llm"],
            "listen": "gpu8.dc.example.com:8001",
            "metrics_listen": "gpu8.dc.example.com:8002",
            "tls": True,
        },
    ]
    raw["auth"]["tenants"][1]["allowed_regions"] = ["us-east"]
    return raw


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.load_all(text, Loader=_LOADER) if d is not None]


def all_documents(rendered: Rendered) -> list[dict[str, Any]]:
    return [d for text in rendered.files.values() for d in documents(text)]
