"""The manager's report block: every group's violation ring, ring write index, run counters and plan status in
one device allocation, so that a step's report reaches the host in one piece (the report kernel's mailbox slot,
or one device-to-host copy) and the write indexes are cleared at once (a copy and a memset per array would cost
a driver call each, on every step; canary/manager/mailbox.py).

Layout (int64 words): ``[0, G)`` the ``G`` groups' ring write indexes (an int32 in each word's low half, the
rest never written), ``[G, 3G)`` each group's record-mover status word (``[2]``: fault bits, refused entries;
SPEC 4.1, canary/manager/moves.py), with ``agree`` (a GPU manager with a communicator) ``[3G, 5G)`` each group's
agreement words (``[2]``: plan, entries; SPEC 4.3, canary/manager/distributed.py), then per group
``slot_run_counter`` [2], ``kernel_run_counter`` [2], the plan's ``status`` (an int32 in one word) and the ring
``[ring_capacity, 8]``. The first ``3G`` (``5G``) words are cleared behind each report: every report carries one
step's ring rows and agreement words and the move faults since the last report.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..contract.ring import RING_ROW_WORDS
from ..interop.libs import library_of

_HEAD = 5  # counters [2] + [2], status


def _int32(words: Any) -> Any:
    """The first int32 of a ``[1]`` int64 array (the low half of the word: CUDA and x86 are little-endian)."""
    if library_of(words) == "torch":
        return words.view(__import__("torch").int32)[:1]
    return words.view(np.int32)[:1]


class ReportBlock:
    """``names``: the groups, in order; ``ring_capacity`` rows each; ``empty(n, dtype)``: the manager's allocator.

    ``groups[i]``: ``(ring, ring_write_index, slot_run_counter, kernel_run_counter, status)`` device views of
    group ``i``, to bind its canary state and verify plan over. ``words``: the block's length in int64 words
    (what a report carries); ``index_words``: the leading words holding the write indexes and the move status
    words (what is cleared). ``move_status[i]``: group ``i``'s ``[2]`` int64 mover status word, ``move_words[i]``
    its first word's index. ``agree_words[i]``: the index of group ``i``'s two agreement words, ``agree_out[i]``
    their ``[2]`` int64 view (empty lists without ``agree``). ``heads[i]`` / ``rings[i]``: where group ``i``'s head
    words and ring lie in the block (the report's decode).
    """

    def __init__(self, names: Sequence[str], ring_capacity: int, empty, agree: bool = False):
        g = len(names)
        cap = int(ring_capacity)
        per_group = _HEAD + RING_ROW_WORDS * cap
        self.names = tuple(names)
        self.index_words = (5 if agree else 3) * g
        self.words = self.index_words + g * per_group
        self.array = empty(self.words, np.int64)
        a = self.array
        self.groups = []
        self.heads, self.rings = [], []  # each group's first word (its counters), its ring's words
        self.ring_capacity = cap
        self.move_words = [g + 2 * i for i in range(g)]
        self.move_status = [a[w:w + 2] for w in self.move_words]
        self.agree_words = [3 * g + 2 * i for i in range(g)] if bool(agree) else []
        self.agree_out = [a[w:w + 2] for w in self.agree_words]
        for i in range(g):
            o = self.index_words + i * per_group
            ring = slice(o + _HEAD, o + per_group)
            self.groups.append((a[ring].reshape(cap, RING_ROW_WORDS), _int32(a[i:i + 1]), a[o:o + 2],
                                a[o + 2:o + 4], _int32(a[o + 4:o + 5])))
            self.heads.append(o)
            self.rings.append(ring)
