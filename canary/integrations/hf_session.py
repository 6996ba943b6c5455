"""One generation session's canary over transformers' continuous batching (canary.integrations.transformers).

A session is one run of the engine's generation loop (``ContinuousBatchingManager._run_generation_loop``, its
background thread): every canary step call happens on that thread, so a session owns one
:class:`canary.CanaryManager`, built when the loop creates (or resets) its batch processor and closed when the
loop ends. Between sessions the engine frees every request (soft reset of the whole cache), so nothing the
canary knew carries over.

Per engine step (the hooks are in ``canary/integrations/hf_patches.py``):

- :meth:`Session.begin_step`, before the forward: the batch the engine just prepared
  (``requests_in_batch``: each request's state, its query length; its past length is ``position_offset -
  query_length``, the engine having advanced it), requests seen for the first time admitted (their prompt is
  the expected-token row), the slot table synced with the engine's block lists, the step's rows, prefix and
  extend lengths and slots staged, then ``before_forward`` (plan and verify) on the engine's compute stream.
  Requests the canary cannot protect (no row left, longer than the table, or first seen mid-sequence) stay in
  the batch as padding rows whose tokens the write skips (``padding_rows_carry_tokens=True``).
- :meth:`Session.end_step`, after the forward: the engine's own int32 ``input_ids`` / ``position_ids`` (those
  the model read, after async batching's on-device carry-over of the last sampled tokens) cast into int64
  buffers, then ``after_kv_store``.
- :meth:`Session.on_update`, after the engine appended the sampled tokens to its request states: the tokens it
  kept, accepted as host ints (the engine zeroes its device output buffer before the next forward, so the
  manager's zero-copy device token path would read zeros).
- :meth:`Session.on_free`, when the engine frees a request's blocks (finished, cancelled, failed, soft reset):
  ``finish_request``, its table row freed.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np

from canary import CanaryManager, KVGroup

from .hf_slots import SlotTable, release_padding_block, reserve_padding_block

STAGING_BUFFERS = 4  # pinned host buffers in rotation: async batching runs the host one step ahead of the GPU
VIEW_CACHE = 512  # (batch rows, tokens) shapes whose device views are kept: the manager's eager graphs key on them


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
    # Tests only: run a CPU engine through the device path (staging buffers, a device copy of the mirror, cast
    # copies), on CPU tensors, so that CI exercises its bookkeeping where no GPU is.
    device_path: bool = False


@dataclass
class _Live:
    state: Any  # the engine's RequestState (a soft reset makes a new one under the same id)
    row: int
    generated: int  # generated tokens already accepted


class Session:
    """The canary of one generation loop over one ``ContinuousBatchProcessor`` (transformers 5.17)."""

    def __init__(self, processor: Any, opts: Options, deliver: Callable, torch: Any):
        cache = processor.cache
        self.torch, self.cache, self.processor = torch, cache, processor
        if cache.num_groups != 1 or cache.num_sliding_attention_groups:
            raise kv_fail(ValueError, f"cache: expected one full-attention layer group (sliding-window and hybrid "
                                      f"models are not protected yet), got {cache.num_groups} groups, "
                                      f"{cache.num_sliding_attention_groups} of them sliding")
        if cache.use_prefix_sharing:
            raise kv_fail(ValueError, "cache: expected prefix block sharing off, got use_prefix_sharing=True "
                                      "(pass ContinuousBatchingConfig(allow_block_sharing=False))")
        if getattr(processor.offloading_manager, "_num_cpu_blocks", 0):
            raise kv_fail(ValueError, "offloading: expected no CPU offload pool, got one (pass "
                                      "ContinuousBatchingConfig(cpu_offload_space=0))")
        self.cm = cache.group_cache_managers[0]
        self.bm = cache._block_manager
        self.io = processor.inputs_and_outputs
        self.is_async = hasattr(self.io, "io_pairs")
        device = torch.device(cache.device)
        self.cuda = device.type == "cuda"
        self.stream = self.io.compute_stream if self.cuda else None
        self.staged = self.cuda or opts.device_path  # the step's arrays copied to device buffers (GPU)
        bs, nb = cache.block_size, cache.num_blocks
        max_batch = int(processor.cb_config.max_requests_per_batch)
        step_tokens = int(cache.max_batch_tokens)
        cfg = cache.config
        positions = int(getattr(cfg, "max_position_embeddings", 0) or 0) or cache.num_pages
        cols = int(opts.max_seq_len or min(cache.num_pages, positions))
        cols = max(cols, step_tokens)  # an unprotected row carries up to a whole step's tokens (SPEC 3.4)
        rows = int(opts.max_requests or min(max(nb - 1, 1), max(64, 2 * max_batch)))
        if not reserve_padding_block(self.bm):
            raise kv_fail(RuntimeError, "cache: expected engine block 0 free at the start of a generation session "
                                        "(the canary reserves it as its padding slot), got it held by a request")
        try:
            self.table = SlotTable(rows + 1, cols, bs, device=device if self.staged else None, torch=torch)
            layer_sources = self._sources(opts)
            num_slots = (nb + 2) * bs  # the whole K / V tensors, the engine's two trash blocks included
            capacity = int(opts.verify_capacity or min(rows * cols, 1 << 20))
            group = KVGroup(name="kv", req_to_token=self.table.req_to_token, num_slots=num_slots,
                            verify_capacity=capacity,
                            real_kv_sources=layer_sources[0] if layer_sources else (),
                            real_kv_mode=opts.real_kv_mode if layer_sources else "none",
                            padding_rows_carry_tokens=True,
                            layer_sources=layer_sources if opts.layers == "all" and len(layer_sources) > 1 else (),
                            layer_real_kv_mode=opts.real_kv_mode if layer_sources else "all")
            self.canary = CanaryManager(
                group, max_batch_size=max_batch, device=(device.index or 0) if self.cuda else "cpu",
                library="torch" if self.cuda else None, backend=opts.backend, on_violation=deliver,
                ring_capacity=opts.ring_capacity, max_step_tokens=step_tokens)
            self.canary.warmup()
        except BaseException:
            release_padding_block(self.bm)
            raise
        self.live: dict[Hashable, _Live] = {}
        self.skipped: dict[Hashable, Any] = {}  # request -> the state the canary does not protect
        self.protected_total = self.unprotected_total = 0
        self.host_s: list[float] = []  # host seconds the canary added, per step (bounded)
        self.glue_s: list[float] = []  # of which outside the CanaryManager's calls (this glue's own)
        self._t = self._m = 0.0
        self._setup_staging(max_batch, step_tokens)
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

    def _setup_staging(self, max_batch: int, step_tokens: int) -> None:
        n = 3 * max_batch + step_tokens
        if not self.staged:
            self._host = np.empty(n, dtype=np.int64)
            return
        torch, cuda = self.torch, self.cuda
        dev = self.table.device
        self._pinned = [torch.empty(n, dtype=torch.int64, pin_memory=cuda) for _ in range(STAGING_BUFFERS)]
        self._pinned_np = [p.numpy() for p in self._pinned]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(STAGING_BUFFERS)]
        self._used = [False] * STAGING_BUFFERS
        self._turn = 0
        self._dev = torch.empty(n, dtype=torch.int64, device=dev)
        self._ids = torch.empty(step_tokens, dtype=torch.int64, device=dev)
        self._pos = torch.empty(step_tokens, dtype=torch.int64, device=dev)
        self._views: dict[tuple[int, int], tuple] = {}

    def _upload(self, host: np.ndarray) -> Any:
        # Small and rare (new blocks mirrored): a pinned copy from torch's caching host allocator, which keeps
        # the block until the copy ran, so the host never waits.
        t = self.torch.from_numpy(host)
        if not self.cuda:
            return t.clone()
        return t.pin_memory().to(self.table.device, non_blocking=True)

    def _on_stream(self) -> Any:
        return self.torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _ios(self) -> tuple[Any, Any]:
        """(host side, device side) of the engine's current inputs: one object unless async batching."""
        if self.is_async:
            pair = self.io.io_pairs[self.io.current_pair]
            return pair.host_io, pair.device_io
        return self.io, self.io

    # -- requests ---------------------------------------------------------------------------------------------
    def _admit(self, rid: Hashable, state: Any, past: int) -> _Live | None:
        old = self.live.pop(rid, None)
        if old is not None:  # a new state under a known id: the old one ended without its blocks being freed
            self.canary.finish_request(rid)
            self.table.release(rid)
        limit = state.max_new_tokens
        total = len(state.initial_tokens) + (0 if limit is None else int(limit))
        row = None
        if past == 0 and total <= self.table.cols:
            row = self.table.admit(rid)
        if row is None:  # first seen mid-sequence, too long, or no row left: it runs unprotected
            self.skipped[rid] = state
            self.unprotected_total += 1
            return None
        self.canary.add_request(rid, state.initial_tokens)
        rec = self.live[rid] = _Live(state, row, len(state.generated_tokens))
        self.skipped.pop(rid, None)
        self.protected_total += 1
        return rec

    def _drop(self, rid: Hashable) -> None:
        rec = self.live.pop(rid, None)
        if rec is not None:
            self.canary.finish_request(rid)
            self.table.release(rid)
            self.skipped[rid] = rec.state
            self.unprotected_total += 1

    def on_free(self, rid: Hashable) -> None:
        t = time.perf_counter()
        self.skipped.pop(rid, None)
        rec = self.live.pop(rid, None)
        if rec is not None:
            self.canary.finish_request(rid)
            self.table.release(rid)
        self._t += time.perf_counter() - t

    def on_update(self) -> None:
        """Accept the tokens the engine appended to the states of the batch it just updated."""
        t = time.perf_counter()
        host_io, _ = self._ios()
        rids, toks, more = [], [], []
        room = self.table.cols + 1  # the expected-token pool's columns
        for fs in host_io.requests_in_batch:
            st = fs.state
            rid = st.request_id
            rec = self.live.get(rid)
            if rec is None or rec.state is not st:
                continue
            gen = st.generated_tokens
            k = len(gen) - rec.generated
            if k and len(st.initial_tokens) + len(gen) > room:  # no max_new_tokens, past the table: unprotected
                self._drop(rid)
                continue
            if k == 1:
                rids.append(rid)
                toks.append(gen[-1])
            elif k > 1:
                more.append((rid, gen[rec.generated:]))
            rec.generated = len(gen)
        m = time.perf_counter()
        if rids:
            self.canary.accept_tokens_batch(rids, toks)
        for rid, tokens in more:
            self.canary.accept_tokens(rid, tokens)
        self._m += time.perf_counter() - m
        self._t += time.perf_counter() - t

    # -- steps ------------------------------------------------------------------------------------------------
    def begin_step(self) -> tuple | None:
        """Plan and verify the batch the engine prepared; ``None`` when no row of it is protected (no step)."""
        t = time.perf_counter()
        host_io, dev_io = self._ios()
        fss = host_io.requests_in_batch
        rows, pres, exts, ids = [], [], [], []
        blocks = self.cm.block_table
        live, skipped, table, cols = self.live, self.skipped, self.table, self.table.cols
        mirrored = table.mirrored
        for fs in fss:
            st = fs.state
            q = fs.query_length
            past = st.position_offset - q
            rid = st.request_id
            rec = live.get(rid)
            if rec is None or rec.state is not st:
                rec = None if skipped.get(rid) is st else self._admit(rid, st, past)
            if rec is not None:
                if past + q > cols:  # longer than the table (no max_new_tokens): unprotected from here on
                    self._drop(rid)
                    rec = None
                else:
                    b = blocks[rid]
                    if b != mirrored[rid]:
                        table.sync(rid, rec.row, b)
            rows.append(0 if rec is None else rec.row)
            ids.append(None if rec is None else rid)
            pres.append(past)
            exts.append(q)
        if not any(rows):
            self._t += time.perf_counter() - t
            return None
        n = len(rows)
        tokens = sum(exts)
        h = self._next_host() if self.staged else self._host
        h[:n], h[n:2 * n], h[2 * n:3 * n] = rows, pres, exts
        rpi, pre, ext, loc = h[:n], h[n:2 * n], h[2 * n:3 * n], h[3 * n:3 * n + tokens]
        if tokens == n:  # decode: one token a row, at its past length
            table.gather(rpi, pre, loc)
        else:
            starts = np.cumsum(ext) - ext
            table.gather(np.repeat(rpi, ext), np.arange(tokens) + np.repeat(pre - starts, ext), loc)
        args = self._stage(n, tokens) if self.staged else (rpi, pre, ext, loc)
        m = time.perf_counter()
        self.canary.before_forward(req_pool_indices=args[0], prefix_lens=args[1], extend_seq_lens=args[2],
                                   request_ids=ids, stream=self.stream)
        self._m += time.perf_counter() - m
        self._t += time.perf_counter() - t
        return args, dev_io, tokens

    def end_step(self, step: tuple) -> None:
        """Write the records of the step's tokens (after the forward stored their KV)."""
        t = time.perf_counter()
        args, dev_io, n = step
        if self.staged:
            ids, pos = args[4], args[5]
            with self._on_stream():
                ids.copy_(dev_io.input_ids[:n])
                pos.copy_(dev_io.position_ids[:n])
        else:
            ids = dev_io.input_ids[:n].numpy().astype(np.int64)
            pos = dev_io.position_ids[:n].numpy().astype(np.int64)
        m = time.perf_counter()
        self.canary.after_kv_store(out_cache_loc=args[3], input_ids=ids, positions=pos, stream=self.stream)
        self._m += time.perf_counter() - m
        self._t += time.perf_counter() - t
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
        if len(self.host_s) > 65536:
            del self.host_s[:32768], self.glue_s[:32768]
        self._t = self._m = 0.0

    def _next_host(self) -> np.ndarray:
        i = self._turn
        if self._used[i] and self._events[i] is not None:
            self._events[i].synchronize()  # its copy ran long ago unless the host is STAGING_BUFFERS steps ahead
        return self._pinned_np[i]

    def _stage(self, n: int, tokens: int) -> tuple:
        """One copy of [rows | prefix | extend | slots] to the device, on the compute stream; the device views
        of this shape (kept: the same objects each step let the manager replay its captured calls)."""
        i, size = self._turn, 3 * n + tokens
        with self._on_stream():
            self.table.flush(self._upload)
            self._dev[:size].copy_(self._pinned[i][:size], non_blocking=self.cuda)
            if self._events[i] is not None:
                self._events[i].record(self.stream)
        self._used[i] = True
        self._turn = (i + 1) % STAGING_BUFFERS
        views = self._views.get((n, tokens))
        if views is None:
            if len(self._views) >= VIEW_CACHE:
                self._views.clear()
            d = self._dev
            views = self._views[(n, tokens)] = (d[:n], d[n:2 * n], d[2 * n:3 * n], d[3 * n:size],
                                                self._ids[:tokens], self._pos[:tokens])
        return views

    # -- end --------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out = self.canary.stats()
        out["protected_requests"] = self.protected_total
        out["unprotected_requests"] = self.unprotected_total
        return out

    def close(self) -> dict[str, Any]:
        """Deliver the last reports (a sync), free the manager, give block 0 back; the final stats."""
        if self.closed:
            return self.final
        self.closed = True
        try:
            self.canary.close()
        finally:
            release_padding_block(self.bm)
            self.live.clear()
            self.skipped.clear()
            self.final = self.stats()
        return self.final
