"""A paged toy engine for the attribution tests of the index forms (SPEC 3.8): pages of ``s`` slots from a free
list, a block table per request row (the engine's truth), and the index handed to a CPU manager as a token table or
as a page list in each step's batch row order (tests/manager/test_manager_page_attribution.py, the sim suite)."""
from __future__ import annotations

import numpy as np

from canary import CanaryManager, KVGroup
from canary.contract.kvindex import expand_block_table

MAX_REQS, MAX_BLOCKS, BYTES, MAX_BS = 6, 8, 16, 4


class PageListEngine:
    """Pages of ``s`` slots from a free list, a block table per request row (the engine's truth); the index handed
    to the canary in ``form``: ``req_to_token`` (the block table expanded), or a page list in the step's batch
    order, in the bound buffers (``indptr_dtype`` offsets) or in arrays of the step's own. Slot-level K and V."""

    def __init__(self, form: str, s: int, indptr_dtype=np.int64, swa: bool = False, backend: str = "auto"):
        self.form, self.s, self.dtype = form, s, indptr_dtype
        num_slots = 48 * s
        self.bt = np.zeros((MAX_REQS, MAX_BLOCKS), np.int32)
        self.r2t = np.zeros((MAX_REQS, MAX_BLOCKS * s), np.int32)
        self.indptr = np.zeros(MAX_BS + 1, indptr_dtype)
        self.indices = np.zeros(MAX_BS * MAX_BLOCKS, np.int32)
        self.k = np.zeros((num_slots, BYTES), np.uint8)
        self.v = np.zeros((num_slots, BYTES), np.uint8)
        self.free = list(range(1, 48))
        self.rows: dict = {}  # rid -> [row, tokens, kv_len]
        index = (dict(req_to_token=self.r2t) if form == "req_to_token" else
                 dict(kv_indptr=self.indptr, kv_indices=self.indices, page_size=s, max_reqs=MAX_REQS,
                      max_seq_len=MAX_BLOCKS * s))
        self.reports: list = []
        groups = [KVGroup(name="full", num_slots=num_slots, verify_capacity=512,
                          real_kv_sources=[(self.k, 1, BYTES), (self.v, 1, BYTES)], **index)]
        # swa: a second pool over the same index, its slots a permutation of the full pool's (a window wider than
        # any request: every position verified, as in the full group)
        self.lut = np.concatenate([[0], 1 + np.random.default_rng(7).permutation(num_slots - 1)]).astype(np.int64)
        self.swa_k = np.zeros((num_slots, BYTES), np.uint8)
        if swa:
            groups.append(KVGroup(name="swa", num_slots=num_slots, verify_capacity=512, swa_window_size=1000,
                                  full_to_swa_index_mapping=self.lut, real_kv_sources=[(self.swa_k, 1, BYTES)],
                                  **index))
        self.m = CanaryManager(groups, max_batch_size=MAX_BS, device="cpu", backend=backend,
                               on_violation=self.reports.extend)
        self.m.warmup()

    def add(self, rid, row: int, prompt) -> None:
        self.rows[rid] = [row, list(prompt), 0]
        self.m.add_request(rid, list(prompt))

    def slot(self, rid, p: int) -> int:
        return int(self.bt[self.rows[rid][0], p // self.s]) * self.s + p % self.s

    def step(self, batch, flush: bool = True) -> list:
        """``batch``: ``(rid, n)``, n new tokens each (the prompt first, then the accepted ones), in batch row
        order; each request's pages grow as needed. One forward; ``flush``: its report decoded now (else at the
        next step's before_forward). Returns the violations delivered during the call."""
        s = self.s
        rpi, pre, ext, ids, loc, tok, pos, pages, flat = [], [], [], [], [], [], [], [0], []
        for rid, n in batch:
            row, tokens, p = self.rows[rid]
            for b in range(p // s, -(-(p + n) // s)):
                if self.bt[row, b] == 0:
                    self.bt[row, b] = self.free.pop(0)
            rpi.append(row), pre.append(p), ext.append(n), ids.append(rid)
            for q in range(p, p + n):
                loc.append(self.slot(rid, q)), tok.append(tokens[q]), pos.append(q)
            self.rows[rid][2] = p + n
            held = -(-(p + n) // s)
            flat += [int(b) for b in self.bt[row, :held]]
            pages.append(pages[-1] + held)
        self.r2t[...] = expand_block_table(self.bt, s)
        extra = {}
        if self.form == "page_list":  # the bound buffers, refilled in place
            self.indptr[:] = 0
            self.indptr[:len(pages)] = pages
            self.indices[:len(flat)] = flat
        elif self.form == "page_list_per_step":
            extra = dict(kv_indptr=np.asarray(pages, self.dtype), kv_indices=np.asarray(flat, np.int32))
        i64 = lambda v: np.asarray(v, np.int64)  # noqa: E731
        self.m.before_forward(req_pool_indices=i64(rpi), prefix_lens=i64(pre), extend_seq_lens=i64(ext),
                              request_ids=ids, **extra)
        for slot, t, q in zip(loc, tok, pos):  # the engine's KV store
            self.k[slot] = np.random.default_rng(t * 1000 + q).integers(0, 256, BYTES, dtype=np.uint8)
            self.v[slot] = self.k[slot][::-1]
            self.swa_k[self.lut[slot]] = self.k[slot]
        self.m.after_kv_store(out_cache_loc=i64(loc), input_ids=i64(tok), positions=i64(pos))
        if flush:
            self.m.flush()
        got, self.reports[:] = list(self.reports), []
        return got

    def decode(self, order, flush: bool = True) -> list:
        """A decode step of the requests in ``order`` (batch rows), each accepting one token first."""
        for rid in order:
            tokens = self.rows[rid][1]
            tokens.append(100 + len(tokens))
            self.m.accept_tokens(rid, [tokens[-1]])
        return self.step([(rid, 1) for rid in order], flush)
