"""A tiny paged engine whose KV moves (SPEC 4.1): requests written through the planner and the canary, their KV
and records moved between slots as an engine moves them, then verified through the planner again.

:class:`Pool` holds the KV (two sources, and per-layer sources when ``num_layers``; real-KV ``mode`` ALL or
PARTIAL), the canary, its layer rotation, a :class:`~canary.RecordMover` and a planner over ``req_to_token`` (with
an expected-token pool, ``Pool.expected``, when ``expected_tokens``: each step stores its tokens in its row);
:meth:`Pool.step` runs one step of one request (plan, verify, KV stores, write), :meth:`Pool.check` verifies a
request (every layer, when the rotation is on) and :meth:`Pool.verify_rows` several at once.
:data:`SCENARIOS` are the moves of SPEC 4.1, clean and broken; :func:`run_scenario` runs one on a
backend and returns what each of its checks found, so that the backends can be compared and the expectations
asserted (``tests/records/test_move_roundtrip.py``).
"""
from __future__ import annotations

import numpy as np

from canary import (CanaryLayers, CanaryPlanner, CanaryRecords, CanaryState, KernelTag, RecordMover, VerifyPlan,
                    WritePlan, real_kv)
from canary.interop.hostcopy import to_host

NB = 32  # bytes per token of every KV source
MAX_REQS, MAX_LEN = 4, 48


class Pool:
    def __init__(self, backend: str, xp=np, num_slots: int = 96, num_layers: int = 0, seed: int = 0,
                 mode: str = "all", expected_tokens: bool = False):
        self.xp, self.backend = xp, backend
        self.rng = np.random.default_rng(seed)
        device = "cpu" if xp is np else 0
        self.k = xp.asarray(self._bytes((num_slots, NB)))
        self.v = xp.asarray(self._bytes((num_slots, NB)))
        self.lk = xp.asarray(self._bytes((max(num_layers, 1), num_slots, NB)))  # the rotation's layers
        self.state = CanaryState.allocate(num_slots=num_slots, ring_capacity=512, device=device)
        self.records = CanaryRecords(self.state, real_kv([(self.k, 1, NB), (self.v, 1, NB)], mode), backend=backend)
        self.num_layers = num_layers
        self.drained: list = []  # every ring row found() decoded (Violation objects)
        self.layers = None
        if num_layers:
            self.layers = CanaryLayers(self.records, [[(self.lk[i], 1, NB)] for i in range(num_layers)],
                                       mode=mode, backend=backend)
        self.mover = RecordMover(self.records, self.layers, copy_capacity=64, backend=backend)
        self.req_to_token = xp.zeros((MAX_REQS, MAX_LEN), dtype=xp.int32)
        self.vp = VerifyPlan.allocate(verify_capacity=4 * MAX_LEN, max_reqs=MAX_REQS, device=device)
        self.wp = WritePlan.allocate(write_req_capacity=MAX_REQS, device=device)
        # the expected-token pool, one row per req_to_token row (q = rp): each step stores its tokens there
        self.expected = xp.zeros((MAX_REQS, MAX_LEN), dtype=xp.int32) if expected_tokens else None
        self.planner = CanaryPlanner(verify_plan_out=self.vp, write_plan_out=self.wp,
                                     req_to_token=self.req_to_token, req_to_verify_expected_tokens=self.expected,
                                     backend=backend)

    def _bytes(self, shape) -> np.ndarray:
        return self.rng.integers(0, 256, shape, dtype=np.uint8)

    def kv_of(self, slots) -> tuple:
        """The KV bytes of ``slots`` (every source, every layer): what an offload copies out."""
        s = self.xp.asarray(np.asarray(slots, dtype=np.int64))
        return self.k[s].copy(), self.v[s].copy(), self.lk[:, s].copy()

    def put_kv(self, slots, kv) -> None:
        s = self.xp.asarray(np.asarray(slots, dtype=np.int64))
        self.k[s], self.v[s], self.lk[:, s] = kv

    def move_kv(self, src, dst) -> None:
        """The KV copy inside the pool, every source read before any is written (as ``copy`` moves rows)."""
        self.put_kv(dst, self.kv_of(src))

    def slots(self, values) -> object:
        return self.xp.asarray(np.asarray(values, dtype=np.int64))

    def map(self, rp: int, start: int, slots) -> None:
        """``req_to_token[rp, start:start + len(slots)] = slots``: the engine's index names the new slots."""
        self.req_to_token[rp, start:start + len(slots)] = self.xp.asarray(np.asarray(slots, dtype=np.int32))

    def _plan(self, rp, prefix, extend) -> None:
        """One plan over the rows ``rp`` (an int, or a list of them with lists of prefixes and extends)."""
        a = self.xp.asarray
        rows, prefix, extend = (np.atleast_1d(np.asarray(x, dtype=np.int64)) for x in (rp, prefix, extend))
        valid = None if self.expected is None else a(np.full(rows.shape, MAX_LEN, dtype=np.int64))
        self.planner.plan(req_pool_indices=a(rows), prefix_lens=a(prefix), extend_seq_lens=a(extend),
                          req_to_verify_expected_tokens_valid_lens=valid)

    def verify_rows(self, rps, lengths) -> list:
        """One verify over several requests at once (rows ``rps``, their first ``lengths`` positions each): readers
        of a shared block verified in one plan. Returns what it found."""
        self._plan(list(rps), list(lengths), [0] * len(rps))
        self.records.verify(self.vp)
        return self.found()

    def step(self, rp: int, prefix: int, new_slots) -> list:
        """One step of request ``rp``: its ``len(new_slots)`` new tokens stored at ``new_slots`` (positions
        ``prefix ...``), the prefix verified first. Returns what the step found."""
        e = len(new_slots)
        self.map(rp, prefix, new_slots)
        self._plan(rp, prefix, e)
        self.records.verify(self.vp)
        if self.layers is not None:
            self.layers.verify(self.vp)
        s = self.slots(new_slots)
        self.put_kv(new_slots, (self.xp.asarray(self._bytes((e, NB))), self.xp.asarray(self._bytes((e, NB))),
                                self.xp.asarray(self._bytes((self.lk.shape[0], e, NB)))))
        tokens = self.xp.asarray(self.rng.integers(0, 50_000, e).astype(np.int64))
        if self.expected is not None:
            self.expected[rp, prefix:prefix + e] = tokens.astype(self.xp.int32)
        self.records.write(self.wp, out_cache_loc=s, input_ids=tokens,
                           positions=self.xp.asarray(np.arange(prefix, prefix + e, dtype=np.int64)))
        if self.layers is not None:
            self.layers.write(self.wp, out_cache_loc=s)
        return self.found()

    def check(self, rp: int, length: int) -> list:
        """Verify request ``rp``'s first ``length`` positions, every layer of the rotation once."""
        empty = self.slots([])
        for _ in range(max(self.num_layers, 1)):
            self._plan(rp, length, 0)
            self.records.verify(self.vp)
            if self.layers is not None:
                self.layers.verify(self.vp)
                self.layers.write(self.wp, out_cache_loc=empty)  # moves the cursor to the next layer
        return self.found()

    def found(self) -> list:
        """The ring's rows since the last call, sorted: ``(kind, slot, position, reason bits, layer)``."""
        rows = list(self.state.drain())
        self.drained += rows  # the decoded rows too, for a caller that wants their tokens
        return sorted((int(v.kernel), v.slot, v.position, int(v.reasons), -1 if v.layer is None else v.layer)
                      for v in rows)

    def fields(self, slots) -> np.ndarray:
        buf = np.asarray(to_host(self.state.canary_buffer)).view(np.int64)
        return buf[np.asarray(slots)]


def _prefill(pool: Pool, rp: int, slots, decode_slots=()) -> list:
    """Request ``rp``'s prompt stored at ``slots``, then one decode step per slot of ``decode_slots``."""
    found = pool.step(rp, 0, list(slots))
    for k, s in enumerate(decode_slots):
        found += pool.step(rp, len(slots) + k, [s])
    return found


A = list(range(10, 20))
B = [47, 41, 45, 40, 49, 44, 43, 48, 42, 46]  # the restore's slots: another order, as an allocator hands them out


def offload_restore(pool: Pool, move_records: str = "yes", move_kv: bool = True, mover=None) -> dict:
    """Request 1 (10 tokens, then 2 decoded) is offloaded (rows gathered to a host-side buffer, KV copied out),
    request 2 reuses its slots, request 1 is restored into other slots ``B`` and decodes on."""
    mover = mover or pool.mover
    out = {"before": _prefill(pool, 1, A[:8], A[8:])}
    rows = mover.allocate_rows(len(A))
    mover.gather(pool.slots(A), rows)  # after the KV copy is queued, before the slots are reused
    kv = pool.kv_of(A)
    out["reuse"] = _prefill(pool, 2, A)  # another request's tokens overwrite the slots' KV and records
    if move_kv:
        pool.put_kv(B, kv)
    if move_records == "yes":
        mover.scatter(pool.slots(B), rows)
    elif move_records == "swapped":  # the rows of positions 3 and 4 land in each other's slots
        order = list(range(len(B)))
        order[3], order[4] = 4, 3
        mover.scatter(pool.slots([B[i] for i in order]), rows)
    pool.map(1, 0, B)
    out["restored"] = pool.check(1, len(B))
    out["decode"] = pool.step(1, len(B), [50]) + pool.check(1, len(B) + 1)
    out["other"] = pool.check(2, len(A))
    return out


def cow_fork(pool: Pool) -> dict:
    """Request 2 forks request 1 after 6 of its 8 tokens: the shared page's last two slots are copied on write into
    ``C`` (records and KV), both requests decode on."""
    parent, c = A[:8], [60, 61]
    out = {"before": _prefill(pool, 1, parent)}
    pool.mover.copy(pool.slots(parent[6:]), pool.slots(c))
    pool.move_kv(parent[6:], c)
    pool.map(2, 0, parent[:6] + c)
    out["forked"] = pool.check(1, 8) + pool.check(2, 8)
    out["decode"] = pool.step(1, 8, [62]) + pool.step(2, 8, [63]) + pool.check(1, 9) + pool.check(2, 9)
    return out


def defrag(pool: Pool, shift: int) -> dict:
    """Request 1's slots shifted by ``shift`` inside the pool: overlapping lists (a -> b, b -> c)."""
    src = list(range(20, 28))
    dst = [s + shift for s in src]
    out = {"before": _prefill(pool, 1, src)}
    pool.mover.copy(pool.slots(src), pool.slots(dst))
    pool.move_kv(src, dst)
    pool.map(1, 0, dst)
    out["moved"] = pool.check(1, len(dst))
    out["decode"] = pool.step(1, len(dst), [70]) + pool.check(1, len(dst) + 1)
    return out


SCENARIOS = ("offload_restore", "kv_moved_records_not", "records_swapped", "records_moved_kv_not", "cow_fork",
             "defrag_down", "defrag_up", "offload_restore_layers", "layer_table_left_behind")


def run_scenario(name: str, backend: str, xp=np) -> dict:
    if name == "offload_restore":
        return offload_restore(Pool(backend, xp))
    if name == "kv_moved_records_not":
        return offload_restore(Pool(backend, xp), move_records="no")
    if name == "records_swapped":
        return offload_restore(Pool(backend, xp), move_records="swapped")
    if name == "records_moved_kv_not":
        return offload_restore(Pool(backend, xp), move_kv=False)
    if name == "cow_fork":
        return cow_fork(Pool(backend, xp))
    if name == "defrag_down":
        return defrag(Pool(backend, xp), -1)
    if name == "defrag_up":
        return defrag(Pool(backend, xp), 2)
    if name == "offload_restore_layers":
        return offload_restore(Pool(backend, xp, num_layers=3))
    if name == "layer_table_left_behind":  # a mover bound without the rotation: records move, layer hashes stay
        pool = Pool(backend, xp, num_layers=3)
        return offload_restore(pool, mover=RecordMover(pool.records, backend=backend))
    raise ValueError(name)


VERIFY, VERIFY_LAYER = int(KernelTag.VERIFY), int(KernelTag.VERIFY_LAYER)
