"""An installed wheel (not only an editable checkout) carries and finds the kernel sources and the traces."""
import subprocess
import sys
import zipfile

import pytest

pytestmark = pytest.mark.slow  # pip builds a wheel in an isolated environment: seconds, and an index to reach


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(root)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{done.stdout}\n{done.stderr}")
    (path,) = out.glob("kv_canary-*.whl")
    return path


def test_wheel_contains_kernels_and_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for member in ("canary/kernels/plan.cu", "canary/kernels/plan_numba.py", "canary/data/README.md",
                   "canary/data/AzureLLMInferenceTrace_conv.csv", "canary/data/AzureLLMInferenceTrace_code.csv"):
        assert member in names, member


def test_installed_wheel_finds_its_kernels(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=600)
    probe = (
        "import canary, canary.backends.sources as b, canary.replay.scheduler as s\n"
        "assert canary.__file__.startswith(%r), canary.__file__\n"
        "assert 'extern \"C\" __global__' in b.cuda_source('plan')\n"
        "assert b.kernels_dir().joinpath('plan_numba.py').is_file()\n"
        "print(len(s.load_trace('conv')))\n" % str(target)
    )
    # Run from an empty folder so that the checkout's canary/ cannot shadow the installed one.
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == 19366
