"""One generation session's canary over transformers' continuous batching (canary.integrations.transformers).

A session is one run of the engine's generation loop (``ContinuousBatchingManager._run_generation_loop``, its
background thread): every canary step call happens on that thread, so a session owns one
:class:`canary.CanaryManager`, built when the loop creates (or resets) its batch processor and closed when the
loop ends. Between sessions the engine frees every request (soft reset of the whole cache), so nothing the
canary knew carries over.

**The index the attention reads.** The canary group is bound over the engine's own per-step index, as paged
``sdpa`` attention reads it: a token-level page list (SPEC 3.8, ``page_size = 1``) whose ``kv_indptr`` is the
engine's ``cumulative_seqlens_k["full_attention"]`` (int32) and whose ``kv_indices`` is its flat
``read_index_storage[0]`` (int64: every request's past and new slots, in batch order), and the step's slots are
its ``write_index_storage[0]``, its tokens and positions its own int32 ``input_ids`` / ``position_ids`` (those
the model read, after async batching's on-device carry-over of the last sampled tokens). Nothing is mirrored and
nothing is cast: a bug in the engine's index construction is verified as attention sees it. Engine slot 0 is a
real slot (``padding_slot=-1``: the canary reserves none). With async batching the two IO pairs' arrays are
passed per step; otherwise the bound ones are read in place.

Per engine step (the hooks are in ``canary/integrations/hf_patches.py``):

- :meth:`Session.begin_step`, before the forward: the batch the engine just prepared (``requests_in_batch``: each
  request's state and query length; its past length is ``position_offset - query_length``, the engine having
  advanced it), requests seen for the first time admitted (their prompt is the expected-token row), each
  protected request's row (a small integer naming it: SPEC 3.8, rows keyed by request), past and query lengths
  staged, then ``before_forward`` (plan and verify) on the engine's compute stream. The batch is padded to a
  power of two rows with padding rows, so that the manager's captured calls (canary/manager/eager.py) are
  replayed while the batch grows and shrinks. Requests the canary cannot protect (no row left, longer than the
  expected-token pool, or first seen mid-sequence) stay in the batch as padding rows whose tokens the write skips
  (``padding_rows_carry_tokens=True``).
- :meth:`Session.end_step`, after the forward: ``after_kv_store`` over the engine's write index and tokens.
- :meth:`Session.on_update`, after the engine appended the sampled tokens to its request states: the tokens it
  kept, accepted as host ints (the engine zeroes its device output buffer before the next forward). With sync
  batching the batch is only kept there, and its tokens are accepted in the next ``end_step``, after
  ``after_kv_store``: the host work then runs while the GPU runs the next forward, not while it waits for the
  host (the next verify does not read them: :meth:`Session.accept_kept`). Every hook that ends or moves a
  request (``on_free``, offload, restore, prefix swaps, forks, the session's close) accepts a kept batch first.
- :meth:`Session.on_free`, when the engine frees a request's blocks (finished, cancelled, failed, soft reset):
  ``finish_request``, its row freed; not for a request just offloaded to the CPU pool (below).

**CPU offload** (``cpu_offload_space > 0``: the engine's ``OffloadingManager``). When the engine copies a
request's blocks out to its CPU pool (``_offload_to_cpu``: block ``b`` of the request to CPU block ``c``, on its
compute stream), :meth:`Session.on_offload` gathers the records of the request's slots (``b * block_size +
offset``) into a host rows buffer laid out as the CPU pool (CPU block ``c``'s rows are ``c * block_size`` ..
``(c + 1) * block_size - 1``), on the same stream after the engine's copy; the request keeps its canary row and its
expected tokens while it waits (the engine keeps its state object). When the engine restores it into the blocks
it just allocated (``restore_scheduled_requests``), :meth:`Session.on_restore` scatters the rows into the new
slots after the engine's copy back and before the step that reads them: the records move verbatim with the KV
(docs/integration.md 7b), so a byte changed in the CPU pool, or KV restored into other blocks than the block
table names, is reported at the next read, naming the request.

**Forks** (``num_return_sequences > 1``) and **prefix block sharing**: ``canary/integrations/hf_moves.py``
(:meth:`Session.on_fork`, :meth:`Session.on_complete`).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np

from canary import CanaryManager, KVGroup

from .hf_accept import Accepts, bucket
from .hf_moves import KVMoves
from .hf_ranks import distributed

STAGING_BUFFERS = 4  # pinned host buffers in rotation: async batching runs the host one step ahead of the GPU


def kv_fail(exc: type, message: str) -> Exception:
    return exc(f"kv-canary: {message}")


@dataclass
class Options:
    """What :func:`canary.integrations.transformers.enable` was given (docs/integrations/transformers.md)."""

    layers: str = "all"
    real_kv_mode: str = "all"
    verify_capacity: int | None = None
    max_requests: int | None = None
    max_seq_len: int | None = None
    backend: str = "auto"
    ring_capacity: int = 256
    # Tests only: run a CPU engine through the device path (pinned-style staging buffers and their device
    # copies, on CPU tensors), so that CI exercises its bookkeeping where no GPU is.
    device_path: bool = False
    # Tests only: False accepts a batch's tokens in update_batch (as async batching does), not behind the next
    # forward's launch.
    accept_behind_forward: bool = True


@dataclass
class _Live:
    state: Any  # the engine's RequestState (a soft reset makes a new one under the same id)
    row: int
    generated: int  # generated tokens already accepted
    offloaded: int = 0  # 1: copied to the engine's CPU pool, its blocks about to be freed; 2: waiting there


class Session(Accepts, KVMoves):
    """The canary of one generation loop over one ``ContinuousBatchProcessor`` (transformers 5.17)."""

    def __init__(self, processor: Any, opts: Options, deliver: Callable, torch: Any):
        cache = processor.cache
        self.torch, self.cache, self.processor = torch, cache, processor
        if cache.num_groups != 1 or cache.num_sliding_attention_groups:
            raise kv_fail(ValueError, f"cache: expected one full-attention layer group (sliding-window and hybrid "
                                      f"models are not protected yet), got {cache.num_groups} groups, "
                                      f"{cache.num_sliding_attention_groups} of them sliding")
        fast = int(getattr(cache, "max_blocks_per_request", 0) or 0)
        if fast > 0:
            raise kv_fail(ValueError, f"cache: expected no decode fast path, got max_blocks_per_request={fast} (flash "
                                      f"attention's block table, whose KV stores build no write index; pass "
                                      f"ContinuousBatchingConfig(max_blocks_per_request=0) or attention 'paged|sdpa')")
        self.io = processor.inputs_and_outputs
        self.is_async = hasattr(self.io, "io_pairs")
        dev_ios = [pair.device_io for pair in self.io.io_pairs] if self.is_async else [self.io]
        device = torch.device(cache.device)
        self.cuda = device.type == "cuda"
        self.stream = self.io.compute_stream if self.cuda else None
        self.staged = self.cuda or opts.device_path  # the step's rows and lengths copied to device buffers (GPU)
        max_batch = int(processor.cb_config.max_requests_per_batch)
        step_tokens = int(cache.max_batch_tokens)
        self.max_batch, self.step_tokens = max_batch, step_tokens
        cfg = cache.config
        positions = int(getattr(cfg, "max_position_embeddings", 0) or 0) or cache.num_pages
        cols = int(opts.max_seq_len or min(cache.num_pages, positions))
        self.cols = cols
        nb = cache.num_blocks
        rows = int(opts.max_requests or min(max(nb, 1), max(64, 2 * max_batch)))
        self.free_rows = deque(range(1, rows + 1))  # row 0 is the padding row (SPEC 3.2)
        # The engine's own index, per IO object: kv_indptr, kv_indices, and the write side's slots / ids / positions
        self._index = {id(d): (d.cumulative_seqlens_k["full_attention"], d.read_index_storage[0]) for d in dev_ios}
        self._token_views: dict[tuple[int, int], tuple] = {}
        first = dev_ios[0]
        layer_sources = self._sources(opts)
        num_slots = int(cache.key_cache[0].shape[0])  # the whole K / V tensors, the engine's trash blocks included
        capacity = int(opts.verify_capacity or min(rows * cols, 1 << 20))
        group = KVGroup(name="kv", kv_indptr=first.cumulative_seqlens_k["full_attention"],
                        kv_indices=first.read_index_storage[0], page_size=1, max_reqs=rows + 1, max_seq_len=cols,
                        padding_slot=-1, num_slots=num_slots, verify_capacity=capacity,
                        real_kv_sources=layer_sources[0] if layer_sources else (),
                        real_kv_mode=opts.real_kv_mode if layer_sources else "none",
                        padding_rows_carry_tokens=True,
                        layer_sources=layer_sources if opts.layers == "all" and len(layer_sources) > 1 else (),
                        layer_real_kv_mode=opts.real_kv_mode if layer_sources else "all")
        self.canary = CanaryManager(
            group, max_batch_size=max_batch, device=(device.index or 0) if self.cuda else "cpu",
            library="torch" if self.cuda else None, backend=opts.backend, on_violation=deliver,
            ring_capacity=opts.ring_capacity, max_step_tokens=step_tokens,
            **distributed(processor, kv_fail))  # tensor parallelism: this rank's labels and its group (hf_ranks.py)
        self.canary.warmup()
        self.live: dict[Hashable, _Live] = {}
        self.skipped: dict[Hashable, Any] = {}  # request -> the state the canary does not protect
        self.protected_total = self.unprotected_total = 0
        self.block_size = int(cache.block_size)
        self.offloading = processor.offloading_manager
        cpu_blocks = int(getattr(self.offloading, "_num_cpu_blocks", 0) or 0)
        # The records of the engine's CPU pool, CPU block c at rows [c * block_size, (c + 1) * block_size): pinned
        # host memory on a GPU (the mover's kernels write it through unified addressing)
        self.cpu_rows = (self.canary.allocate_record_rows(cpu_blocks * self.block_size, pinned=True)
                         if cpu_blocks else None)
        self.offloaded_total = self.restored_total = 0
        self.sharing = bool(cache.use_prefix_sharing)
        # Blocks whose records may not match their KV: kept (hashed) from before this session's canary existed, or
        # held by a request the canary does not protect (its writes skipped). A prefix hit on one runs
        # unprotected; a protected request's block swapped in place for one moves its records there.
        self.unrecorded: set[int] = set(cache._block_manager._hash_to_id.values()) if self.sharing else set()
        self.prefix_hits = self.swapped_blocks = 0
        self.forked_total = self.copied_blocks = 0
        self._fork_moves: tuple[list[int], list[int]] = ([], [])  # (parent blocks, child blocks) to copy records of
        self.host_s: list[float] = []  # host seconds the canary added, per step (bounded)
        self.glue_s: list[float] = []  # of which outside the CanaryManager's calls (this glue's own)
        self.decode_steps: list[bool] = []  # per step: one token a row (a decode step)
        # of host_s, what ran with no forward of the engine's queued behind it: begin_step (ahead of the forward's
        # launch) and on_update (after the engine synced on it); end_step runs while the GPU runs the forward
        self.exposed_s: list[float] = []
        self._t = self._m = self._x = 0.0
        # Sync batching: a batch's accepted tokens wait for the next end_step (on_update, accept_kept). Async
        # batching runs the host a step ahead of the GPU: there the host is the critical path, and nothing waits.
        self.defer_accept = not self.is_async and opts.accept_behind_forward
        self._kept: list | None = None
        self._decode = False
        self._setup_staging(max_batch)
        if self.cuda:
            # Everything above was allocated and filled on this thread's current stream; the steps run on the
            # engine's compute stream, a non-blocking one: once per session, let the fills land first.
            torch.cuda.synchronize(device)
        self.closed = False

    # -- binding ----------------------------------------------------------------------------------------------
    def _sources(self, opts: Options) -> list:
        """Per layer of the group: [(K, 1, bytes per token), (V, 1, bytes per token)] (token-major, page_size 1:
        slot s is row s of ``[(num_blocks + 2) * block_size, heads, head_dim]``); [] when the KV is not hashable."""
        if opts.real_kv_mode == "none":
            return []
        keys, values = self.cache.key_cache, self.cache.value_cache
        per_token = keys[0][0].numel() * keys[0].element_size()
        if per_token % 16:
            raise kv_fail(ValueError, f"cache: expected K / V bytes per token a multiple of 16 to hash the real KV, "
                                      f"got {per_token} (pass real_kv_mode='none')")
        return [[(k, 1, per_token), (v, 1, per_token)] for k, v in zip(keys, values)]

    def _setup_staging(self, max_batch: int) -> None:
        n = 3 * max_batch
        self._recording = None
        if not self.staged:
            self._host = np.zeros(n, dtype=np.int64)
            return
        torch, cuda = self.torch, self.cuda
        dev = torch.device(self.cache.device)
        self._pinned = [torch.zeros(n, dtype=torch.int64, pin_memory=cuda) for _ in range(STAGING_BUFFERS)]
        self._pinned_np = [p.numpy() for p in self._pinned]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(STAGING_BUFFERS)]
        self._used = [False] * STAGING_BUFFERS
        self._turn = 0
        self._dev = torch.zeros(n, dtype=torch.int64, device=dev)
        self._recording = None
        self._views: dict[int, tuple] = {}
        self._pairs: dict[tuple[int, int], tuple] = {}  # (pinned buffer, rows) -> (device view, pinned view)

    def _ios(self) -> tuple[Any, Any]:
        """(host side, device side) of the engine's current inputs: one object unless async batching."""
        if self.is_async:
            pair = self.io.io_pairs[self.io.current_pair]
            return pair.host_io, pair.device_io
        return self.io, self.io

    # -- requests ---------------------------------------------------------------------------------------------
    def _admit(self, rid: Hashable, state: Any, past: int, forked: bool = False) -> _Live | None:
        """Give ``rid`` a row and its expected tokens (``forked``: a fork child, whose first ``past`` tokens are its
        parent's, in blocks whose records followed them: :meth:`on_fork`); ``None`` when it runs unprotected."""
        if rid in self.live:  # a new state under a known id: the old one ended without its blocks being freed
            self.accept_kept()  # its last tokens (and the kept batch's others) first; that may drop it
        old = self.live.pop(rid, None)
        if old is not None:
            self.canary.finish_request(rid)
            self.free_rows.append(old.row)
        limit = state.max_new_tokens
        total = len(state.initial_tokens) + (0 if limit is None else int(limit))
        mid = past != 0 and not forked and not self._shared_prefix(rid, state, past)
        if mid or total > self.cols or not self.free_rows:
            # first seen mid-sequence, too long, or no row left: it runs unprotected
            self.skipped[rid] = state
            self.unprotected_total += 1
            return None
        gen = state.generated_tokens  # a fork child's copy of its parent's (none: the engine forks during prefill)
        self.canary.add_request(rid, list(state.initial_tokens) + list(gen) if forked and gen else state.initial_tokens)
        self.prefix_hits += past != 0 and not forked
        rec = self.live[rid] = _Live(state, self.free_rows.popleft(), len(gen))
        self.skipped.pop(rid, None)
        self.protected_total += 1
        return rec

    def _drop(self, rid: Hashable) -> None:
        self.accept_kept()  # its last tokens first (none kept inside _accept, which calls this)
        rec = self.live.pop(rid, None)
        if rec is not None:
            self.canary.finish_request(rid)
            self.free_rows.append(rec.row)
            self.skipped[rid] = rec.state
            self.unprotected_total += 1

    def on_free(self, rid: Hashable) -> None:
        self.accept_kept()  # before the request ends (in the engine's order there is none kept here)
        t = time.perf_counter()
        rec = self.live.get(rid)
        if rec is not None and rec.offloaded == 1:  # the free that follows its offload: it waits in the CPU pool
            rec.offloaded = 2
            self._t += time.perf_counter() - t
            return
        self.skipped.pop(rid, None)
        rec = self.live.pop(rid, None)
        if rec is not None:
            self.canary.finish_request(rid)
            self.free_rows.append(rec.row)
        self._t += time.perf_counter() - t

    # -- steps ------------------------------------------------------------------------------------------------
    def begin_step(self) -> tuple | None:
        """Plan and verify the batch the engine prepared; ``None`` when no row of it is protected (no step)."""
        if self._fork_moves[0]:  # a fork outside update_batch (not in 5.17): its records before this verify
            self.move_fork_records()
        t = time.perf_counter()
        host_io, dev_io = self._ios()
        rows, pres, exts, ids = [], [], [], []
        live, skipped, cols = self.live, self.skipped, self.cols
        protected = False
        for fs in host_io.requests_in_batch:
            st = fs.state
            q = fs.query_length
            past = st.position_offset - q
            rid = st.request_id
            rec = live.get(rid)
            if rec is None or rec.state is not st:
                rec = None if skipped.get(rid) is st else self._admit(rid, st, past)
            if rec is not None and past + q > cols:  # past the expected-token pool: unprotected from here on
                self._drop(rid)
                rec = None
            if rec is None:
                if self.sharing:  # its writes are skipped: its blocks hold no records of the canary's
                    self.unrecorded.update(self.cache.group_cache_managers[0].block_table.get(rid, ()))
                rows.append(0)
                ids.append(None)
            else:
                rows.append(rec.row)
                ids.append(rid)
                protected = True
            pres.append(past)
            exts.append(q)
        if not protected:
            self._t += time.perf_counter() - t
            self._x += time.perf_counter() - t
            return None
        n = len(rows)
        tokens = sum(exts)
        self._decode = tokens == n
        if self.staged:
            b = bucket(n, self.max_batch)
            ids += [None] * (b - n)
            args = self._stage(rows, pres, exts, n, b)
            # a CPU manager (tests' device path) checks the token count exactly (host lengths): no padding there
            size = bucket(tokens, self.step_tokens) if self.cuda else tokens
        else:
            h = self._host
            h[:n], h[n:2 * n], h[2 * n:3 * n] = rows, pres, exts
            args = (h[:n], h[n:2 * n], h[2 * n:3 * n])
            size = tokens
        index = {}
        if self.is_async:
            indptr, indices = self._index[id(dev_io)]
            index = dict(kv_indptr=indptr, kv_indices=indices)
        m = time.perf_counter()
        self.canary.before_forward(req_pool_indices=args[0], prefix_lens=args[1], extend_seq_lens=args[2],
                                   request_ids=ids, stream=self.stream, **index)
        self._m += time.perf_counter() - m
        ev = self._recording
        if ev is not None:
            # The staging copy ran on the current stream, which before_forward ordered before the compute stream:
            # an event on the compute stream past the plan marks the pinned buffer free (an explicit stream, so that
            # torch does not look its current stream up)
            ev.record(self.stream)
            self._recording = None
        self._t += time.perf_counter() - t
        self._x += time.perf_counter() - t
        return dev_io, size

    def end_step(self, step: tuple) -> None:
        """Write the records of the step's tokens (after the forward stored their KV)."""
        t = time.perf_counter()
        dev_io, size = step
        key = (id(dev_io), size)
        views = self._token_views.get(key)
        if views is None:  # the engine's static buffers, sliced once per shape: the same objects every step
            views = self._token_views[key] = (dev_io.write_index_storage[0, :size], dev_io.input_ids[:size],
                                              dev_io.position_ids[:size])
        m = time.perf_counter()
        self.canary.after_kv_store(out_cache_loc=views[0], input_ids=views[1], positions=views[2],
                                   stream=self.stream)
        self._m += time.perf_counter() - m
        self._t += time.perf_counter() - t
        self.accept_kept(fed=True)  # the last update's tokens, the inputs of this step, while the GPU runs its forward
        self._close_step()

    def abort_step(self, step: tuple) -> None:
        """The forward raised: close the canary's step anyway (the engine fails the batch's requests, which frees
        their blocks; records written for them are rewritten by the next owners before anything reads them)."""
        try:
            self.end_step(step)
        except Exception:  # noqa: BLE001 - the engine's exception is the one to raise
            pass

    def _close_step(self) -> None:
        self.host_s.append(self._t)
        self.glue_s.append(self._t - self._m)
        self.exposed_s.append(self._x)
        self.decode_steps.append(self._decode)
        if len(self.host_s) > 65536:
            del self.host_s[:32768], self.glue_s[:32768], self.exposed_s[:32768], self.decode_steps[:32768]
        self._t = self._m = self._x = 0.0

    def _stage(self, rows: list, pres: list, exts: list, n: int, b: int) -> tuple:
        """One copy of [rows | past | query] (``b`` rows each, padding rows zero) to the device, on the compute
        stream; the device views of this size (kept: the same objects each step let the manager replay its
        captured calls)."""
        i = self._turn
        if self._used[i] and self._events[i] is not None:
            self._events[i].synchronize()  # its copy ran long ago unless the host is STAGING_BUFFERS steps ahead
        h = self._pinned_np[i]
        h[:n], h[b:b + n], h[2 * b:2 * b + n] = rows, pres, exts
        if b > n:
            h[n:b] = 0
            h[b + n:2 * b] = 0
            h[2 * b + n:3 * b] = 0
        # On this thread's current stream, not the compute stream: before_forward(stream=compute stream) orders
        # the current stream before it once per call (the manager's explicit-stream handshake), which orders this
        # copy too, and a stream context here would cost more host time than the copy
        pair = self._pairs.get((i, b))
        if pair is None:  # the same two views each step of this size: torch's slicing costs microseconds a call
            pair = self._pairs[(i, b)] = (self._dev[:3 * b], self._pinned[i][:3 * b])
        pair[0].copy_(pair[1], non_blocking=self.cuda)
        self._recording = self._events[i]  # recorded on the compute stream after before_forward (begin_step)
        self._used[i] = True
        self._turn = (i + 1) % STAGING_BUFFERS
        views = self._views.get(b)
        if views is None:
            d = self._dev
            views = self._views[b] = (d[:b], d[b:2 * b], d[2 * b:3 * b])
        return views

    # -- end --------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out = self.canary.stats()
        out["protected_requests"] = self.protected_total
        out["unprotected_requests"] = self.unprotected_total
        out["offloaded_requests"] = self.offloaded_total
        out["restored_requests"] = self.restored_total
        out["prefix_hits"] = self.prefix_hits
        out["swapped_blocks"] = self.swapped_blocks
        out["forked_requests"] = self.forked_total
        out["copied_blocks"] = self.copied_blocks
        return out

    def close(self) -> dict[str, Any]:
        """Deliver the last reports (a sync), free the manager; the final stats."""
        if self.closed:
            return self.final
        self.closed = True
        try:
            try:
                self.accept_kept()  # the last update's tokens: the manager's close reads every report
            finally:
                self.canary.close()
        finally:
            self.live.clear()
            self.skipped.clear()
            self.final = self.stats()
        return self.final
