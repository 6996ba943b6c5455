"""Host operations on device state run on the arrays' own device, whatever device is current (two GPUs).

State, plans and KV on cuda:1 while cuda:0 is current, for every owner library: plan, write, verify, then
``drain()`` (which reads and resets the ring), ``health()``, ``set_check_flags()`` and a second step; the
records must match a NumPy reference run of the same steps.
"""
from __future__ import annotations

import numpy as np
import pytest

from canary import CanaryPlanner, CanaryRecords, CanaryState, VerifyPlan, WritePlan, to_host


def _two_gpus():
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    return cupy


def _put(lib, host, device):
    if lib == "torch":
        import torch

        return torch.from_numpy(host.copy()).to(f"cuda:{device}")
    if lib == "numba":
        from numba import cuda

        with cuda.gpus[device]:
            return cuda.to_device(host)
    import cupy

    with cupy.cuda.Device(device):
        return cupy.asarray(host)


def _steps(device, lib, put):
    r2t = np.arange(1, 4 * 16 + 1, dtype=np.int32).reshape(4, 16)
    r2t[0] = 0
    kw = {} if device == "cpu" else {"library": lib}
    vp = VerifyPlan.allocate(verify_capacity=64, device=device, **kw)
    wp = WritePlan.allocate(write_req_capacity=2, device=device, **kw)
    state = CanaryState.allocate(65, ring_capacity=16, device=device, **kw)
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=put(r2t))
    records = CanaryRecords(state)
    reports = []
    for prefix in ([0, 0], [4, 4]):
        plan_in = dict(req_pool_indices=np.array([1, 2], np.int64), prefix_lens=np.array(prefix, np.int64),
                       extend_seq_lens=np.array([4, 4], np.int64))
        loc = np.concatenate([r2t[r, p:p + 4] for r, p in zip((1, 2), prefix)]).astype(np.int64)
        pos = np.concatenate([np.arange(p, p + 4) for p in prefix]).astype(np.int64)
        ids = (pos * 7 + 3).astype(np.int64)
        ids[-1] = -5 if prefix[0] else ids[-1]  # a WRITE_TOKEN-free step, then a chain check that passes
        planner.plan(**{k: put(v) for k, v in plan_in.items()})
        records.verify(vp)
        records.write(wp, out_cache_loc=put(loc), input_ids=put(ids), positions=put(pos))
        reports.append(records.drain())
        state.set_check_flags("all")
    return state, reports, state.health()


@pytest.mark.gpu
@pytest.mark.parametrize("lib", ["cupy", "torch", "numba"])
def test_state_on_the_second_gpu(lib):
    cupy = _two_gpus()
    if lib == "torch":
        pytest.importorskip("torch")
    if lib == "numba":
        pytest.importorskip("numba.cuda")
    with cupy.cuda.Device(0):
        state, reports, health = _steps(1, lib, lambda a: _put(lib, a, 1))
        assert cupy.cuda.runtime.getDevice() == 0
    ref_state, ref_reports, ref_health = _steps("cpu", lib, lambda a: a.copy())
    assert health == ref_health
    assert [sorted(map(str, r)) for r in reports] == [sorted(map(str, r)) for r in ref_reports]
    assert np.array_equal(to_host(state.canary_buffer), ref_state.canary_buffer)
    assert int(to_host(state.ring_write_index)[0]) == 0  # drained on cuda:1
