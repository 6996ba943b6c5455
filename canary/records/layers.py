"""Real-KV hashing of every layer, over time: the layer rotation (docs/records.md 10).

SGLang's canary (and :class:`~canary.CanaryRecords`' ``real_kv_hash``) folds the bytes of the sources it is
given, typically layer 0's K and V: a corruption in any other layer goes unseen. The rotation covers them all
without changing the 32-byte record:

- a side table ``layer_hashes`` ``[num_slots, num_layers]`` int64 (:class:`LayerTable`, caller-owned, allocated
  once) holds each slot's real-KV fold of every layer (SPEC 4's fold, forced bit included, over that layer's
  sources);
- ``write`` (kernel ``canary_write_layers``), launched after the step's KV stores, folds every layer of every
  slot the step wrote and stores the hashes; its thread 0 also advances the device cursor ``layer_cursor``;
- ``verify`` (kernel ``canary_verify_layer``), launched on the step's verify plan, folds layer
  ``layer_cursor[0]`` of every verified slot and compares it with ``layer_hashes[slot, layer]``; a mismatch is a
  ``REAL_KV`` ring row of kind :attr:`~canary.KernelTag.VERIFY_LAYER` naming the layer.

So a changed byte in any layer of a slot verified every step is found within ``num_layers`` steps (``dwell *
num_layers`` with a dwell; docs/integration.md 5c says what sampling does to that bound).

Per-layer sources (:func:`layer_kv`): ``num_layers`` items, each the sources of one layer as
:func:`canary.real_kv` takes them (e.g. ``[(k[l], page_size, nbytes), (v[l], page_size, nbytes)]``; a stacked
``[L, ...]`` tensor's ``k[l]`` views fit). Every layer must have the same number of sources with the same layout
(page size, bytes per token, read bytes, row stride): the kernels keep one layout and a table of per-layer base
pointers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import backends
from ..backends.args import DEFAULT_LAUNCH, LaunchConfig
from ..errors import fail
from ..interop.adapter import HOST, INT_WIDTHS, ArrayView, as_view, check_view
from ..interop.callviews import CallViews
from ..interop.devices import allocator, on_device_of
from ..interop.hostcopy import to_host
from ..interop.overlap import Spans, check_disjoint, spans
from ..contract.plans import INT32, INT64, VerifyPlan, WritePlan, view_verify_plan, view_write_plan
from ..contract.realkv import RealKV, RealKVMode, real_kv
from ..contract.ring import MAX_LAYERS, encode_layer_tag
from ..interop.libs import library_of

CURSOR_WORDS = 2  # layer_cursor: [layer, steps spent on it]


def _where(device_id: int) -> str:
    return "host memory" if device_id == HOST else f"cuda:{device_id}"


@dataclass(frozen=True)
class LayerKV:
    """Validated per-layer sources: ``layers[l]`` is layer ``l``'s :class:`RealKV` (mode PARTIAL or ALL)."""

    layers: tuple[RealKV, ...]
    mode: RealKVMode
    device_id: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_sources(self) -> int:
        return len(self.layers[0].sources)

    def base_pointers(self) -> np.ndarray:
        """``[num_layers * num_sources]`` int64: the base address of source ``k`` of layer ``l`` at ``l * S + k``."""
        return np.array([src.ptr for kv in self.layers for src in kv.sources], dtype=np.int64)


_LAYOUT = ("page_size", "num_bytes_per_token", "read_bytes", "row_stride_bytes", "row_bytes")


def rotation_mode(mode: Any, name: str = "mode") -> RealKVMode:
    """``mode`` as a :class:`RealKVMode` the rotation can use (PARTIAL or ALL); ``ValueError`` naming ``name``."""
    try:
        m = RealKVMode.coerce(mode)
    except (ValueError, TypeError):
        m = None
    if m is None or m == RealKVMode.NONE:
        raise fail(ValueError, f"{name}: expected 'partial' or 'all' (the rotation hashes KV bytes), got {mode!r}")
    return m


def check_dwell(dwell: Any, name: str = "dwell") -> int:
    """``dwell`` (steps each layer stays under the cursor) checked; ``ValueError`` naming ``name``."""
    if isinstance(dwell, bool) or not isinstance(dwell, (int, np.integer)) or not 1 <= int(dwell) < (1 << 31):
        raise fail(ValueError, f"{name}: expected an int in [1, 2**31), got {dwell!r}")
    return int(dwell)


def layer_kv(layer_sources: Any, mode: Any = RealKVMode.ALL) -> LayerKV:
    """Validate per-layer sources (module docstring). ``layer_sources``: a :class:`LayerKV` (returned as is) or a
    sequence of ``num_layers`` (1 to 65536) items, each a sequence of 1 to 4 sources as :func:`canary.real_kv`
    takes them. ``mode``: ``"all"`` (default) or ``"partial"`` (``"none"`` is refused: nothing to rotate).

    Raises ``TypeError`` / ``ValueError`` (``kv-canary:``, naming ``layer_sources[l][k]``) for a bad source, a
    layer whose number of sources or layout differs from layer 0's, sources on several devices.
    """
    if isinstance(layer_sources, LayerKV):
        return layer_sources
    m = rotation_mode(mode)
    if isinstance(layer_sources, (str, bytes)) or not isinstance(layer_sources, Sequence):
        raise fail(TypeError, f"layer_sources: expected a sequence of per-layer source lists, got "
                              f"{type(layer_sources).__name__}")
    if not 1 <= len(layer_sources) <= MAX_LAYERS:
        raise fail(ValueError, f"layer_sources: expected 1 to {MAX_LAYERS} layers, got {len(layer_sources)}")
    layers = []
    for lay, item in enumerate(layer_sources):
        if isinstance(item, tuple) and len(item) in (3, 4) and not isinstance(item[0], tuple):
            raise fail(TypeError, f"layer_sources[{lay}]: expected a list of sources such as [(k, page_size, "
                                  f"nbytes), (v, page_size, nbytes)], got one source tuple (wrap it in a list)")
        try:
            kv = real_kv(item, m)
        except (TypeError, ValueError) as exc:
            raise type(exc)(str(exc).replace("real_kv_sources[", f"layer_sources[{lay}][")) from exc
        if not kv.sources:
            raise fail(ValueError, f"layer_sources[{lay}]: expected 1 to 4 sources, got none")
        kv = RealKV(tuple(_renamed(s, f"layer_sources[{lay}][{k}]") for k, s in enumerate(kv.sources)), kv.mode,
                    kv.device_id)
        if layers:
            first = layers[0]
            if len(kv.sources) != len(first.sources):
                raise fail(ValueError, f"layer_sources[{lay}]: expected {len(first.sources)} sources, as layer 0 "
                                       f"has, got {len(kv.sources)}")
            if kv.device_id != first.device_id:
                raise fail(ValueError, f"layer_sources[{lay}][0]: expected the device of layer_sources[0][0] "
                                       f"({_where(first.device_id)}), got {_where(kv.device_id)}")
            for k, (a, b) in enumerate(zip(first.sources, kv.sources)):
                for attr in _LAYOUT:  # the kernels read every layer with layer 0's layout
                    if getattr(a, attr) != getattr(b, attr):
                        raise fail(ValueError, f"layer_sources[{lay}][{k}]: expected {attr} = {getattr(a, attr)}, "
                                               f"as layer_sources[0][{k}] (every layer shares one layout), got "
                                               f"{getattr(b, attr)}")
        layers.append(kv)
    return LayerKV(tuple(layers), m, layers[0].device_id)


def _renamed(src, name: str):
    return replace(src, name=name)


@dataclass(kw_only=True, frozen=True)
class LayerTable:
    """The rotation's caller-owned device state: ``layer_hashes`` ``[num_slots, num_layers]`` int64 (C-contiguous)
    and ``layer_cursor`` ``[2]`` int32 (the layer the next verify checks, and the steps already spent on it).
    Zeros are a valid start (a slot never written by the rotation fails REAL_KV when verified: a fold is odd)."""

    layer_hashes: Any
    layer_cursor: Any

    @classmethod
    def allocate(cls, num_slots: int, num_layers: int, device: Any = "cpu", library: str | None = None) -> LayerTable:
        """Zeroed arrays on ``device`` (as :meth:`canary.CanaryState.allocate`). ``TypeError`` / ``ValueError``
        for sizes that are not ints >= 1 (``num_layers`` <= 65536)."""
        for name, value, hi in (("num_slots", num_slots, None), ("num_layers", num_layers, MAX_LAYERS)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise fail(TypeError, f"{name}: expected an int, got {type(value).__name__}")
            if int(value) < 1 or (hi is not None and int(value) > hi):
                raise fail(ValueError, f"{name}: expected an int in [1, {hi or 'inf'}], got {value}")
        empty = allocator(device, library)
        n, lay = int(num_slots), int(num_layers)
        return cls(layer_hashes=empty(n * lay, np.int64).reshape(n, lay), layer_cursor=empty(CURSOR_WORDS, np.int32))


@dataclass(frozen=True)
class LayerViews:
    """Validated views of a :class:`LayerTable` bound to a canary and its :class:`LayerKV`."""

    layer_hashes: ArrayView
    layer_cursor: ArrayView
    num_layers: int
    kv: LayerKV
    dwell: int
    base_pointers: np.ndarray  # [num_layers * num_sources] int64

    def host(self, name: str) -> np.ndarray:
        return getattr(self, name).host


class CanaryLayers:
    """The layer rotation bound to a :class:`~canary.CanaryRecords` (its state, ring and counters).

    ``records``: the bound canary (the rotation reads its ``token`` field for reports, appends to its ring and
    counts in its verify counters). ``layer_sources``: :func:`layer_kv`'s input or a :class:`LayerKV`; ``mode``:
    ``"all"`` / ``"partial"``. ``table``: a :class:`LayerTable` ``[records.num_slots, num_layers]`` (default: one
    allocated on the canary's device). ``dwell``: steps each layer stays under the cursor (int >= 1; use the
    sampled-verification bound ``K`` of SPEC 3.7 when the verify plan samples: docs/integration.md 5c).
    ``backend``: as for the canary (default: the canary's).

    Binding validates everything once (``kv-canary:`` errors: sources not covering every slot, on another device,
    sharing memory with the state or the table; a table of the wrong shape / dtype). The caller's arrays must stay
    alive and in place while the rotation is used.
    """

    def __init__(self, records: Any, layer_sources: Any, *, mode: Any = RealKVMode.ALL, table: LayerTable | None = None,
                 dwell: int = 1, backend: str | None = None, launch_config: LaunchConfig = DEFAULT_LAUNCH):
        self.records = records
        sv = records.views
        kv = layer_kv(layer_sources, mode)
        if kv.device_id != sv.device_id:
            raise fail(ValueError, f"layer_sources[0][0]: expected the canary buffer's device "
                                   f"({_where(sv.device_id)}), got {_where(kv.device_id)}")
        check_dwell(dwell)
        for layer in kv.layers:
            layer.check_covers(sv.num_slots, "state.canary_buffer")
            for src in layer.sources:
                sv.spans.check_range(f"{src.name}.array", src.device_id, src.ptr,
                                     (src.rows - 1) * src.row_stride_bytes + src.row_bytes)
        if table is None:
            device = "cpu" if sv.device_id == HOST else sv.device_id
            library = None if sv.device_id == HOST else library_of(records.state.canary_buffer)
            table = LayerTable.allocate(sv.num_slots, kv.num_layers, device=device,
                                        library=library if library in ("cupy", "torch", "numba") else None)
        if not isinstance(table, LayerTable):
            raise fail(TypeError, f"table: expected a LayerTable, got {type(table).__name__}")
        self.table = table
        hashes = check_view(as_view(table.layer_hashes, "table.layer_hashes"), dtype=INT64, ndim=2, writable=True)
        if hashes.shape != (sv.num_slots, kv.num_layers):
            raise fail(ValueError, f"table.layer_hashes: expected shape ({sv.num_slots}, {kv.num_layers}) "
                                   f"[num_slots, num_layers], got {hashes.shape}")
        if kv.num_layers > 1 and hashes.strides[1] != 1 or sv.num_slots > 1 and hashes.strides[0] != kv.num_layers:
            raise fail(ValueError, f"table.layer_hashes: expected a C-contiguous array, got element strides "
                                   f"{hashes.strides}")
        cursor = check_view(as_view(table.layer_cursor, "table.layer_cursor"), dtype=INT32, ndim=1,
                            length=CURSOR_WORDS, writable=True)
        for v in (hashes, cursor):
            if v.device_id != sv.device_id:
                raise fail(ValueError, f"{v.name}: expected the canary buffer's device ({_where(sv.device_id)}), "
                                       f"got {v.where}")
            sv.spans.check(v)
        table_spans = spans([hashes, cursor])
        check_disjoint(table_spans)
        self._table_spans = Spans(table_spans, sv.device_id)
        for layer in kv.layers:
            for src in layer.sources:  # the fold reads them while the kernels write the table
                self._table_spans.check_range(f"{src.name}.array", src.device_id, src.ptr,
                                              (src.rows - 1) * src.row_stride_bytes + src.row_bytes)
        self.views = LayerViews(hashes, cursor, kv.num_layers, kv, int(dwell), kv.base_pointers())
        self._views: dict = {}
        self._module = backends.resolve(backend or records.backend, sv.device_id, family="layers")
        self.backend = self._module.NAME
        self._bound = self._module.bind(sv, self.views, launch_config)

    @property
    def num_layers(self) -> int:
        return self.views.num_layers

    def warmup(self) -> None:
        """Compile and load the kernels (later calls only launch: graph-capturable)."""
        self._bound.warmup()

    def write(self, write_plan: WritePlan, *, out_cache_loc: Any, stream: Any = None) -> None:
        """Fold every layer of every slot the step wrote into ``layer_hashes``, then advance the cursor
        (docs/records.md 10.2). Call it after the step's KV stores of every layer and after the step's
        :meth:`verify`, with the step's ``write_plan`` and ``out_cache_loc`` (``[N]`` int32 or int64, as
        :meth:`CanaryRecords.write` takes them). Never syncs; ``TypeError`` / ``ValueError`` before any launch."""
        go = CallViews(self.records.views.device_id, stream, self.records.state.canary_buffer,
                       self.records.views.spans, self._views)
        wp = view_write_plan(write_plan, go.view, name="write_plan", writable=False)
        loc = go.vec(out_cache_loc, "out_cache_loc", INT_WIDTHS)
        self._check(wp.all() + [loc])
        self._bound.write(wp, loc, go.handle)

    def verify(self, verify_plan: VerifyPlan, *, launch_tag: int = 0, stream: Any = None) -> None:
        """Compare layer ``layer_cursor[0]`` of every verified slot with its stored fold (docs/records.md 10.3).
        ``launch_tag`` in [0, 2**39) (the low 16 bits of a layer row's launch tag hold the layer). Never syncs;
        errors as in :meth:`write`."""
        tag = encode_layer_tag(launch_tag)
        go = CallViews(self.records.views.device_id, stream, self.records.state.canary_buffer,
                       self.records.views.spans, self._views)
        vp = view_verify_plan(verify_plan, go.view, name="verify_plan", writable=False, status=False)
        self._check(vp.all())
        self._bound.verify(vp, tag, go.handle)

    def _check(self, views: list[ArrayView]) -> None:
        device = self.views.layer_hashes.device_id
        for v in views:
            if v.device_id != device:
                raise fail(ValueError, f"{v.name}: expected the device of state.canary_buffer ({_where(device)}), "
                                       f"got {v.where}")
            self._table_spans.check(v)  # the kernels write the table: an input sharing it would change under them

    def cursor(self) -> tuple[int, int]:
        """``(layer, steps spent on it)`` read back (a sync for device arrays)."""
        with on_device_of(self.table.layer_cursor):
            c = np.asarray(to_host(self.table.layer_cursor))
        return int(c[0]), int(c[1])
