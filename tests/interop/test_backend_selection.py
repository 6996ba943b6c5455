"""Backend selection (``canary.backends.resolve``, SPEC 3.5): "auto" picks the reference for host arrays and, on a
CUDA device, CuPy, else Numba, else an error naming both installs; explicit names must match where the arrays
live. ``import_cupy`` and ``load`` are replaced with stand-ins, so every branch runs without a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import canary.backends as backends
from canary import BackendUnavailableError
from canary.backends.reference import layers as reference_layers
from canary.backends.reference import plan as reference_plan
from canary.backends.reference import records as reference_records

from canary.interop.libs import INSTALL

CUPY_HINT, NUMBA_HINT = INSTALL["cupy"], INSTALL["numba"]


class FakeLibs:
    """Stand-ins for ``import_cupy`` and ``load``: which libraries import, and a log of the loads asked for."""

    def __init__(self, *, cupy: bool, numba: bool, cupy_backend: bool = True, numba_on_device: bool = True):
        self.cupy, self.numba, self.cupy_backend, self.numba_on_device = cupy, numba, cupy_backend, numba_on_device
        self.loads: list[tuple[str, str]] = []
        self.cupy_imports = 0

    def import_cupy(self):
        self.cupy_imports += 1
        if not self.cupy:
            raise BackendUnavailableError(f"kv-canary: backend 'cupy' needs CuPy: {CUPY_HINT}")
        return SimpleNamespace(__name__="cupy")

    def load(self, name, family="plan"):
        self.loads.append((name, family))
        if name == "cupy":
            if not (self.cupy and self.cupy_backend):
                raise BackendUnavailableError("kv-canary: backend 'cupy' needs cuda-core")
            return SimpleNamespace(NAME="cupy", ON_DEVICE=True, family=family)
        if name == "numba":
            if not self.numba:
                raise BackendUnavailableError(f"kv-canary: backend 'numba' needs numba-cuda: {NUMBA_HINT}")
            return SimpleNamespace(NAME="numba", ON_DEVICE=self.numba_on_device, family=family)
        assert name == "reference", name
        return SimpleNamespace(NAME="reference", ON_DEVICE=False, family=family)


@pytest.fixture
def libs(monkeypatch):
    def install(**kw) -> FakeLibs:
        fake = FakeLibs(**kw)
        monkeypatch.setattr(backends, "import_cupy", fake.import_cupy)
        monkeypatch.setattr(backends, "load", fake.load)
        return fake

    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    return install


# --------------------------------------------------------------------------------------------------------------
# "auto"


@pytest.mark.parametrize("family,module", [("plan", reference_plan), ("records", reference_records),
                                           ("layers", reference_layers)])
def test_auto_on_host_is_the_reference(family, module):
    assert backends.resolve("auto", -1, family) is module  # the real loader: NumPy only


def test_auto_on_host_tries_no_gpu_library(libs):
    fake = libs(cupy=True, numba=True)
    assert backends.resolve("auto", -1, "records").NAME == "reference"
    assert fake.loads == [("reference", "records")] and fake.cupy_imports == 0


@pytest.mark.parametrize("family", backends.FAMILIES)
def test_auto_on_device_prefers_cupy(libs, family):
    fake = libs(cupy=True, numba=True)
    module = backends.resolve("auto", 0, family)
    assert (module.NAME, module.family) == ("cupy", family)
    assert fake.loads == [("cupy", family)] and fake.cupy_imports == 1


def test_auto_without_cupy_falls_back_to_numba(libs):
    fake = libs(cupy=False, numba=True)
    assert backends.resolve("auto", 1).NAME == "numba"
    assert fake.loads == [("numba", "plan")]  # CuPy's import failed first: its backend was never loaded


def test_auto_with_cupy_but_no_cupy_backend_falls_back_to_numba(libs):
    fake = libs(cupy=True, numba=True, cupy_backend=False)
    assert backends.resolve("auto", 0, "records").NAME == "numba"
    assert fake.loads == [("cupy", "records"), ("numba", "records")]


def test_auto_without_either_names_both_installs(libs):
    libs(cupy=False, numba=False)
    with pytest.raises(BackendUnavailableError) as info:
        backends.resolve("auto", 0)
    assert str(info.value) == ("kv-canary: backend 'auto' found CUDA arrays but neither CuPy nor numba-cuda: "
                               f"{CUPY_HINT}, or {NUMBA_HINT}")
    assert isinstance(info.value.__cause__, BackendUnavailableError)
    assert "numba-cuda" in str(info.value.__cause__)


# --------------------------------------------------------------------------------------------------------------
# Explicit names


@pytest.mark.parametrize("name", ["cupy", "numba"])
@pytest.mark.parametrize("family", backends.FAMILIES)
def test_gpu_backend_on_host_is_refused_before_any_import(libs, name, family):
    fake = libs(cupy=False, numba=False)  # not even installed: the placement error comes first
    msg = (f"^kv-canary: backend: expected a backend for the {family} arrays in host memory \\('reference' or "
           f"'auto'\\), got '{name}', which runs on a CUDA device$")
    with pytest.raises(ValueError, match=msg):
        backends.resolve(name, -1, family)
    assert fake.loads == []


@pytest.mark.parametrize("device", [0, 3])
def test_reference_on_device_is_refused(device):
    msg = (f"^kv-canary: backend: expected a backend for the plan arrays in cuda:{device} \\('cupy', 'numba' or "
           f"'auto'\\), got 'reference', which runs on the host$")
    with pytest.raises(ValueError, match=msg):
        backends.resolve("reference", device)


def test_reference_on_host_is_the_reference():
    assert backends.resolve("reference", -1, "records") is reference_records


@pytest.mark.parametrize("name", ["cupy", "numba"])
def test_gpu_backend_on_device(libs, name):
    fake = libs(cupy=True, numba=True)
    assert backends.resolve(name, 2).NAME == name
    assert fake.loads == [(name, "plan")]


def test_explicit_backend_missing_propagates(libs):
    libs(cupy=True, numba=False)
    with pytest.raises(BackendUnavailableError, match="^kv-canary: backend 'numba' needs numba-cuda: "):
        backends.resolve("numba", 0)


def test_numba_simulator_takes_host_arrays(libs, monkeypatch):
    """Under NUMBA_ENABLE_CUDASIM=1 the numba backend runs on host memory, and only there."""
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    libs(cupy=False, numba=True, numba_on_device=False)
    assert backends.resolve("numba", -1).NAME == "numba"
    # (The message's tail, "which runs on ...", is chosen by name, not by the module: not pinned here.)
    with pytest.raises(ValueError, match=r"^kv-canary: backend: expected a backend for the plan arrays in cuda:0 "
                                         r"\('cupy', 'numba' or 'auto'\), got 'numba', which runs "):
        backends.resolve("numba", 0)
    with pytest.raises(ValueError, match=r"^kv-canary: backend: expected a backend for the plan arrays in host "
                                         r"memory \('reference' or 'auto'\), got 'cupy', which runs on a CUDA device$"):
        backends.resolve("cupy", -1)  # the simulator changes nothing for CuPy


def test_numba_on_device_module_refuses_host_arrays_under_the_simulator_flag(libs, monkeypatch):
    """A numba backend module that runs on a device (the flag set after numba was imported) refuses host arrays."""
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
    libs(cupy=False, numba=True, numba_on_device=True)
    msg = (r"^kv-canary: backend: expected a backend for the plan arrays in host memory \('reference' or 'auto'\), "
           r"got 'numba', which runs on a CUDA device$")
    with pytest.raises(ValueError, match=msg):
        backends.resolve("numba", -1)


@pytest.mark.parametrize("device", [-1, 0])
def test_unknown_name(device):
    with pytest.raises(ValueError, match=r"^kv-canary: backend: expected one of auto, reference, cupy, numba, got "
                                         r"'triton'$"):
        backends.resolve("triton", device)


def test_optional_family_a_backend_lacks_is_none():
    assert backends.optional("reference", "report") is None
    assert backends.optional("reference", "agree") is None
    with pytest.raises(ValueError, match=r"^kv-canary: family: expected one of report, agree, got 'plan'$"):
        backends.optional("reference", "plan")  # a family every backend has is load's, not optional's
