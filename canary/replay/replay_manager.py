"""``kv-canary replay`` (the default): the simulated engine as the first client of :class:`canary.CanaryManager`.

The engine does what docs/integration.md asks of a serving engine and nothing more: ``add_request`` with the
prompt when a request is first scheduled, ``before_forward`` with the step's batch and request ids (the manager
plans, then verifies), the KV stores, ``after_kv_store`` with the step's slots, tokens and positions (the manager
writes the records), ``accept_tokens`` with each sampled token, ``finish_request`` at the end. The manager owns
the expected-token pool (keyed by request id), the plans and the canary state; the replay reads the manager's
plans for its checks (status against the scheduler, ``--check-every`` against the reference planner) and
attributes the manager's :class:`canary.SlotViolation` records to the injected faults.

The replay flushes the manager after every step (one sync per step): an engine never needs to, but it makes
each violation's step exact and lets the attribution read ``req_to_token`` as the step left it. The manager
writes without the write-time token / position asserts (an engine has no truth to assert against beyond what it
fed the forward), so ``position`` and ``token`` faults are caught by the next verify (``POSITION``,
``VERIFY_TOKEN``) rather than by the same step's write.

Attribution: a violation found at step ``t`` belongs to the fault applied last (at a step ``<= t``) that either
made its slot wrong (``Fault.slots``) or involves the request it was found in (``Fault.requests``, or one of the
manager's holders of the slot). The request of a violation is the active request whose ``req_to_token`` entry
at the violation's position maps to its slot; a verify row's position is the one the plan expects, so a
corrupted slot is found in the request that reads it, and chain violations that a fault causes at the next slot
of the same request are attributed too. Violations of no fault are *unattributed* (in a clean run, every
violation is).
"""
from __future__ import annotations

from time import perf_counter_ns
from typing import Any

import numpy as np

from canary import MISSING_SLOT, CanaryManager, KernelTag, KVGroup, RankViolation, SlotViolation, Violation
from canary.contract.plans import mark_missing

from .coverage import Coverage
from .engine import K_BYTES, V_BYTES, V_READ, EngineKV, token_of
from .faults import OFFLOAD_KINDS, Fault, Injector
from .ranks import rank_fault_of
from .scheduler import Scheduler, Step
from .tier import HostTier

RING_CAPACITY = 4096
MAX_SHOWN_VIOLATIONS = 5


def violation_requests(violations: list[Violation], step: Step, r2t: np.ndarray, lut: np.ndarray | None,
                       window: int = 0) -> np.ndarray:
    """Trace request id of each violation (-1: in no active request), vectorized over violations x rows.
    ``window``: the sliding window, which tells a MISSING row's request from those whose position was evicted."""
    n = step.num_active
    if not violations or not n:
        return np.full(len(violations), -1, dtype=np.int64)
    slot = np.array([v.slot for v in violations], dtype=np.int64)
    pos = np.array([v.position for v in violations], dtype=np.int64)
    inside = (pos >= 0) & (pos < r2t.shape[1])
    raw = r2t[step.req_pool_indices[:n][None, :], np.clip(pos, 0, r2t.shape[1] - 1)[:, None]].astype(np.int64)
    cand = raw if lut is None else lut[raw]
    # A MISSING row names no slot: its request is one whose slot at that position is the padding slot (a 0 in its
    # row, or a real slot mapped to nothing) although its verify window holds the position (elsewhere a 0 mapping
    # is a legitimate eviction).
    prefix = step.prefix_lens[:n][None, :]
    needed = (pos[:, None] < prefix) & (pos[:, None] >= (np.maximum(prefix - window, 0) if window else 0))
    missing = (slot == MISSING_SLOT)[:, None]
    no_slot = mark_missing(raw, cand) == MISSING_SLOT
    match = np.where(missing, no_slot & needed, cand == slot[:, None]) & inside[:, None]
    return np.where(match.any(axis=1), step.request_ids[match.argmax(axis=1)], -1)


class ManagerReplay:
    """The canary side of a replay through a :class:`CanaryManager`: :meth:`before_forward` plans and verifies a
    step (the replay then checks the manager's plans), :meth:`run` stores the KV and writes the records, and
    :meth:`summary` reports the run."""

    def __init__(self, sched: Scheduler, *, xp: Any, device: Any, backend: str, faults: list[Fault],
                 req_to_token: Any, lut: Any, verify_capacity: int, on_overflow: str, num_layers: int = 1,
                 layer_dwell: int = 1, offload_tier: int = 0, ranks: Any = None, communicator: Any = None):
        # The engine's KV buffers and fault hooks; the manager owns the canary.
        self.kv = EngineKV(sched, xp=xp, device=device, backend=backend, num_layers=num_layers)
        self.kv.layer_dwell = layer_dwell
        self.kv.pool_by_request = True  # what the faults must assume: the manager keys its pool by request
        if ranks is not None:  # --ranks: this rank's KV bytes (canary.replay.ranks)
            self.kv.rank, self.kv.ranks_size = ranks.tp_rank, ranks.tp_size
        self.injector = Injector(list(faults))
        self.faults = self.injector.faults
        self.total = 0
        self.unattributed: list[tuple[int, Violation]] = []
        self.unattributed_count = 0
        self.by_fault: list[list[tuple[int, Violation]]] = [[] for _ in self.faults]
        self.times_us: list[float] = []
        self.coverage = Coverage(self.kv.r2t, self.kv.lut, self.kv.window)
        self.name = "swa" if self.kv.window else "full"
        ps = sched.page_size
        step_tokens = sched.max_batch_size * sched.chunk_size
        if sched.token_budget:
            step_tokens = min(step_tokens, sched.token_budget + sched.max_batch_size)
        self.manager = CanaryManager(
            [KVGroup(name=self.name, req_to_token=req_to_token, num_slots=self.kv.num_slots,
                     verify_capacity=verify_capacity, on_overflow=on_overflow,
                     real_kv_sources=[(self.kv.k, ps, K_BYTES), (self.kv.v, 1, V_BYTES, V_READ)],
                     swa_window_size=self.kv.window, full_to_swa_index_mapping=lut,
                     layer_sources=self.kv.layer_sources() if num_layers > 1 else (), layer_dwell=layer_dwell)],
            max_batch_size=sched.max_batch_size, device=device, backend=backend, on_violation=self._collect,
            ring_capacity=RING_CAPACITY, max_step_tokens=max(4096, step_tokens), ranks=ranks,
            communicator=communicator)
        self.manager.warmup()
        self.group = self.manager.groups[0]
        # The replay step of each manager step, when they differ (--pd: an instance skips the steps it has no
        # request in); None: the same numbers.
        self.step_of: list[int] | None = None
        self.admitted: set[int] = set()  # requests given to add_request (a finished one is never scheduled again)
        self._step: Step | None = None
        self.last_step: int | None = None  # the last step begun (an interrupted replay stops anywhere)
        self.context = sched.trace.context_tokens
        # The host tier (--offload-tier): the scheduler preempts and restores, the tier moves KV and records.
        self.tier = None
        if offload_tier:
            self.tier = HostTier(self.kv, self.manager, offload_tier)
            sched.on_offload, sched.on_restore = self._offload, self._restore
        for f in self.faults:
            if not offload_tier and f.kind in OFFLOAD_KINDS:
                f.needs = "--offload-tier"

    def _offload(self, index: int, req: int, row: int, prefix: int) -> None:
        self.tier.offload(req, self.kv.r2t[row, :prefix].astype(np.int64))

    def _restore(self, index: int, req: int, row: int, prefix: int) -> None:
        r = self.tier.plan(index, req, row, self.kv.r2t[row, :prefix].astype(np.int64))
        self.injector.at_restore(self.tier, r)
        self.tier.restore(r)

    # -- what the replay reads -----------------------------------------------------------------------------------
    @property
    def plans(self):
        return self.group.verify_plan, self.group.write_plan

    @property
    def pool(self) -> Any:
        return self.manager.pool_array

    # -- the engine's calls ----------------------------------------------------------------------------------------
    def before_forward(self, step: Step, inputs: dict) -> None:
        """Admit new requests, then ``before_forward``: the manager plans and verifies the step."""
        self._step = step
        self.last_step = step.index
        n = step.num_active
        ids = step.request_ids[:n].tolist()
        for req in ids:
            if req not in self.admitted:  # its first step
                self.admitted.add(req)
                self.manager.add_request(req, token_of(req, np.arange(int(self.context[req]))))
        ids += [None] * (step.bs - n)
        self.manager.before_forward(req_pool_indices=inputs["req_pool_indices"], prefix_lens=inputs["prefix_lens"],
                                    extend_seq_lens=inputs["extend_seq_lens"], request_ids=ids)

    def run(self, step: Step, *, req_to_token: Any, lut: Any) -> None:
        """The rest of the step after the plan: KV stores and ``after_kv_store``, sampled tokens, finished
        requests; then the step's report (flushed) is attributed. ``req_to_token`` / ``lut``: the tables the
        planner read (device copies on the GPU)."""
        self.coverage.add(step, self.group.verify_plan)  # before the faults' hooks edit req_to_token
        kv, inj = self.kv, self.injector
        t0 = perf_counter_ns()
        data = kv.entries(step, req_to_token, lut)
        inj.before_write(kv, data)
        kv.store_kv(data.out_cache_loc, data.kv_request, data.kv_position)
        by_group = {self.name: data.out_cache_loc} if self.kv.window else None  # already SWA slots
        self.manager.after_kv_store(out_cache_loc=data.out_cache_loc, input_ids=data.input_ids,
                                    positions=data.positions, out_cache_loc_by_group=by_group)
        inj.after_write(kv, data)
        if any(f.applied_step == step.index for f in inj.faults):  # a fault may have edited any column of its rows
            kv.prev_r2t[data.rows] = kv.r2t[data.rows]
        else:  # only the step's allocation wrote req_to_token: its new columns (whole rows cost 0.3 s a replay)
            entry_rows = np.repeat(data.rows, data.extend)
            cols = np.arange(entry_rows.shape[0], dtype=np.int64) - np.repeat(data.offsets[:-1] - data.prefix,
                                                                              data.extend)
            kv.prev_r2t[entry_rows, cols] = kv.r2t[entry_rows, cols]
        end = data.prefix + data.extend
        reqs = step.request_ids[: step.num_active]
        sampled = token_of(reqs, end[: reqs.shape[0]]).tolist()  # the step's tokens in one call, not one a request
        # The sampler's token at position `end` of a continuing request (prompt tokens are known), as lists: per
        # element NumPy indexing costs more than the manager's call.
        sampling = (end[: reqs.shape[0]] >= self.context[reqs]).tolist()
        for req, goes_on, samples, token in zip(reqs.tolist(), data.continues.tolist(), sampling, sampled):
            if not goes_on:
                self.manager.finish_request(req)
            elif samples:
                self.manager.accept_tokens(req, [token])
        self.manager.flush()
        self.times_us.append((perf_counter_ns() - t0) / 1e3)

    def _collect(self, new: list[SlotViolation]) -> None:
        """``on_violation``: attribute each new record to a fault (the rule of the module docstring)."""
        step = self._step
        self.total += len(new)
        rank = [v for v in new if isinstance(v, RankViolation)]  # the agreement's (--ranks): no slot, no raw row
        for v in rank:
            k = rank_fault_of(self.faults, v.first_step)
            if k is None:
                self.unattributed_count += 1
                if len(self.unattributed) < MAX_SHOWN_VIOLATIONS:
                    self.unattributed.append((v.first_step, v.line()))
            else:
                self.by_fault[k].append((v.first_step, v))
        new = [v for v in new if not isinstance(v, RankViolation)]
        owners = violation_requests([v.raw for v in new], step, self.kv.r2t, self.kv.lut, self.kv.window)
        for v, req in zip(new, owners.tolist()):
            first = v.first_step if self.step_of is None else self.step_of[v.first_step]
            k = self._fault_of_record(v, req, first)
            if k is None:
                self.unattributed_count += 1
                if len(self.unattributed) < MAX_SHOWN_VIOLATIONS:
                    self.unattributed.append((first, v.raw))
            else:
                self.by_fault[k].append((first, v.raw))

    def _fault_of_record(self, v: SlotViolation, req: int, index: int) -> int | None:
        k = self._fault_of(v.raw, req, index)
        if k is not None:
            return k
        for rid in v.request_ids:  # the manager's own holders of the slot
            k = self._fault_of(v.raw, int(rid), index)
            if k is not None:
                return k
        return None

    def _fault_of(self, v: Violation, req: int, index: int) -> int | None:
        best = None
        for k, f in enumerate(self.faults):
            mine = f.applied and f.applied_step <= index and (v.slot in f.slots or req in f.requests)
            if mine and (best is None or f.applied_step >= self.faults[best].applied_step):
                best = k
        return best

    @property
    def failed(self) -> bool:
        """Exit-status rule: a clean run with violations, or an injected fault never detected."""
        if not self.faults:
            return self.total > 0
        return any(not hits for hits in self.by_fault)

    def summary(self, interrupted: bool = False) -> dict:
        """The ``canary`` object of the replay's summary (docs/replay.md lists its keys); ``interrupted``: the
        replay stopped before the trace's end (a fault not reached says so)."""
        st = self.manager.stats()
        h = self.group.state.health()
        faults = []
        for f, hits in zip(self.faults, self.by_fault):
            first = hits[0][0] if hits else None
            at_first = [v for s, v in hits if s == first]
            faults.append({
                "kind": f.kind,
                "requested_step": f.requested_step,
                "applied_step": f.applied_step,
                "first_violation_step": first,
                "steps_to_detection": None if first is None else first - f.applied_step,
                "detected": bool(hits),
                "kernels": _names({_kernel(v) for v in at_first}),
                "reasons": _names({n for v in at_first for n in v.reason_names}),
                "violations": len(hits),
                "all_reasons": _names({n for _, v in hits for n in v.reason_names}),
                "slot": f.slot,
                "position": f.position,
                "requests": list(f.requests),
                "what": f.describe(self.last_step, interrupted),
            })
        times = np.array(self.times_us or [0.0])
        return {
            "drain_every_steps": 1,
            "ring_capacity": RING_CAPACITY,
            "real_kv_mode": self.kv.real_kv.mode.name,
            "num_layers": self.kv.num_layers,
            "violations": self.total,  # new SlotViolation records; repeats are in manager.repeated_sightings
            "dropped": st["ring_dropped"],
            "unattributed_violations": self.unattributed_count,
            "first_unattributed": [f"step {s}: {v}" for s, v in self.unattributed],
            "health": {"write_slots": h.write_slots, "verify_slots": h.verify_slots,
                       "write_launches": h.write_launches, "verify_launches": h.verify_launches},
            "time_us": {"p50": float(np.percentile(times, 50)), "p99": float(np.percentile(times, 99)),
                        "max": float(times.max())},
            **self.coverage.summary(),
            "faults": faults,
            "failed": self.failed,
            "manager": st,
        }


def _kernel(v: Violation) -> str:
    if isinstance(v.kernel, str):  # a RankViolation's "rank"
        return v.kernel
    return v.kernel.name.lower() if isinstance(v.kernel, KernelTag) else f"kind{v.kernel}"


def _names(items: set[str]) -> list[str]:
    order = {"write": 0, "verify": 1}
    return sorted(items, key=lambda s: (order.get(s, 2), s))
