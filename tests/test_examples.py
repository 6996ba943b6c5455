"""The examples run as a user would run them (the GPU one only where there is a GPU)."""
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(name: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_quickstart():
    out = _run("quickstart.py")
    assert "status: OK enable: 1" in out
    assert "verify slots:     [108 109 110 116 117]" in out
    assert "write seed slots: [110 117  -1]" in out


@pytest.mark.gpu
def test_torch_cuda_graph_example():
    pytest.importorskip("torch")
    out = _run("torch_cuda_graph.py")
    assert out.count("enable=1") == 3
