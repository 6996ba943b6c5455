"""The KV moves of transformers' continuous batching that the canary's records follow (a mixin of
:class:`canary.integrations.hf_session.Session`): CPU offload and restore, prefix block sharing's prefix hits and
in-place swaps, and forks' copied blocks (docs/integrations/transformers.md, "CPU offload", "Prefix block sharing"
and "Forks")."""
from __future__ import annotations

import time
from typing import Any, Hashable

import numpy as np


def runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """(first value, offset in ``indices``, length) of each stretch of consecutive values of ``indices``."""
    out: list[tuple[int, int, int]] = []
    for i, v in enumerate(indices):
        if out and v == out[-1][0] + out[-1][2]:
            first, at, n = out[-1]
            out[-1] = (first, at, n + 1)
        else:
            out.append((v, i, 1))
    return out


class KVMoves:
    """Session state it uses: ``canary``, ``cache``, ``processor``, ``offloading``, ``cpu_rows``, ``block_size``,
    ``live``, ``skipped``, ``sharing``, ``unrecorded``, ``stream``, ``cuda``, ``torch``, ``_fork_moves``, ``_admit``,
    ``accept_kept`` and the counters; ``_t`` / ``_m`` host time."""

    # -- CPU offload ------------------------------------------------------------------------------------------
    def _slots(self, blocks: list[int]) -> Any:
        """Every slot of ``blocks``, in order: ``[len(blocks) * block_size]`` int64 (host, or on the cache's device)."""
        bs = self.block_size
        slots = (np.asarray(blocks, dtype=np.int64)[:, None] * bs + np.arange(bs, dtype=np.int64)).ravel()
        if not self.cuda:
            return slots
        return self.torch.from_numpy(slots).to(self.cache.device)  # a pageable copy: done when this returns

    def on_offload(self, rids: Any) -> None:
        """After the engine's ``_offload_to_cpu`` queued its copies (``rids``: the requests it copied out, their
        blocks not freed yet): their slots' records gathered into :attr:`cpu_rows` at their CPU blocks' rows."""
        self.accept_kept()  # a kept batch's tokens before its requests move
        t = time.perf_counter()
        table = self.cache.group_cache_managers[0].block_table
        cpu_of = self.offloading._request_id_to_cpu_blocks
        for rid in rids:
            rec = self.live.get(rid)
            if rec is None:
                continue
            gpu, cpu = table.get(rid, []), cpu_of[rid]
            bs = self.block_size
            m = time.perf_counter()
            for first, at, n in runs(cpu):
                self.canary.gather_records(self._slots(gpu[at:at + n]), self.cpu_rows[first * bs:(first + n) * bs],
                                           stream=self.stream)
            self._m += time.perf_counter() - m
            rec.offloaded = 1
            self.offloaded_total += 1
        self._t += time.perf_counter() - t

    def before_restore(self, requests_in_batch: list) -> list:
        """Before the engine's ``restore_scheduled_requests`` (which forgets the CPU blocks): for each protected
        request it restores, (request, its CPU blocks, the blocks it restores them into)."""
        self.accept_kept()  # a kept batch's tokens before its requests move
        plan = []
        table = self.cache.group_cache_managers[0].block_table
        cpu_of, counts = self.offloading._request_id_to_cpu_blocks, self.offloading._request_id_to_group_block_counts
        for fs in requests_in_batch:
            st = fs.state
            if not st.is_cpu_offloaded:
                continue
            rec = self.live.get(st.request_id)
            if rec is None or rec.state is not st or rec.offloaded != 2:
                continue
            n = counts[st.request_id][0]
            plan.append((rec, list(cpu_of[st.request_id]), list(table.get(st.request_id, [])[:n])))
        return plan

    def on_restore(self, plan: list) -> None:
        """After the engine queued its copies back: each request's rows scattered into the slots of its new blocks."""
        t = time.perf_counter()
        bs = self.block_size
        for rec, cpu, gpu in plan:
            m = time.perf_counter()
            for first, at, n in runs(cpu):
                self.canary.scatter_records(self.cpu_rows[first * bs:(first + n) * bs], self._slots(gpu[at:at + n]),
                                            stream=self.stream)
            self._m += time.perf_counter() - m
            rec.offloaded = 0
            self.restored_total += 1
        self._t += time.perf_counter() - t

    # -- prefix block sharing ---------------------------------------------------------------------------------
    def _shared_prefix(self, rid: Hashable, state: Any, past: int) -> bool:
        """A new request whose first ``past`` tokens the engine found in shared blocks (a prefix hit): protected
        from here when those blocks' records are the canary's (none in :attr:`unrecorded`); the step verifies them
        against its own prompt."""
        if not self.sharing or state.generated_tokens or past >= len(state.initial_tokens):
            return False
        held = self.cache.group_cache_managers[0].block_table.get(rid, [])
        need = -(-past // self.block_size)
        return len(held) >= need and not self.unrecorded.intersection(held[:need])

    def on_complete(self, state: Any, before: list[int]) -> None:
        """After the engine marked a request's blocks complete (``before``: its block table until then), which
        swaps a block for an existing one with the same tokens: the request reads that one from now on. Its
        records are the canary's unless :attr:`unrecorded`; then the request's own records are moved there."""
        self.accept_kept()  # a kept batch's tokens before its requests move
        rid = state.request_id
        rec = self.live.get(rid)
        after = self.cache.group_cache_managers[0].block_table.get(rid, [])
        src, dst = [], []
        for i, (old, new) in enumerate(zip(before, after)):
            if old != new:
                self.swapped_blocks += 1
                if rec is not None and rec.state is state and new in self.unrecorded:
                    src.append(old)
                    dst.append(new)
                    self.unrecorded.discard(new)
        if src:
            self._move_blocks(src, dst)

    def _move_blocks(self, src: list[int], dst: list[int]) -> None:
        """The records of every slot of blocks ``src`` copied into the same offsets of blocks ``dst`` (on the
        compute stream, before the next verify)."""
        t = time.perf_counter()
        slots_src, slots_dst = self._slots(src), self._slots(dst)
        step = max(1, 1024 // self.block_size) * self.block_size  # move_records' 1024 slots a call
        for a in range(0, len(slots_src), step):
            self.canary.move_records(slots_src[a:a + step], slots_dst[a:a + step], stream=self.stream)
        self._m += time.perf_counter() - t
        self._t += time.perf_counter() - t

    # -- forks (num_return_sequences > 1) ---------------------------------------------------------------------
    def on_fork(self, parent: Hashable, children: list) -> None:
        """After the engine's ``fork_request`` gave each child of ``parent`` its block table (the parent's complete
        shareable blocks by reference, a fresh copy of the others) and before it copies their KV: each child of
        a protected parent admitted with its own row (its expected tokens the parent's, its first
        ``position_offset`` tokens already in those blocks), and the records of each block the child holds in
        place of the parent's queued for copying with the KV (:meth:`move_fork_records`). The pairs come from the
        two block tables, not from the engine's copy lists: KV copied into other blocks than the child's table
        names is then reported at the child's first read."""
        self.accept_kept()  # a kept batch's tokens before its requests move
        t = time.perf_counter()
        table = self.cache.group_cache_managers[0].block_table
        active = self.processor.scheduler.active_requests
        rec = self.live.get(parent)
        if rec is not None and (rec.offloaded or rec.state is not active.get(parent)):
            rec = None
        mine = table.get(parent, [])
        src, dst = self._fork_moves
        for child in children:
            state = active.get(child)
            if state is None:
                continue
            if rec is None:  # the parent's blocks hold no records of the canary's: the child runs unprotected
                self.skipped[child] = state
                self.unprotected_total += 1
                continue
            if self._admit(child, state, state.position_offset, forked=True) is None:
                continue
            self.forked_total += 1
            for old, new in zip(mine, table.get(child, [])):
                if old != new:
                    src.append(old)
                    dst.append(new)
        self._t += time.perf_counter() - t

    def move_fork_records(self) -> None:
        """The records queued by :meth:`on_fork` copied (after the engine's ``copy_cache``, on its stream)."""
        src, dst = self._fork_moves
        self._fork_moves = ([], [])
        self.copied_blocks += len(dst)
        self._move_blocks(src, dst)
