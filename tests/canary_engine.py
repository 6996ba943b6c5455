"""A simulated serving engine around the canary, for the end-to-end tests (host, reference backends).

Each step of the replay scheduler: plan (``CanaryPlanner``), scatter the step's true tokens into the
expected-token pool, verify the prefixes, store the step's KV bytes, write the canary records, drain the ring.
Hooks let a test corrupt the step (its entry arrays, the KV bytes, ``req_to_token``) at chosen points.

Synthetic content: the token at ``(request, position)`` is ``splitmix64(request << 32 | position) & 0x7FFF``;
its KV bytes are 12 splitmix64 words of the same pair (32 bytes for the paged K source, 64 for the token-major
V source, of which the canary reads 48).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from canary import CanaryPlanner, VerifyPlan, WritePlan
from canary.hashes import splitmix64
from canary.realkv import RealKVMode, real_kv
from canary.ring import DEFAULT_CHECK_FLAGS, CanaryState, CheckFlags, RingReport
from canary.scheduler import Scheduler, Step, load_trace
from canary.write_verify import KVCanary, scatter_expected_tokens

K_BYTES = 32  # per token, paged source [pages, page_size, 2, 8] float16
V_BYTES = 64  # per token, token-major source [slots, 64] uint8
V_READ = 48


def ranges(starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    owner = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    first = np.cumsum(lens) - lens
    return starts[owner] + (np.arange(int(lens.sum()), dtype=np.int64) - first[owner]), owner


def token_of(req: np.ndarray, pos: np.ndarray) -> np.ndarray:
    return splitmix64((np.asarray(req, dtype=np.int64) << 32) | np.asarray(pos, dtype=np.int64)) & 0x7FFF


def kv_bytes(req: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """[n, 96] uint8: K bytes then V bytes of each token."""
    key = ((np.asarray(req, dtype=np.int64) << 24) | np.asarray(pos, dtype=np.int64)) * 16
    words = splitmix64(key[:, None] + np.arange(12, dtype=np.int64))
    return np.ascontiguousarray(words).view(np.uint8).reshape(len(key), 96)


@dataclass
class StepData:
    """One step's write entries (mutable by hooks) and what the engine knows about them."""

    step: Step
    rows: np.ndarray  # active req_pool_indices
    prefix: np.ndarray
    extend: np.ndarray
    owner: np.ndarray  # batch row of each entry
    request: np.ndarray  # trace request id of each entry
    true_positions: np.ndarray
    true_tokens: np.ndarray
    out_cache_loc: np.ndarray
    positions: np.ndarray
    input_ids: np.ndarray
    kv_request: np.ndarray  # whose KV bytes the forward pass stores at each entry's slot
    kv_position: np.ndarray


@dataclass
class StepLog:
    index: int
    report: RingReport
    enable: int
    verify_entries: int  # entries with slot != 0 when enabled (what the verify must count)
    write_entries: int
    bs: int
    num_active: int


class Engine:
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
        mode: RealKVMode | str = RealKVMode.ALL,
        ring_capacity: int = 4096,
        verify_capacity: int = 1 << 16,
        check_flags: CheckFlags = DEFAULT_CHECK_FLAGS,
        seed: int = 0,
    ):
        self.sched = s = Scheduler(load_trace(trace, requests), max_batch_size=max_batch_size, page_size=page_size,
                                   kv_pool_tokens=kv_pool_tokens, chunk_size=chunk_size, swa_window=swa_window,
                                   pad_buckets=pad_buckets, seed=seed)
        self.page_size = ps = page_size
        self.lut = s.full_to_swa_index_mapping
        self.num_slots = (s.num_swa_pages if swa_window else s.num_pages) * ps
        self.k = np.zeros((self.num_slots // ps, ps, 2, 8), dtype=np.float16)
        self.v = np.zeros((self.num_slots, V_BYTES), dtype=np.uint8)
        self.real_kv = real_kv([(self.k, ps, K_BYTES), (self.v, 1, V_BYTES, V_READ)], mode)
        self.state = CanaryState.allocate(num_slots=self.num_slots, slot_stride_bytes=48, ring_capacity=ring_capacity,
                                          check_flags=check_flags)
        self.canary = KVCanary(self.state, self.real_kv, backend="reference")
        r_cap = max((*pad_buckets, max_batch_size))
        self.vplan = VerifyPlan.allocate(verify_capacity=verify_capacity)
        self.wplan = WritePlan.allocate(write_req_capacity=r_cap)
        self.pool = np.zeros((max_batch_size + 1, s.req_to_token.shape[1]), dtype=np.int32) if with_pool else None
        self.planner = CanaryPlanner(
            backend="reference", verify_plan_out=self.vplan, write_plan_out=self.wplan, req_to_token=s.req_to_token,
            swa_window_size=swa_window, full_to_swa_index_mapping=self.lut, req_to_verify_expected_tokens=self.pool,
        )
        self.r2t = s.req_to_token
        self.prev_r2t = self.r2t.copy()  # req_to_token as it was before the current step's allocation
        self.logs: list[StepLog] = []
        self._steps = s.steps()

    def slot_of(self, raw: np.ndarray) -> np.ndarray:
        raw = np.asarray(raw, dtype=np.int64)
        return raw if self.lut is None else np.where(raw >= 0, self.lut[np.maximum(raw, 0)], raw)

    def store_kv(self, slots: np.ndarray, req: np.ndarray, pos: np.ndarray) -> None:
        ok = slots >= 0
        slots, b = slots[ok], kv_bytes(req[ok], pos[ok])
        kb = self.k.view(np.uint8).reshape(-1, self.page_size, K_BYTES)
        kb[slots // self.page_size, slots % self.page_size] = b[:, :K_BYTES]
        self.v[slots] = b[:, K_BYTES:]

    def kv_token_bytes(self, slot: int) -> np.ndarray:
        """A writable view of the K bytes of ``slot`` (for fault injection)."""
        kb = self.k.view(np.uint8).reshape(-1, self.page_size, K_BYTES)
        return kb[slot // self.page_size, slot % self.page_size]

    def step(
        self,
        before_write: Callable[[Engine, StepData], None] | None = None,
        after_write: Callable[[Engine, StepData], None] | None = None,
    ) -> StepLog | None:
        """Run one step; ``None`` when the trace is done."""
        step = next(self._steps, None)
        if step is None:
            return None
        n, bs = step.num_active, step.bs
        rpi, pre, ext = step.req_pool_indices, step.prefix_lens, step.extend_seq_lens
        rows, prefix, extend = rpi[:n], pre[:n], ext[:n]
        valid = None
        if self.pool is not None:
            valid = np.zeros(bs, dtype=np.int64)
            valid[:n] = prefix + extend
        self.planner.plan(req_pool_indices=rpi, prefix_lens=pre, extend_seq_lens=ext,
                          req_to_verify_expected_tokens_valid_lens=valid)
        enable = int(self.vplan.enable[0])
        nv = int(self.vplan.verify_num_valid[0])
        verify_entries = int((self.vplan.verify_slot_indices[:nv] != 0).sum()) if enable else 0

        pos, owner = ranges(prefix, extend)
        req = step.request_ids[owner]
        toks = token_of(req, pos)
        data = StepData(
            step=step, rows=rows, prefix=prefix, extend=extend, owner=owner, request=req, true_positions=pos,
            true_tokens=toks, out_cache_loc=self.slot_of(self.r2t[rows[owner], pos]), positions=pos.copy(),
            input_ids=toks.copy(), kv_request=req.copy(), kv_position=pos.copy(),
        )
        if self.pool is not None:
            scatter_expected_tokens(req_to_verify_expected_tokens=self.pool, req_pool_indices=rpi, tokens=toks,
                                    token_offsets=self.wplan.write_offsets, column_starts=pre)
        self.canary.verify(self.vplan)
        if before_write is not None:
            before_write(self, data)
        self.store_kv(data.out_cache_loc, data.kv_request, data.kv_position)
        self.canary.write(self.wplan, out_cache_loc=data.out_cache_loc, input_ids=data.input_ids,
                          positions=data.positions, expected_input_ids=toks, expected_positions=pos)
        if after_write is not None:
            after_write(self, data)
        self.prev_r2t[...] = self.r2t
        log = StepLog(step.index, self.canary.drain(), enable, verify_entries, int((data.out_cache_loc >= 0).sum()),
                      bs, n)
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
