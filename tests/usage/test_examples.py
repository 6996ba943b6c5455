"""The examples run as a user would run them (the GPU one only where there is a GPU)."""
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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
    assert out.count("violations {}") == 3 and "protected tokens" in out


def _check_detection(out: str) -> None:
    assert "clean steps: 0 violations" in out
    assert "after the flip: 1 violation(s)" in out
    assert "verify slot 118 pos 2: REAL_KV" in out


def test_detect_corruption():
    _check_detection(_run("detect_corruption.py"))


@pytest.mark.gpu
def test_detect_corruption_on_gpu():
    done = subprocess.run([sys.executable, str(EXAMPLES / "detect_corruption.py"), "--device", "cuda"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    _check_detection(done.stdout)


def _check_integration(done) -> None:
    assert done.returncode == 0, done.stderr
    assert "clean steps: violations {}" in done.stdout
    assert "after the flip: violations {'REAL_KV': 1}" in done.stdout
    assert ("kv-canary: violation group=full kernel=verify step=3 slot=118 position=2 reasons=REAL_KV "
            "stored_token=13 expected_token=13 requests=req-1@2 count=1") in done.stderr


def test_engine_integration_on_cpu():
    _check_integration(subprocess.run([sys.executable, str(EXAMPLES / "engine_integration.py"), "--device", "cpu"],
                                      capture_output=True, text=True, timeout=300))


@pytest.mark.gpu
def test_engine_integration_on_gpu_by_default():
    _check_integration(subprocess.run([sys.executable, str(EXAMPLES / "engine_integration.py")],
                                      capture_output=True, text=True, timeout=300))


def test_jax_engine():
    pytest.importorskip("jax")
    done = subprocess.run([sys.executable, str(EXAMPLES / "jax_engine.py")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "clean steps: violations {}" in done.stdout
    assert "after the fault: violations {'VERIFY_TOKEN': 1}" in done.stdout
    assert "requests named: ['b']" in done.stdout
    assert "reasons=VERIFY_TOKEN" in done.stderr and "requests=b@8" in done.stderr
