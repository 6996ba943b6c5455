"""The end-to-end tests' engine: the replay's simulated engine (``canary/replay/engine.py``) with a canary of its
own, so that the records front object (``CanaryRecords``) runs without the manager.

:meth:`CanaryEngineKV.run` does what a serving engine around the canary does: scatter the step's true tokens into
the expected-token pool, verify the plan, store the step's KV bytes into the real KV buffers, write the canary
records, and drain the ring. Hooks run just before and just after the KV stores and the write, so that a fault
injector (``canary/replay/faults.py``) can corrupt the step's entries, the KV bytes or ``req_to_token``.

The expected-token pool is keyed by request identity by default (``pool_by_request``): each request owns a
pool row from its first step to its last, handed to the planner as ``expected_token_pool_indices``, so that a
``req_to_token`` row reused while a stale forward still reads it is caught (SPEC 3.2). Freed pool rows are
reused first in, first out, after every other free row. ``pool_by_request=False`` keys the pool by the
``req_to_token`` row, the planner's default. :class:`Engine` runs the scheduler, a planner and this engine in
one loop.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from canary import (
    DEFAULT_CHECK_FLAGS, CanaryPlanner, CanaryRecords, CanaryState, CheckFlags, RealKVMode, RingReport, VerifyPlan,
    WritePlan, scatter_expected_tokens, to_host,
)
from canary.replay.engine import EngineKV, Hook, StepData
from canary.replay.scheduler import Scheduler, Step, load_trace

RING_CAPACITY = 4096


@dataclass
class StepLog:
    index: int
    report: RingReport
    enable: int
    verify_entries: int  # entries with slot != 0 when enabled (what the verify must count)
    write_entries: int
    bs: int
    num_active: int


class CanaryEngineKV(EngineKV):
    """:class:`canary.replay.engine.EngineKV` with its own :class:`CanaryState` and :class:`CanaryRecords`
    (``backend``), and, with ``with_pool``, an expected-token pool (the planner must be bound to :attr:`pool`,
    and each plan given :meth:`valid_lens` and :meth:`pool_indices`); ``pool_by_request``: the pool's rows are
    owned by requests (module docstring), else by ``req_to_token`` rows."""

    def __init__(
        self,
        sched: Scheduler,
        *,
        xp: Any = np,
        device: Any = "cpu",
        backend: str = "auto",
        with_pool: bool = True,
        mode: RealKVMode | str = RealKVMode.ALL,
        ring_capacity: int = RING_CAPACITY,
        check_flags: CheckFlags | int = DEFAULT_CHECK_FLAGS,
        pool_by_request: bool = True,
        num_layers: int = 1,
    ):
        super().__init__(sched, xp=xp, device=device, backend=backend, mode=mode, num_layers=num_layers)
        self.state = CanaryState.allocate(num_slots=self.num_slots, slot_stride_bytes=48,
                                          ring_capacity=ring_capacity, device=device, check_flags=check_flags)
        self.canary = CanaryRecords(self.state, self.real_kv, backend=backend)
        self.canary.warmup()  # compile and load now, so no step's canary time includes it
        self.pool_by_request = bool(with_pool and pool_by_request)
        rows = self.r2t.shape[0]
        if self.pool_by_request:  # twice the running requests: a freed row waits for as many others
            rows = 2 * sched.max_batch_size + 1
            self._free_pool_rows = deque(range(1, rows))  # row 0 is the scatter's padding row
            self._pool_row: dict[int, int] = {}
            self._step_q: tuple[int, np.ndarray] | None = None
        self.pool = xp.zeros((rows, self.r2t.shape[1]), dtype=xp.int32) if with_pool else None

    def valid_lens(self, step: Step) -> np.ndarray | None:
        """``req_to_verify_expected_tokens_valid_lens`` of the step (host; 0 for padding rows)."""
        if self.pool is None:
            return None
        n = step.num_active
        valid = np.zeros(step.bs, dtype=np.int64)
        valid[:n] = step.prefix_lens[:n] + step.extend_seq_lens[:n]
        return valid

    def pool_indices(self, step: Step) -> np.ndarray | None:
        """``expected_token_pool_indices`` of the step (host; 0 for padding rows), or ``None`` when the pool is
        keyed by ``req_to_token`` rows (or absent). A request's first step gives it a pool row."""
        if not self.pool_by_request:
            return None
        if self._step_q is not None and self._step_q[0] == step.index:
            return self._step_q[1]
        q = np.zeros(step.bs, dtype=np.int64)
        for i, req in enumerate(step.request_ids.tolist()):
            row = self._pool_row.get(req)
            if row is None:
                row = self._pool_row[req] = self._free_pool_rows.popleft()
            q[i] = row
        self._step_q = (step.index, q)
        return q

    def pool_row(self, request: int) -> int:
        """The pool row of a running request: its own, or its ``req_to_token`` row when keyed by rows."""
        if self.pool_by_request:
            return self._pool_row[int(request)]
        return int(np.flatnonzero(self.sched.row_req == int(request))[0])

    def _release_pool_rows(self, data: StepData) -> None:
        for req in data.step.request_ids[~data.continues].tolist():
            self._free_pool_rows.append(self._pool_row.pop(req))

    def run(
        self,
        step: Step,
        verify_plan: VerifyPlan,
        write_plan: WritePlan,
        *,
        req_to_token: Any,
        lut: Any = None,
        before_write: Hook | None = None,
        after_write: Hook | None = None,
    ) -> StepLog:
        """Run the canary around one planned step; drains the ring (a sync) and returns the step's log.

        ``req_to_token`` / ``lut``: the tables the planner read (device copies on the GPU). Hooks are called
        as ``hook(self, data)``.
        """
        xp = self.xp
        data = self.entries(step, req_to_token, lut)
        if self.pool is not None:
            q = self.pool_indices(step)
            scatter_expected_tokens(req_to_verify_expected_tokens=self.pool,
                                    req_pool_indices=xp.asarray(step.req_pool_indices if q is None else q),
                                    tokens=data.true_tokens,
                                    token_offsets=write_plan.write_offsets,
                                    column_starts=xp.asarray(step.prefix_lens), backend=self.backend)
        self.canary.verify(verify_plan)
        if before_write is not None:
            before_write(self, data)
        self.store_kv(data.out_cache_loc, data.kv_request, data.kv_position)
        self.canary.write(write_plan, out_cache_loc=data.out_cache_loc, input_ids=data.input_ids,
                          positions=data.positions, expected_input_ids=data.write_expected_tokens,
                          expected_positions=data.true_positions)
        if after_write is not None:
            after_write(self, data)
        # Rows outside the step did not change, so copying the step's rows keeps prev_r2t == req_to_token.
        self.prev_r2t[data.rows] = self.r2t[data.rows]
        if self.pool_by_request:
            self._release_pool_rows(data)
        report = self.canary.drain()
        enable = int(to_host(verify_plan.enable)[0])
        nv = int(to_host(verify_plan.verify_num_valid)[0])
        verify_entries = int((verify_plan.verify_slot_indices[:nv] != 0).sum()) if enable else 0
        write_entries = int((data.out_cache_loc >= 0).sum())
        return StepLog(step.index, report, enable, verify_entries, write_entries, step.bs, step.num_active)


class Engine:
    """Scheduler, planner and :class:`EngineKV` in one loop: the end-to-end tests' engine.

    ``xp``: ``numpy`` (host arrays; ``backend`` ``"reference"``) or ``cupy`` (arrays on the current CUDA device;
    ``req_to_token`` and the LUT are mirrored there every step). ``on_overflow``: the planner's (SPEC 3.7):
    ``"sample"`` verifies ``verify_capacity`` entries of a larger step, ``"skip"`` none.
    """

    def __init__(
        self,
        *,
        requests: int = 60,
        trace: str = "conv",
        max_batch_size: int = 16,
        page_size: int = 16,
        kv_pool_tokens: int = 1 << 15,
        chunk_size: int = 128,
        pad_buckets: tuple[int, ...] = (4, 8, 16),
        swa_window: int = 0,
        with_pool: bool = True,
        pool_by_request: bool = True,
        mode: RealKVMode | str = RealKVMode.ALL,
        ring_capacity: int = RING_CAPACITY,
        verify_capacity: int = 1 << 16,
        on_overflow: str = "sample",
        check_flags: CheckFlags | int = DEFAULT_CHECK_FLAGS,
        seed: int = 0,
        xp: Any = np,
        backend: str = "reference",
    ):
        self.sched = s = Scheduler(load_trace(trace, requests), max_batch_size=max_batch_size, page_size=page_size,
                                   kv_pool_tokens=kv_pool_tokens, chunk_size=chunk_size, swa_window=swa_window,
                                   pad_buckets=pad_buckets, seed=seed)
        self.xp = xp
        self.on_host = xp is np
        device = "cpu" if self.on_host else xp.cuda.Device().id
        self.kv = CanaryEngineKV(s, xp=xp, device=device, backend=backend, with_pool=with_pool, mode=mode,
                           ring_capacity=ring_capacity, check_flags=check_flags, pool_by_request=pool_by_request)
        r_cap = max((*pad_buckets, max_batch_size))
        # The cursors persist across steps: a sampled step resumes each request where its last one stopped.
        self.vplan = VerifyPlan.allocate(verify_capacity=verify_capacity, device=device,
                                         max_reqs=s.req_to_token.shape[0])
        self.wplan = WritePlan.allocate(write_req_capacity=r_cap, device=device)
        self.dev_r2t = xp.asarray(s.req_to_token)
        lut = s.full_to_swa_index_mapping
        self.dev_lut = None if lut is None else xp.asarray(lut)
        self.planner = CanaryPlanner(
            backend=backend, verify_plan_out=self.vplan, write_plan_out=self.wplan, req_to_token=self.dev_r2t,
            swa_window_size=swa_window, full_to_swa_index_mapping=self.dev_lut,
            req_to_verify_expected_tokens=self.kv.pool, on_overflow=on_overflow,
        )
        self.logs: list[StepLog] = []
        self._steps = s.steps()

    @property
    def state(self) -> CanaryState:
        return self.kv.state

    def step(self, before_write: Hook | None = None, after_write: Hook | None = None) -> StepLog | None:
        """Plan and run one step; ``None`` when the trace is done."""
        step = next(self._steps, None)
        if step is None:
            return None
        xp = self.xp
        if not self.on_host:
            rows = step.req_pool_indices[: step.num_active]
            self.dev_r2t[xp.asarray(rows)] = xp.asarray(self.kv.r2t[rows])
            if self.dev_lut is not None:
                self.dev_lut.set(self.kv.lut)
        valid, q = self.kv.valid_lens(step), self.kv.pool_indices(step)
        self.planner.plan(req_pool_indices=xp.asarray(step.req_pool_indices), prefix_lens=xp.asarray(step.prefix_lens),
                          extend_seq_lens=xp.asarray(step.extend_seq_lens),
                          req_to_verify_expected_tokens_valid_lens=None if valid is None else xp.asarray(valid),
                          expected_token_pool_indices=None if q is None else xp.asarray(q))
        log = self.kv.run(step, self.vplan, self.wplan, req_to_token=self.dev_r2t, lut=self.dev_lut,
                          before_write=before_write, after_write=after_write)
        self.logs.append(log)
        return log

    def run(self, steps: int) -> list[StepLog]:
        out = []
        for _ in range(steps):
            log = self.step()
            if log is None:
                break
            out.append(log)
        return out
