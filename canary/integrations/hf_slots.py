"""The one place where transformers' paged cache meets the canary's slot space (canary.integrations.transformers).

transformers 5.17 keeps each request's KV as a list of block ids (``FullAttentionCacheAllocator.block_table``:
request id -> block ids, ``block_size`` tokens each; engine slot = ``block * block_size + offset`` into the K / V
tensors ``[(num_blocks + 2) * block_size, heads, head_dim]``). The canary's manager reads a ``req_to_token``
table instead (SPEC 2: ``[rows, max_seq_len]`` int32, row 0 and slot 0 = padding). Until the block-table inputs
land, this module bridges the two:

- **Slot 0.** The canary reserves slot 0 as padding; the engine hands out block 0 (slots ``0 .. block_size - 1``)
  like any other. An offset slot space (canary slot = engine slot + 1) cannot keep the real-KV check zero-copy:
  a source reads slot ``s`` at ``base + (s // page_size) * row_stride + (s % page_size) * bytes_per_token``, so
  the K tensor would have to be viewed from one token *before* its first byte. So the engine's block 0 is taken
  out of its free list for the life of a generation session (:func:`reserve_padding_block`, one block of
  capacity) and canary slot = engine slot: no mapping, the K / V tensors are the real-KV sources as they are.
  It is handed back at the session's end, so that the engine's CUDA-graph warm-up (run between sessions, at the
  largest size, which needs every block) still finds all its blocks; ``num_blocks`` / ``num_pages`` are not
  touched, so the engine pads and captures exactly as without the canary.
- **req_to_token.** :class:`SlotTable` mirrors each protected request's block list into a row of its own
  (rows handed out first freed, first reused), filled block by block as the engine allocates them, on the
  host and, on a GPU, in a device copy updated on the engine's compute stream before the step's plan.

THE SWAP POINT: when ``KVGroup(block_table=..., page_size=...)`` (or ``kv_indptr`` / ``kv_indices``) and
``before_forward(..., block_table=...)`` land, :class:`SlotTable` and the two padding-block functions are what
goes: bind the group over a dense ``[rows, max_blocks]`` copy of the engine's block lists (page_size =
``block_size``), pass it per step, and drop the reservation for the "real slot 0" option.
``Session.begin_step`` (``canary/integrations/hf_session.py``) is the only caller of :meth:`SlotTable.sync` and
:meth:`SlotTable.gather`.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Hashable

import numpy as np

PADDING_BLOCK = 0  # the engine block whose slots the canary treats as padding (slot 0 among them)


def reserve_padding_block(block_manager: Any) -> bool:
    """Take engine block 0 out of ``block_manager``'s free list (a transformers 5.17 ``BlockManager``). True when
    taken, False when it was not free (some request holds it: the caller refuses to start the canary)."""
    free = block_manager._uninit_block_ids  # a deque of never-initialized block ids, handed out from the left
    if PADDING_BLOCK in free:
        free.remove(PADDING_BLOCK)
        return True
    return False


def release_padding_block(block_manager: Any) -> None:
    """Give block 0 back to the front of the free list (where the engine's own order had it)."""
    free = block_manager._uninit_block_ids
    if PADDING_BLOCK not in free:
        free.appendleft(PADDING_BLOCK)


class SlotTable:
    """``req_to_token`` for the canary, mirrored from the engine's block lists.

    ``rows`` rows of ``cols`` positions (row 0: padding, never handed out); ``block_size``: the engine's.
    ``device``: ``None`` (the table is the host array) or a torch CUDA device (a device copy, updated by
    :meth:`flush`). Engine slot ``b * block_size + o`` is canary slot ``b * block_size + o`` (block 0 reserved:
    module docstring).
    """

    def __init__(self, rows: int, cols: int, block_size: int, device: Any = None, torch: Any = None):
        self.rows, self.cols, self.block_size = int(rows), int(cols), int(block_size)
        self.host = np.zeros((self.rows, self.cols), dtype=np.int32)
        self._torch, self.device = torch, device
        self.dev = None if device is None else torch.zeros((self.rows, self.cols), dtype=torch.int32, device=device)
        self._free = deque(range(1, self.rows))
        self.row_of: dict[Hashable, int] = {}
        self.mirrored: dict[Hashable, list[int]] = {}  # request -> the block list its row holds
        self._offsets = np.arange(self.block_size, dtype=np.int64)
        self._pending: list[tuple[int, int, np.ndarray]] = []  # (row, first column, slots) for the device copy

    @property
    def req_to_token(self) -> Any:
        """What the manager's ``KVGroup`` binds (the device copy on a GPU)."""
        return self.host if self.dev is None else self.dev

    def admit(self, request_id: Hashable) -> int | None:
        """A row for a new request, or ``None`` when every row is taken (the request then runs unprotected)."""
        if not self._free:
            return None
        row = self._free.popleft()
        self.row_of[request_id] = row
        self.mirrored[request_id] = []
        return row

    def release(self, request_id: Hashable) -> None:
        row = self.row_of.pop(request_id, None)
        self.mirrored.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def sync(self, request_id: Hashable, row: int, blocks: list[int]) -> None:
        """Make ``row`` hold the engine's ``blocks`` (the request's block list, as its attention reads it) for
        every position that fits the row. The caller calls it when ``blocks != mirrored[request_id]`` (a C-level
        list compare per request and step: the engine appends blocks as a request grows, and anything else that
        changes the list, an allocator bug included, is mirrored too, from the first block that differs)."""
        mine = self.mirrored[request_id]
        k = 0
        for k, (a, b) in enumerate(zip(mine, blocks)):  # noqa: B007 - k is the first block that differs
            if a != b:
                break
        else:
            k = min(len(mine), len(blocks))
        bs = self.block_size
        need = min(len(blocks), -(-self.cols // bs))
        if need > k:
            new = (np.asarray(blocks[k:need], dtype=np.int64)[:, None] * bs + self._offsets).reshape(-1)
            start = k * bs
            new = new[: self.cols - start]
            self.host[row, start:start + len(new)] = new
            if self.dev is not None:
                self._pending.append((row, start, new))
        self.mirrored[request_id] = list(blocks)

    def gather(self, rows: np.ndarray, positions: np.ndarray, out: np.ndarray) -> None:
        """``out[i]`` = canary slot of position ``positions[i]`` of row ``rows[i]``, -1 where ``rows[i]`` is 0 (an
        unprotected request: the write skips its tokens). The step's ``out_cache_loc``, in one gather."""
        pad = rows == 0
        flat = rows * self.cols + np.where(pad, 0, positions)
        out[:] = self.host.reshape(-1)[flat]
        if pad.any():
            out[pad] = -1

    def flush(self, upload: Any) -> None:
        """Apply the rows mirrored since the last flush to the device copy, on the current torch stream (the
        caller's: the engine's compute stream, ahead of the plan that reads them). ``upload``: host int64 array ->
        device int64 tensor, asynchronously (the session's: a pinned copy, no host sync)."""
        if not self._pending:
            return
        flat = np.concatenate([row * self.cols + start + np.arange(len(s), dtype=np.int64)
                               for row, start, s in self._pending])
        vals = np.concatenate([s for _, _, s in self._pending])
        self._pending.clear()
        both = upload(np.concatenate([flat, vals]))
        k = len(flat)
        self.dev.view(-1).index_copy_(0, both[:k], both[k:].to(self._torch.int32))
