"""Records that move with the KV (SPEC 4.1): :class:`RecordMover`.

When an engine moves KV between slots (offload and restore, copy-on-write forks, defragmentation, prefill-to-decode
transfer), the records of those slots must move with it: the chain is content-based and the real-KV fold sees
bytes only, so records move verbatim and nothing is re-keyed (SPEC 4.1 says why that is right). A mover is bound
to a :class:`~canary.CanaryRecords` and, optionally, its :class:`~canary.CanaryLayers`; a slot's **row** is its
record's four fields (``token``, ``position``, ``prev_hash``, ``real_kv_hash``) then its layer-hash row:
``row_words = 4 + num_layers`` int64 words, both tables moved by one call.

- :meth:`RecordMover.gather`: rows of a slot list into a caller buffer (device memory, or pinned host memory for
  a GPU canary: an offload's destination);
- :meth:`RecordMover.scatter`: buffer rows into a slot list (the restore);
- :meth:`RecordMover.copy`: slot lists inside the pool, as if every source were gathered before any destination
  is written (overlapping lists work), through the mover's preallocated scratch;
- :meth:`RecordMover.status`: the sticky device status word (slots past the pool, refused).

Backends: the NumPy reference for host arrays, ``kernels/records_move.cu`` (CuPy) and its Numba twin
``kernels/records_move_numba.py`` for CUDA arrays; each call launches on the caller's stream, never syncs, and
allocates nothing after :meth:`RecordMover.warmup`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import backends
from ..backends.args import DEFAULT_LAUNCH, LaunchConfig, MoveArgs, MoveTables
from ..contract.move_layout import STATUS_FAULTS, STATUS_REFUSED, STATUS_WORDS, MoveFault, MoveStatus, row_words
from ..contract.plans import INT64
from ..errors import fail
from ..interop.adapter import HOST, INT_WIDTHS, ArrayView, as_view, check_view
from ..interop.callviews import CallViews
from ..interop.cudart import pinned_host
from ..interop.devices import allocator, on_device_of, zero_fill
from ..interop.hostcopy import to_host
from ..interop.libs import library_of
from ..interop.overlap import Spans, check_disjoint, spans
from .api import CanaryRecords
from .layers import CanaryLayers

DEFAULT_COPY_CAPACITY = 1024
_KNOWN_FAULTS = sum(int(b) for b in MoveFault)


def _where(device_id: int) -> str:
    return "host memory" if device_id == HOST else f"cuda:{device_id}"


def _count(value: Any, name: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise fail(TypeError, f"{name}: expected an int, got {type(value).__name__}")
    if int(value) < low:
        raise fail(ValueError, f"{name}: expected an int >= {low}, got {value}")
    return int(value)


class RecordMover:
    """Moves the rows of slots (records and layer hashes) with the KV: SPEC 4.1.

    ``records``: the bound :class:`~canary.CanaryRecords`. ``layers``: its :class:`~canary.CanaryLayers` (its
    ``layer_hashes`` rows move with the records) or ``None``. ``copy_capacity``: the most slots one :meth:`copy`
    moves (default 1024, or the rows of ``scratch``); the mover allocates its scratch ``[copy_capacity,
    row_words]`` int64 once, on the canary's device, unless ``scratch`` (the caller's array of that shape) is given.
    ``status``: the caller's ``[2]`` int64 status word (default: one allocated, zeroed). ``backend``: as for the
    canary (default: the canary's). ``launch_config``: :class:`~canary.LaunchConfig`.

    Binding validates everything once: ``TypeError`` / ``ValueError`` (``kv-canary:``, naming the argument) for
    layers bound to other records, a scratch or status word of the wrong dtype, shape or device, or sharing memory
    with the records, the layer table or each other. The caller's arrays must stay alive and in place while the
    mover is used.
    """

    def __init__(self, records: CanaryRecords, layers: CanaryLayers | None = None, *, copy_capacity: int | None = None,
                 scratch: Any = None, status: Any = None, backend: str | None = None,
                 launch_config: LaunchConfig = DEFAULT_LAUNCH):
        if not isinstance(records, CanaryRecords):
            raise fail(TypeError, f"records: expected a CanaryRecords, got {type(records).__name__}")
        if layers is not None and not isinstance(layers, CanaryLayers):
            raise fail(TypeError, f"layers: expected a CanaryLayers or None, got {type(layers).__name__}")
        if layers is not None and layers.records is not records:
            raise fail(ValueError, "layers: expected the CanaryLayers bound to these records, got one bound to other "
                                   "records")
        self.records, self.layers = records, layers
        sv = records.views
        self.device_id = device = sv.device_id
        self.num_layers = 0 if layers is None else layers.num_layers
        self.row_words = row_words(self.num_layers)
        if device == HOST:
            self._empty = allocator("cpu")
        else:
            library = library_of(records.state.canary_buffer)
            self._empty = allocator(device, library if library in ("cupy", "torch", "numba") else None)
        if scratch is None:
            cap = DEFAULT_COPY_CAPACITY if copy_capacity is None else _count(copy_capacity, "copy_capacity")
            scratch = self._empty(cap * self.row_words, np.int64).reshape(cap, self.row_words)
        self.scratch = scratch
        sc = self._buffer(as_view(scratch, "scratch"), "scratch", writable=True)
        if copy_capacity is not None and _count(copy_capacity, "copy_capacity") != sc.shape[0]:
            raise fail(ValueError, f"copy_capacity: expected the rows of scratch ({sc.shape[0]}) or None, got "
                                   f"{copy_capacity}")
        self.copy_capacity = sc.shape[0]
        if status is None:
            status = self._empty(STATUS_WORDS, np.int64)
        self.status_word = status
        st = check_view(as_view(status, "status"), dtype=INT64, ndim=1, length=STATUS_WORDS, writable=True)
        for v in (sc, st):
            if v.device_id != device:
                raise fail(ValueError, f"{v.name}: expected the canary buffer's device ({_where(device)}), got "
                                       f"{v.where}")
        table = [] if layers is None else [layers.views.layer_hashes, layers.views.layer_cursor]
        state = [sv.canary_buffer, sv.ring, sv.ring_write_index, sv.slot_run_counter, sv.kernel_run_counter,
                 sv.check_flags] + ([sv.reported_slots] if sv.reported_slots is not None
                                    and sv.reported_slots.device_id == device else [])
        held = spans(state + table)  # disjoint already (bind_state, CanaryLayers)
        for v in (sc, st):
            Spans(held, device).check(v)  # the kernels write the tables while they write these, and the reverse
        check_disjoint(spans([sc, st]))
        self._bound_spans = Spans(held + spans([sc, st]), device)  # what every per-call array must keep clear of
        self._scratch_view = sc
        self._views: dict = {}
        tables = MoveTables(sv.canary_buffer, sv.num_slots, sv.slot_stride_bytes, sv.fields,
                            None if layers is None else layers.views.layer_hashes, self.num_layers, st, device)
        self._module = backends.resolve(backend or records.backend, device, family="move")
        self.backend = self._module.NAME
        if not isinstance(launch_config, LaunchConfig):
            raise fail(TypeError, f"launch_config: expected a LaunchConfig, got {type(launch_config).__name__}")
        self._bound = self._module.bind(tables, launch_config)

    @property
    def num_slots(self) -> int:
        return self.records.num_slots

    def warmup(self) -> None:
        """Compile and load the kernels, so that later calls only launch (graph-capturable)."""
        self._bound.warmup()

    def allocate_rows(self, n: int, device: Any = None, library: str | None = None) -> Any:
        """A zeroed ``[n, row_words]`` int64 buffer for :meth:`gather` / :meth:`scatter`, on ``device`` (default: the
        canary's; ``"cpu"``, a CUDA ordinal or ``"cuda:N"``, as :meth:`canary.CanaryState.allocate` takes it). For
        pinned host memory allocate it yourself (``cupyx.zeros_pinned``, torch's ``pin_memory()``)."""
        n = _count(n, "n")
        empty = self._empty if device is None else allocator(device, library)
        return empty(n * self.row_words, np.int64).reshape(n, self.row_words)

    # -- the calls ---------------------------------------------------------------------------------------------

    def gather(self, slots: Any, out: Any, *, stream: Any = None) -> None:
        """``out[i] = row(slots[i])`` for each ``i < n`` (SPEC 4.1): the record's four fields, then its layer-hash
        row; a zero row for a negative slot (padding), and for one ``>= num_slots`` (status ``SOURCE_RANGE``).

        ``slots``: ``[n]`` int32 or int64. ``out``: ``[>= n, row_words]`` int64, written (rows past ``n``
        untouched): device memory of the canary's device, pinned host memory for a GPU canary, or host memory for
        a host canary. ``stream``: where the kernel runs (default: the current stream of the library that owns the
        canary buffer; host arrays take none). Run it after the KV copy that reads those slots is queued on the
        same stream, and before anything overwrites them. Never syncs. Raises ``TypeError`` / ``ValueError``
        (``kv-canary:``, naming the argument) before anything is launched.
        """
        go = self._go(stream)
        s = go.vec(slots, "slots", INT_WIDTHS)
        self._check_device([s])
        rows = self._rows(go, out, "out", s.shape[0], writable=True)
        Spans(spans([rows]), rows.device_id).check(s)  # the kernel writes out while it reads the list
        self._bound.gather(MoveArgs(s, rows), go.handle)

    def scatter(self, slots: Any, src: Any, *, stream: Any = None) -> None:
        """``row(slots[i]) = src[i]`` for each ``i < n`` with ``0 <= slots[i] < num_slots`` (SPEC 4.1); a negative slot
        is skipped, one ``>= num_slots`` skipped with status ``DEST_RANGE``. ``src``: ``[>= n, row_words]`` int64
        (read), placed as :meth:`gather`'s ``out``; other arguments as there. Run it after the KV is in place and
        before anything verifies those slots. Two entries naming one slot: the caller's error (the reference keeps
        the later row, a GPU either, possibly torn)."""
        go = self._go(stream)
        s = go.vec(slots, "slots", INT_WIDTHS)
        self._check_device([s])
        rows = self._rows(go, src, "src", s.shape[0], writable=False)
        self._bound.scatter(MoveArgs(s, rows), go.handle)

    def copy(self, src_slots: Any, dst_slots: Any, *, stream: Any = None) -> None:
        """Inside the pool: as if ``gather(src_slots, scratch)`` then ``scatter(dst_slots, scratch)`` (SPEC 4.1), so
        every source is read before any destination is written (``a -> b, b -> c`` moves ``a``'s row to ``b`` and
        ``b``'s old row to ``c``). ``src_slots``, ``dst_slots``: ``[n]`` int32 or int64 each, ``n <=
        copy_capacity``. Two launches on ``stream``; never syncs; errors as in :meth:`gather`."""
        go = self._go(stream)
        src = go.vec(src_slots, "src_slots", INT_WIDTHS)
        dst = go.vec(dst_slots, "dst_slots", INT_WIDTHS)
        n = src.shape[0]
        if dst.shape[0] != n:
            raise fail(ValueError, f"dst_slots: expected the length of src_slots ({n}), got {dst.shape[0]}")
        if n > self.copy_capacity:
            raise fail(ValueError, f"src_slots: expected at most copy_capacity = {self.copy_capacity} slots (the "
                                   f"scratch's rows), got {n}")
        self._check_device([src, dst])
        self._bound.gather(MoveArgs(src, self._scratch_view), go.handle)
        self._bound.scatter(MoveArgs(dst, self._scratch_view), go.handle)

    def status(self) -> MoveStatus:
        """The status word read back (a sync for device arrays): the :class:`MoveFault` bits and the refused
        entries since the last :meth:`clear_status`."""
        with on_device_of(self.status_word):
            word = np.asarray(to_host(self.status_word)).astype(np.int64)
        return MoveStatus(MoveFault(int(word[STATUS_FAULTS]) & _KNOWN_FAULTS), int(word[STATUS_REFUSED]))

    def clear_status(self) -> None:
        """Zero the status word (host API, on the array library's current stream)."""
        with on_device_of(self.status_word):
            zero_fill(self.status_word)

    # -- checks ------------------------------------------------------------------------------------------------

    def _go(self, stream: Any) -> CallViews:
        return CallViews(self.device_id, stream, self.records.state.canary_buffer, self._bound_spans, self._views)

    def _buffer(self, view: ArrayView, name: str, writable: bool) -> ArrayView:
        v = check_view(view, dtype=INT64, ndim=2, writable=writable)
        if v.shape[1] != self.row_words:
            layers = f"4 record words + {self.num_layers} layer hashes" if self.num_layers else "4 record words"
            raise fail(ValueError, f"{name}: expected {self.row_words} columns ({layers}), got shape {v.shape}")
        return v

    def _rows(self, go: CallViews, obj: Any, name: str, n: int, writable: bool) -> ArrayView:
        v = self._buffer(go.view(obj, name), name, writable)
        if v.shape[0] < n:
            raise fail(ValueError, f"{name}: expected at least {n} rows (one per slot of the list), got {v.shape[0]}")
        if v.device_id != self.device_id and not (self.device_id != HOST and v.device_id == HOST
                                                  and pinned_host(v.ptr)):
            extra = " or pinned host memory" if self.device_id != HOST else ""
            raise fail(ValueError, f"{name}: expected the canary buffer's device ({_where(self.device_id)}){extra}, "
                                   f"got {v.where}")
        return v

    def _check_device(self, views: list[ArrayView]) -> None:
        for v in views:
            if v.device_id != self.device_id:
                raise fail(ValueError, f"{v.name}: expected the canary buffer's device ({_where(self.device_id)}), "
                                       f"got {v.where}")
