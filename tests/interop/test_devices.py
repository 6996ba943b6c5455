"""The one allocator (``canary.interop.devices``) and the host-side device guard, on a machine without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from canary import BackendUnavailableError, CanaryState, VerifyPlan, WritePlan
from canary.interop.devices import allocator, cuda_ordinal, on_device_of, zero_fill
from canary.interop.libs import INSTALL


@pytest.mark.parametrize("device,want", [("cpu", None), (None, None), (0, 0), (3, 3), ("cuda", 0), ("cuda:2", 2)])
def test_cuda_ordinal(device, want):
    assert cuda_ordinal(device) == want


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "cuda:1:2", -1, 1.0, True])
def test_bad_device_names_the_argument(device):
    with pytest.raises(ValueError, match=r"^kv-canary: device: expected 'cpu', a CUDA ordinal or 'cuda:N', got "):
        allocator(device)


def test_host_arrays_are_zeroed_numpy():
    a = allocator("cpu")(5, np.int64)
    assert isinstance(a, np.ndarray) and a.dtype == np.int64 and not a.any()


def test_library_with_host_memory_is_refused():
    with pytest.raises(ValueError, match=r"^kv-canary: library: expected None with device='cpu' \(host arrays are "
                                         r"NumPy\), got 'torch'"):
        VerifyPlan.allocate(verify_capacity=4, library="torch")


def test_unknown_library_is_refused():
    with pytest.raises(ValueError, match=r"^kv-canary: library: expected one of cupy, torch, numba or None, got 'jax'"):
        WritePlan.allocate(write_req_capacity=4, device=0, library="jax")
    with pytest.raises(ValueError, match="kv-canary: library:"):
        CanaryState.allocate(4, device=0, library="tensorflow")


def test_torch_without_cuda_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA torch")
    with pytest.raises(BackendUnavailableError, match=r"^kv-canary: device: expected a usable CUDA device for "
                                                      r"device=0 \(pass device='cpu' for host arrays\), got "):
        VerifyPlan.allocate(verify_capacity=4, device=0, library="torch")


def test_missing_library_names_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(BackendUnavailableError) as info:
        allocator(0, "cupy")
    assert str(info.value) == ("kv-canary: library: expected an installed cupy for library='cupy', got none: "
                               + INSTALL["cupy"])


def test_host_guard_and_zero_fill():
    a = np.arange(6, dtype=np.int64)
    with on_device_of(a):
        zero_fill(a)
    assert not a.any()
    torch = pytest.importorskip("torch")
    t = torch.arange(4)
    with on_device_of(t):
        zero_fill(t)
    assert int(t.abs().sum()) == 0


def test_drain_on_host_state_resets_the_ring():
    state = CanaryState.allocate(8, ring_capacity=2)
    state.ring[0, :] = 7
    state.ring_write_index[0] = 3  # one row dropped
    report = state.drain()
    assert (report.total, report.capacity, report.dropped, len(report)) == (3, 2, 1, 2)
    assert not state.ring.any() and int(state.ring_write_index[0]) == 0


def test_on_device_switches_only_when_another_device_is_current():
    """cudart.on_device: the call runs with the ordinal current, and the caller's device is restored after."""
    from canary.interop.cudart import on_device

    class Runtime:
        def __init__(self, current):
            self.current, self.log = current, []

        def get_device(self):
            return self.current

        def set_device(self, d):
            self.log.append(d)
            self.current = d

    for current, switches in ((0, []), (1, [0, 1])):
        rt = Runtime(current)
        seen = on_device(rt, 0, lambda x: (rt.current, x), "arg")
        assert seen == (0, "arg") and rt.log == switches and rt.current == current
