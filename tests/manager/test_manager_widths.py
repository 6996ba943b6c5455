"""SPEC 2 (*) through the manager: an engine's int32 step and token arrays (NumPy, torch CPU tensors) give the
reports, records and stats int64 arrays give: no cast on the host, the kernels widen (reference backend here;
the GPU suites run the planner's and the write's twins). A device manager takes int64 req_pool_indices only (its
report's snapshot is an int64 device copy): refused by name before the step opens."""
from __future__ import annotations

import numpy as np
import pytest
from helpers.manager_engine import ToyEngine

NAMES = ("rpi", "prefix", "ext", "loc", "tok", "pos")
ALL32 = {n: np.int32 for n in NAMES}


def _summary(got):
    return [[(v.group, v.kernel, v.slot, v.position, v.first_step, int(v.reasons), v.requests) for v in vs]
            for vs in got]


def _scenario(widths, xp=np, groups=("full", "swa", "draft")):
    got = []
    e = ToyEngine(xp=xp, groups=groups, on_violation=got.append, widths=widths)
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
    records = {g.name: np.array(g.records.state.canary_buffer, copy=True) for g in e.manager.groups}
    e.manager.close()
    return _summary(got), stats, records


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


def test_a_device_manager_refuses_int32_req_pool_indices_before_the_step_opens():
    from canary.manager.steps import Steps

    steps = Steps.__new__(Steps)
    steps.ordinal = 0  # the check reads the manager's device only
    with pytest.raises(TypeError, match=r"^kv-canary: req_pool_indices: expected int64 on a CUDA manager .*got "
                                        r"dtype int32$"):
        steps.batch_size(np.zeros(2, np.int32), 4)
    assert steps.batch_size(np.zeros(2, np.int64), 4) == 2
    steps.ordinal = None
    assert steps.batch_size(np.zeros(3, np.int32), 4) == 3
