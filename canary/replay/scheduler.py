"""A continuous-batching scheduler simulator: real request sizes in, canary planner inputs out.

It replays a trace (one row per request: prompt and output token counts, in arrival order) the way a
serving engine runs it, so that every step hands the planner real-shaped inputs:

- Admission is first come, first served: the next request joins while the batch has a free place and the
  KV pool can hold the request's whole sequence. Pages are reserved at admission (like SGLang's
  conservative mode) so that a running request never has to be retracted.
- A request prefills its prompt in chunks (``chunk_size`` tokens per step; an optional ``token_budget``
  caps the tokens of one step, decodes first), then decodes one token per step. The last prefill chunk
  yields the first output token and each decode step writes the KV of the previous one, so the cache of a
  request ends at ``context + generated - 1`` tokens, when it leaves.
- KV slots come from a paged pool (``slot = page * page_size + offset``) through a LIFO free list that
  starts as a seeded permutation, so slots are scattered and freed pages are reused soon, as in a busy
  engine. Page 0 is reserved: slot 0 (the padding slot) is never handed out.
- ``req_to_token`` has ``max_batch_size + 1`` rows; row 0 is the padding row, so request rows are reused.
  Each step writes the slots of the step's new tokens into it *before* the step is yielded, as an engine
  does before it builds the forward batch. Rows of finished requests keep their stale slots.
- Sliding-window mode (``swa_window = W > 0``): every full page also gets a page of a separate SWA pool,
  and ``full_to_swa_index_mapping`` (int64, one entry per full slot) maps each full slot to its SWA slot.
  As in SGLang's SWA allocator, SWA pages that fall wholly out of the window (positions ``< prefix - W``)
  are freed after each step and their LUT entries reset to 0, so the token just before a window may map to
  the padding slot. The SWA pool is sized for the worst case of a full batch, capped at the full pool.
- Optional host tier (``offload_tier = T > 0`` tokens): a running decoding request may be *preempted*: its KV and
  records go to the tier (the scheduler's ``on_offload`` callback, before anything is freed), its pages (under
  the other free pages: handed out last) and reservation go back to the pool and its ``req_to_token`` row is
  released. The rule, deterministic so that the bundled traces exercise it: a preemption happens when the tier
  is empty and either the head of the queue cannot be admitted for want of pages (pool pressure; the victim's
  release must make room for it, and the head is then admitted at once) or the step's index is a positive
  multiple of ``OFFLOAD_EVERY``. The victim is, among the running requests preempted the fewest times so far,
  the latest arrival that has finished its prompt, has at least ``OFFLOAD_DWELL + 2`` tokens left to write and
  whose prefix fits in the tier. It is restored ``OFFLOAD_DWELL`` or more steps later, at the first admission
  where the pool can reserve its pages again and the batch has a place, before any new admission (no new
  request overtakes it): new pages and a new row, ``req_to_token`` rewritten for its prefix, its place in the
  batch by arrival again; then the ``on_restore`` callback moves the KV and records back, and it decodes on. At
  most one request is in the tier.
- Optional CUDA-graph padding: the batch is padded to the smallest bucket ``>= bs``; padding rows have
  ``req_pool_indices = 0`` and random garbage lens, which the planner must never trust.
"""
from __future__ import annotations

import csv
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

OFFLOAD_EVERY = 8  # a preemption is due at every step index that is a positive multiple of this (with a tier)
OFFLOAD_DWELL = 2  # the fewest steps a preempted request stays in the tier (its freed pages go to others first)
BUNDLED_TRACES = {"conv": "AzureLLMInferenceTrace_conv.csv", "code": "AzureLLMInferenceTrace_code.csv"}


@dataclass(frozen=True)
class Trace:
    name: str
    context_tokens: np.ndarray  # [n] int64, prompt length of each request
    generated_tokens: np.ndarray  # [n] int64, output length of each request

    def __len__(self) -> int:
        return int(self.context_tokens.shape[0])


def load_trace(trace: str | Path = "conv", max_requests: int = 0) -> Trace:
    """Read a trace CSV with columns ``TIMESTAMP, ContextTokens, GeneratedTokens``, sorted by arrival.

    ``trace``: ``"conv"`` / ``"code"`` (the bundled Azure 2023 traces, also by file name) or a path.
    ``max_requests``: keep the first N arrivals (0 = all). Raises ``ValueError`` on a malformed file.
    """
    name = str(trace)
    bundled = {**BUNDLED_TRACES, **{v: v for v in BUNDLED_TRACES.values()}}
    source = resources.files("canary.data").joinpath(bundled[name]) if name in bundled else Path(trace)
    # Each row keeps its line in the file (1 = the header): the one way a message names a row, whatever the
    # arrival order the rows are sorted into.
    try:
        with source.open("r", newline="") as f:
            reader = csv.reader(f)
            rows = [(reader.line_num, r) for r in reader]
    except csv.Error as exc:  # a NUL byte, a field over csv's size limit
        raise ValueError(f"kv-canary: trace {name}: expected a CSV text file, got {exc} (line {reader.line_num})"
                         ) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"kv-canary: trace {name}: expected a UTF-8 CSV text file, got undecodable bytes "
                         f"({exc.reason} at byte {exc.start})") from None
    if not rows:
        raise ValueError(f"kv-canary: trace {name}: expected a header row, got an empty file")
    header = [h.strip() for h in rows[0][1]]
    try:
        cols = [header.index(c) for c in ("TIMESTAMP", "ContextTokens", "GeneratedTokens")]
    except ValueError:
        raise ValueError(
            f"kv-canary: trace {name}: expected columns TIMESTAMP, ContextTokens, GeneratedTokens, got {header}"
        ) from None
    body = [(line, r) for line, r in rows[1:] if r]
    if not body:
        raise ValueError(f"kv-canary: trace {name}: expected at least one request row after the header, got none")
    stamps = []
    sizes = np.zeros((len(body), 2), dtype=np.int64)
    lines = np.array([line for line, _ in body], dtype=np.int64)
    for i, (line, r) in enumerate(body):
        try:
            stamps.append(r[cols[0]])
            sizes[i] = int(r[cols[1]]), int(r[cols[2]])
        except (IndexError, ValueError, OverflowError):
            raise ValueError(f"kv-canary: trace {name}: expected integer ContextTokens and GeneratedTokens in every "
                             f"row, got {r} (line {line})") from None
    # ISO timestamps sort as text; a stable sort keeps file order for ties.
    order = np.argsort(np.array(stamps), kind="stable")
    sizes, lines = sizes[order], lines[order]
    if max_requests:
        sizes, lines = sizes[:max_requests], lines[:max_requests]
    if sizes.size and sizes.min() < 1:
        bad = int(np.flatnonzero((sizes < 1).any(axis=1))[0])
        raise ValueError(f"kv-canary: trace {name}: expected token counts >= 1, got {sizes[bad].tolist()} "
                         f"(line {int(lines[bad])})")
    return Trace(Path(name).stem, sizes[:, 0].copy(), sizes[:, 1].copy())


@dataclass(frozen=True)
class Step:
    """The planner inputs of one forward step (NumPy arrays; the tables are the scheduler's own)."""

    index: int
    req_pool_indices: np.ndarray  # [bs] int64; padding rows (0) at the end
    prefix_lens: np.ndarray  # [bs] int64
    extend_seq_lens: np.ndarray  # [bs] int64
    num_active: int  # rows [0, num_active) are requests, the rest padding
    request_ids: np.ndarray  # [num_active] trace index of each request row
    verify_entries: int  # what the plan must count: sum of min(P, W) (or P) over the request rows
    write_entries: int  # sum of E over the request rows
    req_to_token: np.ndarray  # [max_reqs, max_seq_len] int32, updated in place for this step
    full_to_swa_index_mapping: np.ndarray | None  # [num_full_slots] int64, SWA mode only

    @property
    def bs(self) -> int:
        return int(self.req_pool_indices.shape[0])


class _FreeList:
    """A LIFO stack of page ids: the pages freed last are handed out first."""

    def __init__(self, pages: np.ndarray):
        self._pages = pages.astype(np.int64)
        self.size = len(pages)
        self.used = np.zeros(int(pages.max(initial=0)) + 1, dtype=bool)  # handed out at least once

    def pop(self, k: int) -> np.ndarray:
        if k > self.size:  # admission reserves pages, so this is a scheduler bug, not a full pool
            raise RuntimeError(f"kv-canary: scheduler: page pool exhausted ({k} needed, {self.size} free)")
        self.size -= k
        pages = self._pages[self.size : self.size + k].copy()
        self.used[pages] = True
        return pages

    def _unused(self) -> np.ndarray:
        return np.flatnonzero(~self.used[self._pages[: self.size]])

    @property
    def has_unused(self) -> bool:
        return bool(len(self._unused()))

    def take_unused(self) -> int | None:
        """Remove and return a page that was never handed out, the lowest in the stack (``None``: every free page
        has been used)."""
        free = self._unused()
        if not len(free):
            return None
        i = int(free[0])
        page = int(self._pages[i])
        self._pages[i : self.size - 1] = self._pages[i + 1 : self.size].copy()
        self.size -= 1
        self.used[page] = True
        return page

    def push_cold(self, pages: np.ndarray) -> None:
        """Push ``pages`` under the whole stack: handed out last."""
        k = len(pages)
        self._pages[k : self.size + k] = self._pages[: self.size].copy()
        self._pages[:k] = pages
        self.size += k

    def push(self, pages: np.ndarray) -> None:
        self._pages[self.size : self.size + len(pages)] = pages
        self.size += len(pages)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + c)`` for each pair, without a Python loop."""
    counts = np.maximum(counts, 0)
    total = int(counts.sum())
    first = np.cumsum(counts) - counts
    return np.repeat(starts - first, counts) + np.arange(total, dtype=np.int64)


def _cdiv(a, b):
    return -(-a // b)


def default_buckets(max_batch_size: int) -> tuple[int, ...]:
    """CUDA-graph batch sizes: powers of two up to ``max_batch_size``, and ``max_batch_size`` itself."""
    sizes = {1 << k for k in range(max_batch_size.bit_length()) if (1 << k) <= max_batch_size}
    return tuple(sorted(sizes | {max_batch_size}))


class Scheduler:
    """Replays ``trace`` step by step; see the module docstring for the model.

    ``kv_pool_tokens``: size of the full KV pool (rounded down to whole pages, page 0 included).
    ``pad_buckets``: CUDA-graph batch sizes to pad to (empty: no padding). ``seed`` drives every random
    choice (free-list order, padding garbage). Iterate :meth:`steps` to run it.
    """

    def __init__(
        self,
        trace: Trace,
        *,
        max_batch_size: int = 64,
        page_size: int = 16,
        kv_pool_tokens: int = 1 << 17,
        chunk_size: int = 2048,
        token_budget: int = 0,
        swa_window: int = 0,
        pad_buckets: Sequence[int] = (),
        seed: int = 0,
        offload_tier: int = 0,
    ):
        if min(max_batch_size, page_size, chunk_size) < 1 or token_budget < 0 or swa_window < 0:
            raise ValueError("kv-canary: scheduler: expected positive sizes and a window/budget >= 0")
        if offload_tier < 0 or (offload_tier and swa_window):
            raise ValueError(f"kv-canary: scheduler: offload_tier: expected >= 0 tokens, and 0 with a sliding "
                             f"window, got {offload_tier} (swa_window {swa_window})")
        self.trace = trace
        self.max_batch_size = max_batch_size
        self.page_size = ps = page_size
        self.chunk_size = chunk_size
        self.token_budget = token_budget
        self.swa_window = swa_window
        self.pad_buckets = tuple(sorted(pad_buckets))
        self.rng = np.random.default_rng(seed)

        self.kv_len = trace.context_tokens + trace.generated_tokens - 1
        self.pages_needed = _cdiv(self.kv_len, ps)
        self.num_pages = kv_pool_tokens // ps
        if len(trace) and int(self.pages_needed.max()) > self.num_pages - 1:
            raise ValueError(
                f"kv-canary: kv_pool_tokens: expected room for the longest request "
                f"({int(self.kv_len.max())} tokens, {int(self.pages_needed.max())} pages of {ps}), "
                f"got {self.num_pages - 1} usable pages"
            )
        max_pages = int(self.pages_needed.max()) if len(trace) else 1
        rows = max_batch_size + 1
        self.req_to_token = np.zeros((rows, max_pages * ps), dtype=np.int32)
        self.page_table = np.zeros((rows, max_pages), dtype=np.int64)
        self.free_pages = _FreeList(self.rng.permutation(np.arange(1, self.num_pages)))

        self.full_to_swa_index_mapping = None
        if swa_window:
            # Worst case held per request: the pages overlapping [P - W, P + E), at most ceil((W + E) / ps) + 1.
            per_req = _cdiv(swa_window + chunk_size, ps) + 1
            self.num_swa_pages = min(self.num_pages, max_batch_size * per_req + 1)
            self.swa_free = _FreeList(self.rng.permutation(np.arange(1, self.num_swa_pages)))
            self.swa_table = np.zeros((rows, max_pages), dtype=np.int64)
            self.swa_first = np.zeros(rows, dtype=np.int64)  # first page index still held in the SWA pool
            self.full_to_swa_index_mapping = np.zeros(self.num_pages * ps, dtype=np.int64)

        self.row_req = np.full(rows, -1, dtype=np.int64)
        self.row_prefix = np.zeros(rows, dtype=np.int64)
        self.free_rows = list(range(max_batch_size, 0, -1))
        self.running: list[int] = []  # rows, in admission order
        self.next_request = 0
        self.reserved_pages = 0
        self.num_finished = 0
        # The host tier: (request, prefix, step it left) of the preempted request, and the engine's callbacks
        # ``(step index, request, row, prefix)``: offload before the pages are freed, restore after req_to_token is
        # rewritten.
        self.offload_tier = offload_tier
        self.offloaded: list[tuple[int, int, int]] = []
        self.num_offloads = self.num_restores = 0
        self.times_offloaded = np.zeros(len(trace), dtype=np.int64)
        self.on_offload: Callable[[int, int, int, int], None] | None = None
        self.on_restore: Callable[[int, int, int, int], None] | None = None

    def reserve_unused_pages(self) -> tuple[int, int | None] | None:
        """Take out of the pools for good a full page (and an SWA page in SWA mode) that no request ever held:
        the never-written block of a ``zero-kv`` fault. ``None`` when there is none (or no page to spare).

        The full page counts as reserved, so that admission never promises it to a request. The SWA pool is
        sized for the worst case of a full batch, which leaves it a page to spare.
        """
        if self.reserved_pages + 1 > self.num_pages - 1 or not self.free_pages.has_unused:
            return None
        if self.swa_window and not self.swa_free.has_unused:
            return None
        self.reserved_pages += 1
        full = self.free_pages.take_unused()
        return full, (self.swa_free.take_unused() if self.swa_window else None)

    @property
    def done(self) -> bool:
        return not self.running and not self.offloaded and self.next_request == len(self.trace)

    def steps(self) -> Iterator[Step]:
        """Yield one :class:`Step` per forward step; the scheduler advances when the next one is asked for."""
        index = 0
        while not self.done:
            if self.offload_tier:
                self._restore(index)
            self._admit()
            if self.offload_tier and not self.offloaded and self._preempt(index) == "pressure":
                self._admit(overtake=True)  # the head the victim made room for
            rows, prefix, ext = self._schedule()
            self._allocate(rows, prefix, ext)
            yield self._step(index, rows, prefix, ext)
            self._advance(rows, ext)
            index += 1

    def _pool_blocked(self) -> bool:
        """The head of the queue waits for pages alone (the batch has a place for it)."""
        return (self.next_request < len(self.trace) and len(self.running) < self.max_batch_size
                and self.reserved_pages + int(self.pages_needed[self.next_request]) > self.num_pages - 1)

    def _preempt(self, index: int) -> str:
        """Offload one running request to the tier when the rule of the module docstring says so; why (``"pressure"``
        or ``"periodic"``), or ``""`` when none was."""
        pressure = self._pool_blocked()
        if not pressure and not (index > 0 and index % OFFLOAD_EVERY == 0):
            return ""
        usable = self.num_pages - 1
        # Fewest preemptions first, then the latest arrival (the running list is in arrival order): spread them.
        for row in sorted(reversed(self.running), key=lambda r: int(self.times_offloaded[self.row_req[r]])):
            req, prefix = int(self.row_req[row]), int(self.row_prefix[row])
            if prefix < self.trace.context_tokens[req] or self.kv_len[req] - prefix < OFFLOAD_DWELL + 2:
                continue
            if prefix > self.offload_tier:
                continue
            if pressure and (self.reserved_pages - int(self.pages_needed[req])
                             + int(self.pages_needed[self.next_request]) > usable):
                continue
            if self.on_offload is not None:
                self.on_offload(index, req, row, prefix)
            # Reused last: its restore lands in other pages, as in a pool busy enough to need the tier.
            self.free_pages.push_cold(self.page_table[row, : _cdiv(prefix, self.page_size)])
            self.reserved_pages -= int(self.pages_needed[req])
            self.row_req[row] = -1
            self.free_rows.append(row)
            self.running.remove(row)
            self.offloaded.append((req, prefix, index))
            self.num_offloads += 1
            self.times_offloaded[req] += 1
            return "pressure" if pressure else "periodic"
        return ""

    def _restore(self, index: int) -> None:
        """Bring the tier's request back into new pages once it has dwelt there and the pool has room."""
        if not self.offloaded:
            return
        req, prefix, since = self.offloaded[0]
        need = int(self.pages_needed[req])
        if (index - since < OFFLOAD_DWELL or len(self.running) >= self.max_batch_size
                or self.reserved_pages + need > self.num_pages - 1):
            return
        ps = self.page_size
        row = self.free_rows.pop()
        held = _cdiv(prefix, ps)
        self.page_table[row, :held] = self.free_pages.pop(held)
        pos = np.arange(prefix, dtype=np.int64)
        self.req_to_token[row, :prefix] = self.page_table[row, pos // ps] * ps + pos % ps
        self.row_req[row] = req
        self.row_prefix[row] = prefix
        self.reserved_pages += need
        self.running.append(row)
        self.running.sort(key=lambda r: int(self.row_req[r]))  # back in its arrival place (trace order)
        self.offloaded.pop(0)
        self.num_restores += 1
        if self.on_restore is not None:
            self.on_restore(index, req, row, prefix)

    def _admit(self, overtake: bool = False) -> None:
        """Admit from the queue; ``overtake``: even with a request in the tier (the head it was preempted for)."""
        usable = self.num_pages - 1
        if self.offloaded and not overtake:
            return  # no new request overtakes the preempted one
        while self.next_request < len(self.trace) and len(self.running) < self.max_batch_size:
            need = int(self.pages_needed[self.next_request])
            if self.reserved_pages + need > usable:
                break  # first come, first served: a big request at the head blocks the queue
            row = self.free_rows.pop()
            self.row_req[row] = self.next_request
            self.row_prefix[row] = 0
            if self.swa_window:
                self.swa_first[row] = 0
            self.reserved_pages += need
            self.running.append(row)
            self.next_request += 1

    def _schedule(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = np.array(self.running, dtype=np.int64)
        prefix = self.row_prefix[rows]
        left = self.trace.context_tokens[self.row_req[rows]] - prefix
        ext = np.where(left > 0, np.minimum(left, self.chunk_size), 1)
        if self.token_budget:
            order = np.argsort(left > 0, kind="stable")
            spent_before = np.cumsum(ext[order]) - ext[order]
            ext[order] = np.clip(self.token_budget - spent_before, 0, ext[order])
            keep = ext > 0
            rows, prefix, ext = rows[keep], prefix[keep], ext[keep]
        return rows, prefix, ext

    def _allocate(self, rows: np.ndarray, prefix: np.ndarray, ext: np.ndarray) -> None:
        ps = self.page_size
        held = _cdiv(prefix, ps)
        n_new = _cdiv(prefix + ext, ps) - held
        r = np.repeat(rows, n_new)
        j = _ranges(held, n_new)
        pages = self.free_pages.pop(int(n_new.sum()))
        self.page_table[r, j] = pages
        if self.swa_window:
            swa = self.swa_free.pop(len(pages))
            self.swa_table[r, j] = swa
            offsets = np.arange(ps, dtype=np.int64)
            self.full_to_swa_index_mapping[(pages[:, None] * ps + offsets).ravel()] = (swa[:, None] * ps + offsets).ravel()
        r = np.repeat(rows, ext)
        pos = _ranges(prefix, ext)
        self.req_to_token[r, pos] = self.page_table[r, pos // ps] * ps + pos % ps

    def _step(self, index: int, rows: np.ndarray, prefix: np.ndarray, ext: np.ndarray) -> Step:
        n = len(rows)
        bs = next((b for b in self.pad_buckets if b >= n), n)
        garbage = self.rng.integers(-(1 << 40), 1 << 40, size=(2, bs - n))
        w = self.swa_window
        return Step(
            index=index,
            req_pool_indices=np.concatenate([rows, np.zeros(bs - n, dtype=np.int64)]),
            prefix_lens=np.concatenate([prefix, garbage[0]]),
            extend_seq_lens=np.concatenate([ext, garbage[1]]),
            num_active=n,
            request_ids=self.row_req[rows],
            verify_entries=int((np.minimum(prefix, w) if w else prefix).sum()),
            write_entries=int(ext.sum()),
            req_to_token=self.req_to_token,
            full_to_swa_index_mapping=self.full_to_swa_index_mapping,
        )

    def _advance(self, rows: np.ndarray, ext: np.ndarray) -> None:
        ps = self.page_size
        self.row_prefix[rows] += ext
        prefix = self.row_prefix[rows]
        kv_len = self.kv_len[self.row_req[rows]]
        done = prefix >= kv_len
        if self.swa_window:
            # Free SWA pages wholly before the next step's window; a finished request frees all of them.
            end = np.where(done, _cdiv(kv_len, ps), np.maximum(prefix - self.swa_window, 0) // ps)
            first = self.swa_first[rows]
            n = np.maximum(end - first, 0)
            r = np.repeat(rows, n)
            j = _ranges(first, n)
            self.swa_free.push(self.swa_table[r, j])
            slots = (self.page_table[r, j][:, None] * ps + np.arange(ps)).ravel()
            self.full_to_swa_index_mapping[slots] = 0
            self.swa_first[rows] = np.maximum(first, end)
        finished = rows[done]
        for row in finished.tolist():
            req = int(self.row_req[row])
            self.free_pages.push(self.page_table[row, : self.pages_needed[req]])
            self.reserved_pages -= int(self.pages_needed[req])
            self.row_req[row] = -1
            self.free_rows.append(row)
        if len(finished):
            gone = set(finished.tolist())
            self.running = [row for row in self.running if row not in gone]
            self.num_finished += len(finished)
