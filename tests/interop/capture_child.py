"""One CUDA-graph capture scenario, run in its own process (a failed capture poisons the process).

``python capture_child.py OWNER CAPTURE STREAM``: OWNER (torch, cupy, numba, cai, cai2: the library owning
every array; cai and cai2: CUDA Array Interface v3 and v2 objects over CuPy), CAPTURE (torch:
``torch.cuda.graph``; cupy: ``Stream.begin_capture``), STREAM (given: the capturing
stream passed as ``stream=``; default: ``stream=None``). Plans, verifies and writes inside the capture, then
refills every input in place and replays three times; after each replay the plan buffers and the canary state
must equal a NumPy reference run on the same inputs. Prints ``OK`` or ``RAISED <message>`` (a refused call);
any mismatch is an assertion error (non-zero exit).
"""
from __future__ import annotations

import sys

import numpy as np

OWNER, CAPTURE, STREAM = sys.argv[1:4]
BS, ROWS, SEQ, SLOTS, N_NEW = 4, 8, 64, 8 * 64 + 1, 32

import cupy  # noqa: E402
import torch  # noqa: E402
from numba import cuda  # noqa: E402

from canary import (  # noqa: E402
    CanaryPlanner, CanaryRecords, CanaryState, VerifyPlan, WritePlan, to_host,
)


IS_CAI = OWNER in ("cai", "cai2")


class CAI:
    """An object that speaks only the CUDA Array Interface (no DLPack), over a CuPy array: CuPy's v3 dict
    (owner ``cai``), or restated as version 2, with no ``stream`` key (owner ``cai2``, torch's version)."""

    def __init__(self, a):
        self._a = a
        cai = dict(a.__cuda_array_interface__)
        if OWNER == "cai2":
            cai.pop("stream", None)
            cai["version"] = 2
        self.__cuda_array_interface__ = cai


def put(host: np.ndarray):
    if OWNER == "torch":
        return torch.from_numpy(host.copy()).cuda()
    if OWNER == "numba":
        return cuda.to_device(host)
    a = cupy.asarray(host)
    return CAI(a) if IS_CAI else a


def refill(dev, host: np.ndarray) -> None:
    """New contents, same memory (what an engine does between replays)."""
    if OWNER == "torch":
        dev.copy_(torch.from_numpy(host))
    elif OWNER == "numba":
        dev.copy_to_device(host)
    else:
        (dev._a if IS_CAI else dev).set(host)


def library():
    return {"torch": "torch", "numba": "numba"}.get(OWNER, "cupy")


def wrap(obj):
    """CAI owners: the library allocates CuPy arrays; hand them over as CAI-only objects."""
    return CAI(obj) if IS_CAI else obj


rng = np.random.default_rng(7)
r2t_host = np.arange(1, ROWS * SEQ + 1, dtype=np.int32).reshape(ROWS, SEQ)
r2t_host[0] = 0


def step_inputs():
    rpi = rng.choice(np.arange(1, ROWS), size=BS, replace=False).astype(np.int64)
    prefix = rng.integers(0, 40, size=BS).astype(np.int64)
    ext = np.zeros(BS, dtype=np.int64)
    ext[: BS] = N_NEW // BS
    loc = np.concatenate([r2t_host[r, p:p + e] for r, p, e in zip(rpi, prefix, ext)]).astype(np.int64)
    pos = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix, ext)]).astype(np.int64)
    ids = rng.integers(0, 1000, size=N_NEW).astype(np.int64)
    return dict(req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=ext), dict(out_cache_loc=loc,
                                                                                      input_ids=ids, positions=pos)


def build(device, lib, make):
    vp = VerifyPlan.allocate(verify_capacity=BS * SEQ, device=device, max_reqs=ROWS, **lib)
    wp = WritePlan.allocate(write_req_capacity=BS, device=device, **lib)
    state = CanaryState.allocate(SLOTS, ring_capacity=256, device=device, **lib)
    if device != "cpu" and IS_CAI:
        vp = VerifyPlan(**{k: wrap(v) for k, v in vars(vp).items()})
        wp = WritePlan(**{k: wrap(v) for k, v in vars(wp).items()})
        state = CanaryState(**{k: None if v is None else wrap(v) for k, v in vars(state).items()})
    planner = CanaryPlanner(verify_plan_out=vp, write_plan_out=wp, req_to_token=make(r2t_host))
    records = CanaryRecords(state)
    return vp, wp, state, planner, records


plan_in, write_in = step_inputs()
dev_plan = {k: put(v) for k, v in plan_in.items()}
dev_write = {k: put(v) for k, v in write_in.items()}
vp, wp, state, planner, records = build(0, {"library": library()}, put)
ref = build("cpu", {}, lambda a: a.copy())
planner.warmup()
records.warmup()


def run(p, r, v, w, plan_kw, write_kw, stream):
    p.plan(**plan_kw, stream=stream)
    r.verify(v, launch_tag=1, stream=stream)
    r.write(w, **write_kw, launch_tag=1, stream=stream)


try:
    if CAPTURE == "torch":
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.graph(graph, stream=side):
            run(planner, records, vp, wp, dev_plan, dev_write, torch.cuda.current_stream() if STREAM == "given" else None)
        replay, sync = graph.replay, torch.cuda.synchronize
    else:
        side = cupy.cuda.Stream(non_blocking=True)
        with side:
            side.begin_capture()
            try:
                run(planner, records, vp, wp, dev_plan, dev_write, side if STREAM == "given" else None)
            finally:
                graph = side.end_capture()
        replay, sync = (lambda: graph.launch(side)), side.synchronize
except RuntimeError as exc:
    print("RAISED", exc)
    sys.exit(0)

OUT = ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
       "verify_num_valid", "enable", "status")
for step in range(3):
    plan_in, write_in = step_inputs()
    for k, v in plan_in.items():
        refill(dev_plan[k], v)
    for k, v in write_in.items():
        refill(dev_write[k], v)
    torch.cuda.synchronize()
    cupy.cuda.Device(0).synchronize()
    replay()
    sync()
    rvp, rwp, rstate, rplanner, rrecords = ref
    run(rplanner, rrecords, rvp, rwp, plan_in, write_in, None)
    got = {k: to_host(getattr(vp, k)._a if IS_CAI else getattr(vp, k)) for k in OUT}
    n = int(rvp.verify_num_valid[0])
    assert n > 0 and int(got["verify_num_valid"][0]) == n, (step, got["verify_num_valid"], n)
    for k in OUT:
        want = getattr(rvp, k)
        g = got[k]
        if k.startswith("verify_") and k != "verify_num_valid":
            g, want = g[:n], want[:n]
        assert np.array_equal(g, want), (step, k)
    for k in ("canary_buffer", "ring_write_index", "slot_run_counter", "kernel_run_counter"):
        g = to_host(getattr(state, k)._a if IS_CAI else getattr(state, k))
        assert np.array_equal(g, getattr(rstate, k)), (step, k)
print("OK")
