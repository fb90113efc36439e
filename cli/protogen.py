"""Regenerate the committed protobuf code in ``common/gen`` (``make proto``).

protoc's virtual path mapping (``-Icommon/gen=proto``) makes the generated
imports absolute (``from common.gen.inference import ...``), so the code works
as part of the package without any import rewriting.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = (
    "inference/grpc_service.proto",
    "meridian/v1/capacity.proto",
    "meridian/v1/admin.proto",
    # Envoy's ext_proc API, for the local tier as an endpoint picker (local_lb.ext_proc).
    "envoy/config/core/v3/base.proto",
    "envoy/type/v3/http_status.proto",
    "envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto",
    "envoy/service/ext_proc/v3/external_processor.proto",
)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Generate into ``out_dir`` (which then holds ``common/gen/...``); return the files."""
    args = [
        "grpc_tools.protoc",
        f"-Icommon/gen={ROOT / 'proto'}",
        # The well-known types (google/protobuf/struct.proto, ...) that grpc_tools ships.
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(f"common/gen/{p}" for p in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted(p for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


if __name__ == "__main__":
    written = generate(ROOT)
    print("\n".join(str(p.relative_to(ROOT)) for p in written))
    sys.exit(0)
