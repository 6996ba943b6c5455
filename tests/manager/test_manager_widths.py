"""SPEC 2 (*) through the manager: an engine's int32 step and token arrays (NumPy, torch CPU tensors) give the
reports, records and stats int64 arrays give: no cast on the host, the kernels widen (reference backend here;
the GPU suites run the planner's and the write's twins). A device manager takes int32 req_pool_indices too (its
report's snapshot strides them into 8-byte words)."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.manager_engine import ToyEngine

NAMES = ("rpi", "prefix", "ext", "loc", "tok", "pos")
ALL32 = {n: np.int32 for n in NAMES}


def _summary(got):
    return [[(v.group, v.kernel, v.slot, v.position, v.first_step, int(v.reasons), v.requests) for v in vs]
            for vs in got]


def _scenario(widths, xp=np, groups=("full", "swa", "draft"), **kw):
    got = []
    e = ToyEngine(xp=xp, groups=groups, on_violation=got.append, widths=widths, **kw)
    e.add("a", [5, 6, 7, 8])
    e.add("b", [9, 10])
    for _ in range(2):
        e.decode_step(["a", "b"])
    e.flip("full", e.slot_of("a", 1))
    e.decode_step(["a", "b"])
    e.accept("a", [55])
    e.accept("b", [66])
    e.forward([("a", 1), ("b", 1)], write_tokens={"b": [77]})  # a token the engine did not accept
    e.decode_step(["a", "b"])
    e.forward([(None, 0), ("a", 1), ("b", 1)])  # a padding row too
    e.manager.flush()
    stats = e.manager.stats()
    records = {g.name: _host(g.records.state.canary_buffer) for g in e.manager.groups}
    e.manager.close()
    return _summary(got), stats, records


def _host(a):
    return a.get() if hasattr(a, "get") else np.array(a, copy=True)  # CuPy refuses np.array


def _same(a, b):
    assert a[0] == b[0] and a[0], (a[0], b[0])
    assert a[1] == b[1]
    assert all(np.array_equal(a[2][k], b[2][k]) for k in a[2])


def test_int32_arrays_report_what_int64_arrays_report():
    want = _scenario({})
    _same(_scenario(ALL32), want)
    for k, name in enumerate(NAMES):  # each array alone, and alternating mixes
        _same(_scenario({name: np.int32}), want)
        _same(_scenario({n: np.int32 for j, n in enumerate(NAMES) if (j + k) % 2}), want)


def test_torch_cpu_int32_tensors():
    torch = pytest.importorskip("torch")

    class T:
        uint8 = np.uint8

        @staticmethod
        def asarray(a):
            return torch.as_tensor(np.asarray(a))

        @staticmethod
        def zeros(shape, dtype):
            return torch.as_tensor(np.zeros(shape, dtype=dtype))

    want = _scenario({}, T, groups=("full", "swa"))
    _same(_scenario(ALL32, T, groups=("full", "swa")), want)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "numba"])
def test_int32_arrays_on_a_gpu_report_what_int64_arrays_report(backend):
    """A device manager: int32 req_pool_indices too (the report's strided snapshot), each array alone and all."""
    cupy = pytest.importorskip("cupy")
    if backend == "numba":
        pytest.importorskip("numba.cuda")
    want = _scenario({}, cupy, device=0, backend=backend)
    _same(_scenario(ALL32, cupy, device=0, backend=backend), want)
    _same(_scenario({"rpi": np.int32}, cupy, device=0, backend=backend), want)


def test_a_device_manager_takes_int32_req_pool_indices_too():
    """Its report's copy strides int32 rows into 8-byte words (Steps.snapshot_rows; the fake-CUDA transfer test
    and the GPU suite check what the reports name); only the shape and the batch size are refused here."""
    from canary.manager.steps import Steps

    steps = Steps.__new__(Steps)
    steps.ordinal = 0  # the check reads the manager's device only
    for dtype in (np.int32, np.int64):
        assert steps.batch_size(np.zeros(2, dtype), 4) == 2
    with pytest.raises(ValueError, match=r"^kv-canary: req_pool_indices: expected a \[bs\] int32 or int64 array, "
                                         r"got shape \(2, 1\)$"):
        steps.batch_size(np.zeros((2, 1), np.int32), 4)
    steps.ordinal = None
    assert steps.batch_size(np.zeros(3, np.int32), 4) == 3
