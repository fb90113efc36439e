"""``meridian admin``: the Admin API from a shell.

meridian admin list                 the topology with live state, as a table
meridian admin drain NAME           a GPU, zone or region takes no new requests
meridian admin undrain NAME
meridian admin weight GPU W         scale a GPU's share (W > 0, default 1)
meridian admin reload               every tier re-reads its topology file

It calls the global tier (``--target``, default 127.0.0.1:8001) with the admin
key from ``--key`` or ``MERIDIAN_ADMIN_KEY``. An error exits 1 with the gRPC
status and its message; so does a reload that some tier could not apply (its
line says ERROR; the other tiers' lines say what they did).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc

from cli.options import HelpFormatter, positive_float
from common.gen.meridian.v1 import admin_pb2 as apb
from common.gen.meridian.v1 import admin_pb2_grpc as apb_grpc

KEY_ENV = "MERIDIAN_ADMIN_KEY"
COLUMNS = ("NAME", "KIND", "HEALTH", "DRAINED", "WEIGHT", "INFLIGHT", "GPUS", "SLOTS", "FREE")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meridian admin", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--target", default="127.0.0.1:8001", metavar="HOST:PORT", help="the global tier's address"
    )
    parser.add_argument("--key", help=f"admin key (default: ${KEY_ENV})")
    parser.add_argument(
        "--ca", metavar="FILE", help="CA certificate, when the global endpoint serves TLS"
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=15.0, metavar="SECONDS", help="call deadline"
    )
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("list", help="the topology with live state")
    for name in ("drain", "undrain"):
        what = f"{name} a GPU, zone or region"
        action = sub.add_parser(name, help=what, description=what)
        action.add_argument("name", help="its name in the topology")
    weight = sub.add_parser("weight", help="set a GPU's weight", description="set a GPU's weight")
    weight.add_argument("gpu", help="the GPU's name in the topology")
    weight.add_argument("weight", type=float, help="> 0; 2 = seen as twice as fast (default 1)")
    sub.add_parser("reload", help="every tier re-reads its topology file")
    return parser


def rows(nodes: list[apb.Node], depth: int = 0) -> Iterator[tuple[str, ...]]:
    """One table row per node, children indented under their parent."""
    for node in nodes:
        health = "up" if node.healthy else "DOWN"
        if node.kind == "gpu" and node.ejected:
            health = "ejected"
        capacity = node.kind == "gpu" or node.summary_fresh
        yield (
            "  " * depth + node.name,
            node.kind,
            health,
            "yes" if node.drained else "no",
            f"{node.weight:g}" if node.kind == "gpu" else "-",
            str(node.outstanding_requests),
            f"{node.healthy_gpus}/{node.total_gpus}" if capacity else "?",
            str(node.total_slots) if capacity else "?",
            str(node.free_slots) if capacity else "?",
        )
        if node.error:
            yield ("  " * (depth + 1) + f"(children unknown: {node.error})", *[""] * 8)
        yield from rows(list(node.children), depth + 1)


def table(nodes: list[apb.Node]) -> str:
    lines = [COLUMNS, *rows(nodes)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def reload_report(reply: apb.ReloadTopologyResponse) -> str:
    out = []
    for tier in reply.tiers:
        if tier.error:
            out.append(f"{tier.tier}: ERROR {tier.error}")
            continue
        parts = [
            f"{label} {', '.join(items)}"
            for label, items in (
                ("added", tier.added),
                ("removed (draining)", tier.removed),
                ("changed", tier.changed),
                ("not applied", tier.not_applied),
            )
            if items
        ]
        out.append(f"{tier.tier}: " + ("; ".join(parts) if parts else "no change"))
    return "\n".join(out)


def channel(args: argparse.Namespace) -> grpc.Channel:
    if args.ca:
        creds = grpc.ssl_channel_credentials(Path(args.ca).read_bytes())
        return grpc.secure_channel(args.target, creds)
    return grpc.insecure_channel(args.target)


def admin_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    key = args.key or os.environ.get(KEY_ENV)
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    with channel(args) as chan:
        stub = apb_grpc.AdminStub(chan)
        call = {"metadata": metadata, "timeout": args.timeout}
        try:
            if args.action == "list":
                print(table(list(stub.ListTopology(apb.ListTopologyRequest(), **call).nodes)))
            elif args.action in ("drain", "undrain"):
                method = stub.Drain if args.action == "drain" else stub.Undrain
                done = method(apb.DrainRequest(target=args.name), **call)
                print(
                    f"{args.action}ed {done.kind} {done.target} (by {done.applied_by}): "
                    f"{done.detail}"
                )
            elif args.action == "weight":
                request = apb.SetWeightRequest(gpu=args.gpu, weight=args.weight)
                done = stub.SetWeight(request, **call)
                print(f"{done.kind} {done.target} (by {done.applied_by}): {done.detail}")
            else:
                reply = stub.ReloadTopology(apb.ReloadTopologyRequest(), **call)
                print(reload_report(reply))
                if any(tier.error for tier in reply.tiers):
                    return 1
        except grpc.RpcError as err:
            code, details = err.code(), err.details()
            print(f"meridian admin: {code.name}: {details}", file=sys.stderr)
            return 1
    return 0
